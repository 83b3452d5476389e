"""The shapes of what the daemon holds but does not build itself: the ASGI app a
batch's lines go through, its offline jobs and its NATS bridge. Protocols, because
daemon/batches.py imports daemon.core, and daemon/cluster.py loads nats-py, which stays
out of a single box's daemon; real names, not TYPE_CHECKING ones, because Litestar
reads `Daemon`'s annotations when it injects the daemon into a route."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fleet.local_queue import Done

from fleet.daemon.broker import Answer

#: An ASGI application: (scope, receive, send).
ASGIApp = Callable[[Any, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class Jobs(Protocol):
    """What the daemon's life calls on its offline jobs (daemon.batches.Batches, which
    imports daemon.core: the routes reach the whole class through controllers.files)."""

    async def start(self) -> None: ...

    def drain(self) -> None: ...

    async def stop(self) -> None: ...


class ClusterLink(Protocol):
    """What the daemon calls on its NATS bridge (daemon.cluster.Cluster, loaded only with
    `--nats`: nats-py stays out of a single box's daemon)."""

    js: Any

    @property
    def joined(self) -> bool: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def stop_pulling(self) -> None: ...

    async def leave(self) -> None: ...

    async def submit(self, model: str, task: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                     local: bool = False, on_partial: Callable[[Done], None] | None = None,
                     batch: bool = False) -> Answer: ...

    def boxes(self) -> list[dict[str, Any]]: ...

    def check_model(self, model: str, task: str) -> None: ...

    def base_of(self, adapter: str) -> str | None: ...
