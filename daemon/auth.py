"""Bearer-token auth and the bind rule.

Rule (DESIGN.md, safety defaults): a loopback bind may run without a key; any
other bind refuses to start without one. With a key, every path except the open
ones (`/healthz`) needs `Authorization: Bearer <key>`, compared in constant time.
The operator's admin key (fleet.admin) is taken in its place: it opens everything
the API key opens, and the routes that change the daemon too (daemon.operator).

`BearerAuthMiddleware` is plain ASGI: it looks at the scope's raw headers and
either passes the call through untouched or answers 401 itself, with bodies
encoded once at start-up. Wrapping the whole Litestar app with it (rather than
listing it in `Litestar(middleware=...)`, which Litestar runs only for matched
routes) also guards 404/405 answers, so an unauthenticated client learns nothing
about which paths exist.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import msgspec

from fleet.errors import Unauthorized

from fleet.daemon.codec import DETAIL_PATHS, DETAIL_TYPES

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

#: Shortest key accepted for a non-loopback bind: 16 characters.
MIN_KEY_CHARS = 16
#: Fewest distinct characters in such a key: 16 x `a`, or a repeated short word,
#: is guessed long before any real secret.
MIN_KEY_DISTINCT = 8
OPEN_PATHS = ("/healthz",)
_MSGPACK = (b"application/msgpack", b"application/x-msgpack")


def is_loopback(host: str) -> bool:
    """True for `localhost`, 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for wildcards and names."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name may resolve anywhere: treat as exposed
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_bind(host: str, api_key: str) -> None:
    """Refuse to serve on a non-loopback address without a usable API key."""
    if is_loopback(host):
        return
    if not api_key:
        raise Unauthorized(
            f"refusing to bind {host or '0.0.0.0'} without an API key: any host that can reach it could use it",
            hint="set FLEET_API_KEY (or api_key_file in config.toml), or bind 127.0.0.1",
        )
    weakness = key_weakness(api_key)
    if weakness:
        raise Unauthorized(
            f"refusing to bind {host} with a weak API key: {weakness}",
            hint='make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"',
        )


def key_weakness(api_key: str) -> str | None:
    """Why `api_key` is too easy to guess for a non-loopback bind, or None."""
    if len(api_key) < MIN_KEY_CHARS:
        return f"{len(api_key)} characters; use at least {MIN_KEY_CHARS}"
    if any(c.isspace() for c in api_key):
        return "it contains whitespace"
    if len(set(api_key)) < MIN_KEY_DISTINCT:
        return f"only {len(set(api_key))} distinct characters; use at least {MIN_KEY_DISTINCT}"
    return None


def _error(message: str) -> dict[str, Any]:
    return {"error": {"code": Unauthorized.code, "message": message}}


class BearerAuthMiddleware:
    """ASGI middleware answering 401 unless `Authorization: Bearer <api_key>` matches."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str] = OPEN_PATHS,
                 admin_key: str = "") -> None:
        if not api_key:
            raise ValueError("BearerAuthMiddleware needs a non-empty api_key; without one, do not install it")
        self.app = app
        self._key = api_key.encode()
        # Compared with the same key when there is none: the time taken never tells which matched.
        self._admin = admin_key.encode() if admin_key else self._key
        self._open = frozenset(open_paths)
        # Both refusals, pre-encoded in both formats: (body_json, body_msgpack, www-authenticate).
        self._missing = self._bodies(
            "missing bearer token: send 'Authorization: Bearer <FLEET_API_KEY>'", b'Bearer realm="fleet"')
        self._invalid = self._bodies(
            "invalid API key", b'Bearer realm="fleet", error="invalid_token"')
        # The same two on System One's route, in its shape (daemon.codec.DETAIL_PATHS).
        self._detail = {id(r): (self._detail_body(r[0]), self._detail_body(r[1], msgpack=True), r[2])
                        for r in (self._missing, self._invalid)}

    @staticmethod
    def _bodies(message: str, challenge: bytes) -> tuple[bytes, bytes, bytes]:
        body = _error(message)
        return msgspec.json.encode(body), msgspec.msgpack.encode(body), challenge

    @staticmethod
    def _detail_body(encoded: bytes, *, msgpack: bool = False) -> bytes:
        """A pre-encoded refusal as `{"detail": {"error_type", "message"}}`."""
        error = (msgspec.msgpack.decode if msgpack else msgspec.json.decode)(encoded)["error"]
        body = {"detail": {"error_type": DETAIL_TYPES[error["code"]], "message": error["message"]}}
        return msgspec.msgpack.encode(body) if msgpack else msgspec.json.encode(body)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        token = accept = content_type = b""
        for name, value in scope["headers"]:
            # ASGI servers give header names lower-cased.
            if name == b"authorization":
                token = value
            elif name == b"accept":
                accept = value
            elif name == b"content-type":
                content_type = value
        if token[:7].lower() == b"bearer ":
            sent = token[7:].strip()
            if hmac.compare_digest(sent, self._key) | hmac.compare_digest(sent, self._admin):
                await self.app(scope, receive, send)
                return
            refusal = self._invalid
        else:
            refusal = self._missing
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["path"] in DETAIL_PATHS:
            refusal = self._detail[id(refusal)]
        await self._refuse(send, refusal, _wants_msgpack(accept, content_type))

    @staticmethod
    async def _refuse(send: Callable[[Any], Awaitable[None]], refusal: tuple[bytes, bytes, bytes], msgpack: bool) -> None:
        body_json, body_msgpack, challenge = refusal
        body, media = (body_msgpack, b"application/msgpack") if msgpack else (body_json, b"application/json")
        await send({
            "type": "http.response.start",
            "status": Unauthorized.status,
            "headers": [
                (b"content-type", media),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", challenge),
            ],
        })
        await send({"type": "http.response.body", "body": body})


def _wants_msgpack(accept: bytes, content_type: bytes) -> bool:
    # The reply follows Accept, else the request's own type (DESIGN.md, "Bodies").
    accept = accept.lower()
    if any(m in accept for m in _MSGPACK):
        return True
    if b"json" in accept:
        return False
    return content_type.split(b";")[0].strip().lower() in _MSGPACK


def bearer_auth(api_key: str, open_paths: Iterable[str] = OPEN_PATHS,
                admin_key: str = "") -> Callable[[ASGIApp], ASGIApp]:
    """`wrap = bearer_auth(key)`; `wrap(app)` is the guarded app. With no key, the app unchanged.
    `admin_key`, when given, is taken in place of `api_key`.

    Also usable as a Litestar middleware entry (`Litestar(middleware=[bearer_auth(key)])`),
    which then guards matched routes only.
    """
    paths = tuple(open_paths)
    if not api_key:
        return lambda app: app
    return lambda app: BearerAuthMiddleware(app, api_key, paths, admin_key)
