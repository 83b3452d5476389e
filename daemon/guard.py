"""Browser safety: Host, Origin (CORS) and body types, checked before auth.

A web page the user opens can send requests to a loopback daemon. Three checks
keep it out (DESIGN.md, "Safety defaults"):

- `Host` must be a name this daemon is reached by (`allowed_host`): on a loopback
  bind the loopback names and addresses, else the bound address, plus
  `allowed_hosts`. A DNS-rebinding page talks to 127.0.0.1 under its own name, so
  its Host gives it away. A wildcard bind accepts any Host unless names are listed.
- A request carrying `Origin` (browsers add it to cross-origin and to POST
  requests) must come from the daemon's own origin, a loopback origin, or one on
  `cors_origins` (`allowed_origin`); allowed origins get CORS headers and correct
  preflight answers, others 403. Clients that are not browsers send no Origin.
- A body must be JSON or MessagePack (`accepts_body_type`): a page may post
  `text/plain`, form or multipart bodies cross-origin with no preflight at all, so
  those are refused with 415 before anything decodes them. One exception: a file
  upload (`POST /v1/files`, OpenAI's SDKs send multipart/form-data); a page's
  cross-origin post carries an Origin, refused above unless listed.

On Ollama's `/api/*` (Ollama reads every body as JSON) an untyped, form or text
body is read as JSON when the request carries no `Origin` (`ollama_lenient`):
browsers add one to those posts.

Plain ASGI, outside the bearer-auth wrapper: a preflight carries no credentials,
and a foreign page must not learn whether its key would have worked.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from fleet.errors import FleetError, Forbidden, UnsupportedMediaType

from fleet.daemon import codec
from fleet.daemon.auth import is_loopback

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
BODY_TYPES = frozenset({codec.JSON, *codec.MSGPACK_TYPES})
#: Body types read as JSON on Ollama's routes when no browser sent them (`ollama_lenient`).
OLLAMA_BODY_TYPES = frozenset({"", "application/x-www-form-urlencoded", "text/plain", "application/octet-stream"})
#: (method, path) -> the body types it takes besides BODY_TYPES.
UPLOAD_TYPES = {("POST", "/v1/files"): frozenset({"multipart/form-data"})}
#: Distinct Host headers whose verdicts are kept (BrowserGuard.host_allowed).
HOST_CACHE = 256
CORS_METHODS = b"GET, POST, DELETE, OPTIONS"
CORS_HEADERS = b"authorization, content-type, accept, x-request-id"
#: Reply headers a browser app may read (DESIGN.md, "Names fixed for clients").
CORS_EXPOSE = b"x-queue-ms, x-inference-ms, x-served-by, x-request-id, retry-after"
#: How long a browser may cache a preflight answer (seconds).
CORS_MAX_AGE = b"600"


def split_host(value: str) -> str:
    """The host part of a Host header or URL netloc, lower-cased, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


def allowed_host(host_header: str, bind_host: str, names: Iterable[str]) -> bool:
    """Is `host_header` a name this daemon is reached by? (pure; see the module doc)"""
    host = split_host(host_header)
    listed = {n.lower() for n in names}
    if host in listed:
        return True
    if bind_host in WILDCARD_BINDS:
        return not listed or is_loopback(host)
    return is_loopback(host) or host == split_host(bind_host)


def allowed_origin(origin: str, host_header: str, patterns: Iterable[str]) -> bool:
    """May a page of `origin` call this daemon? Its own origin, loopback ones, or a listed one."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(origin, pattern):
            return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file:) and other schemes only when listed
    if host_header and parts.netloc.lower() == host_header.strip().lower():
        return True  # same origin: the daemon's own pages
    return is_loopback(split_host(parts.netloc))


def accepts_body_type(content_type: str, method: str = "POST", path: str = "") -> bool:
    kind = codec.media_type(content_type)
    return kind in BODY_TYPES or kind in UPLOAD_TYPES.get((method, path), ())


def ollama_lenient(path: str, content_type: str, origin: bytes | None) -> bool:
    """Ollama reads any body as JSON: clients that send none or a form type (litellm's
    `ollama/`, `curl -d`) are read so on `/api/*` too, but only when no browser sent
    them (no `Origin`): a page's form post carries one, and stays refused."""
    return (origin is None and path.startswith(codec.OLLAMA_PREFIX)
            and codec.media_type(content_type) in OLLAMA_BODY_TYPES)


def has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return b"transfer-encoding" in headers


class BrowserGuard:
    """ASGI middleware: Host, Origin/CORS and body-type checks (see the module doc)."""

    def __init__(self, app: Any, *, bind_host: str, allowed_hosts: Iterable[str] = (),
                 cors_origins: Iterable[str] = ()) -> None:
        self.app = app
        self.bind_host = bind_host.strip().strip("[]")
        self.configure(allowed_hosts, cors_origins)

    def configure(self, allowed_hosts: Iterable[str], cors_origins: Iterable[str]) -> None:
        """New lists (SIGHUP reload); the bind address never changes while serving."""
        self.allowed_hosts = tuple(allowed_hosts)
        self.cors_origins = tuple(cors_origins)
        #: Host header -> allowed_host's verdict: a client sends the same Host on every
        #: request, and parsing it as an address is most of this middleware's time.
        #: Bounded (cleared when full): Host values are the client's to choose.
        self._hosts: dict[str, bool] = {}

    def host_allowed(self, host: str) -> bool:
        verdict = self._hosts.get(host)
        if verdict is None:
            if len(self._hosts) >= HOST_CACHE:
                self._hosts.clear()
            verdict = self._hosts[host] = allowed_host(host, self.bind_host, self.allowed_hosts)
        return verdict

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-cased names (ASGI); a repeated one: the last wins
        host = headers.get(b"host", b"").decode("latin-1")
        if host and not self.host_allowed(host):
            await refuse(scope, send, headers, Forbidden(
                f"Host {split_host(host)!r} is not a name of this daemon; add it to allowed_hosts to serve it"))
            return
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if not allowed_origin(text, host, self.cors_origins):
                await refuse(scope, send, headers, Forbidden(
                    f"cross-origin request from {text!r} refused; add the origin to cors_origins to allow it"))
                return
            if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
                await preflight(send, origin)
                return
            send = with_cors(send, origin)
        if scope["type"] == "http" and has_body(headers) and scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not accepts_body_type(content_type, scope["method"], scope["path"]) \
                    and not ollama_lenient(scope["path"], content_type, origin):
                await refuse(scope, send, headers, UnsupportedMediaType(
                    f"request bodies must be application/json or application/msgpack, "
                    f"not {codec.media_type(content_type) or 'untyped'}"))
                return
        await self.app(scope, receive, send)


async def preflight(send: Send, origin: bytes) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": [
        (b"access-control-allow-origin", origin),
        (b"access-control-allow-methods", CORS_METHODS),
        (b"access-control-allow-headers", CORS_HEADERS),
        (b"access-control-max-age", CORS_MAX_AGE),
        (b"vary", b"Origin"),
        (b"content-length", b"0"),
    ]})
    await send({"type": "http.response.body", "body": b""})


def with_cors(send: Send, origin: bytes) -> Send:
    async def send_with_cors(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [
                *message.get("headers", ()),
                (b"access-control-allow-origin", origin),
                (b"access-control-expose-headers", CORS_EXPOSE),
                (b"vary", b"Origin"),
            ]}
        await send(message)

    return send_with_cors


async def refuse(scope: Scope, send: Send, headers: dict[bytes, bytes], exc: FleetError) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    msgpack = codec.reply_is_msgpack(headers.get(b"accept", b"").decode("latin-1"),
                                     headers.get(b"content-type", b"").decode("latin-1"))
    body = codec.error_body(exc, msgpack=msgpack, path=scope["path"])
    await send({"type": "http.response.start", "status": exc.status, "headers": [
        (b"content-type", (codec.MSGPACK if msgpack else codec.JSON).encode()),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": body})
