"""The store through the daemon that owns it: `GET /v1/store`, `POST /v1/store/pull`,
`DELETE /v1/models/{name}` (in controllers.models; daemon.owner says what each does
to resident copies).

`fleetctl pull | list | rm` take these routes whenever a daemon answers, so a model
lands in (or leaves) the store the daemon serves from, whatever FLEET_HOME the
shell has. All three are the operator's (daemon.operator): they name the store's
folders and sources on this box, and change what the daemon serves.

- `GET /v1/store`: `{home, models: [manifest + size_bytes + path], damaged: [{name,
  why, fix}]}`, what `fleetctl list --json` prints.
- `POST /v1/store/pull` `{source, name?, task?, runtime?, base?, force?, quantize?}`: `source` is
  what `fleetctl pull` takes (a catalog or stored name, `hf:ORG/NAME[@REV]`,
  `path:DIR` with DIR absolute, as the daemon's user reads it, `pkg:PACKAGE`). A bad
  request (unknown name: with the closest known one, a bad source, `store_max_models`
  reached) is refused before anything runs; then the reply streams NDJSON lines:
  `{status, total, completed}` per phase (copy, download) as bytes move, at most
  every 0.1 s; `{status: "replacing", ...}` when resident copies are retired; last
  `{status: "success", result: <fleet.pull PullResult>, replaced: [...]}` or
  `{error: {code, message, hint?}}`.
- `DELETE /v1/models/{name}` (OpenAI's delete of a model): unloads every copy, then
  removes it; `{id, object: "model", deleted: true, size_bytes, was_pinned, unloaded}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import PurePosixPath
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError
from fleet.gguf_convert import check_quant_type
from fleet.pull import pull_model, resolve_name
from fleet.store import Progress, damage_fix

from fleet.daemon import codec
from fleet.daemon.controllers.ollama import room_for_model, shown
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack, reply
from fleet.daemon.operator import operator_only
from fleet.daemon.owner import detached, resident_copies, retire_copies

log = logging.getLogger("fleet.daemon")

NDJSON = "application/x-ndjson"
#: Progress lines are sent at most this often (seconds), plus each phase's first and last.
PROGRESS_EVERY_S = 0.1


class PullBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `fleetctl pull` sends: its argument and options."""

    source: str
    name: str | None = None
    task: str | None = None
    runtime: str | None = None
    base: str | None = None
    force: bool = False
    #: f16 | q8_0 | q4_k_m: store a safetensors generator as one GGUF file of that type.
    quantize: str | None = None


class LineProgress(Progress):
    """fleet.pull's progress as NDJSON lines, handed from the pulling thread to the
    event loop (`call_soon_threadsafe`: the queue is the loop's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue[dict[str, Any]]) -> None:
        self.loop, self.out = loop, out
        self.status, self.total, self.completed, self.sent_at = "", 0, 0, 0.0

    def emit(self, line: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, line)

    def _progress(self) -> None:
        self.sent_at = time.monotonic()
        self.emit({"status": self.status, "total": self.total, "completed": self.completed})

    def start(self, description: str, total_bytes: int) -> None:
        self.status, self.total, self.completed = description, total_bytes, 0
        self._progress()

    def advance(self, nbytes: int) -> None:
        self.completed += nbytes
        if time.monotonic() - self.sent_at >= PROGRESS_EVERY_S:
            self._progress()

    def finish(self) -> None:
        self._progress()


def error_line(request: Request, exc: FleetError) -> dict[str, Any]:
    body = {"code": exc.code, "message": shown(request, exc)}
    if exc.hint:
        body["hint"] = exc.hint
    return {"error": body}


def checked_source(source: str) -> str:
    """A `path:` source names a folder as the daemon's user reads it: absolute, so it
    does not depend on the daemon's working directory or home (`fleetctl pull` sends
    its own folders that way)."""
    kind, sep, ref = source.partition(":")
    if sep and kind == "path" and not PurePosixPath(ref).is_absolute():
        raise BadRequest(f"{source!r}: a path: source sent to the daemon must be an absolute folder",
                         param="source")
    if sep and kind == "path" and PurePosixPath(ref) == PurePosixPath("/"):
        raise BadRequest("path:/ is the whole filesystem, not a model folder", param="source")
    return source


class StoreController(Controller):
    path = "/v1"
    guards = [operator_only]

    @get("/store")
    async def store(self, request: Request, daemon: Daemon) -> Response:
        store = daemon.store
        manifests, damage = await asyncio.to_thread(lambda: (store.list(), store.damage()))
        return reply(request, {
            "home": daemon.settings.home,
            "models": [{**msgspec.to_builtins(m), "size_bytes": m.size_bytes, "path": str(store.path(m.name))}
                       for m in manifests],
            "damaged": [{"name": name, "why": why, "fix": damage_fix(name), "path": str(store.root / name)}
                        for name, why in damage],
        })

    @post("/store/pull", status_code=200)
    async def pull(self, request: Request, daemon: Daemon) -> Stream:
        body = codec.decode(await request.body(), PullBody, msgpack=body_is_msgpack(request))
        source = checked_source(body.source)
        if body.quantize is not None:
            check_quant_type(body.quantize)  # a 400 now, not an error line after a 200
        opts = dict(task=body.task, runtime=body.runtime, base=body.base, force=body.force, quantize=body.quantize)
        name = await asyncio.to_thread(resolve_name, daemon.store, source, name=body.name)
        room_for_model(daemon, name)
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def run() -> tuple[Any, list[dict]]:
            result = await asyncio.to_thread(pull_model, daemon.store, source, name=body.name,
                                             progress=LineProgress(loop, lines), **opts)
            replaced = []
            if result.status != "up_to_date":
                if await resident_copies(daemon, name):
                    lines.put_nowait({"status": f"replacing the loaded copies of {name}"})
                replaced = await retire_copies(daemon, name)
            log.info("pulled %s through the API: %s", name, result.status)
            return result, replaced

        async def stream() -> AsyncIterator[bytes]:
            # The pull and the retiring of old copies run to their end even when the
            # client leaves (a stored model must never keep serving its old weights).
            task = detached(run(), name)
            while not task.done() or not lines.empty():
                nxt = asyncio.ensure_future(lines.get())
                await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    yield codec.json_line(nxt.result()) + b"\n"
                else:
                    nxt.cancel()
            try:
                result, replaced = task.result()
            except FleetError as exc:
                yield codec.json_line(error_line(request, exc)) + b"\n"
                return
            except Exception as exc:  # the stream has begun: the error can only be its last line
                yield codec.json_line({"error": {"code": "internal",
                                                 "message": f"internal error: {type(exc).__name__}"}}) + b"\n"
                return
            yield codec.json_line({"status": "success", "result": msgspec.to_builtins(result),
                                   "replaced": replaced}) + b"\n"

        return Stream(stream(), media_type=NDJSON)
