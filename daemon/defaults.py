"""The model a request runs on when it names none: the configured default for its
task, else the only stored model of that task. Used by the routes, batch lines and
spills alike, so it sits below the controllers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fleet.errors import BadRequest
from fleet.store import Store

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
