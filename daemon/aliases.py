"""Aliases on the request path: each request reads the alias table once, at admission.

`AliasScope` (plain ASGI, outside the routes) gives every HTTP request a `Resolution`:
the first time the request names an alias (its `model`, its `adapter`, a per-model URL,
a token-id input's tokenizer) the alias is resolved against the table of that moment,
and every later look-up of the same name in the same request gets the same version.
The task functions (daemon.tasks) put the resolved names into the payload the worker
reads, so what was admitted runs on the version it was admitted with, on whichever box
runs it: a switch changes what the *next* requests get, never one in flight, and no
request runs on two versions. The reply names the version that served it
(`X-Fleet-Model-Version`) and the alias it came through (`X-Fleet-Alias`).

The table (`AliasBook.table`) is a dict replaced whole on each change, on the event
loop: a reader holds the old dict or the new one. Changes are written first (the store
file under its flock, or with NATS the JetStream KV bucket: daemon.alias_kv) and only
then swapped in, so a change that cannot be saved changes nothing. What a change
records (its history event, a promotion's package) goes into the store, and with NATS
into buckets every box reads (daemon.alias_records): `record`, `history`, `package`.

A canary (`Alias.canary`, `canary_percent`) splits the alias's clients by a hash of
the client (daemon.clients: `X-Fleet-Client` on loopback, else the peer's address), so
one client sees one version while the share stays (fleet.aliases.choose_version).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from fleet.aliases import Alias, AliasStore, Event, check_percent, choose_version, utc_now, validate_alias
from fleet.catalog import validate_name
from fleet.promotions import ID_RE, Package, PackageStore
from fleet.errors import BadRequest, ModelNotFound, NotFound, Unavailable

from fleet.daemon.clients import client_of

log = logging.getLogger("fleet.daemon")

VERSION_HEADER = "X-Fleet-Model-Version"
ALIAS_HEADER = "X-Fleet-Alias"
_VERSION = VERSION_HEADER.lower().encode()
_ALIAS = ALIAS_HEADER.lower().encode()

#: (before, after) -> after: one change of one alias (None: absent / removed).
Change = Callable[[Alias | None], Alias | None]


class Resolution:
    """One request's view of the alias table: each name it resolved, and the version it
    runs on (for the reply's headers)."""

    __slots__ = ("scope", "names", "served", "alias", "_client")

    def __init__(self, scope: Any) -> None:
        self.scope = scope
        self.names: dict[str, str] = {}
        self.served: str | None = None
        self.alias: str | None = None
        self._client: str | None = None

    def client(self) -> str:
        """Who the request comes from (daemon.clients), read only when a canary asks."""
        if self._client is None:
            self._client = client_of(self.scope) if self.scope is not None else ""
        return self._client


RESOLUTION: contextvars.ContextVar[Resolution | None] = contextvars.ContextVar("fleet_aliases", default=None)


class AliasScope:
    """ASGI: a `Resolution` for each HTTP request, and its version in the reply's headers."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        res = Resolution(scope)
        token = RESOLUTION.set(res)

        async def send_version(message: Any) -> None:
            # A success names its version; a refusal served nothing (and may name no stored model).
            if message["type"] == "http.response.start" and res.served is not None and message["status"] < 400:
                extra = [(_VERSION, res.served.encode())]
                if res.alias is not None:
                    extra.append((_ALIAS, res.alias.encode()))
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_version)
        finally:
            RESOLUTION.reset(token)


class AliasBook:
    """The alias table this daemon routes by, and the one way to change it."""

    def __init__(self, store_root: Path) -> None:
        self.files = AliasStore(store_root)
        #: Promotion packages (daemon.promotions), beside the table.
        self.packages = PackageStore(store_root)
        self.table: dict[str, Alias] = {}
        #: With NATS (daemon.alias_kv): the KV bucket the table lives in once this box has
        #: read it (`clustered` from the start); None: the store file.
        self.shared: Any = None
        self.clustered = False
        self.joining: asyncio.Task | None = None
        #: One change at a time in this process (the file's flock or the KV's
        #: compare-and-set orders them between processes and boxes).
        self._changing = asyncio.Lock()

    def load(self) -> None:
        """The table from the store file (at start, and on SIGHUP without NATS)."""
        if self.shared is None:
            self.table = self.files.load()

    # -- the request path ------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The version `name` means for the current request: an alias's version (or its
        canary, for the canary's share of clients), fixed at the request's first look-up;
        any other name is itself."""
        res = RESOLUTION.get()
        if res is not None:
            got = res.names.get(name)
            if got is not None:
                return got
        alias = self.table.get(name)
        if alias is None:
            version = name
        else:
            version = choose_version(alias, res.client() if res is not None else "")
            if res is not None:
                res.alias = name
        if res is not None:
            res.names[name] = version
        return version

    @staticmethod
    def serving(version: str) -> None:
        """The current request runs on `version` (the reply's `X-Fleet-Model-Version`)."""
        res = RESOLUTION.get()
        if res is not None:
            res.served = version

    def aliases_of(self, version: str) -> list[str]:
        return sorted(a.name for a in self.table.values() if version in (a.version, a.canary))

    def get(self, name: str) -> Alias:
        alias = self.table.get(validate_alias(name))
        if alias is None:
            raise NotFound(f"no alias {name!r}", hint="fleetctl alias ls lists the aliases")
        return alias

    # -- changes -----------------------------------------------------------------------

    async def change(self, name: str, change: Change, event: Callable[[Alias | None, Alias | None], Event | None],
                     ) -> tuple[Alias | None, Alias | None, float]:
        """Apply `change` to alias `name`, save it, swap the table, record `event(before,
        after)` in the alias's history. (before, after, seconds the write and swap took)."""
        validate_alias(name)
        if self.clustered and self.shared is None:
            raise Unavailable("this box has not joined the NATS cluster's alias table yet: a change here would "
                              "not reach the other boxes; retry shortly")
        async with self._changing:
            t0 = time.perf_counter()
            if self.shared is not None:
                before, after = await self.shared.change(name, change)
            else:
                before, after = await asyncio.to_thread(self._change_file, name, change)
            self.apply(name, after)
            seconds = time.perf_counter() - t0
        record = event(before, after)
        if record is not None:
            record.seconds = round(seconds, 6)
            await self.record(record)
        return before, after, seconds

    # -- what changes record ----------------------------------------------------------

    async def record(self, event: Event) -> None:
        """Append `event` to its alias's history: the store's file, and with NATS the
        shared bucket. A change stands when its record fails: that is logged."""
        try:
            await asyncio.to_thread(self.files.record, event)
            if self.shared is not None:
                await self.shared.records.record(event)
        except Exception as exc:  # the change stands; its record is what failed
            log.error("alias %s changed, but its history could not be written: %s", event.alias, exc)

    async def history(self, alias: str) -> list[Event]:
        """The alias's events, oldest first: every box's with NATS, else this store's."""
        if self.shared is not None:
            return await self.shared.records.history(validate_alias(alias))
        return await asyncio.to_thread(self.files.history, validate_alias(alias))

    async def write_package(self, package: Package) -> None:
        await asyncio.to_thread(self.packages.write, package)
        if self.shared is not None:
            await self.shared.records.write_package(package)

    async def package(self, package_id: str) -> Package:
        """A promotion package by id: this store's, else (with NATS) the one another box wrote."""
        try:
            return await asyncio.to_thread(self.packages.read, package_id)
        except NotFound:
            if self.shared is None or not ID_RE.match(package_id):
                raise
        found = await self.shared.records.read_package(package_id)
        if found is None:
            raise NotFound(f"no promotion package {package_id!r} on any box")
        return found

    def _change_file(self, name: str, change: Change) -> tuple[Alias | None, Alias | None]:
        with self.files.locked() as table:
            before = table.get(name)
            after = change(before)
            if after is None:
                table.pop(name, None)
            else:
                table[name] = after
        return before, after

    def apply(self, name: str, alias: Alias | None) -> None:
        """`alias` (None: removed) becomes `name`'s entry: the table is replaced whole."""
        table = dict(self.table)
        if alias is None:
            table.pop(name, None)
        else:
            table[name] = alias
        self.table = table

    # -- ps ------------------------------------------------------------------------------

    def view(self, recent: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Each alias as `/v1/ps` shows it, with its versions' error rates and latencies
        over top's window (daemon.top): a canary beside the version it may replace."""
        return [view_of(alias, recent) for alias in sorted(self.table.values(), key=lambda a: a.name)]


def view_of(alias: Alias, recent: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One alias as `/v1/ps` and `/v1/aliases` show it (`AliasBook.view`)."""
    versions = {}
    for version in filter(None, (alias.version, alias.canary)):
        m = recent.get(version, {})
        rate, errors = m.get("requests_per_s", 0.0), m.get("errors_per_s", 0.0)
        versions[version] = {"requests_per_s": rate, "errors_per_s": errors,
                             "error_rate": round(errors / rate, 4) if rate else 0.0,
                             "p50_ms": m.get("p50_ms"), "p95_ms": m.get("p95_ms")}
    return {**_plain(alias), "versions": versions}


def _plain(alias: Alias) -> dict[str, Any]:
    return {"name": alias.name, "version": alias.version, "previous": alias.previous, "canary": alias.canary,
            "canary_percent": alias.canary_percent, "at": alias.at, "by": alias.by, "change": alias.change}


# ---- the changes, as pure functions of (before) -> after ----------------------------------------

def version_task(daemon: Any, name: str) -> str | None:
    """The task of version `name`: a model or adapter this box stores; None for one only a
    live box of its cluster has (with NATS); ModelNotFound for one nobody has."""
    validate_name(name)
    if daemon.store.exists(name):
        return daemon.store.get(name).task
    if daemon.cluster is not None and daemon.knows_model(name):
        return None
    raise ModelNotFound(f"model {name!r} is not in the store", hint="fleetctl list shows what is pulled")


def check_target(daemon: Any, name: str, version: str, before: Alias | None) -> None:
    """May alias `name` point at `version`? A stored model or adapter (here, or with NATS
    on a live box), not an alias itself (no chains), of the task the alias served so far;
    and `name` must not be a stored model's own name (the alias would hide it)."""
    validate_name(version)
    table = daemon.aliases.table
    if version in table:
        raise BadRequest(f"{version!r} is itself an alias: point {name!r} at a stored version "
                         f"({table[version].version!r})", param="version")
    if "@" not in name and daemon.store.exists(name):
        raise BadRequest(f"{name!r} is a stored model's name: an alias needs a name of its own", param="name")
    task = version_task(daemon, version)
    if before is not None and task is not None:
        try:
            was = version_task(daemon, before.version)
        except ModelNotFound:  # its version was removed since: any task may follow
            was = None
        if was is not None and was != task:
            raise BadRequest(f"alias {name!r} serves {was} ({before.version!r}); {version!r} serves {task}: "
                             "clients of the alias would get another task's answers", param="version")


def set_to(name: str, version: str, *, by: str, canary: str | None = None, canary_percent: float = 0.0,
           ) -> Change:
    """Point `name` at `version` (its former version becomes the rollback target), with an
    optional canary."""
    check_percent(canary_percent)

    def change(before: Alias | None) -> Alias:
        if before is None:
            return Alias(name=name, version=version, canary=canary, canary_percent=canary_percent if canary else 0.0,
                         at=utc_now(), by=by)
        previous = before.version if before.version != version else before.previous
        return Alias(name=name, version=version, previous=previous, canary=canary,
                     canary_percent=canary_percent if canary else 0.0, at=utc_now(), by=by,
                     change=before.change + 1)

    return change


def with_canary(name: str, candidate: str, percent: float, *, by: str) -> Change:
    """Send `percent` % of alias `name`'s clients to `candidate`; the version stays."""
    check_percent(percent)

    def change(before: Alias | None) -> Alias:
        if before is None:
            raise NotFound(f"no alias {name!r}: a canary runs beside a version, so set one first "
                           f"(fleetctl alias set {name} VERSION)")
        return Alias(name=name, version=before.version, previous=before.previous, canary=candidate,
                     canary_percent=percent, at=utc_now(), by=by, change=before.change + 1)

    return change


def rolled_back(name: str, *, by: str) -> Change:
    """Back to the previous version: a running canary ends (its version stays), else the
    version and its rollback target trade places (a second rollback undoes the first)."""
    def change(before: Alias | None) -> Alias:
        if before is None:
            raise NotFound(f"no alias {name!r}", hint="fleetctl alias ls lists the aliases")
        if before.canary:
            return Alias(name=name, version=before.version, previous=before.previous, at=utc_now(), by=by,
                         change=before.change + 1)
        if before.previous is None:
            raise BadRequest(f"alias {name!r} has no previous version to go back to (it has only pointed at "
                             f"{before.version!r})", hint=f"fleetctl history {name}")
        return Alias(name=name, version=before.previous, previous=before.version, at=utc_now(), by=by,
                     change=before.change + 1)

    return change


def removed(name: str) -> Change:
    def change(before: Alias | None) -> None:
        if before is None:
            raise NotFound(f"no alias {name!r}", hint="fleetctl alias ls lists the aliases")
        return None

    return change


def event_of(kind: str, *, by: str, reason: str = "", package: str | None = None,
             ) -> Callable[[Alias | None, Alias | None], Event]:
    """The history entry of a change of kind `kind`."""
    def event(before: Alias | None, after: Alias | None) -> Event:
        alias = (after or before).name  # type: ignore[union-attr]
        return Event(alias=alias, kind=kind, at=utc_now(), by=by, previous=before.version if before else None,
                     version=after.version if after else None, canary=after.canary if after else None,
                     canary_percent=after.canary_percent if after else 0.0, reason=reason, package=package)

    return event


def resolved(book: AliasBook, req: Any, payload: bytes, encode: Callable[[Any], bytes]) -> tuple[Any, bytes]:
    """A task's request with its aliases (`model`, `adapter`) resolved for the current
    request, and its payload for the queue, encoded again only when a name changed: the
    worker, on whichever box, reads stored names only. The version it names (the adapter,
    when there is one) goes into the reply's `X-Fleet-Model-Version`."""
    model, adapter = req.model, getattr(req, "adapter", None)
    version = book.resolve(model) if model else model
    lora = book.resolve(adapter) if adapter else adapter
    if lora or version:
        book.serving(lora or version)
    if version == model and lora == adapter:
        return req, payload
    req = msgspec.structs.replace(req, model=version, **({"adapter": lora} if lora != adapter else {}))
    return req, encode(req)
