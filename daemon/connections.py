"""Connection limits uvicorn does not have: header and body read deadlines, and caps
on open connections per client address and in all.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a
client that sends one byte at a time (slowloris), or a Content-Length larger than
the body it sends, holds its connection, a file descriptor and a parser forever;
enough of them exhaust the process's descriptors and every new client fails.

`guarded_protocol` subclasses uvicorn's httptools protocol with:
- a header deadline: a request's headers must be complete `header_timeout_s` after
  the connection opened, or after the first byte of a request on a kept-alive
  connection (the wait for that byte is uvicorn's `timeout_keep_alive`);
- a body rate: while a body is being read, each `body_timeout_s` window must bring at
  least MIN_BODY_BYTES_PER_S per second of it, else the connection is closed (a pause
  the server itself asked for, when the app reads slowly, does not count). One
  timer per window, not per chunk;
- `ConnectionTable`: at a cap (per client address, or in all) a new connection
  closes the oldest connection of that scope that the app is not serving: one
  waiting for headers or kept alive first, else one still sending its body. A slow
  client can never keep a quick one out; with every connection of the scope being
  served, the new one is refused (503).

And a request's head, checked before any app sees it (`head_refusal`):
- at most `max_header_bytes` of request line and headers: past it the answer is
  431 and nothing more is parsed (httptools keeps a header's whole value until it
  ends: a 32 MB header held 32 MB per connection). The parser is fed at most the
  room left while a head is being read;
- a `Transfer-Encoding` other than a single `chunked`: 501 for a coding fleet does
  not decode (gzip, identity, ...), 400 for a malformed list; httptools itself
  answered 400 in plain text to some and read `gzip, chunked` as plain chunked;
- one `Host` (two of them: 400; the browser guard would read only the last);
- what httptools cannot parse: 400 in the contract's shape, not uvicorn's plain text.
A refusal (`refuse`) is written, the sending side shut, and whatever the client
still sends is read and dropped for LINGER_S before the close: closing with unread
bytes resets the connection, and the client could lose the answer.

And `OneWrite`: uvicorn writes a response's head and its body in two `write`
calls, two segments on the wire; the client then wakes for the head, and again
for the body. Writes made in one turn of the event loop go out in one call at
the end of that turn instead.

And departures: each request carries a `daemon.departures.Departure` in its scope;
a connection that closes before its response started tells it (`left`), so a
request whose client went away stops waiting and withdraws its queued work.

Each connection is in one phase: IDLE (waiting for a request's headers, or kept
alive), BODY (headers in, body still arriving), SERVED (whole request in, the app
answering). Invariant: a protocol is in the table from `connection_made` (admitted)
until it is evicted or `connection_lost`, whichever comes first. Everything runs on
the event loop's thread.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import resource
import termios
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from fleet.errors import BadRequest, FleetError, HeadersTooLarge, NotImplementedCoding

from fleet.daemon import codec
from fleet.daemon.http import error_parts

from fleet.daemon.departures import SCOPE_KEY, Departure

log = logging.getLogger("fleet.daemon")

#: Descriptors kept for the daemon itself (queue, worker pipes, logs, NATS) on top of
#: those open when serving starts, when the connection cap is fitted to RLIMIT_NOFILE.
FD_HEADROOM = 32
#: The server stops: how long a connection that opened and has sent nothing yet may take
#: to start its request (`shutdown`) before it is closed.
FRESH_GRACE_S = 1.0
#: Slowest body upload accepted, averaged over each `body_timeout_s` window: far
#: below any real client, far above a byte-a-second trickle.
MIN_BODY_BYTES_PER_S = 1024
#: Closing slow connections is logged at most this often (seconds), with a count:
#: an attack must not flood the log.
LOG_EVERY_S = 10.0
_REFUSED_BODY = b'{"error":{"code":"unavailable","message":"too many open connections; retry later"}}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


#: After a refusal, how long what the client still sends is read and dropped before
#: the close (s), so that it reads the refusal first (module doc).
LINGER_S = 2.0


IDLE, BODY, SERVED = "idle", "body", "served"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_per_client: int
    #: Settings.max_header_bytes (its default here too, for tests that build limits).
    max_header_bytes: int = 64 << 10


def fit_to_descriptors(max_connections: int, soft_limit: int, open_now: int) -> int:
    """The connection cap this process can hold without running out of descriptors."""
    return max(1, min(max_connections, soft_limit - open_now - FD_HEADROOM))


def connection_limits(settings: Any) -> ConnectionLimits:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    total = fit_to_descriptors(settings.max_connections, soft if soft > 0 else 1 << 20, open_now)
    return ConnectionLimits(
        header_timeout_s=settings.header_timeout_ms / 1000.0,
        body_timeout_s=settings.body_timeout_ms / 1000.0,
        max_connections=total,
        max_per_client=max(1, min(settings.max_connections_per_client, total)),
        max_header_bytes=settings.max_header_bytes,
    )


class ConnectionTable:
    """Open connections, oldest first, in all and by client address (pure policy over
    objects with `phase`, `client_host` and `close()`)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.all: dict[Any, None] = {}
        self.by_client: dict[str, dict[Any, None]] = {}
        self.closed_slow = 0
        self._logged_at = 0.0

    def admit(self, conn: Any) -> bool:
        """Register `conn`; at a cap, first close the connection `find_connection_to_close`
        picks in that scope. False: the scope is full of served connections, refuse `conn`."""
        mine = self.by_client.get(conn.client_host, {})
        for scope, cap in ((mine, self.limits.max_per_client), (self.all, self.limits.max_connections)):
            if len(scope) >= cap:
                victim = find_connection_to_close(scope)
                if victim is None:
                    return False
                self.drop(victim)
                victim.close()
        self.all[conn] = None
        self.by_client.setdefault(conn.client_host, {})[conn] = None
        return True

    def drop(self, conn: Any) -> None:
        if conn in self.all:
            del self.all[conn]
            mine = self.by_client[conn.client_host]
            del mine[conn]
            if not mine:
                del self.by_client[conn.client_host]

    def note_slow_close(self, why: str) -> None:
        self.closed_slow += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("closed a connection: %s (%d slow connections closed so far)", why, self.closed_slow)


def find_connection_to_close(scope: dict[Any, None]) -> Any | None:
    """The oldest idle connection, else the oldest still sending its body, else None."""
    uploading = None
    for conn in scope:  # oldest first (insertion order)
        if conn.phase == IDLE:
            return conn
        if conn.phase == BODY and uploading is None:
            uploading = conn
    return uploading


class OneWrite:
    """A transport whose writes of one event-loop turn leave in one `write` (a
    response's head and body: one segment, one wake-up of the client). Anything
    else goes to the transport; `close` sends what is held first."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        if not self._transport.is_closing() and self._transport.can_write_eof():
            self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def unread_bytes(fd: int) -> int:
    """Bytes received on socket `fd` and not yet read (FIONREAD)."""
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return buf[0]


def head_refusal(special: list[tuple[bytes, bytes]]) -> FleetError | None:
    """The refusal a request's head earns (module doc), from its `Host` and
    `Transfer-Encoding` headers (lower-cased names), or None."""
    hosts = sum(1 for name, _ in special if name == b"host")
    if hosts > 1:
        return BadRequest(f"the request has {hosts} Host headers: send one")
    codings = [c.strip().lower() for name, v in special if name == b"transfer-encoding" for c in v.split(b",")]
    if not codings or codings == [b"chunked"]:
        return None
    other = [c for c in codings if c and c != b"chunked"]
    if other:
        return NotImplementedCoding(f"Transfer-Encoding {other[0].decode('latin-1')!r} is not supported: send the "
                                    "body as it is, with Content-Length or chunked")
    return BadRequest("Transfer-Encoding must be chunked once, not "
                      f"{', '.join(c.decode('latin-1') for c in codings)!r}")


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """An HttpToolsProtocol class bound to one ConnectionTable (one per server)."""
    table = ConnectionTable(limits)

    class GuardedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.phase = IDLE
            self.client_host = ""
            self._deadline: asyncio.TimerHandle | None = None
            self._body_bytes = 0  # body bytes received in the current window
            self._in_head = True  # the next bytes parsed belong to a request's head
            self._head_bytes = 0  # bytes of the current head fed to the parser (at most max_header_bytes)
            self._refused = False  # answered by `refuse`: the rest is dropped until the close
            self._last_request = False  # the server stops: the request being read is this one's last
            self._fresh = True  # no response written on this connection yet

        def close(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(OneWrite(transport, self.loop))  # type: ignore[arg-type]
            self.client_host = self.client[0] if self.client else ""
            if not table.admit(self):
                self.connections.discard(self)
                transport.write(_REFUSED)
                transport.close()
                return
            self._arm(limits.header_timeout_s, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            table.drop(self)
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                # The client left before its answer: its waits stop, its work is withdrawn.
                departure = cycle.scope.get(SCOPE_KEY)
                if departure is not None:
                    departure.left()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._in_head = False
            # Most requests carry one Host and no Transfer-Encoding: nothing more to check.
            special = [(n, v) for n, v in self.headers if n == b"host" or n == b"transfer-encoding"]
            if len(special) > 1 or (special and special[0][0] != b"host"):
                refusal = head_refusal(special)
                if refusal is not None:
                    self.refuse(refusal, path=self.url.partition(b"?")[0].decode("latin-1"))
                    return
            self.phase = BODY
            self._body_bytes = 0
            self._arm(limits.body_timeout_s, self._body_window_ends)
            self.scope[SCOPE_KEY] = Departure()  # before the request's task starts (super)
            super().on_headers_complete()
            if self._last_request and self.cycle is not None:
                self.cycle.keep_alive = False  # read after `shutdown`: the connection ends with it

        def on_body(self, body: bytes) -> None:
            if self._refused:
                return
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes = True, 0
            if self._refused:
                return
            if self.phase == BODY:
                self.phase = SERVED
                self._disarm()
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # read and dropped until the close (module doc)
            if self._deadline is None and self.phase == IDLE:
                # The first byte after a kept-alive wait: the next request's headers
                # are now due within the header deadline.
                self._arm(limits.header_timeout_s, self._headers_late)
            if self._in_head:
                # Counted before the parser runs: a message that ends in `data` resets the
                # count for the next one (`on_message_complete`), which then starts at zero.
                room = limits.max_header_bytes - self._head_bytes
                if len(data) > room:
                    data, rest = data[:room], data[room:]
                    self._head_bytes += len(data)
                    super().data_received(data)
                    if self._refused or self.transport.is_closing():
                        return
                    if self._in_head:
                        self.refuse(HeadersTooLarge(f"the request's headers are over the limit of "
                                                    f"{limits.max_header_bytes} bytes (max_header_bytes)"))
                        return
                    data = rest
                else:
                    self._head_bytes += len(data)
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            # httptools could not parse the request (uvicorn's data_received): the contract's shape.
            if not self._refused:
                self.refuse(BadRequest("the request is not valid HTTP/1.1"))

        def refuse(self, exc: FleetError, *, path: str = "") -> None:
            """Answer `exc` on this connection and end it (module doc): nothing more is parsed."""
            self._refused = True
            self.phase = IDLE  # the first to go at the connection caps
            headers = dict(self.headers or ())
            msgpack = codec.reply_is_msgpack(headers.get(b"accept", b"").decode("latin-1"),
                                             headers.get(b"content-type", b"").decode("latin-1"))
            method = self.scope.get("method", "") if self.scope else ""
            body, _ = error_parts(exc, method=method, path=path, msgpack=msgpack, private=())
            head = [STATUS_LINE[exc.status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head.append(b"content-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % ((codec.MSGPACK if msgpack else codec.JSON).encode(), len(body)))
            self.transport.write(b"".join(head) + body)
            self.transport.write_eof()
            self._arm(LINGER_S, self.close)

        def shutdown(self) -> None:
            """The server stops (SIGTERM): uvicorn lets a response in progress finish and closes
            every other connection at once. One that already holds the start of a request (a
            head being read, or bytes waiting in the socket: a client that connected and sent
            just before the listener closed) would then lose a request its client believes
            sent, with no answer at all. That one is read and answered like any other during
            the drain (or `unavailable` at its bound), and the connection closes after it."""
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if idle and not self._refused and not self.transport.is_closing():
                if self._request_begun():
                    self._last_request = True
                    if self._deadline is None:
                        self._arm(limits.header_timeout_s, self._headers_late)
                    return
                if self._fresh and cycle is None:
                    # Connected, nothing sent yet: its request is on its way (a client
                    # connects to send one). A short wait for its first byte, then the close.
                    self._last_request = True
                    self._arm(min(FRESH_GRACE_S, limits.header_timeout_s), self._fresh_grace_ends)
                    return
            super().shutdown()

        def _request_begun(self) -> bool:
            """Whether bytes of a next request were read (`_head_bytes`) or wait in the socket."""
            if self._head_bytes:
                return True
            sock = self.transport.get_extra_info("socket")
            try:
                return bool(sock is not None and unread_bytes(sock.fileno()))
            except OSError:
                return False

        def on_response_complete(self) -> None:
            # Kept alive: uvicorn closes the connection after `keep_alive_timeout_ms`
            # without a byte; the header deadline starts with the next request's first
            # byte (data_received), so a long keep-alive does not let headers trickle.
            self.phase = IDLE
            self._fresh = False
            self._disarm()
            super().on_response_complete()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # A pipelined request started: its headers (at least) are in.
                self.phase = BODY if cycle.more_body else SERVED
                if self.phase == SERVED:
                    self._disarm()
                else:
                    self._arm(limits.body_timeout_s, self._body_window_ends)

        def _arm(self, delay_s: float, callback: Any) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(delay_s, callback)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if self.phase == IDLE and not self.transport.is_closing():
                table.note_slow_close(f"request headers not received within {limits.header_timeout_s:g} s")
                self.transport.close()

        def _fresh_grace_ends(self) -> None:
            self._deadline = None
            if self.phase != IDLE or self.transport.is_closing():
                return
            if self._head_bytes:  # its request started: the header deadline applies to the rest
                self._arm(limits.header_timeout_s, self._headers_late)
            else:
                self.transport.close()

        def _body_window_ends(self) -> None:
            self._deadline = None
            if self.phase != BODY or self.transport.is_closing():
                return
            got, self._body_bytes = self._body_bytes, 0
            # Paused reading means the app has not read what arrived: that wait is ours.
            if got >= MIN_BODY_BYTES_PER_S * limits.body_timeout_s or (self.flow is not None and self.flow.read_paused):
                self._arm(limits.body_timeout_s, self._body_window_ends)
                return
            table.note_slow_close(f"request body slower than {MIN_BODY_BYTES_PER_S} bytes/s "
                                  f"over {limits.body_timeout_s:g} s")
            self.transport.close()

    return GuardedProtocol
