"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for the load generator.

Requests are fully prepared bytes (head + body) built once before a run, so a
send is one `write` and a reply is one header read plus one body read: the
generator spends its CPU on the wire, not on building requests. Replies with
Content-Length and chunked replies are both read; `Connection: close` drops
the connection after the reply.
"""

from __future__ import annotations

import asyncio
import math
from urllib.parse import urlsplit


class Endpoint:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// URLs are benched (got {url!r})")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path if parts.path not in ("", "/") else ""

    def with_default_path(self, path: str) -> str:
        return self.path or path


def build_request(ep: Endpoint, path: str, body: bytes, content_type: str, accept: str,
                  api_key: str = "") -> bytes:
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {ep.host}:{ep.port}",
        f"Content-Type: {content_type}",
        f"Accept: {accept}",
        f"Content-Length: {len(body)}",
    ]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


#: Idle keep-alive connections older than this are dropped, not reused: servers
#: close idle connections on their own timer (uvicorn: 5 s), and a request written
#: into a connection the server just closed fails for no fault of the server.
MAX_IDLE_S = 3.0


class Conn:
    __slots__ = ("reader", "writer", "idle_since", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0
        #: True when taken from the idle list (a failure before any reply byte may be a stale close).
        self.reused = False

    def close(self) -> None:
        self.writer.close()


async def connect(ep: Endpoint) -> Conn:
    # A large read limit: one reply line/header block is small, but readuntil's
    # limit also bounds the buffered bytes it scans.
    reader, writer = await asyncio.open_connection(ep.host, ep.port, limit=1 << 20)
    return Conn(reader, writer)


async def exchange(conn: Conn, request: bytes) -> tuple[int, bytes, bool, float, float]:
    """Send one prepared request; return (status, body, keep_alive, queue_ms, inference_ms).

    queue_ms / inference_ms are the server's own `X-Queue-Ms` / `X-Inference-Ms`
    (fleet's contract: time waiting, time in the model); NaN when it sends none.
    """
    conn.writer.write(request)
    reader = conn.reader
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = -1
    chunked = False
    keep_alive = True
    queue_ms = inference_ms = math.nan
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"connection" and b"close" in value.lower():
            keep_alive = False
        elif name == b"x-queue-ms":
            queue_ms = float(value)
        elif name == b"x-inference-ms":
            inference_ms = float(value)
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append(await reader.readexactly(size + 2))
        body = b"".join(p[:-2] for p in parts)
    elif length >= 0:
        body = await reader.readexactly(length)
    else:
        body = await reader.read()
        keep_alive = False
    return status, body, keep_alive, queue_ms, inference_ms


class Pool:
    """Keep-alive connections, at most `limit` open; callers beyond that wait in FIFO order."""

    def __init__(self, ep: Endpoint, limit: int) -> None:
        self.ep = ep
        self.limit = limit
        self.idle: list[Conn] = []
        self.open = 0
        self.waiters: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def acquire(self) -> Conn:
        now = asyncio.get_running_loop().time()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since <= MAX_IDLE_S:
                conn.reused = True
                return conn
            conn.close()
            self.open -= 1
        if self.open < self.limit:
            self.open += 1
            try:
                return await connect(self.ep)
            except BaseException:
                self.open -= 1
                raise
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        await self.waiters.put(fut)
        conn = await fut
        if conn is None:  # a slot was freed by a dropped connection: open a fresh one
            self.open += 1
            try:
                return await connect(self.ep)
            except BaseException:
                self.open -= 1
                raise
        return conn

    def release(self, conn: Conn) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        while not self.waiters.empty():
            fut = self.waiters.get_nowait()
            if not fut.done():
                conn.reused = True
                fut.set_result(conn)
                return
        self.idle.append(conn)

    def discard(self, conn: Conn | None) -> None:
        if conn is not None:
            conn.close()
            self.open -= 1
        while not self.waiters.empty():
            fut = self.waiters.get_nowait()
            if not fut.done():
                fut.set_result(None)
                return

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.open -= len(self.idle)
        self.idle.clear()


class BlockingConn:
    """One keep-alive connection for sequential latency runs, on a blocking socket.

    A lone client in a loop is what the latency goal is about; an event loop on the
    client side would add its own wake-ups to every round trip. Replies must carry
    Content-Length (fleet's non-streamed replies do). `exchange` returns
    (status, headers with lower-case names, body).
    """

    def __init__(self, ep: Endpoint, timeout_s: float = 30.0) -> None:
        self.ep, self.timeout_s = ep, timeout_s
        self._connect()

    def _connect(self) -> None:
        import socket

        self.sock = socket.create_connection((self.ep.host, self.ep.port), timeout=self.timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def exchange(self, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        self.sock.sendall(request)
        buf = self._buf
        if not buf:
            try:
                buf = self._recv()
            except ConnectionError:
                # The server closed the idle connection (its keep-alive timeout) before
                # reading this request: nothing of it was served, so it is sent again on
                # a new connection, as HTTP clients do.
                self.sock.close()
                self._connect()
                self.sock.sendall(request)
                buf = self._recv()
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv()
        lines = buf[:end].split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers[b"content-length"])
        start = end + 4
        while len(buf) < start + length:
            buf += self._recv()
        self._buf = buf[start + length:]
        return int(lines[0][9:12]), headers, buf[start:start + length]

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()
