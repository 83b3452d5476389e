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
it off, live on SIGHUP. The event loop only queues a line (`Lines`: ~1 us); a thread
writes them, every 0.1 s. Measured (docs/architecture.md, "Access log"): nothing the
hot route feels, ~25 us of the API process's CPU per line written. The middleware sits
inside the request id and outside everything else, so refusals (401, 403, 413) are
logged too; a batch's lines, which never cross HTTP (daemon.batches), are not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from fleet.config import Settings

from fleet.daemon.logs import REQUEST_ID

log = logging.getLogger("fleet.access")
#: How often the queued access lines are written (seconds).
FLUSH_S = 0.1


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


class Lines:
    """Access lines leave the event loop as tuples on a queue (~1 us each); a thread of
    their own writes what has come every FLUSH_S, so a line costs the loop nothing it
    would feel and the formatting runs warm, lines back to back (one line written on
    its own, right after a request, cost the loop ~0.35 ms on the 2-vCPU box: cold
    caches, two JSON handlers). A line is in the log within FLUSH_S of its request's
    end; the app's shutdown writes those still queued (`AccessLog`, lifespan)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, line: tuple) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="fleet-access-log", daemon=True)
                    self._thread.start()
        self._queue.put(line)

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            try:
                self.flush()
            except Exception:  # the log must never take the daemon down, nor stop logging
                logging.getLogger("fleet.daemon").exception("writing access lines failed")

    def flush(self) -> None:
        """Write every line queued so far (the thread, and the shutdown)."""
        with self._lock:
            while True:
                try:
                    line = self._queue.get_nowait()
                except queue.Empty:
                    return
                write(line)


def write(line: tuple) -> None:
    """One access record, through the log's handlers (the one format), stamped with
    its request's end time and id."""
    created, rid, method, route, model, status, ms, client = line
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, "%s %s %d %.1f ms model=%s client=%s",
                            (method, route, status, ms, model, client), None,
                            extra={"method": method, "route": route, "model": model, "status": status,
                                   "ms": round(ms, 2), "client": client})
    record.created, record.msecs = created, (created - int(created)) * 1000
    token = REQUEST_ID.set(rid)  # the handlers' filter stamps the request's id (daemon.logs)
    try:
        log.handle(record)
    finally:
        REQUEST_ID.reset(token)


LINES = Lines()


class AccessLog:
    """ASGI: after each HTTP request, its access line (module doc). Reads
    `settings.access_log` per request, so a SIGHUP turns it on or off. At the app's
    shutdown (the lifespan's `shutdown.complete`), the lines still queued are written."""

    def __init__(self, app: Callable[..., Awaitable[None]], settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            async def send_flushed(message: Any) -> None:
                if message["type"] == "lifespan.shutdown.complete":
                    LINES.flush()
                await send(message)

            await self.app(scope, receive, send_flushed)
            return
        if scope["type"] != "http" or not self.settings.access_log or not log.isEnabledFor(logging.INFO):
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
            peer = scope.get("client")
            LINES.put((time.time(), REQUEST_ID.get(), scope["method"], scope["path"], note.model, note.status,
                       (time.perf_counter() - t0) * 1e3, f"{peer[0]}:{peer[1]}" if peer else "-"))
