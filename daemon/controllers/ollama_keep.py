"""Ollama's `keep_alive` on fleet's admin path (controllers/ollama.py's module doc says
the mapping): negative = a worker-side pin for the life of this daemon process, 0 =
unload once answered, anything else = fleet's LRU eviction.

Apart from the routes because it is the one part of the Ollama API that changes what
the workers hold, and the rules for who may do that (the operator's pins are never a
client's to make or undo) are read in one place.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request

from fleet.control import LOAD, PIN, UNLOAD, UNPIN
from fleet.errors import BadRequest, FleetError

from fleet.daemon.commands import choose_worker, holders, send
from fleet.daemon.controllers.ollama_wire import Keep, choose_keep
from fleet.daemon.core import Daemon
from fleet.daemon.operator import is_operator

log = logging.getLogger("fleet.daemon")


def client_keep(request: Request, value: Any, dropped: list[str]) -> tuple[Keep, list[str]]:
    """`keep_alive` as Ollama reads it; keeping (< 0) and unloading (0) only for the
    operator, else not applied and named among the ignored fields (see the module doc)."""
    keep = choose_keep(value)
    if keep is Keep.LRU or is_operator(request):
        return keep, dropped
    return Keep.LRU, dropped + ["keep_alive"]


async def pin(daemon: Daemon, name: str) -> None:
    """keep_alive < 0: load now and keep resident while this daemon runs (Ollama's keep
    never outlives its server). Pinned on the worker only, never persisted: a client
    cannot make the daemon hold a model across restarts, nor hold readiness for it."""
    workers = await daemon.workers()
    if any(w["up"] and w["models"].get(name, {}).get("pinned") for w in workers):
        return
    await send(daemon, choose_worker(workers, name, None), PIN, name)


def refuse_operator_pin(daemon: Daemon, name: str) -> None:
    """keep_alive 0 on a model the operator keeps (preload, persisted pin): refused."""
    if name in daemon.pinned_models():
        raise BadRequest(f"{name} is kept resident by the operator (preloaded or pinned): keep_alive 0 does not "
                         f"unload it; the operator releases it with `fleetctl unpin {name}`")


async def unload(daemon: Daemon, name: str, *, operator_pin: bool = False) -> None:
    """Unload every copy, releasing a client's keep on the workers first. An operator's
    pin is released only with `operator_pin` (`/api/delete` removes the model itself)."""
    if operator_pin:
        daemon.record_unpin(name)
    else:
        refuse_operator_pin(daemon, name)
    for worker in await holders(daemon, name):
        await send(daemon, worker, UNPIN, name)
        await send(daemon, worker, UNLOAD, name)


async def keep_before(daemon: Daemon, name: str, keep: Keep) -> None:
    if keep is Keep.PIN:
        await pin(daemon, name)
    elif keep is Keep.UNLOAD:
        refuse_operator_pin(daemon, name)  # before the request runs: refused, not answered and ignored


async def keep_after(daemon: Daemon, name: str, keep: Keep) -> None:
    """keep_alive 0: unload once answered. The answer is already the client's, so a
    failure here is logged, not returned."""
    if keep is not Keep.UNLOAD:
        return
    try:
        await unload(daemon, name)
    except FleetError as exc:
        log.warning("keep_alive 0: unloading %s failed: %s", name, exc.message)


async def apply_keep(daemon: Daemon, name: str, keep: Keep) -> str:
    """A request with nothing to run: load, pin or unload; its `done_reason`."""
    if keep is Keep.UNLOAD:
        await unload(daemon, name)
        return "unload"
    if keep is Keep.PIN:
        await pin(daemon, name)
    elif name not in await daemon.loaded_models():
        await send(daemon, choose_worker(await daemon.workers(), name, None), LOAD, name)
    return "load"
