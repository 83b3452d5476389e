"""One function per task: check the native request, submit it to the daemon, decode
the worker's result.

Every route of a task ends here, whatever its wire shape (native, OpenAI, Ollama,
TEI, Cohere): a controller decodes its peer's request into the native one
(`fleet.protocol`), calls the task's function, and shapes what comes back into its
peer's reply. Checks that hold for every shape (input counts, `top_k`, generation
limits) and the batch-budget token estimates live here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from fleet.decisions import DecideRequest, DecideResult
from fleet.errors import BadRequest, ModelNotFound, PayloadTooLarge, Unsupported
from fleet.prompts import first_prompt, folder_prompts, prompt_table, resolve_prompt
from fleet.tools import check_tools
from fleet.vectors import SCALAR, from_wire
from fleet.messages import (
    ClassifyResult, EmbedResult, EmbedResultRaw, ExtractResult, GenerateResult, RerankResult,
    SparseEmbedResult, SparseEmbedResultRaw, TokenEmbedResult, TokenEmbedResultRaw,
)
from fleet.messages import TokenLogprob as WireLogprob
from fleet.protocol import (
    ANSWER_RESERVE_TOKENS, ClassifyRequest, EmbedRequest, Entity, ExtractRequest, GenerateRequest, ImageInput,
    LabelScore, RerankDocument, RerankHit, RerankRequest, TokenLogprob, TopLogprob, Usage,
)

from fleet.daemon import zero_shot
from fleet.daemon.aliases import resolved
from fleet.daemon.broker import Answer
from fleet.daemon.core import Daemon
from fleet.daemon.pieces import MIN_PIECE_TOKENS, check_ceiling, joined, text_costs

#: Batch-budget tokens an image costs (a ViT-B/16 at 224 px sees 197 patches;
#: the worker counts exactly, this only sizes batches).
IMAGE_TOKENS = 256
#: Upper bound checked here; the worker checks the model's own (prompt + max_tokens <= its context).
MAX_TOKENS_LIMIT = 1 << 20
#: Names the server limit that ended a reply's text (`length_limit_headers`).
LENGTH_LIMIT_HEADER = "X-Fleet-Length-Limit"
MAX_STOPS = 8
#: Most likely tokens per step: chat and native `top_logprobs` (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

#: Most tokens in a piece of a request for a model only another box stores (its profile's default).
MAX_PIECE_TOKENS = 16384
_encode = msgspec.msgpack.Encoder().encode

#: `output` -> decoder of the worker's embed result; the `_RAW` ones leave the tensor
#: bytes undecoded (msgspec.Raw) for MessagePack replies, which splice them in as they came.
_EMBED = {"dense": msgspec.msgpack.Decoder(EmbedResult), "tokens": msgspec.msgpack.Decoder(TokenEmbedResult),
          "sparse": msgspec.msgpack.Decoder(SparseEmbedResult)}
_EMBED_RAW = {"dense": msgspec.msgpack.Decoder(EmbedResultRaw), "tokens": msgspec.msgpack.Decoder(TokenEmbedResultRaw),
              "sparse": msgspec.msgpack.Decoder(SparseEmbedResultRaw)}
_rerank = msgspec.msgpack.Decoder(RerankResult)
_classify = msgspec.msgpack.Decoder(ClassifyResult)
_extract = msgspec.msgpack.Decoder(ExtractResult)
_generate = msgspec.msgpack.Decoder(GenerateResult)
_decide = msgspec.msgpack.Decoder(DecideResult)
#: Options a question lists under it and reads from single-token labels
#: (runtimes/adapters/decide.py); a question with more reads a row per option.
LISTED_OPTIONS = 26


# ---- shared checks and estimates ---------------------------------------------------------

def check_inputs(daemon: Daemon, inputs: list[Any]) -> None:
    if not inputs:
        raise BadRequest("`inputs` is empty: send at least one text")
    if len(inputs) > daemon.settings.max_inputs:
        raise BadRequest(f"{len(inputs)} inputs is more than the limit of {daemon.settings.max_inputs} per request")


def estimate_tokens(payload: bytes | memoryview, texts: int) -> int:
    """Token estimate for batch budgets: ~4 bytes of UTF-8 per token plus two
    special tokens per text. Workers count exactly; this only sizes batches."""
    return len(payload) // 4 + 2 * texts


def embed_tokens(req: EmbedRequest, payload: bytes | memoryview) -> int:
    """Batch-budget tokens: texts from the payload size (`estimate_tokens`); with
    images, texts by their characters and each image as IMAGE_TOKENS."""
    images = sum(1 for x in req.inputs if x.__class__ is ImageInput)
    if not images:
        return estimate_tokens(payload, len(req.inputs))
    chars = sum(len(x) for x in req.inputs if x.__class__ is str)
    return chars // 4 + 2 * (len(req.inputs) - images) + IMAGE_TOKENS * images


# ---- large requests as pieces (daemon.pieces) --------------------------------------------------

async def submit_inputs(daemon: Daemon, task: str, model: str, req: Any, field: str, payload: bytes, tokens: int,
                        costs: Callable[[int | None], np.ndarray], **piece_fields: Any) -> list[tuple[int, Answer]]:
    """Queue a request over many inputs (its `field`): as one item, or, when the model
    would read more tokens than one batch's work (`Sizing.whole`), as pieces of
    consecutive inputs (daemon.pieces), each the request with its slice of `field`
    (and `piece_fields`).
    (first input, answer) per item, in input order. `tokens` is the cheap estimate
    (bytes, `estimate_tokens`: never below what `costs(cap)` sums to); `costs(cap)`
    gives the tokens per input, `cap` being the model's max_seq_len (None: unknown)
    when it cuts. Refused at once past `max_request_tokens` (`check_ceiling`), and, one
    cut into pieces, past what its model reads here within its deadline
    (`Daemon.check_deadline`)."""
    timeout_ms = req.timeout_ms
    if tokens <= MIN_PIECE_TOKENS:  # a small request: no per-input work (the lone client's path)
        return [(0, await daemon.submit(task, model, payload, tokens=tokens, timeout_ms=timeout_ms))]
    manifest = local_manifest(daemon, model, task)
    most = manifest.profile.max_batch_tokens if manifest is not None else MAX_PIECE_TOKENS
    limit = daemon.settings.max_request_tokens
    budget = daemon.whole_budget(model, task, most)
    if tokens <= budget and not 0 < limit < tokens:
        return [(0, await daemon.submit(task, model, payload, tokens=tokens, timeout_ms=timeout_ms))]
    # Without truncation an input over max_seq_len is refused by the worker (422
    # input_too_long, before tokenizing), whatever its length: it counts as one token more.
    cap = manifest.max_seq_len if manifest is not None else None
    if cap and not getattr(req, "truncate", True):
        cap += 1
    per_input = costs(cap)
    total = int(per_input.sum())
    check_ceiling(model, total, limit)
    if total <= budget or len(per_input) < 2:
        return [(0, await daemon.submit(task, model, payload, tokens=total, timeout_ms=timeout_ms))]
    daemon.check_deadline(model, task, total, timeout_ms)
    items = getattr(req, field)

    def payload_of(a: int, b: int) -> bytes:
        return _encode(msgspec.structs.replace(req, **{field: items[a:b]}, **piece_fields))

    return await daemon.submit_pieces(task, model, np.cumsum(per_input), payload_of, most=most,
                                      timeout_ms=timeout_ms)


def local_manifest(daemon: Daemon, model: str, task: str) -> Any:
    """The manifest a request for `model` is sized by: its own, or its base's for a LoRA
    adapter (the base reads its texts); None for a model only another box stores."""
    try:
        manifest = daemon.manifest(model, task)
        return daemon.manifest(manifest.base, task) if manifest.base else manifest
    except ModelNotFound:
        return None


# ---- embed ---------------------------------------------------------------------------------

async def embed(daemon: Daemon, req: EmbedRequest, payload: bytes, *, raw: bool = False) -> tuple[Any, Answer]:
    """Queue an embed request; the worker's result for `req.output` (EmbedResult,
    TokenEmbedResult or SparseEmbedResult; their `...Raw` twins with `raw`) and the answer.

    `payload` is the request as MessagePack (for MessagePack clients, the body
    exactly as received: no re-encoding; image bytes ride in it to the worker untouched)."""
    req, payload = resolved(daemon.aliases, req, payload, _encode)
    check_inputs(daemon, req.inputs)
    if req.top_k is not None and (req.output != "sparse" or req.top_k < 1):
        raise BadRequest(f"top_k takes a count >= 1 and only with output 'sparse', got top_k={req.top_k} "
                         f"with output {req.output!r}")
    check_embed_controls(daemon, req)
    answers = await submit_inputs(daemon, "embed", target_model(daemon, "embed", req.model, req.adapter), req,
                                  "inputs", payload, embed_tokens(req, payload), lambda cap: embed_costs(req, cap))
    if len(answers) == 1:
        return (_EMBED_RAW if raw else _EMBED)[req.output].decode(answers[0][1].body), answers[0][1]
    res = join_embed([_EMBED[req.output].decode(a.body) for _, a in answers])
    return (raw_twin(res) if raw else res), joined([a for _, a in answers], None)


def embed_costs(req: EmbedRequest, cap: int | None) -> np.ndarray:
    """Tokens the model reads per input (daemon.pieces.text_costs; an image IMAGE_TOKENS)."""
    n = len(req.inputs)
    if not any(x.__class__ is ImageInput for x in req.inputs):
        return text_costs(np.fromiter(map(len, req.inputs), dtype=np.int64, count=n), cap)
    lengths = np.fromiter((len(x) if x.__class__ is str else 0 for x in req.inputs), dtype=np.int64, count=n)
    images = np.fromiter((x.__class__ is ImageInput for x in req.inputs), dtype=bool, count=n)
    return np.where(images, IMAGE_TOKENS, text_costs(lengths, cap))


def join_embed(parts: list[Any]) -> Any:
    """One embed result of its pieces' results (input order; all of one output)."""
    first, used = parts[0], sum(p.input_tokens for p in parts)
    if first.__class__ is EmbedResult:
        return msgspec.structs.replace(first, data=b"".join(p.data for p in parts),
                                       shape=(sum(p.shape[0] for p in parts), first.shape[1]), input_tokens=used)
    if first.__class__ is TokenEmbedResult:
        return TokenEmbedResult([b for p in parts for b in p.data], [s for p in parts for s in p.shapes], used)
    return SparseEmbedResult([v for p in parts for v in p.vectors], first.dimension, used)


def raw_twin(res: Any) -> Any:
    """A decoded embed result as its `...Raw` twin (what MessagePack replies splice in)."""
    if res.__class__ is EmbedResult:
        return EmbedResultRaw(msgspec.Raw(_encode(res.data)), res.shape, res.input_tokens, res.dtype, res.dimensions)
    if res.__class__ is TokenEmbedResult:
        return TokenEmbedResultRaw(msgspec.Raw(_encode(res.data)), res.shapes, res.input_tokens)
    return SparseEmbedResultRaw(msgspec.Raw(_encode(res.vectors)), res.dimension, res.input_tokens)


def check_embed_controls(daemon: Daemon, req: EmbedRequest) -> None:
    """`dimensions`, `output_dtype` and `prompt_name`, checked before queueing (the
    worker checks what only the loaded model knows: its width)."""
    if req.output != "dense":
        asked = [("dimensions", req.dimensions is not None), ("output_dtype", req.output_dtype != "float32")]
        for field in (f for f, given in asked if given):
            raise BadRequest(f"{field} applies to dense vectors (output 'dense'), not to output {req.output!r}",
                             param=field)
    if req.dimensions is not None and req.dimensions < 1:
        raise BadRequest(f"dimensions must be at least 1, got {req.dimensions}", param="dimensions")
    if req.output_dtype in SCALAR and not req.normalize:
        raise BadRequest(f"output_dtype {req.output_dtype!r} quantizes unit vectors on the fixed range [-1, 1]: "
                         "send normalize: true (binary, ubinary and float16 take any vector)", param="output_dtype")
    if req.prompt is None and req.prompt_name is not None:
        table, default = embed_prompts(daemon, req.model)
        resolve_prompt(req.model, table, default, None, req.prompt_name)


def embed_prompts(daemon: Daemon, model: str) -> tuple[dict[str, str], str | None]:
    """A stored embedder's prompt names -> texts, and its default prompt name (fleet.prompts)."""
    manifest = daemon.manifest(model, "embed")
    if manifest.base:  # a LoRA adapter embeds with its base's prompts
        manifest = daemon.manifest(manifest.base, "embed")
        model = manifest.name
    prompts, default = manifest.prompts, manifest.default_prompt_name
    if prompts is None:  # pulled before manifests kept prompts: its folder says, as the worker reads it
        prompts, default = folder_prompts(daemon.store.path(model))
    return prompt_table(manifest.runtime, prompts), default


def mapped_prompt(daemon: Daemon, model: str, field: str, value: str | None, meanings: dict[str, tuple[str, ...]],
                  prompt: str | None, prompt_name: str | None) -> tuple[str | None, list[str]]:
    """(prompt_name to send, fields not applied) for a route's own task field
    (Cohere `input_type`, Jina `task`) whose values mean the prompt names in
    `meanings`, best first (fleet.prompts.first_prompt). An explicit `prompt` or
    `prompt_name` wins over it; a model with no prompt for it embeds as sent."""
    if value is None:
        return prompt_name, []
    names = meanings.get(value)
    if names is None:
        raise BadRequest(f"{field} must be one of {', '.join(meanings)}, not {value!r}", param=field)
    if prompt is not None or prompt_name is not None:
        return prompt_name, [field]
    table, _ = embed_prompts(daemon, model)
    name, applies = first_prompt(table, names)
    return name, [] if applies else [field]


def ignored_fields(req: EmbedRequest) -> list[str]:
    """Fields of an embed request that were accepted and not applied: `prompt_name`
    next to `prompt` (the text wins, as in sentence-transformers)."""
    return ["prompt_name"] if req.prompt is not None and req.prompt_name is not None else []


def vectors(res: EmbedResult) -> np.ndarray:
    """A dense result as an (inputs, values per row) array of its dtype (a view of its bytes)."""
    return from_wire(res.data, res.shape, res.dtype)


def sparse_vectors(res: SparseEmbedResult) -> list[tuple[list[int], list[float]]]:
    """A sparse result as (indices, values) per input."""
    return [(np.frombuffer(v.indices, dtype="<i4").tolist(), np.frombuffer(v.values, dtype="<f4").tolist())
            for v in res.vectors]


# ---- rerank --------------------------------------------------------------------------------

def check_rerank(daemon: Daemon, req: RerankRequest) -> None:
    if req.documents is not None and req.texts is not None:
        raise BadRequest("send the documents as `documents` or as `texts`, not both")
    docs = req.documents if req.documents is not None else req.texts
    if docs is None:
        raise BadRequest("`documents` is missing: send the texts to rank against the query")
    if not docs:
        raise BadRequest("`documents` is empty: send at least one document")
    if len(docs) > daemon.settings.max_inputs:
        raise BadRequest(f"{len(docs)} documents is more than the limit of {daemon.settings.max_inputs} per request")
    if not req.query.strip():
        raise BadRequest("`query` is empty")
    if req.top_n is not None and req.top_n < 1:
        raise BadRequest(f"top_n must be at least 1, got {req.top_n}")
    if req.rank_fields not in (None, ["text"]):
        raise Unsupported("rank_fields: fleet ranks documents on their `text` only", param="rank_fields")
    if req.relevant_spans is not None and req.relevant_spans.get("mode", "disabled") != "disabled":
        raise Unsupported("relevant_spans: fleet's rerankers score whole documents", param="relevant_spans")


async def rerank(daemon: Daemon, req: RerankRequest, payload: bytes) -> tuple[list[RerankHit], Usage, Answer]:
    """Queue one rerank request; its hits, best first, with documents as asked."""
    req, payload = resolved(daemon.aliases, req, payload, _encode)
    check_rerank(daemon, req)
    docs = req.docs
    # Each pair carries the query again and one more special token than a single text.
    tokens = estimate_tokens(payload, len(docs)) + len(req.query) * (len(docs) - 1) // 4 + len(docs)
    field = "documents" if req.documents is not None else "texts"

    def costs(cap: int | None) -> np.ndarray:
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs)) + len(req.query)
        return text_costs(lengths, cap) + 1

    answers = await submit_inputs(daemon, "rerank", target_model(daemon, "rerank", req.model, req.adapter), req,
                                  field, payload, tokens, costs, top_n=None)
    if len(answers) == 1:
        answer = answers[0][1]
        res = _rerank.decode(answer.body)
        index = np.frombuffer(res.index, dtype="<i4").tolist()
        scores = np.frombuffer(res.scores, dtype="<f4").tolist()
    else:
        # Each piece ranked its own documents: every score at its document's place, ranked
        # again as the worker ranks (stable: ties in document order), cut to top_n.
        parts = [(a, _rerank.decode(answer.body)) for a, answer in answers]
        all_scores = np.empty(len(docs), dtype=np.float32)
        for a, part in parts:
            all_scores[np.frombuffer(part.index, dtype="<i4") + a] = np.frombuffer(part.scores, dtype="<f4")
        order = np.argsort(-all_scores, kind="stable")[:req.top_n]
        index, scores = order.tolist(), all_scores[order].tolist()
        res = RerankResult(b"", b"", sum(part.input_tokens for _, part in parts))
        answer = joined([a for _, a in answers], None)
    if req.return_documents or req.return_text:
        hits = [
            RerankHit(i, s, s, RerankDocument(docs[i]) if req.return_documents else None,
                      docs[i] if req.return_text else None)
            for i, s in zip(index, scores)
        ]
    else:
        hits = [RerankHit(i, s, s) for i, s in zip(index, scores)]
    return hits, Usage(input_tokens=res.input_tokens), answer


# ---- classify and extract ------------------------------------------------------------------

async def classify(daemon: Daemon, req: ClassifyRequest, payload: bytes,
                   ) -> tuple[list[list[LabelScore]], Usage, Answer]:
    """Queue one classify request; per input, its labels with scores, best first."""
    req, payload = resolved(daemon.aliases, req, payload, _encode)
    check_inputs(daemon, req.inputs)
    if req.top_k is not None and req.top_k < 1:
        raise BadRequest(f"top_k must be at least 1, got {req.top_k}")
    model = target_model(daemon, "classify", req.model, req.adapter)
    # Zero-shot runs each input with each candidate label: it costs that many forwards.
    pairs = 1
    if req.candidate_labels is not None:
        zero_shot.check(daemon, req, model)
        pairs = len(req.candidate_labels)
    answers = await submit_inputs(daemon, "classify", model, req,
                                  "inputs", payload, estimate_tokens(payload, len(req.inputs)) * pairs,
                                  lambda cap: text_costs(np.fromiter(map(len, req.inputs), dtype=np.int64,
                                                                     count=len(req.inputs)), cap) * pairs)
    if len(answers) == 1:
        answer = answers[0][1]
        res = _classify.decode(answer.body)
    else:
        parts = [_classify.decode(a.body) for _, a in answers]
        res = ClassifyResult(parts[0].labels, b"".join(p.top for p in parts), b"".join(p.scores for p in parts),
                             (sum(p.shape[0] for p in parts), parts[0].shape[1]), sum(p.input_tokens for p in parts))
        answer = joined([a for _, a in answers], None)
    top = np.frombuffer(res.top, dtype="<i4").reshape(res.shape).tolist()
    scores = np.frombuffer(res.scores, dtype="<f4").reshape(res.shape).tolist()
    labels = res.labels
    results = [[LabelScore(labels[j], s) for j, s in zip(row_top, row_scores)]
               for row_top, row_scores in zip(top, scores)]
    return results, Usage(input_tokens=res.input_tokens), answer


async def extract(daemon: Daemon, req: ExtractRequest, payload: bytes) -> tuple[list[list[Entity]], Usage, Answer]:
    """Queue one extract request; per input, its entity spans."""
    req, payload = resolved(daemon.aliases, req, payload, _encode)
    check_inputs(daemon, req.inputs)
    answers = await submit_inputs(daemon, "extract", target_model(daemon, "extract", req.model, req.adapter), req,
                                  "inputs", payload, estimate_tokens(payload, len(req.inputs)),
                                  lambda cap: text_costs(np.fromiter(map(len, req.inputs), dtype=np.int64,
                                                                     count=len(req.inputs)), cap))
    if len(answers) == 1:
        answer = answers[0][1]
        res = _extract.decode(answer.body)
    else:
        parts = [_extract.decode(a.body) for _, a in answers]
        res = ExtractResult([spans for p in parts for spans in p.spans], sum(p.input_tokens for p in parts))
        answer = joined([a for _, a in answers], None)
    if len(res.spans) != len(req.inputs):
        raise RuntimeError(f"extract: {len(res.spans)} span lists for {len(req.inputs)} inputs; this is a bug")
    # The worker sends offsets only; the text of each span is cut here from the input as sent.
    results = [[Entity(s.entity, text[s.start : s.end], s.start, s.end, s.score) for s in spans]
               for text, spans in zip(req.inputs, res.spans)]
    return results, Usage(input_tokens=res.input_tokens), answer


# ---- decide --------------------------------------------------------------------------------

def decide_tokens(req: DecideRequest) -> int:
    """Batch-budget tokens of a decision (~4 characters a token): the state once, and
    each question's rows: two listing its options, or one per option past LISTED_OPTIONS."""
    total = len(req.state) // 4 + 2
    for q in req.questions:
        n = len(q.options)
        if n <= LISTED_OPTIONS:
            rows, chars = 2, 2 * (len(q.text) + sum(map(len, q.options)))
        else:
            rows, chars = n, n * len(q.text) + sum(map(len, q.names))
        total += chars // 4 + 8 * rows
    return total


async def decide(daemon: Daemon, req: DecideRequest) -> tuple[DecideResult, Answer]:
    """Queue one decision request (every route's shape rendered into `req`); the
    probabilities per option of each question. Over a budget is 413: more questions
    than `max_inputs`, more tokens than `max_request_tokens`."""
    req, _ = resolved(daemon.aliases, req, b"", _encode)
    if len(req.questions) > daemon.settings.max_inputs:
        raise PayloadTooLarge(f"{len(req.questions)} questions is more than the limit of "
                              f"{daemon.settings.max_inputs} per request (max_inputs)")
    tokens = decide_tokens(req)
    check_ceiling(req.model, tokens, daemon.settings.max_request_tokens, what="state and questions")
    answer = await daemon.submit("decide", req.model, _encode(req), tokens=tokens, timeout_ms=req.timeout_ms)
    return _decide.decode(answer.body), answer


# ---- generate ------------------------------------------------------------------------------

def check_generate(req: GenerateRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("send exactly one of `prompt` or `messages`")
    if req.prompt is not None and not req.prompt:
        raise BadRequest("`prompt` is empty")
    if req.messages is not None and not req.messages:
        raise BadRequest("`messages` is empty: send at least one message")
    if req.max_tokens is not None and not 1 <= req.max_tokens <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"max_tokens must be at least 1 (and within the model's context), got {req.max_tokens}")
    if not 0.0 <= req.temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {req.temperature}")
    if not 0.0 < req.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise BadRequest(f"`stop` takes at most {MAX_STOPS} non-empty strings")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                         param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.regex is not None and req.format is not None:
        raise BadRequest("send one of `format` or `regex`, not both", param="regex")
    check_tools(req.tools, req.tool_choice)
    if req.tools and req.tool_choice != "none":
        # A call is held to its own grammar, and its tokens are not the text's.
        if req.format is not None or req.regex is not None:
            raise BadRequest("send `tools` or an output format (`format`, `regex`, `response_format`), not both",
                             param="tools")
        if req.logprobs:
            raise BadRequest("`logprobs` are not given with `tools` (a call's tokens are not text)",
                             param="logprobs")
        if req.messages is None:
            raise BadRequest("`tools` need chat `messages`: a prompt has no chat template to render them",
                             param="tools")


def target_model(daemon: Daemon, task: str, model: str, adapter: str | None) -> str:
    """The store name a request runs as: `model`, or its LoRA `adapter`, which must
    be a stored adapter of that model (400 naming it and the model's adapters). With
    NATS, one only another box stores counts too: that box runs it in the base's lane."""
    if adapter is None:
        return model
    try:
        found = daemon.manifest(adapter, task)
    except (ModelNotFound, BadRequest):
        found = None
    if found is not None and found.base == model:
        return adapter
    if found is None and daemon.cluster is not None and daemon.cluster.base_of(adapter) == model:
        return adapter
    base = daemon.manifest(model, task)  # an unknown model is 404; one of another task 400
    if base.base is not None:
        raise BadRequest(f"{model!r} is itself a LoRA adapter (of {base.base!r}): send `model: {base.base!r}` with "
                         f"`adapter: {adapter!r}`, or the adapter alone as `model`", param="adapter")
    own = sorted(daemon.store.dependents(model))
    raise BadRequest(f"{model!r} has no LoRA adapter {adapter!r}; its adapters: {', '.join(own) or 'none'}",
                     param="adapter", hint="fleetctl list shows what is pulled; fleetctl pull DIR --base MODEL "
                                           "adds an adapter")


def generate_tokens(req: GenerateRequest, payload: bytes) -> int:
    """Admission tokens of a generation: its prompt and its answer, which is `max_tokens`
    at most, or with none of the client's, the ANSWER_RESERVE_TOKENS its worker reserves
    first (what it runs to is not known before it ends; the context's room would make
    every such request look as long as its model's context)."""
    return estimate_tokens(payload, 1) + (ANSWER_RESERVE_TOKENS if req.max_tokens is None else req.max_tokens)


def length_limit_headers(res: GenerateResult) -> dict[str, str]:
    """`X-Fleet-Length-Limit` when a server limit (not the client's) ended the text:
    which one, and the tokens (prompt and generated) the sequence held then."""
    if not res.length_limit:
        return {}
    return {LENGTH_LIMIT_HEADER: f"{res.length_limit}; tokens={res.input_tokens + res.output_tokens}"}


def observe_generation(daemon: Daemon, model: str, answer: Answer, res: GenerateResult) -> None:
    """An answered generation in /metrics and top: its time to first token (queue wait and
    prefill, as the worker measured them) and the tokens it generated."""
    ttft_s = (answer.queue_ms + res.first_token_ms) / 1e3
    daemon.metrics.observe_generation(model, ttft_s, res.output_tokens)
    daemon.recent.generation(daemon.metrics.model_label(model), ttft_s, res.output_tokens)


async def generate(daemon: Daemon, req: GenerateRequest, payload: bytes) -> tuple[GenerateResult, Answer]:
    """Queue one generation and wait for the whole text."""
    req, payload = resolved(daemon.aliases, req, payload, _encode)
    check_generate(req)
    answer = await daemon.submit("generate", target_model(daemon, "generate", req.model, req.adapter), payload,
                                 tokens=generate_tokens(req, payload), timeout_ms=req.timeout_ms)
    res = _generate.decode(answer.body)
    observe_generation(daemon, req.model, answer, res)
    return res, answer


def token_logprobs(wire: list[WireLogprob] | None) -> list[TokenLogprob] | None:
    """The worker's per-token bytes and logprobs as `fleet.protocol.TokenLogprob` (OpenAI's chat shape)."""
    if wire is None:
        return None
    return [
        TokenLogprob(t.token.decode("utf-8", "replace"), t.logprob, list(t.token),
                     [TopLogprob(b.decode("utf-8", "replace"), lp, list(b))
                      for b, lp in zip(t.top_tokens, t.top_logprobs)])
        for t in wire
    ]
