"""One error family for the whole product, mapped once.

Every user-facing failure is a `FleetError` subclass with a contract `code`
(DESIGN.md, "Errors") and an HTTP status. The daemon maps them to
`{error: {code, message}}` replies in exactly one place; the CLI maps them to a
message and an exit code in exactly one place. "Worker died" is not here: it is
a supervision event (restart, redeliver), never an answer to a client.
"""

from __future__ import annotations


class FleetError(Exception):
    code = "internal"
    status = 500
    #: Hint printed by the CLI under the error line (the next command to try).
    hint: str | None = None
    #: The request field at fault, when one is (OpenAI-shaped error bodies carry it as `param`).
    param: str | None = None

    def __init__(self, message: str, *, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint
        if param is not None:
            self.param = param

    def __str__(self) -> str:
        return self.message


class BadRequest(FleetError):
    code, status = "bad_request", 400


class UnknownFields(BadRequest):
    """A request names fields its shape does not have. `fields` holds each one's path
    (`max_token`, `inputs[0].imgae`) and the closest known field, or None. The message
    is the native routes' wording; OpenAI-shaped routes word it as OpenAI does
    (daemon.http.error_parts)."""

    def __init__(self, message: str, fields: list[tuple[str, str | None]]) -> None:
        super().__init__(message, param=fields[0][0])
        self.fields = fields


class Unauthorized(FleetError):
    code, status = "unauthorized", 401


class Forbidden(FleetError):
    """A foreign Host (DNS rebinding), a cross-origin request from an Origin not on `cors_origins`,
    or a route that changes the daemon called with a key that is not the admin key (daemon.operator)."""

    code, status = "forbidden", 403


class UnsupportedMediaType(FleetError):
    """A body that is neither JSON nor MessagePack (a browser form or text/plain post)."""

    code, status = "unsupported_media_type", 415


class ModelNotFound(FleetError):
    code, status = "model_not_found", 404


class NotFound(FleetError):
    """No such route (or resource other than a model)."""

    code, status = "not_found", 404


class MethodNotAllowed(FleetError):
    code, status = "method_not_allowed", 405


class Unsupported(FleetError):
    """A request field this server knows but does not implement (OpenAI `tools`,
    `n` > 1, ...): refused by name, never silently ignored."""

    code, status = "unsupported", 400


class PayloadTooLarge(FleetError):
    code, status = "payload_too_large", 413


class InputTooLong(FleetError):
    code, status = "input_too_long", 422


class Overloaded(FleetError):
    code, status = "overloaded", 429

    def __init__(self, message: str, *, retry_after_s: float = 1.0, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s


class ModelTooLarge(FleetError):
    code, status = "model_too_large", 507


class InsufficientStorage(FleetError):
    """The disk that holds FLEET_HOME is full (an upload, a batch's results, a pin, a config file)."""

    code, status = "insufficient_storage", 507


class HeadersTooLarge(FleetError):
    """A request's head (request line and headers) past `max_header_bytes` (daemon.connections)."""

    code, status = "headers_too_large", 431


class NotImplementedCoding(FleetError):
    """A request body in a transfer coding the daemon does not decode (only `chunked` is):
    501, as HTTP/1.1 asks of a server that meets a coding it does not implement."""

    code, status = "not_implemented", 501


class PromotionRefused(FleetError):
    """An evaluation found the candidate worse than the version it would replace, beyond
    the margin (daemon.promotions): the alias stays; the message carries both numbers."""

    code, status = "promotion_refused", 409


class QuotaExceeded(FleetError):
    """An owner's quota (fleet.quotas: models, adapters, resident bytes) would be passed:
    nothing was added or loaded; the message names the owner, the bound and its setting."""

    code, status = "quota_exceeded", 507


class ModelLoadFailed(FleetError):
    code, status = "model_load_failed", 500


class IntegrityError(FleetError):
    """A store file no longer matches the sha256 its manifest recorded."""

    code, status = "integrity_error", 500


class InferenceFailed(FleetError):
    code, status = "inference_failed", 500


class Unavailable(FleetError):
    code, status = "unavailable", 503


class Timeout(FleetError):
    code, status = "timeout", 504


class ClientClosed(FleetError):
    """The client closed its connection before the answer: the request stopped waiting
    and its work left the queue (daemon.departures). Nobody reads the reply; the code
    counts it in `fleet_requests_total` (499: the client closed the request)."""

    code, status = "client_closed", 499


class SourceUnreachable(FleetError):
    """A pull source (hub, path, package) could not be read."""

    code, status = "source_unreachable", 502


#: code -> class, so an error that crossed a process boundary as (code, message)
#: comes back as the same type.
BY_CODE: dict[str, type[FleetError]] = {
    cls.code: cls
    for cls in (
        FleetError, BadRequest, Unauthorized, ModelNotFound, PayloadTooLarge, InputTooLong,
        NotFound, MethodNotAllowed, Unsupported, Overloaded, ModelTooLarge, ModelLoadFailed, IntegrityError, InferenceFailed,
        Unavailable, Timeout, ClientClosed, SourceUnreachable, Forbidden, UnsupportedMediaType, InsufficientStorage,
        PromotionRefused, QuotaExceeded,
    )
}


def from_code(code: str, message: str) -> FleetError:
    return BY_CODE.get(code, FleetError)(message)
