"""HTTP plumbing shared by the controllers: negotiated replies and errors."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from fleet.errors import BY_CODE, FleetError, Overloaded
from daemon import codec

log = logging.getLogger("fleet.daemon")

#: Litestar's own HTTP errors (routing, limits) mapped onto contract codes.
_HTTP_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "payload_too_large", 415: "unsupported_media_type", 429: "overloaded",
}


def wants_msgpack(request: Request) -> bool:
    return codec.reply_is_msgpack(request.headers.get("accept"), request.headers.get("content-type"))


def reply(request: Request, obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    msgpack = wants_msgpack(request)
    return Response(
        content=codec.encode(obj, msgpack=msgpack),
        status_code=status,
        media_type=codec.MSGPACK if msgpack else codec.JSON,
        headers=headers,
    )


def error_reply(request: Request, exc: FleetError) -> Response:
    msgpack = wants_msgpack(request)
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return Response(
        content=codec.error_body(exc, msgpack=msgpack),
        status_code=exc.status,
        media_type=codec.MSGPACK if msgpack else codec.JSON,
        headers=headers,
    )


def on_fleet_error(request: Request, exc: FleetError) -> Response:
    return error_reply(request, exc)


def on_http_error(request: Request, exc: HTTPException) -> Response:
    code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal")
    err = BY_CODE.get(code, FleetError)(str(exc.detail))
    err.status = exc.status_code
    return error_reply(request, err)


def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_reply(request, FleetError(f"internal error: {type(exc).__name__}"))
