"""HTTP plumbing shared by the controllers: body formats, negotiated replies, the
answer's timing headers, and errors."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from fleet.errors import BY_CODE, FleetError, Overloaded, UnknownFields
from fleet.protocol import OpenAIErrorBody, OpenAIErrorReply
from fleet.daemon import codec, fields
from fleet.daemon.broker import Answer

log = logging.getLogger("fleet.daemon")

#: Key in the app's `state` of the folders whose paths never reach a client (the
#: store, FLEET_HOME) and their stand-ins: a worker's load error may quote a file
#: path; the reply names the model and `<store>` instead, the log keeps the full text.
PRIVATE_PATHS = "fleet_private_paths"

#: Litestar's own HTTP errors (routing, limits) mapped onto contract codes.
_HTTP_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "payload_too_large", 415: "unsupported_media_type", 429: "overloaded",
}


def body_is_msgpack(request: Request) -> bool:
    """The request's body is MessagePack (by its Content-Type); else it is read as JSON."""
    return codec.is_msgpack(request.headers.get("content-type"))


def wants_msgpack(request: Request) -> bool:
    return codec.reply_is_msgpack(request.headers.get("accept"), request.headers.get("content-type"))


def answer_headers(answer: Answer) -> dict[str, str]:
    """`X-Queue-Ms`, `X-Inference-Ms` and `X-Served-By` of a worker's answer, and the
    batch it ran in: `X-Batch-Items`, `X-Batch-Tokens`, `X-Batch-Adapters` (the LoRA
    adapters mixed into it, comma-separated; absent when none was)."""
    headers = {
        "X-Queue-Ms": f"{answer.queue_ms:.2f}",
        "X-Inference-Ms": f"{answer.inference_ms:.2f}",
        "X-Served-By": answer.served_by,
        "X-Batch-Items": str(answer.batch_items),
        "X-Batch-Tokens": str(answer.batch_tokens),
    }
    if answer.loras:
        headers["X-Batch-Adapters"] = ",".join(answer.loras)
    if answer.pieces > 1:  # a large request ran as pieces (daemon.pieces)
        headers["X-Fleet-Pieces"] = str(answer.pieces)
    return headers


def reply(request: Request, obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    msgpack = wants_msgpack(request)
    return Response(
        content=codec.encode(obj, msgpack=msgpack),
        status_code=status,
        media_type=codec.MSGPACK if msgpack else codec.JSON,
        headers=headers,
    )


#: Routes that speak OpenAI's API: their error bodies also carry `type` and `param`.
OPENAI_ROUTES = frozenset({"/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models",
                           "/v1/responses", "/v1/decisions"})


def is_openai_route(path: str) -> bool:
    """`/v1/models/{id}` is OpenAI's too; `/v1/models/{name}/pin` and friends are fleet's admin.
    The Files and Batches API (`/v1/files...`, `/v1/batches...`) is OpenAI's."""
    return (path in OPENAI_ROUTES or path.startswith(("/v1/files", "/v1/batches"))
            or (path.startswith("/v1/models/") and "/" not in path[len("/v1/models/"):]))


def openai_error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status (its SDKs pick the exception class by status)."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def hide_paths(message: str, private: tuple[tuple[str, str], ...]) -> str:
    """`message` with each private folder (most specific first) replaced by its stand-in."""
    for path, stand_in in private:
        if path in message:
            message = message.replace(path, stand_in)
    return message


def error_parts(exc: FleetError, *, method: str, path: str, msgpack: bool, private: tuple[tuple[str, str], ...],
                headers: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
    """An error's reply body (the contract's shape; OpenAI's on OpenAI routes) and headers,
    for the Litestar app and the plain-ASGI routes (daemon.hot) alike."""
    shown = hide_paths(exc.message, private)
    if shown != exc.message:
        log.warning("%s on %s %s: %s", exc.code, method, path, exc.message)
        exc.message = shown
    headers = dict(headers or {})
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if is_openai_route(path):
        # OpenAI's own words for arguments it does not know, so clients match them.
        message = fields.openai_message(exc.fields) if isinstance(exc, UnknownFields) else exc.message
        body = codec.encode(OpenAIErrorReply(OpenAIErrorBody(exc.code, message, openai_error_type(exc.status),
                                                             exc.param)), msgpack=msgpack)
    else:
        body = codec.error_body(exc, msgpack=msgpack, path=path)
    return body, headers


def error_reply(request: Request, exc: FleetError, headers: dict[str, str] | None = None) -> Response:
    msgpack = wants_msgpack(request)
    body, headers = error_parts(exc, method=request.method, path=request.url.path, msgpack=msgpack,
                                private=request.app.state.get(PRIVATE_PATHS, ()), headers=headers)
    return Response(
        content=body,
        status_code=exc.status,
        media_type=codec.MSGPACK if msgpack else codec.JSON,
        headers=headers,
    )


def on_fleet_error(request: Request, exc: FleetError) -> Response:
    return error_reply(request, exc)


def on_http_error(request: Request, exc: HTTPException) -> Response:
    code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal")
    message = str(exc.detail)
    headers = {}
    # Routing errors name what was asked: the first answer a misconfigured client sees.
    if exc.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 413:
        message = f"request body is over the limit of {request.app.request_max_body_size} bytes (max_body_bytes)"
    elif exc.status_code == 405:
        allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
        message = f"{request.method} is not allowed on {request.url.path}"
        if allowed:
            message += f" (allowed: {allowed})"
            headers["Allow"] = allowed
    err = BY_CODE.get(code, FleetError)(message)
    err.status = exc.status_code
    return error_reply(request, err, headers)


def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_reply(request, FleetError(f"internal error: {type(exc).__name__}"))
