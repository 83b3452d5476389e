"""The model a request runs on when it names none: the configured default for its
task, else the only stored model of that task; and System One's `jev-latest`, the
box's default decision model. Used by the routes, batch lines and spills alike, so it
sits below the controllers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fleet.catalog import load_catalog
from fleet.errors import BadRequest, FleetError, ModelNotFound
from fleet.store import Store

from fleet.daemon import systemone

if TYPE_CHECKING:
    from fleet.daemon.core import Daemon


#: store root -> (its mtime in ns, (name, task) of each stored model, adapters left out).
#: A pull or an rm renames a directory in the root, which moves its mtime: the listing
#: is read again only then, not on every request that names no model (~0.09 ms per
#: stored model on this box).
_listings: dict[str, tuple[int, list[tuple[str, str]]]] = {}


def choose_default_model(task: str, configured: dict[str, str], stored: Iterable[tuple[str, str]]) -> str:
    """The model a request of `task` that names none runs on: the configured
    default for the task, else the only stored model of that task. `stored` is
    (name, task) of each stored model (LoRA adapters left out: they are named)."""
    if task in configured:
        return configured[task]
    candidates = sorted(name for name, t in stored if t == task)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise BadRequest(f"`model` is missing and no {task} model is stored: pull one (fleetctl pull NAME) and "
                         f"name it in the request", param="model")
    raise BadRequest(f"`model` is missing and {len(candidates)} {task} models are stored: name one of "
                     f"{', '.join(candidates)} (or set default_models.{task} in config.toml)", param="model")


def stored_tasks(store: Store) -> list[tuple[str, str]]:
    try:
        mtime = os.stat(store.root).st_mtime_ns
    except FileNotFoundError:
        return []
    key = str(store.root)
    listing = _listings.get(key)
    if listing is None or listing[0] != mtime:
        listing = _listings[key] = (mtime, [(m.name, m.task) for m in store.list() if not m.base])
    return listing[1]


def default_model(daemon: Daemon, task: str) -> str:
    return choose_default_model(task, daemon.settings.default_models, stored_tasks(daemon.store))


def decision_model(daemon: Daemon, name: str) -> str:
    """The store name a request's `model` runs on: `jev-latest` is this box's default
    decision model (config `default_models.decide`, else the only stored one)."""
    if name != systemone.DEFAULT_ALIAS:
        return reads_decisions(daemon, name)
    configured = daemon.settings.default_models.get("decide")
    if configured:
        return reads_decisions(daemon, configured)
    stored = sorted(n for n, task in stored_tasks(daemon.store) if task == "decide")
    if len(stored) == 1:
        return stored[0]
    if not stored:
        raise ModelNotFound(f"{name!r} is this box's default decision model, and none is stored",
                            hint="fleetctl pull path:DIR --task decide (any causal LM) adds one")
    raise BadRequest(f"{name!r} is this box's default decision model, and {len(stored)} are stored: name one of "
                     f"{', '.join(stored)}, or set default_models.decide in config.toml", param="model")


def reads_decisions(daemon: Daemon, name: str) -> str:
    """`name`, unless it is a stored generator fleet reads no decisions from. A
    transformers generator answers them from the weights its worker holds
    (runtimes/adapters/decide_shared.py); another (a GGUF's llama.cpp runtime reads no label
    logits) is refused with how to pull its weights as a decision model (the
    catalog's `<name>-decide` where there is one)."""
    try:
        daemon.manifest(name, "decide")  # cached: a decision model or a generator costs no look-up here
        return name
    except ModelNotFound:
        return name  # the route answers it (a remote box's, an upstream's, or none)
    except BadRequest:
        pass  # stored, for another task
    stored = daemon.aliases.resolve(name)
    manifest = daemon.store.get(stored)
    if manifest.task != "generate":
        return name
    twin = f"{stored}-decide"
    try:
        entry = load_catalog(daemon.settings.home).find(twin)
    except FleetError:
        entry = None
    if entry is not None and entry.task == "decide":
        how = f"fleetctl pull {twin}"
    elif manifest.source.startswith("hf:"):
        how = f"fleetctl pull {manifest.source} --task decide --name {twin}"
    else:
        how = f"pull its source again with --task decide --name {twin}"
    raise BadRequest(f"{stored!r} is a {manifest.runtime} generator, which reads no decisions; they are read from "
                     f"a transformers causal LM, stored as a generator or as a decision model (task decide): {how}",
                     param="model")
