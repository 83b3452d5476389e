"""`GET /v1/models` and `/v1/models/{id}` (OpenAI shape), `GET /v1/ps`, `/healthz`, `/readyz`.

The model list holds every stored model, then every alias whose version this box stores
(`id` the alias, `alias_of` its version, the rest the version's card): an OpenAI client
picks a model from the list, and an alias is a name it may use."""

from __future__ import annotations

import os
import time
from datetime import datetime

import msgspec
from litestar import Controller, Request, Response, delete, get

from fleet import __version__
from fleet.calibration import calibration_extra
from fleet.catalog import load_catalog
from fleet.decisions import SHARED_DECIDERS
from fleet.errors import BadRequest, ModelNotFound
from fleet.errors import FleetError
from fleet.protocol import DecisionModelCard, ModelCard, ModelDetail, ModelList
from fleet.store import Manifest
from fleet.tools import capabilities

from fleet.daemon.core import Daemon, live_profiles
from fleet.daemon.controllers.ollama_facts import facts
from fleet.daemon.defaults import decision_model
from fleet.daemon.http import reply
from fleet.daemon.systemone import DEFAULT_ALIAS
from fleet.daemon.model_urls import SCOPE_MODEL
from fleet.daemon.operator import is_operator, operator_only
from fleet.daemon.owner import delete_model


async def workers_view(daemon: Daemon) -> list[dict]:
    """Registered workers (from the queue), each with its supervisor slot index and
    restart count joined by pid; a worker restarted after a crash shows a new pid."""
    slots = {s["pid"]: s for s in daemon.supervisor.view()} if daemon.supervisor else {}
    out = []
    for w in await daemon.workers():
        slot = slots.get(w["pid"])
        out.append({**w, "index": slot["index"] if slot else None, "restarts": slot["restarts"] if slot else 0})
    return out


def unix_seconds(iso: str) -> int:
    """A manifest's `created_at` (ISO 8601, UTC) as OpenAI's `created`; 0 when unreadable."""
    try:
        return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


def model_capabilities(daemon: Daemon, m: Manifest) -> list[str]:
    """What `m` can do (fleet.tools.capabilities), a LoRA adapter what its base can; read
    from the store's files (the chat template), cached per pull."""
    try:
        own = daemon.store.get(m.base) if m.base else m
    except FleetError:
        own = m
    template = facts(daemon.store, own).template if m.task == "generate" else None
    return capabilities(m.task, own.runtime, template)


def model_card(daemon: Daemon, m: Manifest, loaded: set[str], pinned: set[str],
               workers: list[dict] | None = None) -> ModelCard:
    return ModelCard(id=m.name, created=unix_seconds(m.created_at), task=m.task, runtime=m.runtime,
                     loaded=m.name in loaded, pinned=m.name in pinned, capabilities=model_capabilities(daemon, m),
                     **(decision_temperatures(daemon, m.name, workers or []) if m.task == "decide" else {}))


def alias_cards(daemon: Daemon, cards: dict[str, ModelCard], only: str | None) -> list[ModelCard]:
    """A card per alias (module doc) from its version's card in `cards` (by stored name);
    an alias whose version only another box stores is left out (its task is not known
    here)."""
    out = []
    for alias in sorted(daemon.aliases.table.values(), key=lambda a: a.name):
        card = cards.get(alias.version)
        if card is not None and (only is None or alias.name == only):
            canary = {"canary": alias.canary, "canary_percent": alias.canary_percent} if alias.canary else {}
            out.append(msgspec.structs.replace(card, id=alias.name, pinned=False, alias_of=alias.version, **canary))
    return out


def decision_temperatures(daemon: Daemon, name: str, workers: list[dict]) -> dict:
    """A decision model's temperatures for its card: a worker's live ones, else the
    catalog's (what its next load takes)."""
    for view in live_profiles(workers, name):
        if view.decide_temperatures is not msgspec.UNSET:
            return {"decide_temperatures": view.decide_temperatures, "calibration": view.calibration,
                    "temperatures_live": True}
    try:
        entry = load_catalog(daemon.settings.home).find(name)
    except FleetError:  # a broken models.toml: the card says nothing it cannot know
        return {}
    cal = calibration_extra(entry.calibration if entry is not None else None)
    return {"decide_temperatures": cal["decide_temperatures"] or {}, "calibration": cal["calibration"],
            "temperatures_live": False}


def decision_cards(daemon: Daemon, listed: list[Manifest]) -> list[DecisionModelCard]:
    """System One's model list: the decision models and the generators that answer
    decisions from their own weights, after the `jev-latest` alias when it names one."""
    how = {"transformers": "a causal LM read by scoring", "nli": "an NLI cross-encoder",
           "laya": "a Laya checkpoint (its own decision head)", "bev": "a bev-decider checkpoint (its own pointer head)"}
    how_generator = "a generator's weights read by scoring"
    cards = {m.name: DecisionModelCard(m.name, "Typed decisions (noul, choice, score) from " + (
                 how.get(m.runtime, m.runtime) if m.task == "decide" else how_generator), m.created_at[:10])
             for m in listed if (m.task == "decide" or (m.task, m.runtime) in SHARED_DECIDERS) and not m.base}
    try:
        default = decision_model(daemon, DEFAULT_ALIAS)
    except FleetError:
        return list(cards.values())
    if default not in cards:
        return list(cards.values())
    alias = DecisionModelCard(DEFAULT_ALIAS, f"This box's default decision model: {default}",
                              cards[default].release_date)
    return [alias, *cards.values()]


class ModelsController(Controller):
    path = "/v1"

    @get("/models")
    async def models(self, request: Request, daemon: Daemon) -> Response:
        loaded = await daemon.loaded_models()
        pinned = daemon.pinned_models()
        only = request.scope.get(SCOPE_MODEL)  # a per-model URL: as if the daemon held that model alone
        stored = daemon.store.list()
        listed = [m for m in stored if only is None or m.name == only]
        workers = await daemon.workers() if any(m.task == "decide" for m in listed) else []
        cards = [model_card(daemon, m, loaded, pinned, workers) for m in listed]
        versions = {a.version for a in daemon.aliases.table.values()}
        by_name = {c.id: c for c in cards}
        by_name |= {m.name: model_card(daemon, m, loaded, pinned) for m in stored
                    if m.name in versions and m.name not in by_name}
        return reply(request, ModelList(cards + alias_cards(daemon, by_name, only),
                                        models=decision_cards(daemon, listed) or msgspec.UNSET))

    @get("/models/{model_id:str}")
    async def model(self, request: Request, daemon: Daemon, model_id: str) -> Response:
        alias = daemon.aliases.table.get(model_id)
        if alias is not None and daemon.store.exists(alias.version):
            card = model_card(daemon, daemon.store.get(alias.version), await daemon.loaded_models(),
                              daemon.pinned_models())
            return reply(request, alias_cards(daemon, {alias.version: card}, model_id)[0])
        try:
            manifest = daemon.store.get(model_id)
        except BadRequest:  # not a valid model name: no such model either
            raise ModelNotFound(f"unknown model {model_id!r}", param="model") from None
        except ModelNotFound:
            raise ModelNotFound(f"unknown model {model_id!r}", hint="fleetctl list shows what is pulled",
                                param="model") from None
        workers = await daemon.workers()
        card = model_card(daemon, manifest, await daemon.loaded_models(), daemon.pinned_models(), workers)
        profiles = live_profiles(workers, manifest.name)
        return reply(request, ModelDetail(**msgspec.structs.asdict(card), profiles=profiles))

    @delete("/models/{model_id:str}", status_code=200, guards=[operator_only])
    async def delete(self, request: Request, daemon: Daemon, model_id: str) -> Response:
        """OpenAI's delete of a model: every copy unloaded, then the model leaves the
        store (daemon.owner; `fleetctl rm` with a daemon running)."""
        done = await delete_model(daemon, model_id)
        return reply(request, {"id": model_id, "object": "model", "deleted": True, **done})

    @get("/ps")
    async def ps(self, request: Request, daemon: Daemon) -> Response:
        ready, why, unservable = await daemon.readiness_detail()
        return reply(request, {
            "box": daemon.box,
            "pid": os.getpid(),
            "version": __version__,
            "uptime_s": round(time.time() - daemon.started_at, 1),
            "ready": ready,
            "status": why,
            # Which store this daemon serves, for its operator (`fleetctl ps` names it).
            **({"home": daemon.settings.home} if is_operator(request) else {}),
            # Pins (preloads, persisted pins) that cannot be served: name -> why.
            "unservable": unservable,
            "queue": {"depth": daemon.queue.depth() if daemon.queue else 0,
                      "in_flight": daemon.broker.in_flight if daemon.broker else 0},
            "lanes": await daemon.lanes(),
            "workers": await workers_view(daemon),
            "slots": daemon.supervisor.view() if daemon.supervisor else [],
            # Aliases, their versions and canaries, each version's recent error rate and latencies.
            "aliases": daemon.aliases.view(daemon.recent.models()),
        })


class MetricsController(Controller):
    @get("/metrics", include_in_schema=False)
    async def metrics(self, request: Request, daemon: Daemon) -> Response:
        if daemon.broker is not None:  # without waiting for the queue lock on the loop
            await daemon.broker.read(daemon.refresh_gauges)
        body, content_type = daemon.metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)


class HealthController(Controller):
    @get("/healthz")
    async def healthz(self, request: Request) -> Response:
        return reply(request, {"status": "ok"})

    @get("/readyz")
    async def readyz(self, request: Request, daemon: Daemon) -> Response:
        ready, why, unservable = await daemon.readiness_detail()
        body = {"ready": ready, "status": why, **({"unservable": unservable} if unservable else {})}
        return reply(request, body, status=200 if ready else 503)
