"""A request whose client left stops waiting, and its work leaves the queue (issue 42).

Before, only a stream noticed its client leaving (Litestar watches a started
stream's connection). A non-streaming request waited for its answer whatever
happened to its connection: a 600-input embed whose client closed the socket
after 0.5 s was computed in full (12 s of a worker's time), and 2 000 requests
dropped by their clients kept the queue busy for 25 s after they left.

Now:
1. The connection's protocol (daemon.connections) gives each request a `Departure`
   in its ASGI scope (SCOPE_KEY) and calls `left()` when the connection closes
   before the response started: no body read, no task, no `receive` call per
   request; the event loop already hears the close.
2. `DepartureMiddleware` makes it the request's `DEPARTURE`, so the one request
   path (`Daemon.request`) waits through `Departure.wait`.
3. `left()` cancels each task waiting there. Cancelling is how a request already
   withdraws its work: `Broker.run` cancels its queue item (a queued one leaves
   its lane unrun; a claimed one's deadline becomes 1 ns and its worker stops at
   the next micro-batch boundary, `WorkerCore.run_steps`), a request in pieces
   withdraws every piece (daemon.pieces), and with NATS the box running it is told
   (`fleet.cancel`, daemon.cluster). The wait then raises `ClientClosed`: the request
   is answered once, to nobody, and counted (`fleet_requests_total`, status
   `client_closed`); its items in `fleet_withdrawn_items_total`.

A response once started is past waiting: a started stream is Litestar's to stop
(its cancel reaches the same `Broker.run`). Work that is not a client's request
(a batch job's lines, admin commands) runs without a `Departure`.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fleet.errors import ClientClosed

T = TypeVar("T")

#: Where the connection's protocol puts a request's `Departure` in its ASGI scope.
SCOPE_KEY = "fleet.departure"


class Departure:
    """One request's connection, as its waits see it: whether the client left before
    the response started, and the tasks waiting for answers meanwhile."""

    __slots__ = ("gone", "_waiting")

    def __init__(self) -> None:
        self.gone = False
        self._waiting: set[asyncio.Task] = set()

    def left(self) -> None:
        """The client closed the connection before the response started (the protocol's
        `connection_lost`, on the loop): every wait stops (module doc, 3)."""
        if self.gone:
            return
        self.gone = True
        for task in self._waiting:
            task.cancel()

    async def wait(self, model: str, answer: Awaitable[T]) -> T:
        """`await answer`, the current task's wait for the work of a request for `model`;
        ClientClosed when the client leaves meanwhile (or had left)."""
        if self.gone:
            if asyncio.iscoroutine(answer):
                answer.close()
            raise ClientClosed(f"{model}: the client closed the connection; nothing was queued")
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await answer
        except asyncio.CancelledError:
            # Ours (the client left) unless someone else cancelled the task too (a shutdown):
            # then it stays cancelled.
            if self.gone and task.uncancel() == 0:
                raise ClientClosed(f"{model}: the client closed the connection before the answer; "
                                   "its work was withdrawn") from None
            raise
        finally:
            self._waiting.discard(task)


#: The current request's Departure; None outside a client's request (a batch job's lines).
DEPARTURE: contextvars.ContextVar[Departure | None] = contextvars.ContextVar("fleet_departure", default=None)


class DepartureMiddleware:
    """ASGI: the scope's `Departure` as the request's `DEPARTURE`."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        departure = scope.get(SCOPE_KEY)
        if departure is None:
            await self.app(scope, receive, send)
            return
        token = DEPARTURE.set(departure)
        try:
            await self.app(scope, receive, send)
        finally:
            DEPARTURE.reset(token)
