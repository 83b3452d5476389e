"""What the access log (daemon/access.py) costs: the event loop's part, measured as
bench/asgi_cold.py measures the hot route, and the writer thread's part.

1. One trivial request through the request-id middleware, with and without
   `AccessLog` (the daemon's own handlers: JSON lines to a pipe standing in for
   stderr, and the rotating log file), warm (back to back) and cold (each after a
   20 ms sleep and a pass over 32 MiB), p50 of 150: what the loop pays per request.
2. The writer's CPU per line when it writes a batch of queued lines (thread time).

Usage: python -m fleet.bench access-log
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time

import numpy as np

from fleet.bench.cli import bench

GAP_S, N, SKIP = 0.02, 150, 20


def _log_to_pipe(home: str) -> None:
    from fleet.daemon.logs import setup_logging

    r, w = os.pipe()
    threading.Thread(target=lambda: [os.read(r, 1 << 16) for _ in iter(int, 1)], daemon=True).start()
    setup_logging("info", stream=os.fdopen(w, "w", buffering=1), json=True, home=home)


async def _app(scope, receive, send) -> None:
    from fleet.daemon.access import note_model

    note_model("all-minilm-l6-v2")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message) -> None:
    pass


async def _time(asgi, cold: bool, junk: np.ndarray) -> float:
    took = []
    for _ in range(N):
        if cold:
            time.sleep(GAP_S)
            junk.sum()
        scope = {"type": "http", "method": "POST", "path": "/v1/embed", "headers": [], "client": ("127.0.0.1", 5555)}
        t0 = time.perf_counter()
        await asgi(scope, _receive, _send)
        took.append(time.perf_counter() - t0)
    return float(np.median(took[SKIP:])) * 1e3


async def _loop_part(home: str) -> None:
    from fleet.daemon.access import AccessLog
    from fleet.daemon.logs import RequestIdMiddleware
    from fleet.config import Settings

    junk = np.ones(4 << 20)
    settings = Settings(home=home)
    for cold in (False, True):
        plain = await _time(RequestIdMiddleware(_app), cold, junk)
        logged = await _time(RequestIdMiddleware(AccessLog(_app, settings)), cold, junk)
        print(f"loop, {'cold' if cold else 'warm'}: {plain:.3f} ms without, {logged:.3f} ms with an access line "
              f"(+{logged - plain:.3f} ms)")


def _writer_part() -> None:
    from fleet.daemon.access import LINES

    line = (time.time(), "0123456789abcdef", "POST", "/v1/embed", "all-minilm-l6-v2", 200, 1.234, "127.0.0.1:5555")
    for batch in (1, 10, 100):
        runs = []
        for _ in range(max(3, 2000 // batch)):
            for _ in range(batch):
                LINES._queue.put(line)
            t0 = time.thread_time_ns()
            LINES.flush()
            runs.append((time.thread_time_ns() - t0) / batch / 1e3)
        print(f"writer, batches of {batch:3}: {statistics.median(runs):.1f} us CPU per line")


@bench("access-log")
def main(args: argparse.Namespace) -> None:
    home = tempfile.mkdtemp(prefix="fleet-access-bench-")
    _log_to_pipe(home)
    asyncio.run(_loop_part(home))
    _writer_part()
