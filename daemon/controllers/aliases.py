"""`/v1/aliases`: stable names clients use, each pointing at a stored version (daemon.aliases).

- `GET /v1/aliases`: every alias, its version, rollback target and canary, with each
  version's request rate, error rate and latencies over top's window.
- `GET /v1/aliases/{alias}`, `GET /v1/aliases/{alias}/history` (fleet.aliases.Event, oldest first).
- `PUT /v1/aliases/{alias}` `{version, canary?, canary_percent?, owner?, reason?, warm?}`: point
  the alias at `version`. With `warm` (the default) the version is loaded first, so the
  alias's next requests do not wait for it; a version that does not load changes nothing.
- `POST /v1/aliases/{alias}/rollback` `{owner?, reason?, warm?}`: back to the previous
  version (a running canary ends instead). With `warm` (the default), when the current
  version is loaded on this box the previous one is loaded first, while the current one
  still serves, so the first request after the rollback does not wait for a load (a
  target still resident: milliseconds; an evicted one: its load time). A target that does
  not load changes nothing; `warm: false` switches at once.
- `DELETE /v1/aliases/{alias}`.

Reading is open; the rest is the operator's (daemon.operator: the admin key).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post, put

from fleet.aliases import validate_alias
from fleet.catalog import validate_name
from fleet.control import LOAD
from fleet.errors import BadRequest, FleetError

from fleet.daemon import codec
from fleet.daemon.aliases import (
    check_target, event_of, removed, rolled_back, set_to, version_task, view_of,
)
from fleet.daemon.controllers.admin import choose_worker, send
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack, reply
from fleet.daemon.operator import operator_only

#: Who made a change, as the history records it (the CLI sends the user's name).
OWNER_RE = re.compile(r"^[A-Za-z0-9._:@/+-]{1,64}\Z")
OPERATOR = "operator"
MAX_REASON = 1000


class AliasSet(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: str
    canary: str | None = None
    canary_percent: float = 0.0
    owner: str | None = None
    reason: str = ""
    warm: bool = True


class AliasNote(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    owner: str | None = None
    reason: str = ""


class Rollback(AliasNote, forbid_unknown_fields=True, kw_only=True):
    #: Load the previous version first when the current one is loaded (module doc).
    warm: bool = True


def owner_of(owner: str | None) -> str:
    if owner is None:
        return OPERATOR
    if not OWNER_RE.match(owner):
        raise BadRequest(f"owner must be 1-64 of A-Z a-z 0-9 . _ : @ / + -, got {owner!r}", param="owner")
    return owner


def check_reason(reason: str) -> str:
    if len(reason) > MAX_REASON:
        raise BadRequest(f"reason is {len(reason)} characters; at most {MAX_REASON}", param="reason")
    return reason


async def body_of(request: Request, type_: type[Any]) -> Any:
    body = await request.body()
    if not body:
        return type_()
    return codec.decode(body, type_, msgpack=body_is_msgpack(request))


async def warm(daemon: Daemon, version: str) -> None:
    """Load `version` on this box before the alias points at it (no-op for a version only
    another box stores): a version that does not load refuses the switch, with its error.
    A LoRA adapter is no model a worker loads: its base is loaded (the weights that take
    seconds), and the adapter's own few MB attach at its first request, as they do for a
    request that names it."""
    if not daemon.store.exists(version) or daemon.broker is None:
        return
    target = daemon.store.get(version).base or version
    await send(daemon, choose_worker(await daemon.workers(), target, None), LOAD, target)


def changed(daemon: Daemon, after: Any, before: Any, seconds: float) -> dict[str, Any]:
    """A change's reply: the alias as this change left it (not as the table may be by now)."""
    return {"alias": view_of(after, daemon.recent.models()) if after is not None else None, "before": before.version if before else None, "seconds": round(seconds, 6)}


async def packages_of(daemon: Daemon, events: list[Any]) -> dict[str, Any]:
    """The evaluation and provenance of each promotion the events name (fleet.promotions),
    by package id; a package that no longer reads is left out (the event still names it)."""
    out = {}
    for e in events:
        if e.package:
            try:
                p = await daemon.aliases.package(e.package)
            except FleetError:
                continue
            out[p.id] = {"kind": p.kind, "candidate": p.candidate.name, "source": p.candidate.source,
                         "revision": p.candidate.revision, "licence": p.candidate.licence, "replaced": p.replaced,
                         "forced": p.forced, "eval_sha256": p.evaluation.file_sha256, "lines": p.evaluation.lines,
                         "margin": p.evaluation.margin, "candidate_metrics": p.evaluation.candidate,
                         "current_metrics": p.evaluation.current, "regressions": p.evaluation.regressions}
    return out


class AliasesController(Controller):
    path = "/v1/aliases"

    @get("")
    async def list_aliases(self, request: Request, daemon: Daemon) -> Response:
        return reply(request, {"aliases": daemon.aliases.view(daemon.recent.models())})

    @get("/{alias:str}")
    async def show(self, request: Request, daemon: Daemon, alias: str) -> Response:
        return reply(request, view_of(daemon.aliases.get(alias), daemon.recent.models()))

    @get("/{alias:str}/history")
    async def history(self, request: Request, daemon: Daemon, alias: str) -> Response:
        events = await daemon.aliases.history(alias)
        if not events:
            daemon.aliases.get(alias)  # 404 for an alias that never was
        return reply(request, {"alias": alias, "events": events, "packages": await packages_of(daemon, events)})

    @put("/{alias:str}", guards=[operator_only], status_code=200)
    async def set_alias(self, request: Request, daemon: Daemon, alias: str) -> Response:
        """Point `alias` at a stored version (a new alias, or a switch)."""
        validate_alias(alias)
        body = await body_of(request, AliasSet)
        by, reason = owner_of(body.owner), check_reason(body.reason)
        before = daemon.aliases.table.get(alias)
        check_target(daemon, alias, body.version, before)
        if (body.canary is None) != (body.canary_percent == 0.0):
            raise BadRequest("a canary takes both `canary` (the candidate) and `canary_percent` (its share, > 0)",
                             param="canary")
        if body.canary is not None:
            validate_name(body.canary)
            if version_task(daemon, body.canary) not in (None, version_task(daemon, body.version)):
                raise BadRequest(f"canary {body.canary!r} serves another task than {body.version!r}", param="canary")
        if body.warm:
            for version in filter(None, (body.version, body.canary)):
                await warm(daemon, version)
        kind = "canary" if body.canary else "set"
        before, after, seconds = await daemon.aliases.change(
            alias, set_to(alias, body.version, by=by, canary=body.canary, canary_percent=body.canary_percent),
            event_of(kind, by=by, reason=reason))
        return reply(request, changed(daemon, after, before, seconds))

    @post("/{alias:str}/rollback", guards=[operator_only], status_code=200)
    async def rollback(self, request: Request, daemon: Daemon, alias: str) -> Response:
        """Back to the previous version (or the canary ends), recorded in the history."""
        body = await body_of(request, Rollback)
        by, reason = owner_of(body.owner), check_reason(body.reason)
        found = daemon.aliases.get(alias)
        if found.previous is not None and not found.canary:
            version_task(daemon, found.previous)  # 404 when it was deleted since: clients would get 404s
            if body.warm and found.version in await daemon.loaded_models():
                await warm(daemon, found.previous)
        before, after, seconds = await daemon.aliases.change(alias, rolled_back(alias, by=by),
                                                             event_of("rollback", by=by, reason=reason))
        return reply(request, changed(daemon, after, before, seconds))

    @delete("/{alias:str}", guards=[operator_only], status_code=200)
    async def remove(self, request: Request, daemon: Daemon, alias: str) -> Response:
        body = await body_of(request, AliasNote)
        by, reason = owner_of(body.owner), check_reason(body.reason)
        daemon.aliases.get(alias)
        before, _, seconds = await daemon.aliases.change(alias, removed(alias), event_of("remove", by=by, reason=reason))
        return reply(request, {"alias": None, "before": before.version if before else None,
                               "seconds": round(seconds, 6)})
