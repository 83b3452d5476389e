"""Contract types for the HTTP API (DESIGN.md, "Names fixed for clients").

Shared by the daemon (decode requests, encode replies) and the Python client.
Requests are plain msgspec Structs so decoding validates types in one pass; a
request decoded from a MessagePack body is forwarded to the worker as the very
same bytes (no re-encoding). Request Structs forbid unknown fields (STYLE.md 10a):
a misspelled field is refused while decoding, at no cost to a well-formed
request; daemon.fields names it and the closest known one.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorReply(msgspec.Struct, frozen=True):
    error: ErrorBody


class OpenAIErrorBody(msgspec.Struct, frozen=True):
    """The error body on OpenAI-shaped routes: the contract's `code` and `message`
    plus OpenAI's `type` and `param` (the field at fault, or null)."""

    code: str
    message: str
    type: str
    param: str | None = None


class OpenAIErrorReply(msgspec.Struct, frozen=True):
    error: OpenAIErrorBody


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int = 0
    output_tokens: int = 0


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


# ---- /v1/generate, OpenAI /v1/completions and /v1/chat/completions -------------

class FunctionDef(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A tool the model may call: its name, what it does, and its arguments' JSON Schema
    (an object; none: no arguments). `strict` is OpenAI's: fleet always holds a
    constrained call to the schema (fleet.tools)."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One of `tools` (OpenAI's chat shape; Ollama's is the same)."""

    function: FunctionDef
    type: Literal["function"] = "function"


class FunctionName(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`tool_choice` naming one function: the model calls it (OpenAI's shape)."""

    function: FunctionName
    type: Literal["function"] = "function"


#: "none": no call; "auto": text or calls, as the model chooses; "required": one call or
#: more; a NamedToolChoice: that function. With "required" or a name, decoding is held to
#: the call format and the tools' schemas; with "auto", to text or such calls.
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, frozen=True):
    """A call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool call of an assistant message, in history or in a reply (OpenAI's shape)."""

    function: FunctionCall
    id: str = ""
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A chat turn: `role` and `content`; an assistant turn's `tool_calls`; a `tool`
    turn's `tool_call_id` and the function's `name` (what the model's chat template reads)."""

    role: str
    #: Text, or OpenAI content parts (only `{"type": "text", "text": ...}` parts are taken).
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


#: Structured output of a generation: "json" = the text is one JSON object; a
#: dict = a JSON Schema the text must match. Enforced while decoding (a grammar
#: masks the tokens that cannot continue valid output), not checked afterwards.
GenerateFormat = Literal["json"] | dict


#: An answer with no `max_tokens` of its client's: admission counts it as its prompt and this
#: many tokens, and the worker reserves key/value cache for this many tokens past what the
#: sequence holds, growing the reserve by as much each time the sequence reaches it
#: (runtimes.generate). The answer itself runs until the model stops or its context is full.
ANSWER_RESERVE_TOKENS = 512


class GenerateRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One generation: a `prompt`, or chat `messages` rendered with the model's
    chat template. `model` may name a LoRA adapter directly, or the base with
    the adapter in `adapter`. `max_tokens` None: until the model stops or its
    context is full (as OpenAI and Ollama do; the reply's `length_limit` says
    when a server limit ended it). `temperature` 0 is greedy; `seed` makes sampling
    reproducible; the text is cut before the first `stop` string. `format`
    constrains the output (GenerateFormat); `logprobs` returns each generated
    token's log-probability and, with `top_logprobs` = k, the k most likely
    tokens at each step."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    adapter: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    timeout_ms: int | None = None
    format: GenerateFormat | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    #: The text must match this regular expression (enforced while decoding, as `format`;
    #: TGI's `grammar` of type regex). Not with `format`.
    regex: str | None = None
    #: Functions the model may call (chat `messages` only), rendered by the model's chat
    #: template and parsed in its family's format (fleet.tools); `tool_choice` None is
    #: "auto" with tools. `parallel_tool_calls` false: one call at most.
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class TopLogprob(msgspec.Struct, frozen=True):
    """A likely token at one step (OpenAI's shape): its text (a partial UTF-8
    character shows as U+FFFD), its exact UTF-8 bytes, its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token with `logprobs`: OpenAI's chat shape (also the native one).
    The log-probabilities are those of the distribution the token was picked
    from: after a `format` grammar's mask, before temperature and top-p."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class GenerateReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """`length_limit`: the server's limit that ended the text (finish_reason `length`
    with no `max_tokens` of the client's, or one past it): "context" (the model's
    context is full) or "memory" (its key/value cache found no room to grow)."""

    model: str
    text: str
    finish_reason: str  # stop | length | tool_calls
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    length_limit: str | None = None
    #: The calls the model made (`finish_reason` "tool_calls"); `text` is what it wrote beside them.
    tool_calls: list[ToolCall] | None = None


class GenerateChunkReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """One server-sent event of a native stream: text deltas (with the logprobs
    of the tokens they complete), then one with `finish_reason` and `usage`."""

    model: str
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    length_limit: str | None = None
    tool_calls: list[ToolCall] | None = None


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: One more event before `[DONE]`: `choices: []` and the usage of the whole request.
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI `response_format.json_schema`: the output must match `schema`."""

    name: str = ""
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI `response_format`: `text`, `json_object` (one JSON object) or
    `json_schema`; enforced while decoding (GenerateRequest.format). TGI's kinds too:
    `{"type": "json_object" | "json", "value": schema}` (huggingface_hub's
    chat_completion sends its schema so) and `{"type": "regex", "value": pattern}`."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: Any = None


class CompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI `/v1/completions`. Fields fleet does not implement (`echo`,
    `best_of`, `suffix`, `logit_bias`, penalties, `n` > 1) are refused by name
    when they ask for something, never ignored; `user` is accepted and named in
    `X-Fleet-Ignored-Fields`."""

    model: str
    prompt: str | list[str]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None
    #: The legacy API's top-k count (0-5): each token's logprob and the k most likely.
    logprobs: int | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class OpenAIChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A message of OpenAI `/v1/chat/completions`: `role` and `content` go to the
    model's chat template; `name` and `refusal` are accepted and named in
    `X-Fleet-Ignored-Fields`; tool calls and audio are refused (no tool calling)."""

    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    audio: dict | None = None


class ChatCompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI `/v1/chat/completions`. Tool calling (`tools`, `tool_choice`,
    `functions`, `function_call`), `logit_bias`, penalties, audio output,
    reasoning and verbosity controls, web search, moderation, `store` and
    `n` > 1 are refused by name when they ask for something, never ignored;
    `user`, `metadata`, `service_tier`, the prompt-cache hints,
    `safety_identifier` and `parallel_tool_calls` are accepted and named in
    `X-Fleet-Ignored-Fields`."""

    model: str
    messages: list[OpenAIChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None


class OpenAICompletionUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, frozen=True):
    """The legacy completions shape: per token its text, logprob, the top ones as
    {token: logprob}, and its character offset in the generated text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionReply(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAICompletionUsage | None = None
    object: str = "text_completion"


class AssistantMessage(msgspec.Struct, frozen=True):
    """`content` is null when the model only called tools (as OpenAI answers)."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(msgspec.Struct, frozen=True):
    """`length_limit` (fleet's, only when one applies): the server limit that ended the
    text, as GenerateReply's."""

    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    length_limit: str | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionReply(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAICompletionUsage
    object: str = "chat.completion"


class FunctionDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """A streamed piece of the `index`-th call: its id, type and name on the first one."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    length_limit: str | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    #: Only on the last event, with `stream_options.include_usage` (`choices` is then empty).
    usage: OpenAICompletionUsage | None = None
    object: str = "chat.completion.chunk"
