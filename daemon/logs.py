"""Structured logging for the daemon: JSON lines for machines, rich for people.

Under systemd (or any pipe) stderr is not a TTY, so every record is one JSON
object on one line, which journald and log shippers take as is. At a terminal
the same records go through rich.

Every record logged while a request is being handled carries its request id:
the id lives in a contextvar, so it follows the request across awaits and into
`asyncio.to_thread` without being passed around. Disabled levels cost one
cached `isEnabledFor` check, as with any stdlib logger: call sites use
`log.debug("x %s", y)`, never f-strings.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any

from fleet.errors import BadRequest
from fleet.logs import JsonFormatter, file_handler, install, quiet_libraries, route_library_logs, under_systemd

#: The id of the request being handled in this context, or None outside one.
REQUEST_ID: ContextVar[str | None] = ContextVar("fleet_request_id", default=None)

LEVELS = ("debug", "info", "warning", "error", "critical")

# A client-sent id is kept only if it is short and plain: it ends up in every log line.
_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def new_request_id() -> str:
    """A fresh request id: 16 hex characters (64 random bits)."""
    return os.urandom(8).hex()


class RequestIdMiddleware:
    """ASGI: bind a request id for the whole request and echo it as `X-Request-Id`.

    The client's `X-Request-Id` is kept when it is plain (1-64 of A-Z a-z 0-9 . _ : -),
    else a fresh id is made. Put it outermost so refusals carry an id too.
    """

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                if _CLIENT_ID.match(value):
                    rid = value.decode()
                break
        if rid is None:
            rid = new_request_id()
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class _RequestIdFilter(logging.Filter):
    # A handler filter runs in the logging caller's context, so the contextvar
    # read here is the request's, even when the record propagated from a child
    # logger (logger-level filters would not see propagated records).
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class _RichFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        rid = getattr(record, "request_id", None)
        return f"[{rid}] {msg}" if rid else msg


def setup_logging(level: str | int = "info", *, stream: IO[str] | None = None, json: bool | None = None,
                  home: str | Path | None = None) -> logging.Handler:
    """Install the root's handlers (idempotent): `stream` (stderr) in JSON lines, or
    rich at a terminal (`json=None` picks by `stream.isatty()`); with `home`, also the
    foreground daemon's log file FLEET_HOME/logs/fleetd.log (fleet.logs; not under
    systemd, whose journal keeps the log). Libraries' logs and warnings go through them,
    their progress bars off. Returns the stream handler.

    Run uvicorn with `log_config=None` so its loggers propagate here.
    """
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise BadRequest(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
        level = getattr(logging, level.upper())
    stream = stream if stream is not None else sys.stderr
    use_json = json if json is not None else not (hasattr(stream, "isatty") and stream.isatty())
    handler: logging.Handler
    if use_json:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
    else:
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(file=stream), show_path=False, rich_tracebacks=True)
        handler.setFormatter(_RichFormatter())
    handlers = [handler]
    if home is not None and not under_systemd():
        handlers.append(file_handler(home, rotate=True))
    for h in handlers:
        h.addFilter(_RequestIdFilter())
    quiet_libraries()
    install(handlers, level)
    route_library_logs()
    return handler
