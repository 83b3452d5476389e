"""What the query-parameter check (`daemon/query.py`) costs a request, in process.

Times the app's `before_request` hook on one `GET /v1/files` request, with no
query string and with two declared parameters (`?purpose=batch&limit=2`), less
an empty async hook; and, for scale, a whole `GET /healthz` through the
daemon's Litestar app (no sockets, no lifespan). Best of 7 runs. On the 2-vCPU
dev box (AMD EPYC Zen 4, load average 2-3): +40 ns, +0.41 us, app ~24 us.

Usage: python -m fleet.bench query-check
"""

from __future__ import annotations

import argparse
import asyncio
import time

from litestar import Request

from fleet.daemon.app import create_app
from fleet.daemon.core import Daemon
from fleet.daemon.query import declared_query, refuse_undeclared
from fleet.config import Settings
from fleet.bench.cli import bench

RUNS, CALLS, REQUESTS = 7, 200_000, 4_000


async def _nothing(request: Request) -> None:
    return None


async def per_call_ns(app, hook, handler, query: bytes) -> float:
    request = Request({"type": "http", "method": "GET", "path": "/v1/files", "query_string": query, "headers": [],
                       "route_handler": handler, "app": app, "litestar_app": app, "state": {}, "path_params": {}})
    best = float("inf")
    for _ in range(RUNS):
        t = time.perf_counter()
        for _ in range(CALLS):
            await hook(request)
        best = min(best, (time.perf_counter() - t) / CALLS * 1e9)
    return best


async def whole_request_us(app) -> float:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        """The reply is dropped: only the time to make it is measured."""

    best = float("inf")
    for _ in range(RUNS):
        t = time.perf_counter()
        for _ in range(REQUESTS):
            await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                       "scheme": "http", "path": "/healthz", "raw_path": b"/healthz", "query_string": b"",
                       "root_path": "", "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 1),
                       "server": ("127.0.0.1", 2), "state": {}}, receive, send)
        best = min(best, (time.perf_counter() - t) / REQUESTS * 1e6)
    return best


async def _main() -> None:
    app = create_app(Daemon(Settings(home="/nonexistent-fleet-home")))
    check = refuse_undeclared(declared_query(app))
    handler = next(r for r in app.routes if r.path == "/v1/files").route_handler_map["GET"][0]
    base = await per_call_ns(app, _nothing, handler, b"")
    for query in (b"", b"purpose=batch&limit=2"):
        cost = await per_call_ns(app, check, handler, query) - base
        print(f"query check, {query.decode() or 'no query string'}: +{cost:.0f} ns a request")
    print(f"a whole GET /healthz in process: {await whole_request_us(app):.1f} us")


@bench("query-check")
def main(args: argparse.Namespace) -> None:
    asyncio.run(_main())
