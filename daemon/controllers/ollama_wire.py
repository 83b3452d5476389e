"""The Ollama API's shapes and the pure rules that map them onto fleet's.

Field names follow Ollama's own document (docs/api.md) and its Go types
(api/types.go). Requests are decoded leniently, as Ollama's Go server does:
unknown fields are ignored (the Structs forbid them, so msgspec finds one at no
cost to a request without; `codec.decode_lenient` then drops them). What fleet
cannot honour is refused by name (`refuse_unsupported`), never dropped in
silence: unknown fields and known ones fleet does not apply are named in the
`X-Fleet-Ignored-Fields` reply header (daemon.fields). In `options`, where Ollama itself accepts and ignores
what a model has no use for, fleet applies temperature, top_p, seed,
num_predict and stop, and names the rest in the `X-Fleet-Ignored-Options`
reply header.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import msgspec

from fleet.catalog import validate_name
from fleet.errors import BadRequest, ModelNotFound
from fleet.protocol import EmbedDtype, TokenLogprob

#: Ollama's sampling defaults (api/types.go `DefaultOptions`): a client that sends
#: no options gets what it would get from Ollama.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
#: The one tag fleet's store names have: `name` and `name:latest` are the same model.
LATEST = "latest"
#: The Ollama API release whose document these routes follow; clients gate features on it.
API_VERSION = "0.32.15"
IGNORED_OPTIONS_HEADER = "X-Fleet-Ignored-Options"
#: Options fleet applies (the rest are accepted and ignored, as Ollama does for options a runner does not use).
APPLIED_OPTIONS = frozenset({"temperature", "top_p", "seed", "num_predict", "stop"})
#: Message fields accepted and not applied (the chat template gets role, content, calls and tool names).
IGNORED_MESSAGE = ("thinking",)


# ---- requests ------------------------------------------------------------------------

class OllamaMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class Options(msgspec.Struct, frozen=True):
    """The options fleet applies; `num_predict` < 0 means "no limit of my own" (fleet's default)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None


#: `keep_alive`: seconds as a number, or a Go duration string ("5m", "1h30m", "-1s").
KeepAliveValue = float | str | None


class GenerateBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict | None = None
    images: list[str] | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAliveValue = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""
    messages: list[OllamaMessage] | None = None
    tools: list[Any] | None = None
    stream: bool = True
    format: str | dict | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAliveValue = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class EmbedBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`/api/embed`, plus fleet's `prompt_name`, `prompt` and `output_dtype` (as on `/v1/embed`)."""

    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAliveValue = None
    prompt_name: str | None = None
    prompt: str | None = None
    output_dtype: EmbedDtype = "float32"


class EmbeddingsBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The legacy `/api/embeddings` (one `prompt`, one unnormalised vector), plus fleet's
    `prompt_name` and `dimensions` (its `prompt` is the text to embed, Ollama's name:
    an instruction text goes through `/api/embed`)."""

    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAliveValue = None
    prompt_name: str | None = None
    dimensions: int | None = None


class NameBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`/api/show`, `/api/delete`, `/api/pull`: `model` (older clients send `name`)."""

    model: str = ""
    name: str = ""
    stream: bool = True
    verbose: bool = False
    insecure: bool = False

    @property
    def target(self) -> str:
        return self.model or self.name


# ---- replies ---------------------------------------------------------------------------

class OllamaFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


class OllamaToolCall(msgspec.Struct, frozen=True):
    """A call as Ollama spells it: arguments as an object, not JSON text."""

    function: OllamaFunction


class ReplyMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    tool_calls: list[OllamaToolCall] | None = None


class Stats(msgspec.Struct, frozen=True):
    """Where the time of one request went, in nanoseconds (Ollama's unit)."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class GenerateLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """One `/api/generate` object: a piece of text, or the last one with the stats."""

    model: str
    created_at: str
    response: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    #: Per token, with `logprobs` (Ollama's shape: token, logprob, bytes, top_logprobs).
    logprobs: list[TokenLogprob] | None = None
    #: fleet's: the server limit that ended the text ("context" | "memory"), when one did.
    length_limit: str | None = None


class ChatLine(msgspec.Struct, frozen=True, omit_defaults=True):
    model: str
    created_at: str
    message: ReplyMessage
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    #: Per token, with `logprobs` (Ollama's shape: token, logprob, bytes, top_logprobs).
    logprobs: list[TokenLogprob] | None = None
    #: fleet's: the server limit that ended the text ("context" | "memory"), when one did.
    length_limit: str | None = None


class EmbedReply(msgspec.Struct, frozen=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsReply(msgspec.Struct, frozen=True):
    embedding: list[float]


class Details(msgspec.Struct, frozen=True):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class TagModel(msgspec.Struct, frozen=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class TagsReply(msgspec.Struct, frozen=True):
    models: list[TagModel]


class RunningModel(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    model: str
    size: int
    digest: str
    details: Details
    #: Bytes of the model's copies on GPUs (0 on CPU): always sent, as Ollama does.
    size_vram: int
    #: fleet has no unload timer: a model stays until its memory is needed (or keep_alive 0
    #: unloads it), so every entry says Ollama's "forever".
    expires_at: str
    context_length: int | None = None


class PsReply(msgspec.Struct, frozen=True):
    models: list[RunningModel]


class ShowReply(msgspec.Struct, frozen=True):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str
    license: str = ""


class Progress(msgspec.Struct, frozen=True, omit_defaults=True):
    """One `/api/pull` status line."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class ErrorLine(msgspec.Struct, frozen=True):
    """Ollama's error shape, as a reply body and as the last line of a broken stream."""

    error: str


# ---- names -----------------------------------------------------------------------------

_TAG = re.compile(r"^[a-z0-9_][a-z0-9._-]{0,127}$")

def store_name(ollama_name: str) -> str:
    """The store name an Ollama `name[:tag]` means: `name` and `name:latest` are
    the model `name`; fleet keeps one version per name, so any other tag is not
    found. Names are case-insensitive, as Ollama's are."""
    if not ollama_name:
        raise BadRequest("model is required")
    name, sep, tag = ollama_name.strip().lower().rpartition(":")
    if not sep:
        name, tag = tag, LATEST
    if not _TAG.match(tag):
        raise BadRequest(f"invalid model name {ollama_name!r}: use name or name:tag (letters, digits, '.', '_', '-')")
    if tag != LATEST:
        raise ModelNotFound(f"model '{ollama_name}' not found: fleet keeps one version of each model, "
                            f"tagged :{LATEST} (see /api/tags)")
    return validate_name(name)


def ollama_name(name: str) -> str:
    return f"{name}:{LATEST}"


# ---- keep_alive ------------------------------------------------------------------------

class Keep(Enum):
    """What `keep_alive` asks of fleet's memory manager."""

    #: A positive duration (or none): the model stays until memory is needed (LRU eviction).
    LRU = "lru"
    #: Negative ("forever"): pin it.
    PIN = "pin"
    #: Zero: unload it once this request is answered.
    UNLOAD = "unload"


_GO_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+$")
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def choose_keep(value: KeepAliveValue) -> Keep:
    """Map `keep_alive` as Ollama reads it (api/types.go `Duration.UnmarshalJSON`):
    a number is seconds, a string a Go duration; negative means forever."""
    if value is None:
        return Keep.LRU
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            if not _GO_DURATION.match(text):
                raise BadRequest(f"invalid keep_alive {value!r}: use seconds or a duration such as "
                                 "\"5m\", \"1h\", \"-1\" (forever) or \"0\" (unload now)") from None
            seconds = sum(float(n) for n, _ in _GO_PART.findall(text)) * (-1 if text.startswith("-") else 1)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise BadRequest("invalid keep_alive: not a number")
    if seconds < 0:
        return Keep.PIN
    if seconds == 0:
        return Keep.UNLOAD
    return Keep.LRU


# ---- options, format, refusals ---------------------------------------------------------

def read_options(raw: dict[str, Any] | None) -> tuple[Options, list[str]]:
    """(the options fleet applies, names of the ones it accepts and ignores)."""
    if not raw:
        return Options(), []
    try:
        opts = msgspec.convert(raw, Options)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid options: {exc}".replace("`$.", "`options.")) from None
    ignored = sorted(k for k, v in raw.items() if k not in APPLIED_OPTIONS and v is not None)
    return opts, ignored


def sampling(opts: Options) -> dict[str, Any]:
    """GenerateRequest keyword arguments for Ollama's options (Ollama's defaults where unset)."""
    out: dict[str, Any] = {
        "temperature": DEFAULT_TEMPERATURE if opts.temperature is None else opts.temperature,
        "top_p": DEFAULT_TOP_P if opts.top_p is None else opts.top_p,
    }
    # Ollama's seed -1 (its default) is "random".
    if opts.seed is not None and opts.seed >= 0:
        out["seed"] = opts.seed
    if opts.num_predict is not None:
        if opts.num_predict == 0:
            raise BadRequest("options.num_predict must be at least 1 (or -1: no limit of your own)")
        # Negative (-1 "infinite", -2 "fill the context"): no limit of the client's (the default).
        if opts.num_predict > 0:
            out["max_tokens"] = opts.num_predict
    if opts.stop:
        out["stop"] = opts.stop
    return out


def output_format(value: str | dict | None) -> str | dict | None:
    """Ollama's `format` as GenerateRequest.format: "" = none, "json", or a JSON Schema."""
    if value is None or value == "":
        return None
    if value == "json" or isinstance(value, dict):
        return value
    raise BadRequest(f"invalid format {value!r}: use \"json\" or a JSON Schema object")


def logprob_fields(logprobs: bool | None, top_logprobs: int | None) -> dict[str, Any]:
    """GenerateRequest's logprobs fields; Ollama reads `top_logprobs` only with `logprobs`."""
    if not logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": top_logprobs or 0}


def refuse_unsupported(model: str, fields: dict[str, Any]) -> None:
    """400 naming the first field fleet's generators cannot honour (Ollama says
    the same for a model without that capability)."""
    for field, why in (
        ("images", "takes no images"),
        ("think", "does not support thinking"),
        ("suffix", "does not support insert (suffix)"),
        ("template", "does not take a custom template: fleet renders the model's own chat template"),
        ("context", "does not take a context: send the conversation as /api/chat messages"),
    ):
        if fields.get(field):
            raise BadRequest(f"{model!r} {why}")


# ---- time --------------------------------------------------------------------------------

def created_at() -> str:
    """Now, RFC 3339 in UTC with microseconds (Ollama's `created_at`)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso_utc(text: str) -> str:
    """A store timestamp (ISO 8601, UTC, seconds) as RFC 3339."""
    return text if text.endswith("Z") else text + "Z"


#: Ollama's expires_at for a model kept forever: now + the longest Go duration.
FOREVER_S = (2**63 - 1) / 1e9


def forever() -> str:
    t = datetime.now(timezone.utc).timestamp() + FOREVER_S
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
