"""Cohere's embed API on fleet's port: `POST /v2/embed`, and the v1 body on `POST /v1/embed`.

`cohere.ClientV2(base_url=...).embed(...)` and `cohere.Client(...).embed(...)`
work unchanged. Each request runs as the native one (`daemon.tasks.embed`):

* `input_type` (search_query, search_document, classification, clustering)
  picks the model's own prompt for it (`COHERE_PROMPTS`, best first; the
  first name with a non-empty prompt wins). A model with no prompt for it
  embeds the text as sent, and the reply says so in `X-Fleet-Ignored-Fields`.
  `prompt_name` / `prompt` (fleet's) win over `input_type`.
* `embedding_types`: float (the default), int8, uint8, binary, ubinary,
  base64 (the float32 bytes, little-endian, base64). One type is made by the
  worker (`output_dtype`); several are made here from one float32 answer, with
  the same rule (`fleet.vectors.quantize`). Replies carry them under
  `embeddings.<type>`, integers in JSON, as Cohere does.
* `output_dimension` is the native `dimensions`; `truncate` END (the default)
  cuts long texts at the model's limit, NONE refuses them (`input_too_long`),
  START is refused (fleet cuts on the right).
* `max_tokens`, `images` and `inputs` are refused (`unsupported`); `priority`
  is accepted and not applied (named in `X-Fleet-Ignored-Fields`).

`POST /v1/embed` is fleet's native route; a body with Cohere's `texts` and no
`inputs` (a field the native route does not have) is a Cohere v1 request and is
answered in Cohere's v1 shape (`response_type` `embeddings_floats`, or
`embeddings_by_type` when `embedding_types` is given). Any other body is native.
"""

from __future__ import annotations

import base64
import secrets

import msgspec
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest, Unsupported
from fleet.protocol import EmbedRequest
from fleet.vectors import quantize

from fleet.daemon import codec, fields, tasks
from fleet.daemon.defaults import default_model
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply

#: Cohere `input_type` -> the prompt names it means, best first.
COHERE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query", "retrieval.query"),
    "search_document": ("search_document", "document", "passage", "corpus", "retrieval.passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
#: What `embedding_types` may ask: fleet's output dtypes (Cohere's `float` is float32) and base64.
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
TRUNCATE = {"END": True, "NONE": False}


class CohereEmbedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v2/embed` (and the v1 body): Cohere's fields, plus fleet's `prompt_name`, `prompt`, `timeout_ms`.
    Unknown fields are refused, naming the closest known one (as on `/v2/rerank`)."""

    texts: list[str] | None = None
    model: str = ""
    input_type: str | None = None
    embedding_types: list[str] | None = None
    truncate: str = "END"
    output_dimension: int | None = None
    max_tokens: int | None = None
    images: list[str] | None = None
    inputs: list[dict] | None = None
    priority: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    timeout_ms: int | None = None


class CohereEmbeddings(msgspec.Struct, frozen=True, omit_defaults=True, rename={"floats": "float"}):
    """One list per asked type, each with one row per text (`float` is Cohere's name for float32)."""

    floats: list[list[float]] | None = None
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedVersion(msgspec.Struct, frozen=True):
    version: str


class CohereEmbedBilled(msgspec.Struct, frozen=True):
    input_tokens: int


class CohereEmbedMeta(msgspec.Struct, frozen=True):
    api_version: CohereEmbedVersion
    billed_units: CohereEmbedBilled


class CohereEmbedReply(msgspec.Struct, frozen=True):
    """`POST /v2/embed` (and v1 with `embedding_types`) as Cohere answers it."""

    id: str
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereEmbedMeta
    response_type: str = "embeddings_by_type"


class CohereEmbedFloatsReply(msgspec.Struct, frozen=True):
    """Cohere v1 without `embedding_types`: one float list per text."""

    id: str
    embeddings: list[list[float]]
    texts: list[str]
    meta: CohereEmbedMeta
    response_type: str = "embeddings_floats"


class _Keys(msgspec.Struct):
    """Which of `texts` and `inputs` a JSON body has (other fields ignored)."""

    texts: msgspec.Raw = msgspec.UNSET
    inputs: msgspec.Raw = msgspec.UNSET


def v1_body(body: bytes) -> CohereEmbedRequest | None:
    """The Cohere v1 request a JSON body of `POST /v1/embed` is (it has `texts` and no
    `inputs`; read strictly then), or None (a native body, or not JSON)."""
    try:
        keys = msgspec.json.decode(body, type=_Keys)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not JSON, or nested past any request: the native route says so
    if keys.texts is msgspec.UNSET or keys.inputs is not msgspec.UNSET:
        return None
    return codec.decode(body, CohereEmbedRequest, msgpack=False)


async def answer(daemon: Daemon, creq: CohereEmbedRequest, version: str) -> tuple[object, dict[str, str]]:
    """The Cohere reply (v1 or v2) to `creq` and its headers."""
    ignored = check(creq)
    if creq.texts is None:
        raise BadRequest("`texts` is missing: send the texts to embed", param="texts")
    model = creq.model or default_model(daemon, "embed")
    types = creq.embedding_types or ["float"]
    unknown = [t for t in types if t not in EMBEDDING_TYPES]
    if unknown:
        raise BadRequest(f"embedding_types {unknown} are not known: use {', '.join(EMBEDDING_TYPES)}",
                         param="embedding_types")
    prompt_name, more = tasks.mapped_prompt(daemon, model, "input_type", creq.input_type, COHERE_PROMPTS,
                                            creq.prompt, creq.prompt_name)
    # One type (not base64): the worker makes it; several: one float32 answer, converted here.
    one = types[0] if len(set(types)) == 1 and types[0] != "base64" else "float"
    req = EmbedRequest(model=model, inputs=creq.texts, truncate=TRUNCATE[creq.truncate],
                       prompt_name=prompt_name, prompt=creq.prompt, dimensions=creq.output_dimension,
                       output_dtype="float32" if one == "float" else one, timeout_ms=creq.timeout_ms)
    res, done = await tasks.embed(daemon, req, codec.encode_msgpack(req))
    vectors = tasks.vectors(res)
    by_type: dict[str, object] = {}
    for t in dict.fromkeys(types):
        if t == "base64":
            by_type[t] = [base64.b64encode(row.tobytes()).decode() for row in vectors]
        else:
            dtype = "float32" if t == "float" else t
            by_type["floats" if t == "float" else t] = (vectors if dtype == res.dtype else
                                                        quantize(vectors, dtype)).tolist()
    meta = CohereEmbedMeta(CohereEmbedVersion(version), CohereEmbedBilled(res.input_tokens))
    headers = {**answer_headers(done), **fields.ignored_header([*ignored, *more, *tasks.ignored_fields(req)])}
    if version == "1" and creq.embedding_types is None:
        return CohereEmbedFloatsReply(secrets.token_hex(16), by_type["floats"], creq.texts, meta), headers
    return CohereEmbedReply(secrets.token_hex(16), CohereEmbeddings(**by_type), creq.texts, meta), headers


async def exchange_v1(daemon: Daemon, creq: CohereEmbedRequest, *, msgpack_out: bool) -> tuple[bytes, dict[str, str]]:
    """A Cohere v1 body posted to `POST /v1/embed`: the reply body and headers."""
    out, headers = await answer(daemon, creq, "1")
    return codec.encode(out, msgpack=msgpack_out), headers


def check(creq: CohereEmbedRequest) -> list[str]:
    """Refuse what fleet does not do; the fields accepted but not applied."""
    if creq.images or creq.inputs:
        field = "images" if creq.images else "inputs"
        raise Unsupported(f"{field}: fleet's Cohere route embeds `texts`; send images to POST /v1/embed",
                          param=field)
    if creq.max_tokens is not None:
        raise Unsupported("max_tokens: fleet cuts texts at the model's own limit (truncate END)",
                          param="max_tokens")
    if creq.truncate not in TRUNCATE:
        if creq.truncate == "START":
            raise Unsupported("truncate START: fleet cuts long texts at their end (END), or refuses them (NONE)",
                              param="truncate")
        raise BadRequest(f"truncate must be NONE, START or END, not {creq.truncate!r}", param="truncate")
    return ["priority"] if creq.priority is not None else []


class CohereEmbedController(Controller):
    tags = ["cohere"]

    @post("/v2/embed", status_code=200)
    async def embed_v2(self, request: Request, daemon: Daemon) -> Response:
        creq = codec.decode(await request.body(), CohereEmbedRequest, msgpack=body_is_msgpack(request))
        out, headers = await answer(daemon, creq, "2")
        return reply(request, out, headers=headers)
