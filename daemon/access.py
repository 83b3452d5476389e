"""The access log: one line per HTTP request, in the daemon's one log format (fleet.logs).

Logger `fleet.access`, level info; each record carries `method`, `route` (the path,
without the query string), `model` (the model a request asked for, "-" for routes
that run none), `status` (0 when the client left before any answer), `ms` (from the
request's arrival to its last byte sent, a stream's included) and `client` (the
peer's address); the request id comes with every record (daemon.logs). In the JSON
lines of the journal or the log file:

    {"ts": ..., "level": "info", "logger": "fleet.access",
     "msg": "POST /v1/embed 200 2.4 ms model=all-minilm-l6-v2 client=127.0.0.1:50412",
     "request_id": ..., "method": "POST", "route": "/v1/embed", "model": "all-minilm-l6-v2",
     "status": 200, "ms": 2.41, "client": "127.0.0.1:50412"}

On by default; `access_log = false` in config.toml (or FLEET_ACCESS_LOG=false) turns
it off, live on SIGHUP. A line costs the API process ~15 us of CPU (docs/architecture.md,
"Access log"), against ~1 ms for the lightest request end to end. The middleware sits
inside the request id and outside everything else, so refusals (401, 403, 413) are
logged too; a batch's lines, which never cross HTTP (daemon.batches), are not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from fleet.config import Settings

log = logging.getLogger("fleet.access")


class Note:
    """What the request's handlers tell its access line (one per request)."""

    __slots__ = ("model", "status")

    def __init__(self) -> None:
        self.model = "-"
        self.status = 0


#: The access note of the request being handled, None outside one (or with the log off).
NOTE: ContextVar[Note | None] = ContextVar("fleet_access_note", default=None)


def note_model(model: str) -> None:
    """The model this request asked for (Daemon.request: every inference route)."""
    note = NOTE.get()
    if note is not None:
        note.model = model


class AccessLog:
    """ASGI: after each HTTP request, its access line (module doc). Reads
    `settings.access_log` per request, so a SIGHUP turns it on or off."""

    def __init__(self, app: Callable[..., Awaitable[None]], settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not self.settings.access_log:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        note = Note()
        token = NOTE.set(note)

        async def send_noted(message: Any) -> None:
            if message["type"] == "http.response.start":
                note.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noted)
        finally:
            NOTE.reset(token)
            ms = (time.perf_counter() - t0) * 1e3
            peer = scope.get("client")
            client = f"{peer[0]}:{peer[1]}" if peer else "-"
            method, route = scope["method"], scope["path"]
            log.info("%s %s %d %.1f ms model=%s client=%s", method, route, note.status, ms, note.model, client,
                     extra={"method": method, "route": route, "model": note.model, "status": note.status,
                            "ms": round(ms, 2), "client": client})
