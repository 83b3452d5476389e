"""Model residency admin: `POST|DELETE /v1/models/{name}/pin`, `POST /v1/models/{name}/load|unload`.

The daemon never loads a model itself: it picks the worker (`choose_worker`)
and sends it a command through its control lane (protocol: fleet.control),
then waits for the ack like any request. A worker's error (`model_too_large`,
`model_load_failed`, ...) comes back with its contract code.

Optional body (JSON or MessagePack): `{"device": "cpu" | "cuda:K"}` for pin and
load (unpin and unload act on every copy and refuse it). Replies: `{model, op,
results: [{worker, device, loaded, pinned, bytes, load_ms, evicted, already}]}`,
one entry per worker that acted.

Every route here is the operator's (daemon.operator): without the admin key, 401/403.
"""

from __future__ import annotations


import msgspec
from litestar import Controller, Request, Response, delete, post

from fleet.catalog import validate_name
from fleet.errors import BadRequest, FleetError
from fleet.control import LOAD, PIN, UNLOAD, UNPIN

from fleet.daemon import codec
from fleet.daemon.commands import choose_worker, holders, send
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack, reply
from fleet.daemon.operator import operator_only
from fleet.daemon.quotas import check_owner_load


class AdminOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    device: str | None = None


def stored(daemon: Daemon, name: str) -> str:
    """`name` is stored, else `model_not_found` with the store's advice: `fleetctl pull
    NAME` for a catalog model not pulled yet, else the closest stored or catalog name."""
    validate_name(name)
    if not daemon.store.exists(name):
        raise daemon.store.missing(name)
    return name


async def stored_or_held(daemon: Daemon, name: str) -> None:
    """Unpin and unload also reach a copy still resident after its files left the store
    by another way than the daemon (daemon.owner): it must not be left unreachable."""
    validate_name(name)
    if not daemon.store.exists(name) and not await holders(daemon, name):
        raise daemon.store.missing(name)


async def options(request: Request) -> AdminOptions:
    body = await request.body()
    if not body:
        return AdminOptions()
    return codec.decode(body, AdminOptions, msgpack=body_is_msgpack(request))


def every_copy(opts: AdminOptions, op: str) -> None:
    """unpin and unload act on every worker holding the model: a `device` would not be applied."""
    if opts.device is not None:
        raise BadRequest(f"{op} acts on every worker that holds the model: `device` is not taken here",
                         param="device")


class AdminController(Controller):
    path = "/v1/models/{name:str}"
    guards = [operator_only]

    @post("/pin", status_code=200)
    async def pin(self, request: Request, daemon: Daemon, name: str) -> Response:
        """Load now (if needed) and never evict; persisted, so it survives a restart."""
        stored(daemon, name)
        await check_owner_load(daemon, name)
        opts = await options(request)
        worker = choose_worker(await daemon.workers(), name, opts.device)
        held = bool(worker["models"].get(name, {}).get("pinned"))
        result = await send(daemon, worker, PIN, name)
        try:
            daemon.record_pin(name, result["device"])
        except FleetError:
            # Not persisted (a full disk: insufficient_storage), so not pinned: the
            # worker lets go of the pin it just took (not of one it held before).
            if not held:
                await send(daemon, worker, UNPIN, name)
            raise
        return reply(request, {"model": name, "op": PIN, "results": [result]})

    @delete("/pin", status_code=200)
    async def unpin(self, request: Request, daemon: Daemon, name: str) -> Response:
        """Evictable again (stays resident until room is needed)."""
        await stored_or_held(daemon, name)
        every_copy(await options(request), UNPIN)
        was_pinned = daemon.record_unpin(name)
        results = [await send(daemon, w, UNPIN, name) for w in await holders(daemon, name)]
        return reply(request, {"model": name, "op": UNPIN, "was_pinned": was_pinned, "results": results})

    @post("/load", status_code=200)
    async def load(self, request: Request, daemon: Daemon, name: str) -> Response:
        stored(daemon, name)
        await check_owner_load(daemon, name)
        opts = await options(request)
        result = await send(daemon, choose_worker(await daemon.workers(), name, opts.device), LOAD, name)
        return reply(request, {"model": name, "op": LOAD, "results": [result]})

    @post("/unload", status_code=200)
    async def unload(self, request: Request, daemon: Daemon, name: str) -> Response:
        await stored_or_held(daemon, name)
        every_copy(await options(request), UNLOAD)
        if name in daemon.pinned_models():
            raise BadRequest(f"{name} is pinned; unpin it first (fleetctl unpin {name})")
        results = [await send(daemon, w, UNLOAD, name) for w in await holders(daemon, name)]
        return reply(request, {"model": name, "op": UNLOAD, "results": results})
