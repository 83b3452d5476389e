"""`/mcp`: fleet's tools (fleet.mcp_tools) over MCP's streamable HTTP transport.

`McpRoute` sits inside the browser guard and bearer auth (daemon/server.py), so
`/mcp` takes the same key, Host and Origin checks as every route; the `mcp` SDK's
own DNS-rebinding check is left off (the guard is that check, with the operator's
`allowed_hosts` and `cors_origins`).

The SDK's session manager runs stateless with JSON replies: each POST is answered
on its own, so the daemon keeps no MCP session (no table to fill, nothing lost at
a restart) and a tool call's answer is one JSON body, not an event stream.
It is built on the first `/mcp` request, not at start: importing the SDK takes
~1 s, on a thread so the loop keeps serving meanwhile.

A tool call runs its route in this process, as a batch line does (daemon.batches:
`Daemon.dispatch`, the hot routes and the Litestar app), with the MCP request's
client (its fair share of a lane: daemon.clients), its departure (a client that
leaves withdraws the work: daemon.departures) and its `X-Request-Id`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from fleet.errors import FleetError, Unsupported
from fleet.mcp_tools import ToolFailure, build_server, error_message

from fleet.daemon.clients import ClientMiddleware
from fleet.daemon.core import Daemon
from fleet.daemon.departures import SCOPE_KEY, DepartureMiddleware
from fleet.daemon.http import error_parts
from fleet.daemon.logs import RequestIdMiddleware

log = logging.getLogger("fleet.daemon")

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

PATH = "/mcp"
#: Request headers a tool call's route sees from its MCP request.
_PASSED = frozenset({b"x-fleet-client", b"x-request-id", b"traceparent"})


class McpRoute:
    """ASGI: `/mcp` to the MCP session manager, everything else to `app`."""

    def __init__(self, app: Any, daemon: Daemon) -> None:
        self.app = app
        self.daemon = daemon
        self._manager: Any = None
        self._opening: asyncio.Task | None = None
        self._running: asyncio.Task | None = None
        self._routes: Any = None

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        try:
            manager = self._manager or await self._open()
        except FleetError as exc:
            body, headers = error_parts(exc, method=scope["method"], path=PATH, msgpack=False, private=())
            await send({"type": "http.response.start", "status": exc.status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
            await send({"type": "http.response.body", "body": body})
            return
        manager.asgi_app.max_body_size = self.daemon.settings.max_body_bytes  # live: SIGHUP may change it
        await manager.handle_request(scope, receive, send)

    async def _open(self) -> Any:
        """The session manager, running (once; concurrent first requests wait for the same)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._start())
        try:
            return await asyncio.shield(self._opening)
        except FleetError:
            self._opening = None  # the next request tries again (e.g. after `pip install`)
            raise

    async def _start(self) -> Any:
        try:
            await asyncio.to_thread(_import_sdk)
        except ModuleNotFoundError as exc:
            raise Unsupported(f"MCP needs the mcp package ({exc.name} is not installed): "
                              "pip install 'fleet-serve[mcp]'") from None
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        manager = StreamableHTTPSessionManager(app=build_server(self.call), json_response=True, stateless=True,
                                               max_request_body_size=self.daemon.settings.max_body_bytes)
        ready = asyncio.Event()

        async def run() -> None:
            async with manager.run():
                ready.set()
                await asyncio.Event().wait()  # until the loop ends (cancelled at shutdown)

        self._running = asyncio.create_task(run(), name="fleet-mcp")
        started = asyncio.create_task(ready.wait())
        await asyncio.wait({self._running, started}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            started.cancel()
            self._running.result()  # raises what stopped it
        self._manager = manager
        log.info("MCP: serving tools on %s", PATH)
        return manager

    async def call(self, method: str, path: str, body: dict[str, Any] | None, request: Any) -> dict[str, Any]:
        """One tool's route, in this process (module doc): its JSON reply, or ToolFailure."""
        if self._routes is None:
            self._routes = RequestIdMiddleware(ClientMiddleware(DepartureMiddleware(self.daemon.dispatch)))
        outer = request.scope if request is not None else {}
        content = b"" if body is None else msgspec.json.encode(body)
        headers = [(b"host", b"localhost"), (b"accept", b"application/json"),
                   (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                   *((k, v) for k, v in outer.get("headers", ()) if k in _PASSED)]
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": headers, "client": outer.get("client") or ("127.0.0.1", 0),
            "server": outer.get("server") or ("127.0.0.1", 0), "state": {},
        }
        if outer.get(SCOPE_KEY) is not None:
            scope[SCOPE_KEY] = outer[SCOPE_KEY]
        status, reply = await run_asgi(self._routes, scope, content)
        if status >= 400:
            raise ToolFailure(error_message(status, reply))
        try:
            data = msgspec.json.decode(reply)
        except msgspec.DecodeError:
            raise ToolFailure(f"{method} {path} answered {status} with a body that is not JSON") from None
        return data if isinstance(data, dict) else {"result": data}


def _import_sdk() -> None:
    import mcp.server.lowlevel  # noqa: F401
    import mcp.server.streamable_http_manager  # noqa: F401


async def run_asgi(app: Any, scope: dict[str, Any], body: bytes) -> tuple[int, bytes]:
    """One request through the ASGI `app`, in this process: (status, body)."""
    delivered = False
    never = asyncio.Event()
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the departure (scope) says when the client left, not this
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)
