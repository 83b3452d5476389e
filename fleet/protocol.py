"""Contract types for the HTTP API (DESIGN.md, "Names fixed for clients").

Shared by the daemon (decode requests, encode replies) and the Python client.
Requests are plain msgspec Structs so decoding validates types in one pass; a
request decoded from a MessagePack body is forwarded to the worker as the very
same bytes (no re-encoding). Request Structs forbid unknown fields (STYLE.md 10a):
a misspelled field is refused while decoding, at no cost to a well-formed
request; daemon.fields names it and the closest known one.

The rooms: this module holds the encoder tasks' types (embed, rerank, classify,
extract) and the model views; fleet/protocol_generate.py generation's;
fleet/protocol_common.py the error body and usage both use. Every name of the three is
importable from here.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fleet.protocol_common import ErrorBody, ErrorReply, OpenAIErrorBody, OpenAIErrorReply, Usage  # noqa: F401
from fleet.protocol_generate import (  # noqa: F401  (re-exported: the contract is imported from here)
    ANSWER_RESERVE_TOKENS, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionReply,
    ChatCompletionRequest, ChatDelta, ChatLogprobs, ChatMessage, CompletionChoice, CompletionLogprobs,
    CompletionReply, CompletionRequest, FunctionCall, FunctionDef, FunctionDelta, FunctionName, GenerateChunkReply,
    GenerateFormat, GenerateReply, GenerateRequest, JsonSchemaFormat, NamedToolChoice, OpenAIChatMessage,
    OpenAICompletionUsage, ResponseFormat, StreamOptions, TokenLogprob, ToolCall, ToolCallDelta, ToolChoice, ToolDef,
    TopLogprob)


# ---- /v1/embed -------------------------------------------------------------

class ImageInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An image item of `/v1/embed` `inputs`: the encoded file (PNG, JPEG, WebP, ...)
    as MessagePack bin. It travels to the worker as sent; only the worker decodes it."""

    image: bytes


class ImageInputJson(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`ImageInput` in a JSON body: base64, or a data URL (`data:image/png;base64,...`)."""

    image: str


#: What `/v1/embed` returns per input: one vector (dense), SPLADE term weights
#: (sparse: `{indices, values}`), or one vector per token (tokens, ColBERT-style).
EmbedOutput = Literal["dense", "sparse", "tokens"]

#: The values of dense vectors (fleet.vectors): float32 as computed, float16, int8 and
#: uint8 on the fixed range [-1, 1] (unit vectors only), binary and ubinary one bit per
#: dimension (x > 0), packed eight to a byte.
EmbedDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]


class EmbedRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """`inputs` items are texts or `{image: bytes}` (image models only).

    A `str | Struct` union: msgspec tells the two apart by MessagePack type (str
    vs map), so decoding a text-only body costs what `list[str]` costs.
    `normalize` applies to dense and per-token vectors (each token's vector is
    cut to unit length); sparse weights are returned as the model gives them,
    cut to the `top_k` largest per input when asked.
    `model` may be left out where the task has a default (config `default_models`,
    else the only stored embedding model).
    """

    model: str = ""
    inputs: list[str | ImageInput] = []
    normalize: bool = True
    truncate: bool = True
    output: EmbedOutput = "dense"
    top_k: int | None = None
    timeout_ms: int | None = None
    #: The instruction before every input: one of the model's prompt names, or the
    #: text itself (`prompt` wins; `prompt: ""` is none). Neither: the model's default prompt.
    prompt_name: str | None = None
    prompt: str | None = None
    #: Matryoshka: keep the first `dimensions` values of each vector (then normalise).
    dimensions: int | None = None
    output_dtype: EmbedDtype = "float32"
    #: A LoRA adapter of `model` to embed with (or name the adapter as `model`).
    adapter: str | None = None


class EmbedRequestJson(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """`EmbedRequest` as a JSON body spells it (images as base64 text)."""

    model: str = ""
    inputs: list[str | ImageInputJson] = []
    normalize: bool = True
    truncate: bool = True
    output: EmbedOutput = "dense"
    top_k: int | None = None
    timeout_ms: int | None = None
    #: The instruction before every input: one of the model's prompt names, or the
    #: text itself (`prompt` wins; `prompt: ""` is none). Neither: the model's default prompt.
    prompt_name: str | None = None
    prompt: str | None = None
    #: Matryoshka: keep the first `dimensions` values of each vector (then normalise).
    dimensions: int | None = None
    output_dtype: EmbedDtype = "float32"
    #: A LoRA adapter of `model` to embed with (or name the adapter as `model`).
    adapter: str | None = None


class EmbedReplyMsgpack(msgspec.Struct, frozen=True):
    """The vectors as raw little-endian bytes of `dtype`, `shape` = [inputs, values
    per row]: for binary and ubinary a row is ceil(dimensions / 8) bytes, so
    `dimensions` (the vector's own length) says how many of its bits count."""

    model: str
    embeddings: bytes | msgspec.Raw
    shape: tuple[int, int]
    usage: Usage
    dtype: str = "float32"
    dimensions: int | None = None


class EmbedReplyJson(msgspec.Struct, frozen=True):
    """As the MessagePack reply, with the vectors as lists: numbers for float32 and
    float16, integers for int8, uint8 and the packed bytes of binary and ubinary."""

    model: str
    embeddings: list[list[float]]
    shape: tuple[int, int]
    usage: Usage
    dtype: str = "float32"
    dimensions: int | None = None


class EmbedTokensReplyMsgpack(msgspec.Struct, frozen=True):
    """`output: "tokens"`: one float32 block (raw little-endian, C order) per input,
    `shapes[i] = [tokens of input i, d]` (padding excluded, special tokens kept)."""

    model: str
    embeddings: list[bytes] | msgspec.Raw
    shapes: list[tuple[int, int]]
    usage: Usage
    dtype: str = "float32"


class EmbedTokensReplyJson(msgspec.Struct, frozen=True):
    model: str
    embeddings: list[list[list[float]]]
    shapes: list[tuple[int, int]]
    usage: Usage


class SparseVector(msgspec.Struct, frozen=True):
    """One input's SPLADE weights: vocabulary ids, ascending, and their weights
    (all non-zero ones, or the `top_k` largest). MessagePack: int32 and float32
    little-endian bytes; JSON: lists."""

    indices: bytes | list[int]
    values: bytes | list[float]


class EmbedSparseReply(msgspec.Struct, frozen=True):
    """`output: "sparse"`; `dimension` is the vocabulary size (ids are below it)."""

    model: str
    embeddings: list[SparseVector] | msgspec.Raw
    dimension: int
    usage: Usage


# ---- OpenAI /v1/embeddings --------------------------------------------------

class OpenAIEmbeddingsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`input`: a text, texts, one text as token ids, or several as id lists (the
    ids read in the model's own vocabulary); mixed lists are refused. `user` is
    accepted and named in `X-Fleet-Ignored-Fields`.

    Beyond OpenAI's fields (the openai SDK sends them with `extra_body`):
    fleet's `prompt_name`, `prompt` and `output_dtype` (with `encoding_format`
    float only: base64 is read as float32 by OpenAI clients), and Jina's `task`
    (mapped to the model's prompt of that meaning)."""

    model: str = ""
    input: str | list[str | int | list[int]] = []
    encoding_format: str = "float"  # float | base64
    dimensions: int | None = None
    user: str | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    task: str | None = None
    output_dtype: EmbedDtype = "float32"


class OpenAIEmbedding(msgspec.Struct, frozen=True):
    embedding: list[float] | str
    index: int
    object: str = "embedding"


class OpenAIUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingsReply(msgspec.Struct, frozen=True):
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage
    object: str = "list"


# ---- models -----------------------------------------------------------------

class ModelCard(msgspec.Struct, frozen=True):
    """An OpenAI model object (`id`, `object`, `created`: Unix seconds of the pull,
    `owned_by`) with fleet's own fields after it."""

    id: str
    created: int
    task: str
    runtime: str
    object: str = "model"
    owned_by: str = "fleet"
    loaded: bool = False
    pinned: bool = False
    #: What it can do (fleet.tools.capabilities): embed, rerank, classify, extract, decide;
    #: a generator: completion, chat (it has a chat template), tools (its template can
    #: express them); vision (it takes images).
    capabilities: list[str] = []
    #: Decision models: their temperatures and where they came from (ProfileView's
    #: fields): a worker's live ones when one holds the model, else what its next load
    #: takes from the catalog (`temperatures_live` says which). Absent for other tasks.
    decide_temperatures: dict[str, float] | msgspec.UnsetType = msgspec.UNSET
    calibration: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    temperatures_live: bool | msgspec.UnsetType = msgspec.UNSET
    #: An alias (fleet.aliases): the stored version it points at now, and a canary's
    #: candidate with its share of clients; `id` is the alias, the rest the version's.
    alias_of: str | msgspec.UnsetType = msgspec.UNSET
    canary: str | msgspec.UnsetType = msgspec.UNSET
    canary_percent: float | msgspec.UnsetType = msgspec.UNSET


class ProfileView(msgspec.Struct, frozen=True):
    """A live serving profile: the worker and device running it, the profile's name
    (a tuned device class or "default"), its settings, and each setting's source
    (shipped, tuned, config, manifest or default: fleet.catalog.PROFILE_SOURCES)."""

    worker: int
    device: str
    name: str
    settings: dict[str, Any]
    sources: dict[str, str]
    #: Decision models: the live temperatures (`kind:bucket` -> T; a key not listed is
    #: 1.0) and where they came from (fleet.calibration.Calibration without them; null:
    #: never calibrated). Absent for other tasks.
    decide_temperatures: dict[str, float] | msgspec.UnsetType = msgspec.UNSET
    calibration: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET


class ModelDetail(ModelCard, frozen=True):
    """`GET /v1/models/{id}`: the model card and the live serving profile of each worker
    that holds the model (empty when none does)."""

    profiles: list[ProfileView] = []


class DecisionModelCard(msgspec.Struct, frozen=True):
    """A model `POST /v1/systemone` takes, as System One lists it: its name, what it is,
    and the date it was pulled (YYYY-MM-DD)."""

    name: str
    description: str
    release_date: str


class ModelList(msgspec.Struct, frozen=True):
    """OpenAI's list (`data`), and System One's (`models`: the decision models and the
    `jev-latest` alias when it names one; left out on a box without decision models);
    each client reads its own key."""

    data: list[ModelCard]
    object: str = "list"
    models: list[DecisionModelCard] | msgspec.UnsetType = msgspec.UNSET


# ---- /v1/rerank ---------------------------------------------------------------

class RerankDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A document as Cohere and Jina spell it, in requests and in results."""

    text: str


class RerankRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Score `documents` against `query` with a cross-encoder; best first.

    Documents are strings or `{text}` objects. Also takes the TEI spelling:
    `texts` for `documents`, `raw_scores`, and `return_text` (the documents come
    back as `text`). `top_n` and `return_documents` are Cohere's and Jina's.
    """

    model: str = ""
    query: str = ""
    documents: list[str | RerankDocument] | None = None
    texts: list[str] | None = None
    top_n: int | None = None
    return_documents: bool = False
    return_text: bool = False
    #: The model's logit instead of its activation (sigmoid unless the model says otherwise).
    raw_scores: bool = False
    truncate: bool = True
    timeout_ms: int | None = None
    #: LLM rerankers (runtime llm-rerank) only: the task instruction their prompt
    #: carries, instead of the model's default; a cross-encoder refuses it.
    instruction: str | None = None
    #: Cohere's: documents are ranked on their `text` only, and no relevant spans are
    #: found; asking otherwise is refused (`unsupported`), never silently ignored.
    rank_fields: list[str] | None = None
    relevant_spans: dict | None = None
    #: Cohere's, accepted and named in `X-Fleet-Ignored-Fields`: documents are cut at
    #: the model's own length, and requests have no priorities.
    max_tokens_per_doc: int | None = None
    max_chunks_per_doc: int | None = None
    priority: int | None = None
    #: A LoRA adapter of `model` to score with (or name the adapter as `model`).
    adapter: str | None = None

    @property
    def docs(self) -> list[str]:
        """The documents' texts, whichever name carried them (the daemon refuses both or neither)."""
        if self.documents is None:
            return self.texts or []
        return [d if d.__class__ is str else d.text for d in self.documents]


class RerankHit(msgspec.Struct, frozen=True, omit_defaults=True):
    """One ranked document: `relevance_score` is Cohere's and Jina's name for `score`
    (the same number); `document` with `return_documents`, `text` with `return_text`."""

    index: int
    relevance_score: float
    score: float
    document: RerankDocument | None = None
    text: str | None = None


class RerankReply(msgspec.Struct, frozen=True):
    model: str
    results: list[RerankHit]
    usage: Usage


class CohereApiVersion(msgspec.Struct, frozen=True):
    version: str


class CohereBilledUnits(msgspec.Struct, frozen=True):
    search_units: int


class CohereMeta(msgspec.Struct, frozen=True):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits


class CohereRerankReply(msgspec.Struct, frozen=True):
    """`POST /v2/rerank` as Cohere answers it (plus fleet's `model` and `usage`)."""

    id: str
    results: list[RerankHit]
    meta: CohereMeta
    model: str
    usage: Usage


# ---- /v1/classify ---------------------------------------------------------------

class ClassifyRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str = ""
    inputs: list[str] = []
    #: Labels per input, best first; None = all of the model's labels.
    top_k: int | None = None
    #: Sigmoid per label instead of softmax over labels; None = as the model's config says.
    multi_label: bool | None = None
    #: Logits instead of probabilities.
    raw_scores: bool = False
    truncate: bool = True
    timeout_ms: int | None = None
    #: A LoRA adapter of `model` to classify with (or name the adapter as `model`).
    adapter: str | None = None
    #: Zero-shot: score these labels instead of the model's own (an NLI model only: daemon.zero_shot).
    candidate_labels: list[str] | None = None
    #: Zero-shot: the hypothesis each candidate label is put in, at its `{}` (None: fleet.nli.DEFAULT_HYPOTHESIS).
    hypothesis_template: str | None = None


class LabelScore(msgspec.Struct, frozen=True):
    label: str
    score: float


class ClassifyReply(msgspec.Struct, frozen=True):
    model: str
    results: list[list[LabelScore]]
    usage: Usage


# ---- /v1/extract ----------------------------------------------------------------

class ExtractRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str = ""
    inputs: list[str] = []
    #: Entity types to look for: only zero-shot extraction models take them; a
    #: token-classification model tags its own fixed labels and refuses this.
    labels: list[str] | None = None
    truncate: bool = True
    timeout_ms: int | None = None
    #: A LoRA adapter of `model` to tag with (or name the adapter as `model`).
    adapter: str | None = None


class Entity(msgspec.Struct, frozen=True):
    """One entity span; `start`/`end` are character offsets into the input as sent."""

    entity: str
    text: str
    start: int
    end: int
    score: float


class ExtractReply(msgspec.Struct, frozen=True):
    model: str
    results: list[list[Entity]]
    usage: Usage
