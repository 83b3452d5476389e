"""Body formats: decode requests, negotiate and encode replies, shape errors.

MessagePack (`application/msgpack`, and Litestar's `application/x-msgpack`) and
JSON. The reply follows `Accept`, else the request's Content-Type, else JSON.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from fleet.errors import BadRequest, FleetError
from fleet.protocol import ErrorBody, ErrorReply

from fleet.daemon import fields

T = TypeVar("T")
U = TypeVar("U")

MSGPACK = "application/msgpack"
MSGPACK_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})
JSON = "application/json"

_mp_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_decoders: dict[tuple[type, bool], Any] = {}


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def is_msgpack(header: str | None) -> bool:
    return media_type(header) in MSGPACK_TYPES


def reply_is_msgpack(accept: str | None, content_type: str | None) -> bool:
    """Negotiate the reply format: an explicit Accept wins, else mirror the request."""
    if accept:
        for part in accept.split(","):
            kind = media_type(part)
            if kind in MSGPACK_TYPES:
                return True
            if kind in (JSON, "application/*+json"):
                return False
    return is_msgpack(content_type)


def decode(body: bytes, type_: type[T], *, msgpack: bool) -> T:
    """Decode and validate a request body in one pass; errors become `bad_request`,
    naming the field at fault (an unknown one with the closest known one: the
    request Structs forbid unknown fields, daemon.fields)."""
    try:
        return validate(body, type_, msgpack=msgpack)
    except msgspec.ValidationError as exc:
        raise fields.invalid(exc, type_, body, msgpack=msgpack) from None


def decode_negotiated(body: bytes, content_type: str | None, accept: str | None, msgpack_type: type[T],
                      json_type: type[U]) -> tuple[T | U, bool, bool]:
    """(request, msgpack_in, msgpack_out): the body decoded by its Content-Type
    (MessagePack as `msgpack_type`, else JSON as `json_type`, as `decode` does) and the
    reply's format negotiated (`reply_is_msgpack`), in one call: the hot route's way in."""
    msgpack_in = is_msgpack(content_type)
    req = decode(body, msgpack_type if msgpack_in else json_type, msgpack=msgpack_in)
    return req, msgpack_in, reply_is_msgpack(accept, content_type)


def decode_lenient(body: bytes, type_: type[T], *, msgpack: bool) -> tuple[T, list[str]]:
    """(request, paths of the unknown fields it dropped) for routes whose original
    server ignores unknown fields (Ollama, TEI): they name them in the
    `X-Fleet-Ignored-Fields` header. A body without unknown fields costs what `decode`
    costs; one with them is read once more as plain data, stripped and decoded again."""
    try:
        return validate(body, type_, msgpack=msgpack), []
    except msgspec.ValidationError as exc:
        if not fields.names_unknown(exc):
            raise fields.invalid(exc, type_, body, msgpack=msgpack) from None
    obj = validate(body, Any, msgpack=msgpack)
    dropped = fields.strip(obj, fields.type_tree(type_))
    return decode(encode(obj, msgpack=msgpack), type_, msgpack=msgpack), [u.path for u in dropped]


def validate(body: bytes, type_: type[T], *, msgpack: bool) -> T:
    """`decode`'s one pass: a body that does not parse is a `bad_request`; msgspec's
    ValidationError (the body parses, its fields do not fit) is left to the caller."""
    key = (type_, msgpack)
    decoder = _decoders.get(key)
    if decoder is None:
        decoder = _decoders[key] = (msgspec.msgpack.Decoder(type_) if msgpack else msgspec.json.Decoder(type_))
    if not body:
        raise BadRequest("empty request body")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        kind = "MessagePack" if msgpack else "JSON"
        raise BadRequest(f"malformed {kind} body: {exc}") from None
    except UnicodeDecodeError as exc:  # a msgpack str that is not valid UTF-8
        raise BadRequest(f"text is not valid UTF-8: {exc}") from None
    except RecursionError:
        # msgspec stops at the interpreter's recursion limit: nesting that deep is
        # never a valid request (deliberately not a traceback in the log per request).
        raise BadRequest("request body is nested too deeply") from None


def encode(obj: Any, *, msgpack: bool) -> bytes:
    return _mp_encoder.encode(obj) if msgpack else _json_encoder.encode(obj)


#: Characters JSON leaves raw in strings that line readers still break lines at
#: (`str.splitlines`, so httpx's `iter_lines` under the Ollama client; JavaScript
#: before ES2019). Outside strings JSON is ASCII, so escaping them keeps the value.
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def json_line(obj: Any) -> bytes:
    """JSON of `obj` for a line-framed stream (NDJSON, SSE `data:`, JSONL files): a
    model's text never splits one value over two lines, whatever reads it."""
    data = _json_encoder.encode(obj)
    for raw, escaped in _LINE_BREAKERS:  # three C scans of bytes that are in cache
        data = data.replace(raw, escaped)
    return data


def encode_msgpack(obj: Any) -> bytes:
    """MessagePack bytes of `obj` (a JSON request re-encoded for the queue, mostly). JSON
    numbers have no size limit but MessagePack integers stop at 64 bits: a client's
    out-of-range integer is its error, not a server fault."""
    try:
        return _mp_encoder.encode(obj)
    except OverflowError:
        raise BadRequest("a number is out of range: integers must fit in 64 bits") from None


#: Ollama's routes: errors there are Ollama's `{"error": "message"}` (its clients show
#: an object in that field as a dict), whatever refuses the request.
OLLAMA_PREFIX = "/api/"


#: Typed decisions' System One route (daemon/systemone.py): errors are its shape,
#: `{"detail": {"error_type", "message"}}`, whatever refuses the request; its error
#: types are fleet's codes but where its clients read their own names.
DETAIL_PATHS = frozenset({"/v1/systemone"})
DETAIL_TYPES = {"unauthorized": "authentication_error", "forbidden": "permission_error"}


#: TEI's and TGI's routes: errors there are their `{"error": "message", "error_type":
#: code}` (fleet's code), the string Hugging Face's clients show (huggingface_hub reads
#: `error`; @huggingface/inference shows only "an HTTP error occurred" when it is not a
#: string). `POST /` and a per-model base URL's TEI and TGI routes (`/models/NAME/...`)
#: answer the same; its `/v1/...` routes keep theirs.
HF_PATHS = frozenset({"/", "/embed", "/embed_sparse", "/embed_all", "/rerank", "/predict", "/tokenize", "/info",
                      "/similarity", "/decode", "/generate", "/generate_stream", "/pipeline/token-classification"})


def is_hf_path(path: str) -> bool:
    if path.startswith("/models/"):
        path = "/" + path[len("/models/"):].partition("/")[2]
    return path in HF_PATHS


def hf_error(exc: FleetError) -> dict[str, str]:
    """TEI's and TGI's error object (a streamed TGI error event is the same)."""
    return {"error": exc.message, "error_type": exc.code}


def error_body(exc: FleetError, *, msgpack: bool, path: str = "") -> bytes:
    if path.startswith(OLLAMA_PREFIX):
        return encode({"error": exc.message}, msgpack=msgpack)
    if is_hf_path(path):
        return encode(hf_error(exc), msgpack=msgpack)
    if path in DETAIL_PATHS:
        return encode({"detail": {"error_type": DETAIL_TYPES.get(exc.code, exc.code), "message": exc.message}},
                      msgpack=msgpack)
    return encode(ErrorReply(ErrorBody(exc.code, exc.message)), msgpack=msgpack)
