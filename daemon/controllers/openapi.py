"""The OpenAPI 3.1 document of every route, and the offline docs page.

Handlers take the raw request and decode it with msgspec themselves (bodies
are MessagePack or JSON, replies follow `Accept`), so Litestar cannot infer
their shapes. `OPERATIONS` says, once per route, which Struct (or JSON Schema)
a request and its reply have; `build_document` walks the app's real routes and
fills the document from that table and from msgspec's schemas of the Structs.
A route missing from the table is still listed, without shapes, and
tests/test_openapi.py fails on it. Request Structs forbid unknown fields
(`additionalProperties: false`); on the routes whose original server ignores
them (Ollama, TEI: `Op.unknown_fields`) the document says they are allowed, and
every route that names what it did not apply documents `X-Fleet-Ignored-Fields`.

`/docs` is Swagger UI served from the `swagger-ui-py` package's files (no CDN: it
works offline); without that package the page says so and links the JSON.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from fleet import __version__
from fleet.batches import Batch, BatchCreateRequest, BatchList, FileDeleted, FileList, FileObject
from fleet.aliases import ALIAS_RE
from fleet.promotions import ID_RE as PROMOTION_ID, Package
from fleet.catalog import NAME_RE
from fleet.protocol import (
    ChatCompletionChunk, ChatCompletionReply, ChatCompletionRequest, ClassifyReply, ClassifyRequest,
    CohereRerankReply, CompletionReply, CompletionRequest, EmbedReplyJson, EmbedRequestJson, EmbedSparseReply,
    EmbedTokensReplyJson, ErrorReply, ExtractReply, ExtractRequest, GenerateChunkReply, GenerateReply,
    GenerateRequest, ModelList, OpenAIEmbeddingsReply, OpenAIEmbeddingsRequest, OpenAIErrorReply,
    RerankReply, RerankRequest,
)
from fleet.protocol import ModelDetail

from fleet.daemon import systemone
from fleet.daemon.calibration import CalibrateRequest
from fleet.daemon.controllers import decisions, ollama_create, responses, tei, tgi
from fleet.daemon.controllers import cohere, ollama_wire as ow
from fleet.daemon.controllers.admin import AdminOptions
from fleet.daemon.controllers.store import PullBody as StorePullBody
from fleet.daemon.controllers.aliases import AliasNote, AliasSet
from fleet.daemon.controllers.promotions import PromoteRequest
from fleet.daemon.fields import IGNORED_FIELDS_HEADER
from fleet.daemon.jobstore import BATCH_ID, FILE_ID

JSON, MSGPACK, SSE, NDJSON, TEXT = (
    "application/json", "application/msgpack", "text/event-stream", "application/x-ndjson", "text/plain")
FORM, JSONL, BYTES = "multipart/form-data", "application/jsonl", "application/octet-stream"


@dataclass(frozen=True)
class Op:
    """One route's document: what it is for, its body and its reply (a Struct type or
    a JSON Schema dict), and the media types they travel in."""

    summary: str
    tag: str
    request: Any = None
    reply: Any = None
    #: Media types of the body (JSON and MessagePack on native and compatible routes).
    accepts: tuple[str, ...] = (JSON, MSGPACK)
    #: Media types of the 200 reply; a stream's pieces are described by `stream`.
    returns: tuple[str, ...] = (JSON, MSGPACK)
    #: With `stream: true`: (media type, schema of one piece).
    stream: tuple[str, Any] | None = None
    body_required: bool = True
    errors: Any = ErrorReply
    #: What the route does with a field its request does not have: "refused" (400 naming
    #: it and the closest known one) or "ignored" (as the original server does; named
    #: in `X-Fleet-Ignored-Fields`).
    unknown_fields: str = "refused"
    #: The reply may carry `X-Fleet-Ignored-Fields` (fields accepted and not applied).
    names_ignored: bool = False
    #: Query parameters: (name, JSON Schema, description).
    query: tuple[tuple[str, dict, str], ...] = ()
    #: The statuses a success answers with, each with `reply` (none: the route always refuses).
    success: tuple[str, ...] = ("200",)


def _array(items: Any) -> dict:
    return {"type": "array", "items": items}


def _object(description: str, **properties: Any) -> dict:
    return {"type": "object", "description": description, "properties": properties}


_NUMBER, _STRING, _INT, _BOOL = {"type": "number"}, {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_ADMIN_REPLY = _object("What each worker that acted answered.", model=_STRING, op=_STRING,
                       results=_array({"type": "object"}), was_pinned=_BOOL)
_ADMIN = dict(tag="admin", request=AdminOptions, reply=_ADMIN_REPLY, body_required=False)
_OLLAMA = dict(tag="ollama", errors=ow.ErrorLine, returns=(JSON,), unknown_fields="ignored")
_TEI = dict(returns=(JSON,), unknown_fields="ignored")
_OPENAI = dict(errors=OpenAIErrorReply, names_ignored=True)
_JOBS = dict(tag="batches", errors=OpenAIErrorReply)
_DECISION = _object("Answers in question order, the model that answered, and its token counts.",
                    answers=_array({"type": "object"}), model=_STRING, usage={"type": "object"})
#: `POST /v1/files`: OpenAI's form (daemon/batchfile.receive_upload reads it as it streams in).
_UPLOAD = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary",
             "description": "The batch's input: JSONL, one request a line ({custom_id, method, url, body})."},
    "purpose": {"type": "string", "enum": ["batch"], "description": "fleet keeps files for batches only."},
    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
    "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2_592_000,
                               "description": "Delete the file this long after its upload (default: "
                                              "batch_retention_days)."}},
    "additionalProperties": False}
_ALIAS = _object("An alias: the version it serves, its rollback target, its canary and their recent figures.",
                 name=_STRING, version=_STRING, previous=_STRING, canary=_STRING, canary_percent=_NUMBER,
                 at=_STRING, by=_STRING, change=_INT, versions={"type": "object"})
_ALIAS_CHANGE = _object("The alias after the change, the version before it, and how long the switch took.",
                        alias=_ALIAS, before=_STRING, seconds=_NUMBER)
_AFTER = ("after", _STRING, "The id of the last item of the previous page: this page starts after it.")

OPERATIONS: dict[tuple[str, str], Op] = {
    # -- native -----------------------------------------------------------------------------
    ("POST", "/v1/embed"): Op(
        "Embed texts or images: dense vectors (with the model's prompts, Matryoshka `dimensions` and compact "
        "`output_dtype`s), per-token vectors or sparse vectors. A Cohere v1 body (`texts`, no `inputs`) is "
        "answered in Cohere's v1 shape.", "native",
        EmbedRequestJson, {"oneOf": [EmbedReplyJson, EmbedTokensReplyJson, EmbedSparseReply]}),
    ("POST", "/v1/rerank"): Op("Score documents against a query, best first (Cohere v1 / Jina shape).",
                               "native", RerankRequest, RerankReply, names_ignored=True),
    ("POST", "/v1/classify"): Op("Label texts with a sequence classifier.", "native", ClassifyRequest,
                                 ClassifyReply),
    ("POST", "/v1/extract"): Op("Named entities (token classification or zero-shot labels).", "native",
                                ExtractRequest, ExtractReply),
    ("POST", "/v1/generate"): Op("Generate text (continuous batching); `stream: true` answers server-sent events.",
                                 "native", GenerateRequest, GenerateReply, stream=(SSE, GenerateChunkReply)),
    ("GET", "/v1/ps"): Op("Workers, resident models, devices and lanes of this daemon.", "admin", None,
                          _object("The daemon's state (see `fleetctl ps --json`).", box=_STRING, status=_STRING,
                                  uptime_s=_NUMBER, queue={"type": "object"}, workers=_array({"type": "object"}),
                                  slots=_array({"type": "object"}), lanes=_array({"type": "object"}))),
    ("POST", "/v1/models/{name}/pin"): Op("Load the model and keep it resident, also after a restart.", **_ADMIN),
    ("DELETE", "/v1/models/{name}/pin"): Op("Let the model be evicted again when room is needed.", **_ADMIN),
    ("POST", "/v1/models/{name}/load"): Op("Load the model now (it may be evicted later).", **_ADMIN),
    ("POST", "/v1/models/{name}/unload"): Op("Unload the model from every worker now.", **_ADMIN),
    ("POST", "/v1/models/{model_id}/calibration"): Op(
        "Fit a decision model's temperatures from labelled examples (System One requests with `labels`), report "
        "the expected calibration error before and after, and (with `write`) store them in models.toml and apply "
        "them at once (the operator's; `fleetctl calibrate`).", "admin", CalibrateRequest,
        _object("The fit per question kind and option-count bucket.", model=_STRING, examples=_INT,
                questions=_INT, ece_before=_NUMBER, ece_after=_NUMBER, buckets=_array({"type": "object"}),
                temperatures={"type": "object", "additionalProperties": _NUMBER}, written=_STRING, live=_BOOL)),
    ("GET", "/v1/top"): Op("The box over the last seconds, per model and worker (see `fleetctl top --json`).",
                           "admin", None, _object("Rates, latencies, queues, batches, workers, devices, events.",
                                                  box=_STRING, window_s=_NUMBER, queue={"type": "object"},
                                                  models=_array({"type": "object"}),
                                                  workers=_array({"type": "object"}),
                                                  devices=_array({"type": "object"}),
                                                  events=_array({"type": "object"}))),
    ("GET", "/v1/cluster"): Op("Every box of the NATS cluster, its models and its load (with --nats).", "admin",
                               None, _object("Live heartbeat entries of the cluster's boxes.",
                                             boxes=_array({"type": "object"}))),
    ("GET", "/healthz"): Op("The process answers.", "health", None, _object("Liveness.", status=_STRING)),
    ("GET", "/readyz"): Op("Every pinned model is resident (503 with the reason otherwise).", "health", None,
                           _object("Readiness.", ready=_BOOL, status=_STRING)),
    ("GET", "/metrics"): Op("Prometheus metrics.", "health", None, _STRING, returns=(TEXT,)),
    # -- OpenAI ------------------------------------------------------------------------------
    ("POST", "/v1/embeddings"): Op("OpenAI embeddings: `input` as text(s) or token ids.", "openai",
                                   OpenAIEmbeddingsRequest, OpenAIEmbeddingsReply, **_OPENAI),
    ("POST", "/v1/completions"): Op("OpenAI completions.", "openai", CompletionRequest, CompletionReply,
                                    stream=(SSE, CompletionReply), **_OPENAI),
    ("POST", "/v1/chat/completions"): Op("OpenAI chat completions.", "openai", ChatCompletionRequest,
                                         ChatCompletionReply, stream=(SSE, ChatCompletionChunk), **_OPENAI),
    ("POST", "/v1/responses"): Op("OpenAI Responses API: text or message `input`, `instructions`, "
                                  "`text.format`; `stream: true` answers its typed events.", "openai",
                                  responses.ResponsesRequest, responses.ResponseObject,
                                  stream=("text/event-stream", {"type": "object"}), **_OPENAI),
    ("GET", "/v1/models"): Op("Stored models (OpenAI model objects).", "openai", None, ModelList,
                              errors=OpenAIErrorReply),
    ("GET", "/v1/models/{model_id}"): Op("One stored model (OpenAI model object), with the live serving profile "
                                         "of each worker holding it.", "openai", None, ModelDetail,
                                         errors=OpenAIErrorReply),
    # -- OpenAI Files and Batches (offline jobs, daemon/batches.py) -------------------------------
    ("POST", "/v1/files"): Op("Upload a batch's input file (multipart, streamed to disk, checked line by line).",
                              request=_UPLOAD, reply=FileObject, accepts=(FORM,), **_JOBS),
    ("GET", "/v1/files"): Op("Stored files, a page at a time.", reply=FileList, query=(
        _AFTER, ("limit", {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 10_000}, "Files a page."),
        ("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "By upload time."),
        ("purpose", _STRING, "Only files of this purpose (`batch`, `batch_output`).")), **_JOBS),
    ("GET", "/v1/files/{file_id}"): Op("One file.", reply=FileObject, **_JOBS),
    ("GET", "/v1/files/{file_id}/content"): Op("A file's bytes: a batch's input, output or error JSONL.",
                                               reply=_STRING, returns=(JSONL,), **_JOBS),
    ("DELETE", "/v1/files/{file_id}"): Op("Delete a file (not the input of a batch still running).",
                                          reply=FileDeleted, **_JOBS),
    ("POST", "/v1/batches"): Op("Run an uploaded file's requests as batch work, behind interactive work, within "
                                "`completion_window`.", request=BatchCreateRequest, reply=Batch, **_JOBS),
    ("GET", "/v1/batches"): Op("Batches, newest first, a page at a time.", reply=BatchList, query=(
        _AFTER, ("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Batches a page.")),
        **_JOBS),
    ("GET", "/v1/batches/{batch_id}"): Op("One batch: status, counts, usage, result files.", reply=Batch, **_JOBS),
    ("POST", "/v1/batches/{batch_id}/cancel"): Op("Cancel a batch: no new line starts, lines in flight are "
                                                  "withdrawn, the rest answered `batch_cancelled`.", reply=Batch,
                                                  **_JOBS),
    # -- TypeSafe System One (typed decisions) ----------------------------------------------
    ("POST", "/v1/systemone"): Op("Typed decisions: noul, choice and score questions about a state, answered with "
                                  "probabilities and confidence (422 `detail[]` for what does not fit the schema).",
                                  "systemone", systemone.REQUEST_SCHEMA, systemone.REPLY_SCHEMA, returns=(JSON,),
                                  errors=systemone.ERROR_SCHEMA, unknown_fields="ignored", names_ignored=True),
    ("POST", "/v1/decisions"): Op("OpenAI Decisions: predicate, choice and score questions about an input, "
                                  "answered in order (the same answers as /v1/systemone).", "openai",
                                  decisions.DecisionRequest, _DECISION, returns=(JSON, MSGPACK), **_OPENAI),
    # -- the store, through the daemon that owns it (daemon/controllers/store.py) ----------------
    ("GET", "/v1/store"): Op("The stored models with their sources, sizes and folders, and the damaged ones "
                             "(the operator's; `fleetctl list --json`).", "admin", None,
                             _object("This daemon's store.", home=_STRING, models=_array({"type": "object"}),
                                     damaged=_array({"type": "object"}))),
    ("POST", "/v1/store/pull"): Op(
        "Pull a catalog or stored name, or an hf:, path: (absolute) or pkg: source, into this daemon's store; "
        "resident copies of a model it changes are retired (the operator's; `fleetctl pull`). NDJSON lines: "
        "`{status, total, completed}` per phase, last `{status: success, result, replaced}` or `{error}`.",
        "admin", StorePullBody, None, returns=(NDJSON,), stream=(NDJSON, {"type": "object"})),
    ("DELETE", "/v1/models/{model_id}"): Op(
        "Unload every copy of the model, then remove it from the store (OpenAI's delete of a model; the "
        "operator's; `fleetctl rm`).", "admin", None,
        _object("The model removed.", id=_STRING, object=_STRING, deleted=_BOOL, size_bytes=_INT,
                was_pinned=_BOOL, unloaded=_array(_INT))),
    # -- Cohere ------------------------------------------------------------------------------
    ("POST", "/v2/rerank"): Op("Cohere v2 rerank.", "cohere", RerankRequest, CohereRerankReply, names_ignored=True),
    ("POST", "/v2/embed"): Op("Cohere v2 embed: `input_type` picks the model's prompt, `embedding_types` float, "
                              "int8, uint8, binary, ubinary, base64.", "cohere", cohere.CohereEmbedRequest,
                              cohere.CohereEmbedReply),
    # -- Hugging Face TEI --------------------------------------------------------------------
    ("POST", "/embed"): Op("TEI: dense embeddings, one array per input.", "tei", tei.TeiEmbedRequest,
                           _array(_array(_NUMBER)), **_TEI),
    ("POST", "/embed_all"): Op("TEI: per-token embeddings of each input.", "tei", tei.TeiEmbedRequest,
                               _array(_array(_array(_NUMBER))), **_TEI),
    ("POST", "/embed_sparse"): Op("TEI: sparse embeddings (SPLADE models).", "tei", tei.TeiEmbedRequest,
                                  _array(_array(tei.TeiSparseValue)), **_TEI),
    ("POST", "/predict"): Op("TEI: sequence classification, labels with scores.", "tei", tei.TeiPredictRequest,
                             {"oneOf": [_array(tei.TeiPrediction), _array(_array(tei.TeiPrediction))]}, **_TEI),
    ("POST", "/rerank"): Op("TEI: rerank, a bare list of {index, score[, text]}.", "tei", tei.TeiRerankRequest,
                            _array(tei.TeiRank), **_TEI),
    ("POST", "/tokenize"): Op("TEI: the tokens of each input.", "tei", tei.TeiTokenizeRequest,
                              _array(_array(tei.TeiToken)), **_TEI),
    ("GET", "/info"): Op("TEI: the served model and its limits.", "tei", None, tei.TeiInfo, returns=(JSON,), query=(
        ("model", _STRING, "The model to describe (default: the embedding default). A per-model URL "
                           "(`/models/NAME/info`) sets it."),)),
    ("POST", "/similarity"): Op("TEI: cosine of `source_sentence` with each of `sentences`.", "tei",
                                tgi.SimilarityRequest, _array(_NUMBER), **_TEI),
    ("POST", "/decode"): Op("TEI: token ids to text in the model's own vocabulary.", "tei", tgi.DecodeRequest,
                            _array(_STRING), **_TEI),
    ("POST", "/pipeline/token-classification"): Op(
        "Hugging Face token classification: entities as {entity_group, score, word, start, end}.", "tei",
        tgi.TokenClassificationRequest, {"oneOf": [_array(tgi.HfEntity), _array(_array(tgi.HfEntity))]}, **_TEI),
    # -- Hugging Face TGI --------------------------------------------------------------------
    ("POST", "/generate"): Op("TGI: generate (`stream: true` as /generate_stream).", "tgi", tgi.TgiGenerateRequest,
                              tgi.TgiGenerateReply, stream=("text/event-stream", tgi.TgiStreamReply), **_TEI),
    ("POST", "/generate_stream"): Op("TGI: server-sent events, one per token; the last has the whole text.", "tgi",
                                     tgi.TgiGenerateRequest, tgi.TgiStreamReply, unknown_fields="ignored",
                                     returns=("text/event-stream",)),
    # -- Ollama ------------------------------------------------------------------------------
    ("GET", "/api/version"): Op("Ollama: API version.", reply=_object("", version=_STRING), **_OLLAMA),
    ("GET", "/api/tags"): Op("Ollama: stored models.", reply=ow.TagsReply, **_OLLAMA),
    ("GET", "/api/ps"): Op("Ollama: loaded models.", reply=ow.PsReply, **_OLLAMA),
    ("POST", "/api/show"): Op("Ollama: one model's details.", request=ow.NameBody, reply=ow.ShowReply, **_OLLAMA),
    ("POST", "/api/generate"): Op("Ollama: generate (NDJSON stream unless `stream: false`).", request=ow.GenerateBody,
                                  reply=ow.GenerateLine, stream=(NDJSON, ow.GenerateLine), **_OLLAMA),
    ("POST", "/api/chat"): Op("Ollama: chat (NDJSON stream unless `stream: false`).", request=ow.ChatBody,
                              reply=ow.ChatLine, stream=(NDJSON, ow.ChatLine), **_OLLAMA),
    ("POST", "/api/embed"): Op("Ollama: embeddings.", request=ow.EmbedBody, reply=ow.EmbedReply, **_OLLAMA),
    ("POST", "/api/embeddings"): Op("Ollama (legacy): one embedding.", request=ow.EmbeddingsBody,
                                    reply=ow.EmbeddingsReply, **_OLLAMA),
    ("POST", "/api/pull"): Op("Ollama: pull into the store (NDJSON progress unless `stream: false`).",
                              request=ow.NameBody, reply=ow.Progress, stream=(NDJSON, ow.Progress), **_OLLAMA),
    ("DELETE", "/api/delete"): Op("Ollama: remove from the store.", request=ow.NameBody, reply=None, **_OLLAMA),
    ("POST", "/api/blobs/{digest}"): Op("Ollama: upload one file (checked against its sha256 digest); 201 "
                                        "stored, 200 already stored, both with an empty body.",
                                        request={"type": "string", "format": "binary"}, accepts=(BYTES,),
                                        success=("200", "201"), body_required=False, **_OLLAMA),
    ("POST", "/api/create"): Op("Ollama: a LoRA model from `from` (a stored model) and `adapters` (uploaded blobs).",
                                request=ollama_create.CreateBody, reply=ow.Progress, **_OLLAMA),
    ("POST", "/api/copy"): Op("Ollama: copy a stored model under a new name.", request=ollama_create.CopyBody,
                              reply=None, **_OLLAMA),
    ("POST", "/api/push"): Op("Ollama: refused, always (fleet has no registry); the body is not read.",
                              success=(), **_OLLAMA),
    # -- aliases (daemon/controllers/aliases.py) ----------------------------------------------
    ("GET", "/v1/aliases"): Op("Every alias: its version, rollback target and canary, with each version's request "
                               "and error rates and latencies over the last seconds.", "aliases", None,
                               _object("The aliases.", aliases=_array(_ALIAS))),
    ("GET", "/v1/aliases/{alias}"): Op("One alias, as the list shows it.", "aliases", None, _ALIAS),
    ("GET", "/v1/aliases/{alias}/history"): Op("Every change of the alias (set, promote, canary, rollback, remove), "
                                               "oldest first.", "aliases", None,
                                               _object("The alias's changes.", alias=_STRING,
                                                       events=_array({"type": "object"}))),
    ("PUT", "/v1/aliases/{alias}"): Op("Point the alias at a stored version (the operator's). Requests already "
                                       "admitted finish on the version they started on.", "aliases", AliasSet,
                                       _ALIAS_CHANGE),
    ("POST", "/v1/aliases/{alias}/rollback"): Op("Back to the previous version, or end a running canary (the "
                                                 "operator's).", "aliases", AliasNote, _ALIAS_CHANGE,
                                                 body_required=False),
    ("DELETE", "/v1/aliases/{alias}"): Op("Remove the alias (the operator's).", "aliases", AliasNote, _ALIAS_CHANGE,
                                          body_required=False),
    ("POST", "/v1/promotions"): Op("Evaluate a candidate against the alias's version on an evaluation file (JSONL in "
                                   "`eval`), write a promotion package, and switch the alias (or start a canary) "
                                   "unless the candidate is worse beyond `margin`: then 409 `promotion_refused` "
                                   "with both versions' numbers (the operator's).", "aliases", PromoteRequest,
                                   Package),
    ("GET", "/v1/promotions/{promotion_id}"): Op("One promotion package.", "aliases", None, Package),
    # -- this document -----------------------------------------------------------------------
    ("GET", "/openapi.json"): Op("This document (OpenAPI 3.1).", "docs", None, {"type": "object"}, returns=(JSON,)),
    ("GET", "/docs"): Op("The API's docs page (Swagger UI, offline).", "docs", None, _STRING, returns=("text/html",)),
}

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")
_REF = "#/components/schemas/{name}"
#: What a path parameter holds, by its name; any other is a model name.
_PATH_PATTERNS = {"file_id": f"^{FILE_ID.pattern}$", "batch_id": f"^{BATCH_ID.pattern}$",
                  "digest": ollama_create.DIGEST_RE.pattern, "alias": ALIAS_RE.pattern,
                  "promotion_id": PROMOTION_ID.pattern}


def openapi_path(litestar_path: str) -> str:
    """`/v1/models/{name:str}/pin` -> `/v1/models/{name}/pin`."""
    return _PARAM.sub(r"{\1}", litestar_path)


def _types(schema: Any) -> list[type]:
    """The Struct types inside a schema value (a type, or a dict/list holding types)."""
    if isinstance(schema, type):
        return [schema]
    if isinstance(schema, dict):
        return [t for v in schema.values() for t in _types(v)]
    if isinstance(schema, list):
        return [t for v in schema for t in _types(v)]
    return []


def _resolve(schema: Any, refs: dict[type, dict]) -> Any:
    if isinstance(schema, type):
        return refs[schema]
    if isinstance(schema, dict):
        return {k: _resolve(v, refs) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_resolve(v, refs) for v in schema]
    return schema


def routes_of(app: Any) -> list[tuple[str, str]]:
    """(method, OpenAPI path) of every route the app serves: HEAD/OPTIONS and handlers
    marked `include_in_schema=False` (the docs page's own files) left out; `/metrics`
    is marked so for Litestar's sake but is documented here."""
    out = []
    for route in app.routes:
        path = openapi_path(route.path)
        for handler in getattr(route, "route_handlers", ()):
            if handler.include_in_schema is False and path != "/metrics":
                continue
            out += [(m, path) for m in sorted(handler.http_methods) if m not in ("HEAD", "OPTIONS")]
    return sorted(set(out))


def structs_in(types: list[type]) -> set[type]:
    """Every Struct type a value of `types` can hold, at any depth."""
    found: set[type] = set()

    def walk(t: Any) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in found:
                return
            found.add(t.cls)
            for f in t.fields:
                walk(f.type)
        for name in ("type", "item_type", "key_type", "value_type"):
            if hasattr(t, name):
                walk(getattr(t, name))
        for inner in getattr(t, "types", ()) + getattr(t, "item_types", ()):
            walk(inner)

    for t in mi.multi_type_info(types):
        walk(t)
    return found


def allow_unknown_fields(ops: list[Op | None], components: dict[str, Any]) -> None:
    """Request components used only by routes that ignore unknown fields (Ollama, TEI)
    say so: without `additionalProperties: false`."""
    def requests(rule: str) -> set[type]:
        return structs_in([t for op in ops if op is not None and op.unknown_fields == rule
                           for t in _types(op.request)])

    for cls in requests("ignored") - requests("refused"):
        components.get(cls.__name__, {}).pop("additionalProperties", None)


def build_document(routes: list[tuple[str, str]]) -> dict[str, Any]:
    ops = [OPERATIONS.get(r) for r in routes]
    types = list(dict.fromkeys(t for op in ops if op is not None
                               for t in _types([op.request, op.reply, op.errors,
                                                op.stream[1] if op.stream else None])))
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    allow_unknown_fields(ops, components)
    refs = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), op in zip(routes, ops):
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, op, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "fleet", "version": __version__,
                 "description": "Serve a fleet of small open models from one box. Bodies are JSON or "
                                "MessagePack (`application/msgpack`); replies follow `Accept`, else the "
                                "request's type. In MessagePack replies a tensor is raw little-endian bytes "
                                "plus `shape` and `dtype`. Off loopback, send `Authorization: Bearer <key>`. "
                                "Routes that change the daemon (the `admin` tag's pin, load and unload; Ollama's "
                                "pull, delete, copy, create, push and blobs) take the operator's admin key "
                                "(`admin.key` in FLEET_HOME) as that bearer token, on loopback too. "
                                "Requests are understood or refused: native, OpenAI and Cohere routes answer 400 "
                                "to an unknown field, naming it and the closest known one; Ollama and TEI routes "
                                "ignore it, as those servers do. Every route answers 400 to a query parameter "
                                "it does not list. A field accepted and not applied, and an "
                                f"ignored unknown one, is named in the `{IGNORED_FIELDS_HEADER}` reply header."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }


def _operation(method: str, path: str, op: Op | None, refs: dict[type, dict]) -> dict[str, Any]:
    params = [{"name": name, "in": "path", "required": True,
               "schema": {"type": "string", "pattern": _PATH_PATTERNS.get(name, NAME_RE.pattern)}}
              for name in _PARAM.findall(path)]
    if op is None:  # not in OPERATIONS: listed, but without shapes (tests/test_openapi.py fails on it)
        return {"summary": "undocumented", "parameters": params, "responses": {"200": {"description": "OK"}}}
    out: dict[str, Any] = {"summary": op.summary, "tags": [op.tag], "operationId": _operation_id(method, path)}
    params += [{"name": name, "in": "query", "required": False, "schema": schema, "description": description}
               for name, schema, description in op.query]
    if params:
        out["parameters"] = params
    if op.request is not None:
        schema = _resolve(op.request, refs)
        out["requestBody"] = {"required": op.body_required,
                              "content": {media: {"schema": schema} for media in op.accepts}}
    ok: dict[str, Any] = {"description": "OK"}
    if op.unknown_fields == "ignored" or op.names_ignored:
        ok["headers"] = {IGNORED_FIELDS_HEADER: {
            "description": "Fields of the request that were not applied (comma-separated paths): unknown ones "
                           "(where this route ignores them) and known ones fleet accepts and does not apply.",
            "schema": {"type": "string"}}}
    if op.request is not None and JSON in op.accepts:
        out["description"] = ("Unknown fields are ignored, as the original server does, and named in "
                              f"`{IGNORED_FIELDS_HEADER}`." if op.unknown_fields == "ignored" else
                              "Unknown fields are refused: 400 naming each and the closest known field.")
    if op.reply is not None:
        ok["content"] = {media: {"schema": _resolve(op.reply, refs)} for media in op.returns}
    if op.stream is not None:
        ok.setdefault("content", {})[op.stream[0]] = {
            "schema": _resolve(op.stream[1], refs),
            "description": "With `stream: true`: one piece per event (SSE `data:` line) or per NDJSON line."}
    error = {"description": "The error, in the contract's shape",
             "content": {JSON: {"schema": _resolve(op.errors, refs)}}}
    out["responses"] = {**{status: ok for status in op.success}, "4XX": error, "5XX": error}
    return out


def _operation_id(method: str, path: str) -> str:
    return method.lower() + re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_")


# ---- the docs page ------------------------------------------------------------------------

#: Files of swagger-ui-py the page needs (served from its package folder, never a CDN).
UI_FILES = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css"}


def ui_folder() -> Path | None:
    """swagger-ui-py's static folder, found without importing the package (it imports jinja2)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if all((folder / name).is_file() for name in UI_FILES) else None


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fleet API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui", deepLinking: true});</script>
</body></html>
"""

NO_UI_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fleet API</title></head>
<body><h1>fleet API</h1>
<p>The interactive docs need the <code>swagger-ui-py</code> package, which is not installed here
(<code>pip install swagger-ui-py</code>); this daemon loads nothing from the internet.</p>
<p>The OpenAPI 3.1 document: <a href="/openapi.json">/openapi.json</a>.</p>
</body></html>
"""
