"""What one request costs in the ASGI app when the process comes to it cold.

A lone client's request reaches the API process after it slept through the
model's forward pass (tens of ms, the caches filled by the model's weights).
This times, in process (no sockets), one trivial `POST` through a Litestar app
and through a plain ASGI callable, warm (back to back) and cold (each after a
20 ms sleep and a pass over 32 MiB), p50 of 150. The figure behind
`daemon/hot.py` (issue 17): on the 2-vCPU dev box Litestar took 0.04 ms warm
and 0.32 ms cold, plain ASGI 0.001 and 0.025 ms.

Usage: python -m fleet.bench asgi-cold
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np
from litestar import Controller, Litestar, Request, Response, post

from fleet.bench.cli import bench

GAP_S, N, SKIP = 0.02, 150, 20


class _Echo(Controller):
    path = "/v1"

    @post("/embed", status_code=200)
    async def embed(self, request: Request) -> Response:
        return Response(content=await request.body(), media_type="application/msgpack", headers={"X-A": "1"})


async def _plain(scope, receive, send) -> None:
    message = await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/msgpack"), (b"x-a", b"1")]})
    await send({"type": "http.response.body", "body": message["body"]})


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/embed", "raw_path": b"/v1/embed", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"127.0.0.1:7744"), (b"content-type", b"application/msgpack"),
                        (b"content-length", b"60")],
            "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 7744), "state": {}}


async def _time(app, cold: bool, junk: np.ndarray) -> float:
    async def receive():
        return {"type": "http.request", "body": b"x" * 60, "more_body": False}

    async def send(message):
        pass

    took = []
    for _ in range(N):
        if cold:
            time.sleep(GAP_S)
            junk.sum()
        t0 = time.perf_counter_ns()
        await app(_scope(), receive, send)
        took.append(time.perf_counter_ns() - t0)
    return float(np.median(took[SKIP:])) / 1e6


async def _main() -> None:
    junk = np.random.default_rng(0).random(4 << 20)  # 32 MiB
    litestar = Litestar([_Echo], openapi_config=None, logging_config=None, debug=False)
    print(f"{'ms (p50 of ' + str(N - SKIP) + ')':24s} {'warm':>8s} {'cold':>8s}")
    for name, app in (("Litestar", litestar), ("plain ASGI", _plain)):
        print(f"{name:24s} {await _time(app, False, junk):8.3f} {await _time(app, True, junk):8.3f}")
    print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


@bench("asgi-cold")
def main(args: argparse.Namespace) -> None:
    asyncio.run(_main())
