"""The hot route, `POST /v1/embed` without a query string, answered in plain ASGI in
front of the Litestar app.

A lone client's request reaches a process that slept through the model's
forward pass, with cold caches. On the 2-vCPU box of issue 17, Litestar's
request cycle for a trivial POST then takes ~0.32 ms (0.04 ms when warm), a
third of the 1 ms the whole serving path may add; a plain ASGI exchange takes
~0.03 ms cold. So this one route skips the framework: the body is read here,
and the work is the function the Litestar route calls,
`controllers.embed.embed_exchange`, handed in by whoever builds the app (daemon.server),
so this module sits below the controllers. Errors take the contract's shape through
`daemon.http.error_parts`, like the app's exception handlers. Everything
else, and the OpenAPI document, stays Litestar's; the wrappers outside this
one (request id, browser guard, auth) see both alike.

Every request passes here, a batch's lines (daemon.batches) and MCP's tool calls too
(`Daemon.dispatch`), so this is where each gets its view of the alias table
(daemon.aliases.Resolution): its aliases resolve once, and its reply names the version
that served it. The app's routes get it from `AliasScope`, which wraps the app; the hot
route sets its own and names the version in the headers it builds, so a request here
enters daemon.aliases only to be scoped and to resolve its names.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar

from fleet.errors import FleetError, PayloadTooLarge

from fleet.daemon import codec, timeline
from fleet.daemon.aliases import ALIAS_HEADER, RESOLUTION, VERSION_HEADER, AliasScope, Resolution
from fleet.daemon.core import Daemon
from fleet.daemon.http import PRIVATE_PATHS, error_parts

log = logging.getLogger("fleet.daemon")

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
#: (daemon, body, content_type=, accept=) -> (reply body, reply headers, reply is MessagePack).
Exchange = Callable[..., Awaitable[tuple[bytes, dict[str, str], bool]]]

_TIMELINE = timeline.HEADER.lower().encode()


class ClientGone(Exception):
    """The client disconnected before its body was read: nothing to answer."""


class HotRoutes:
    """ASGI: `POST /v1/embed` here, everything else to `app` (the Litestar app)."""

    def __init__(self, app: Litestar, daemon: Daemon, exchange: Exchange) -> None:
        self.app = app
        self.daemon = daemon
        self.exchange = exchange
        self._scoped = AliasScope(app)

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        # A query string goes the app's way: the route's query check (daemon.query) refuses
        # what it does not declare.
        if (scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/embed"
                or scope.get("query_string")):
            await self._scoped(scope, receive, send)
            return
        res = Resolution(scope)
        token = RESOLUTION.set(res)
        try:
            await self._route(scope, receive, send, res)
        finally:
            RESOLUTION.reset(token)

    async def _route(self, scope: Any, receive: Receive, send: Send, res: Resolution) -> None:
        headers = dict(scope["headers"])  # lower-cased names (ASGI)
        timeline.begin(headers.get(_TIMELINE))
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        accept = headers.get(b"accept", b"").decode("latin-1")
        try:
            body = await read_body(receive, self.daemon.settings.max_body_bytes, headers.get(b"content-length"))
            content, reply_headers, msgpack_out = await self.exchange(self.daemon, body, content_type=content_type,
                                                                      accept=accept)
            status = 200
            if res.served is not None:  # a success names its version, as AliasScope's replies do
                reply_headers[VERSION_HEADER] = res.served
                if res.alias is not None:
                    reply_headers[ALIAS_HEADER] = res.alias
        except ClientGone:
            return
        except FleetError as exc:
            msgpack_out = codec.reply_is_msgpack(accept, content_type)
            status, (content, reply_headers) = exc.status, self._error(exc, scope, msgpack_out)
        except Exception as exc:  # the app's `on_unexpected`, for this route
            log.exception("unhandled error on POST /v1/embed")
            err = FleetError(f"internal error: {type(exc).__name__}")
            msgpack_out = codec.reply_is_msgpack(accept, content_type)
            status, (content, reply_headers) = err.status, self._error(err, scope, msgpack_out)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", (codec.MSGPACK if msgpack_out else codec.JSON).encode()),
            (b"content-length", str(len(content)).encode()),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply_headers.items()),
        ]})
        await send({"type": "http.response.body", "body": content})

    def _error(self, exc: FleetError, scope: Any, msgpack: bool) -> tuple[bytes, dict[str, str]]:
        return error_parts(exc, method="POST", path=scope["path"], msgpack=msgpack,
                           private=self.app.state.get(PRIVATE_PATHS, ()))


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the limit of {limit} bytes (max_body_bytes)")


async def read_body(receive: Receive, limit: int, declared: bytes | None) -> bytes:
    """The whole request body, at most `limit` bytes (the app's `max_body_bytes`):
    refused at once when its Content-Length says more, else once more arrived."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
