"""The admin guard: routes that change the daemon answer only its operator (fleet.admin).

Two parts, so the route table stays in the controllers:

- `OperatorMark` (plain ASGI, inside bearer auth, outside the per-model URL rewrite)
  marks each request's scope: does it carry the admin key (`Authorization: Bearer
  <key>`, compared in constant time), or is `admin = "open"`?
- `operator_only`, a Litestar guard on each route that changes the daemon (pins,
  load/unload, Ollama's pull, delete, copy, create, push and blobs), refuses an
  unmarked request before its body is read: 401 `unauthorized` without credentials,
  403 `forbidden` with a key that is not the admin key (an API key, or the "unused"
  placeholder OpenAI clients send on loopback). Errors keep each route's shape.

Inference stays open: a request naming a stored model that is not resident loads it,
within the memory policy (least recently used models make room; the operator's pins
are never evicted). What would hold memory or drop another user's model on a
client's word, Ollama's `keep_alive` < 0 (keep resident) and 0 (unload now), is
applied for the operator only (controllers.ollama `client_keep`).

A request the daemon makes itself (a batch line, daemon.batches) carries no mark:
it is not the operator's.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from fleet.admin import OPEN
from fleet.errors import Forbidden, Unauthorized

Scope = MutableMapping[str, Any]

#: Scope key: True when the request is the operator's.
OPERATOR = "fleet.operator"
#: Scope key: True when the request carried any `Authorization` header.
CREDENTIAL = "fleet.credential"


class OperatorMark:
    """ASGI middleware setting `scope[OPERATOR]` and `scope[CREDENTIAL]` (see the module doc)."""

    def __init__(self, app: Any, *, key: str, mode: str) -> None:
        self.app = app
        self.configure(key=key, mode=mode)

    def configure(self, *, key: str, mode: str) -> None:
        """A new key or mode (SIGHUP reload)."""
        if mode != OPEN and not key:
            raise ValueError("the admin guard needs a key unless admin = \"open\"; this is a bug")
        self._key = key.encode()
        self._open = mode == OPEN

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] in ("http", "websocket"):
            token = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    token = value
            scope[CREDENTIAL] = token is not None
            scope[OPERATOR] = self._open or (
                token is not None and token[:7].lower() == b"bearer " and hmac.compare_digest(token[7:].strip(), self._key))
        await self.app(scope, receive, send)


def is_operator(connection: ASGIConnection) -> bool:
    return connection.scope.get(OPERATOR) is True


def operator_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: the route changes the daemon; only the operator may call it."""
    if is_operator(connection):
        return
    method = connection.scope["method"]
    what = f"{method} {connection.scope['path']} " + (
        "is the operator's (it names the store's folders)" if method == "GET" else "changes the daemon")
    if connection.scope.get(CREDENTIAL):
        raise Forbidden(f"{what}: it takes the operator's admin key (admin.key in the daemon's FLEET_HOME) as "
                        "the bearer token, and the one sent is not it")
    raise Unauthorized(f"{what}: send the operator's admin key as 'Authorization: Bearer <key>' "
                       "(fleetctl sends it on its own; the key is admin.key in the daemon's FLEET_HOME)")
