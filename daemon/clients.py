"""Who a request comes from: its flow in the fair queueing of a lane (local_queue
invariant 2), so one client flooding a model does not queue another behind it.

The client is, in order:
1. `X-Fleet-Client: <name>` (1-64 of A-Z a-z 0-9 . _ : @ / -), when the request
   comes from a loopback address: a gateway or sidecar on this box naming the
   tenant it forwards for, or local applications naming themselves. A remote
   client cannot pick its own share by sending names: from any other address
   the header is not read.
2. Else the peer's IP address. Every loopback client without the header is one
   client, as are the requests of one host (fleet has one API key, so the key
   names nobody).
One request's pieces (daemon.pieces) are the same client's.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.daemon.auth import is_loopback

HEADER = b"x-fleet-client"
_NAME = re.compile(rb"[A-Za-z0-9._:@/-]{1,64}\Z")

#: The current request's flow (a number the queue keys fair shares by); 0 = none known.
CLIENT: contextvars.ContextVar[int] = contextvars.ContextVar("fleet_client", default=0)


def client_of(scope: dict[str, Any]) -> str:
    """The client an ASGI request comes from (module doc): `name:<header>` or `addr:<ip>`."""
    peer = scope.get("client")
    host = peer[0] if peer else ""
    if not host or is_loopback(host):
        for key, value in scope["headers"]:
            if key == HEADER:
                if _NAME.match(value):
                    return "name:" + value.decode()
                break
    return "addr:" + host


def flow_of(client: str) -> int:
    """The queue's flow number of a client: stable for the life of the daemon process
    (the queue's fair shares live as long), never 0."""
    return (hash(client) & ((1 << 62) - 1)) or 1


class ClientMiddleware:
    """ASGI: set `CLIENT` for the whole request (its queue items carry it)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = CLIENT.set(flow_of(client_of(scope)))
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(token)
