"""A synthetic embeddings server with a known capacity, for testing the bench itself.

It speaks fleet's `/v1/embed` contract (MessagePack in and out) and serves at
most `capacity` requests per second: admission is a token bucket (GCRA, burst
of `burst` requests) in front of a FIFO queue, then each admitted request takes
`latency_ms` (concurrently, like a device with room for many requests). Below
capacity the latency stays flat; above it the queue, and so the latency, grows
for as long as the overload lasts. That is the sharp knee the knee finder must
locate.

Run: `python -m fleet.bench synthetic --capacity 200 [--port 0]`; it prints
`listening on 127.0.0.1:PORT` once it accepts connections. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from fleet.bench.cli import bench, option

DIM = 384


class _EmbedIn(msgspec.Struct):
    model: str
    inputs: list[str]


class _Usage(msgspec.Struct):
    input_tokens: int


class _EmbedOut(msgspec.Struct):
    model: str
    embeddings: bytes
    shape: tuple[int, int]
    usage: _Usage
    dtype: str = "float32"


class Server:
    def __init__(self, capacity: float, burst: float, latency_ms: float) -> None:
        self.interval = 1.0 / capacity
        self.tolerance = burst * self.interval
        self.latency_s = latency_ms / 1000.0
        #: GCRA theoretical arrival time (loop clock, s); admission order is arrival order.
        self.tat = 0.0
        self.decoder = msgspec.msgpack.Decoder(_EmbedIn)
        self.encoder = msgspec.msgpack.Encoder()

    def admit_at(self, now: float) -> float:
        self.tat = max(self.tat, now)
        at = max(now, self.tat - self.tolerance)
        self.tat += self.interval
        return at

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                arrived = loop.time()
                queued = max(0.0, self.admit_at(arrived) - arrived)
                wait = queued + self.latency_s
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(self.reply(body, queued * 1000.0))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def reply(self, body: bytes, queued_ms: float) -> bytes:
        try:
            req = self.decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            err = self.encoder.encode({"error": {"code": "bad_request", "message": str(exc)}})
            return _response(400, err)
        n = len(req.inputs)
        words = sum(len(t.split()) for t in req.inputs)
        out = _EmbedOut(req.model, bytes(4 * n * DIM), (n, DIM), _Usage(words))
        # The same timing headers fleet sends: time waiting, time "in the model".
        timing = f"X-Queue-Ms: {queued_ms:.2f}\r\nX-Inference-Ms: {self.latency_s * 1000.0:.2f}\r\n"
        return _response(200, self.encoder.encode(out), timing)


def _response(status: int, body: bytes, extra_headers: str = "") -> bytes:
    reason = {200: "OK", 400: "Bad Request"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/msgpack\r\n"
        f"Content-Length: {len(body)}\r\n{extra_headers}\r\n"
    ).encode("latin-1") + body


async def serve(capacity: float, burst: float, latency_ms: float, port: int) -> None:
    server = Server(capacity, burst, latency_ms)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=1024)
    bound = srv.sockets[0].getsockname()[1]
    print(f"listening on 127.0.0.1:{bound}", flush=True)
    async with srv:
        await srv.serve_forever()


@bench("synthetic", option("--capacity", type=float, required=True, help="requests/s served at most"),
       option("--burst", type=float, default=None, help="token-bucket burst, requests (default capacity/20)"),
       option("--latency-ms", type=float, default=10.0), option("--port", type=int, default=0))
def main(args: argparse.Namespace) -> None:
    burst = args.burst if args.burst is not None else max(1.0, args.capacity / 20.0)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(args.capacity, burst, args.latency_ms, args.port))
    except KeyboardInterrupt:
        sys.exit(0)
