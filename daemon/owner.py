"""The daemon is the one owner of its store: what a pull or a delete through its API
does to the copies its workers hold.

A worker keeps a model's weights in memory after they were read; the store's files
alone do not reach it. So every change to the store goes through the daemon
(`fleetctl pull | rm` with a daemon running, `/v1/store/pull`, `DELETE /v1/models/NAME`,
Ollama's `/api/pull` and `/api/delete`), which then settles the resident copies:

- a delete releases the operator's pin (persisted or a preload unpinned since), unpins
  and unloads every copy, then removes the files: nothing serves, lists or reloads a
  model that is gone (`delete_model`);
- a pull that changed a stored model (new files or a refreshed manifest) retires every
  resident copy: each is unloaded, and one a worker kept pinned is loaded again at
  once from the new files, so the pin holds; an unpinned one loads again from the new
  files at its next request (`retire_copies`). The daemon's cached manifest goes too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fleet import blobs
from fleet.control import PIN, UNLOAD, UNPIN
from fleet.errors import BadRequest, FleetError, IntegrityError, ModelNotFound
from fleet.catalog import validate_name

from fleet.daemon.commands import holders, send
from fleet.daemon.core import Daemon

log = logging.getLogger("fleet.daemon")


def stored_or_missing(daemon: Daemon, name: str) -> None:
    """`name` is a model folder of the store (a damaged one counts: it can be deleted),
    else `model_not_found` with the store's advice: pull it when the catalog has it,
    else the closest stored or catalog name (fleet.store `missing`)."""
    try:
        validate_name(name)
    except BadRequest:
        raise ModelNotFound(f"unknown model {name!r}") from None
    if not daemon.store.path(name).is_dir():
        raise daemon.store.missing(name)


async def resident_copies(daemon: Daemon, name: str) -> list[tuple[dict, str]]:
    """(worker, model it holds) for each copy of `name`: the model itself, or for a LoRA
    adapter the base it is attached to (the adapter's weights live in its base's copy)."""
    return [(w, model) for w in await daemon.workers() if w["up"] for model, m in w["models"].items()
            if model == name or name in ((m or {}).get("loras") or ())]


async def retire_copies(daemon: Daemon, name: str) -> list[dict]:
    """After a pull changed `name`: every resident copy is unloaded (an adapter's: its
    base's), and a copy its worker held pinned is pinned (loaded) again from the new
    files. The workers that acted, `{worker, device, model, pinned}` each."""
    daemon.forget(name)
    acted = []
    for worker, model in await resident_copies(daemon, name):
        pinned = bool(worker["models"].get(model, {}).get("pinned"))
        if pinned:
            await send(daemon, worker, UNPIN, model)
        await send(daemon, worker, UNLOAD, model)
        if pinned:
            await send(daemon, worker, PIN, model)
        acted.append({"worker": worker["worker"], "device": worker["device"], "model": model, "pinned": pinned})
        log.info("pull replaced %s: the copy of %s on worker %d %s", name, model, worker["worker"],
                 "was loaded again from the new files (pinned)" if pinned else "was unloaded")
    return acted


async def delete_model(daemon: Daemon, name: str) -> dict:
    """Unload every copy of `name`, then remove it from the store (module doc). Refused
    (400, nothing changed) while adapters stored on it need it or the config preloads it.
    `{size_bytes, was_pinned, unloaded: [worker ids]}`."""
    stored_or_missing(daemon, name)
    dependents = daemon.store.dependents(name)
    if dependents:
        raise BadRequest(f"{name} is the base model of {', '.join(dependents)}: delete those first",
                         hint=f"fleetctl rm {dependents[0]}")
    if name in daemon.settings.preload:
        raise BadRequest(f"{name} is preloaded by this daemon's config (preload): take it out of preload "
                         "before deleting it")
    serving = daemon.aliases.aliases_of(name)  # its clients would get 404s (daemon.aliases)
    if serving:
        raise BadRequest(f"{name} serves the alias {', '.join(serving)}: point it at another version first",
                         hint=f"fleetctl alias set {serving[0]} VERSION, or fleetctl rollback {serving[0]}")
    try:
        size = daemon.store.get(name).size_bytes
    except (IntegrityError, ModelNotFound):
        size = None  # a damaged manifest: removed all the same
    was_pinned = daemon.record_unpin(name)
    unloaded = []
    for worker in await holders(daemon, name):
        await send(daemon, worker, UNPIN, name)
        await send(daemon, worker, UNLOAD, name)
        unloaded.append(worker["worker"])
    await asyncio.to_thread(remove_files, daemon, name)
    daemon.forget(name)
    log.info("deleted %s from the store (unloaded from %d worker(s))", name, len(unloaded))
    return {"size_bytes": size, "was_pinned": was_pinned, "unloaded": unloaded}


def remove_files(daemon: Daemon, name: str) -> None:
    """The model leaves the store, and the uploaded blobs only it held go with it (fleet.blobs)."""
    blobs.release(daemon.settings.home_path, daemon.store, daemon.store.remove(name))


#: Pulls running now: held here so a pull whose client left runs to its end.
_running: set[asyncio.Task] = set()


def detached(work: Any, name: str) -> asyncio.Task:
    """`work` as a task that outlives the request streaming its progress; a failure
    nobody read (the client left) is logged."""
    task = asyncio.ensure_future(work)
    _running.add(task)

    def done(t: asyncio.Task) -> None:
        _running.discard(t)
        if not t.cancelled() and (exc := t.exception()) is not None and not isinstance(exc, FleetError):
            log.error("pulling %s failed", name, exc_info=exc)

    task.add_done_callback(done)
    return task
