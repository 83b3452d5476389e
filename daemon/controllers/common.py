"""What the task controllers share: one decode of the body, the payload to queue,
and the model a request runs on when it names none."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeVar

import msgspec
from litestar import Request

from fleet.errors import BadRequest
from fleet.store import Store

from fleet.daemon import codec
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack

T = TypeVar("T")

#: store root -> (its mtime in ns, (name, task) of each stored model, adapters left out).
#: A pull or an rm renames a directory in the root, which moves its mtime: the listing
#: is read again only then, not on every request that names no model (~0.09 ms per
#: stored model on this box).
_listings: dict[str, tuple[int, list[tuple[str, str]]]] = {}


async def decode_request(request: Request, type_: type[T]) -> tuple[T, bytes]:
    """(validated request, its MessagePack payload for the queue).

    For MessagePack clients the payload is the body exactly as received (no
    re-encoding); JSON bodies are encoded once. A request without `model` gets
    its task's default (`with_model`), and is then encoded once with it.
    """
    body = await request.body()
    msgpack_in = body_is_msgpack(request)
    req = codec.decode(body, type_, msgpack=msgpack_in)
    return req, (body if msgpack_in else codec.encode_msgpack(req))


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


def with_model(daemon: Daemon, task: str, req: T, payload: bytes) -> tuple[T, bytes]:
    """`req` and its payload with `model` filled in when the request left it out."""
    if req.model:  # type: ignore[attr-defined]
        return req, payload
    req = msgspec.structs.replace(req, model=default_model(daemon, task))  # type: ignore[type-var]
    return req, codec.encode_msgpack(req)
