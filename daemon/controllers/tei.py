"""Hugging Face text-embeddings-inference (TEI) routes on the same port:
`POST /embed`, `/embed_sparse`, `/embed_all`, `/rerank`, `/predict`, `/tokenize`
and `GET /info`, with TEI's request and reply shapes (bare lists), so TEI
clients (`huggingface_hub.InferenceClient(model="http://HOST:7744/embed")`,
litellm `huggingface/`, plain `requests`) work unchanged.

TEI serves one model; fleet serves many. A TEI request may add `model`;
without it the task's default runs (`choose_default_model`). `GET /info`
takes it as `?model=`. Each route queues the same request as its native
twin (`/v1/embed`, `/v1/rerank`, `/v1/classify`), so batching, limits and
errors are the native ones; errors keep the contract's `{error: {code, message}}`.
Clients that post TEI's `{"inputs", "parameters": {...}}` (huggingface_hub)
have `normalize`, `truncate` and `dimensions` read from `parameters` too.

Hugging Face's clients (huggingface_hub's InferenceClient, @huggingface/inference)
call the URL they are given, `POST /` or a model's `/models/NAME`, with the HF
Inference API's bodies: there `/predict` answers that API's shapes, a list of
labels per input for text classification (`parameters.top_k`, `function_to_apply`
applied), and zero-shot classification for `parameters.candidate_labels` (an NLI
model answers it, daemon.zero_shot; any other is refused), one list for one text.
`/predict` called by name keeps TEI's shapes.

TEI's request types do not deny unknown fields (serde ignores them), so these
routes ignore them too, and name them in the `X-Fleet-Ignored-Fields` reply
header with the fields a route accepts and does not apply (`normalize` and
`dimensions` on `/embed_sparse` and `/embed_all`, which TEI does not take there).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

import msgspec
import numpy as np
from litestar import Controller, Request, Response, get, post

from fleet import __version__
from fleet.catalog import load_catalog
from fleet.errors import BadRequest, ModelNotFound, Unsupported
from fleet.protocol import ClassifyRequest, EmbedRequest, RerankRequest
from fleet.store import Manifest

from fleet.daemon import codec, fields, tasks, token_replies
from fleet.daemon.defaults import default_model
from fleet.daemon.controllers.tokens import ids_to_texts, load_tokenizer
from fleet.daemon.core import Daemon, live_profiles
from fleet.daemon.http import answer_headers, body_is_msgpack, reply, wants_msgpack
from fleet.daemon.model_urls import SCOPE_ROOT
from fleet.daemon.offload import build_reply, off_loop, text_bytes_over, too_large

_json = msgspec.json.Encoder().encode

#: A TEI `inputs`: one text, one text as token ids, or a batch of texts and id lists.
Inputs = str | list[str | int | list[int]]


class TeiParameters(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """huggingface_hub's `parameters` object (TEI itself reads these at the top level)."""

    normalize: bool | None = None
    truncate: bool | None = None
    dimensions: int | None = None
    prompt_name: str | None = None
    truncation_direction: str | None = None
    prompt: str | None = None


class TeiEmbedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`/embed`, `/embed_sparse`, `/embed_all` (the last two take no `normalize`/`dimensions`, as in TEI:
    there they are named in `X-Fleet-Ignored-Fields`). `normalize` None = true.
    `prompt_name` is TEI's (one of the model's prompts); `prompt` (the text itself) is fleet's."""

    inputs: Inputs
    model: str = ""
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    parameters: TeiParameters | None = None
    timeout_ms: int | None = None
    prompt: str | None = None


class TeiPredictParameters(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The HF Inference API's `parameters` of text classification and of zero-shot
    classification (`candidate_labels`: a list, or one string of comma-separated labels)."""

    top_k: int | None = None
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    candidate_labels: list[str] | str | None = None
    multi_label: bool | None = None
    hypothesis_template: str | None = None


class TeiPredictRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`inputs`: a text, a `[text]`, or a batch `[[text], ...]` (TEI's sentence pairs are refused:
    fleet's classifiers take one text)."""

    inputs: str | list[str | list[str]]
    model: str = ""
    truncate: bool | None = None
    truncation_direction: str = "right"
    raw_scores: bool = False
    timeout_ms: int | None = None
    parameters: TeiPredictParameters | None = None


class TeiRerankRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`/rerank`: `texts` against `query` (`documents` and `top_n`, Cohere's and
    Infinity's spelling, are taken too)."""

    query: str = ""
    texts: list[str] | None = None
    documents: list[str] | None = None
    top_n: int | None = None
    model: str = ""
    truncate: bool | None = None
    truncation_direction: str = "right"
    raw_scores: bool = False
    return_text: bool = False
    timeout_ms: int | None = None
    #: Infinity's: the documents' texts in its results (a `documents` body is answered in its shape).
    return_documents: bool = False


class TeiTokenizeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    inputs: str | list[str]
    model: str = ""
    add_special_tokens: bool = True
    prompt_name: str | None = None


class InfinityRank(msgspec.Struct, frozen=True):
    relevance_score: float
    index: int
    document: str | None = None


class InfinityUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class InfinityRerankReply(msgspec.Struct, frozen=True):
    """Infinity's (and vLLM's) `/rerank` answer, to a body with `documents`."""

    results: list[InfinityRank]
    model: str
    usage: InfinityUsage
    id: str
    created: int
    object: str = "rerank"


class TeiRank(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    score: float
    text: str | None = None


class TeiPrediction(msgspec.Struct, frozen=True):
    score: float
    label: str


class TeiSparseValue(msgspec.Struct, frozen=True):
    index: int
    value: float


class TeiToken(msgspec.Struct, frozen=True):
    """`start`/`stop`: byte offsets into the UTF-8 input (TEI's); null for special tokens."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class TeiInfo(msgspec.Struct, frozen=True):
    model_id: str
    model_sha: str | None
    model_dtype: str
    served_model_name: str
    model_type: dict[str, Any]
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None


#: The TEI `model_type` key of each fleet task that /info describes.
TASK_MODEL_TYPE = {"embed": "embedding", "rerank": "reranker", "classify": "classifier"}


def refuse_unsupported(prompt_name: str | None, truncation_direction: str | None) -> None:
    if prompt_name is not None:
        raise Unsupported("prompt_name: put the prompt in front of the text", param="prompt_name")
    if truncation_direction not in (None, "right", "Right"):
        raise Unsupported(f"truncation_direction {truncation_direction!r}: fleet truncates on the right",
                          param="truncation_direction")


async def embed_texts(daemon: Daemon, model: str, inputs: Inputs) -> list[str]:
    """TEI `inputs` as texts: token-id items are read in the model's own vocabulary."""
    if inputs.__class__ is str:
        return [inputs]
    if not inputs:
        raise BadRequest("`inputs` is empty: send at least one text")
    if all(x.__class__ is int for x in inputs):
        return await ids_to_texts(daemon.store, daemon.manifest(model, "embed"), [inputs],
                                  daemon.settings.max_token_ids)
    if any(x.__class__ is int for x in inputs):
        raise BadRequest("`inputs` mixes token ids with texts: send a list of id lists for several inputs")
    at = [i for i, x in enumerate(inputs) if x.__class__ is list]
    if not at:
        return inputs
    texts = list(inputs)
    decoded = await ids_to_texts(daemon.store, daemon.manifest(model, "embed"), [inputs[i] for i in at],
                                 daemon.settings.max_token_ids)
    for i, text in zip(at, decoded):
        texts[i] = text
    return texts


def not_applied(tei: TeiEmbedRequest, output: str) -> list[str]:
    """`normalize` and `dimensions` where TEI does not take them (`/embed_sparse`, `/embed_all`)."""
    if output == "dense":
        return []
    names = ("normalize", "dimensions")
    out = fields.set_fields(tei, names)
    if tei.parameters is not None:
        out += [f"parameters.{n}" for n in fields.set_fields(tei.parameters, names)]
    return out


async def tei_embed(request: Request, daemon: Daemon, output: str) -> tuple[EmbedRequest, Any, dict[str, str]]:
    """Decode a TEI embed request, queue it as the native one, return (native request, worker's result,
    reply headers)."""
    tei, dropped = codec.decode_lenient(await request.body(), TeiEmbedRequest, msgpack=body_is_msgpack(request))
    params = tei.parameters or TeiParameters()
    refuse_unsupported(None, params.truncation_direction or tei.truncation_direction)
    model = tei.model or default_model(daemon, "embed")
    truncate = params.truncate if params.truncate is not None else tei.truncate
    # TEI's /embed_all returns the token vectors as the model gives them (it has no `normalize`).
    normalize = (params.normalize if params.normalize is not None else tei.normalize) is not False and output == "dense"
    req = EmbedRequest(model=model, inputs=await embed_texts(daemon, model, tei.inputs), normalize=normalize,
                       truncate=True if truncate is None else truncate, output=output, timeout_ms=tei.timeout_ms,
                       prompt_name=params.prompt_name or tei.prompt_name, prompt=params.prompt or tei.prompt,
                       # /embed_sparse and /embed_all take no dimensions (named as not applied above).
                       dimensions=None if output != "dense" else
                       params.dimensions if params.dimensions is not None else tei.dimensions)
    token_replies.check_before(daemon, req, token_format(request))
    res, answer = await tasks.embed(daemon, req, codec.encode_msgpack(req))
    not_used = dropped + not_applied(tei, output) + tasks.ignored_fields(req)
    return req, res, {**answer_headers(answer), **fields.ignored_header(not_used)}


def token_format(request: Request) -> str:
    """How `/embed_all` carries a value (daemon.token_replies.VALUE_BYTES): TEI's nested lists."""
    return "lists" if wants_msgpack(request) else "json"


def predict_texts(inputs: str | list[str | list[str]]) -> tuple[list[str], bool]:
    """(texts, whether TEI answers a batch) for TEI's `/predict` inputs."""
    if inputs.__class__ is str:
        return [inputs], False
    if not inputs:
        raise BadRequest("`inputs` is empty: send at least one text")
    if all(x.__class__ is str for x in inputs):
        if len(inputs) == 1:
            return inputs, False
        raise Unsupported("`inputs` as a list of strings is a sentence pair in TEI; fleet's classifiers take one "
                          "text: send a text, or a batch as [[text], [text], ...]", param="inputs")
    if any(x.__class__ is not list for x in inputs):
        raise BadRequest("`inputs` mixes texts and lists: send a text, or a batch as [[text], [text], ...]")
    if any(len(x) != 1 for x in inputs):
        raise Unsupported("each item of a batch must be [text] (sentence pairs are not supported)", param="inputs")
    return [x[0] for x in inputs], True


def byte_offsets(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets (the Python tokenizers binding) as byte offsets into UTF-8 (TEI's)."""
    if text.isascii():
        return spans
    at = np.concatenate(([0], np.cumsum([len(c.encode()) for c in text]))).tolist()
    return [(at[a], at[b]) for a, b in spans]


def tokens_of(text: str, enc: Any) -> list[TeiToken]:
    """TEI's tokens of one input from its `tokenizers.Encoding`."""
    raw = text.encode()
    out = []
    for id_, token, special, (start, stop) in zip(enc.ids, enc.tokens, enc.special_tokens_mask,
                                                  byte_offsets(text, enc.offsets)):
        if special:
            out.append(TeiToken(id_, token, True, None, None))
        else:
            out.append(TeiToken(id_, raw[start:stop].decode(errors="replace"), False, start, stop))
    return out


def stored(daemon: Daemon, name: str) -> Manifest:
    """The stored model `name`, whatever its task (the store's own error names its folder)."""
    try:
        return daemon.store.get(name)
    except ModelNotFound:
        raise ModelNotFound(f"unknown model {name!r}", hint="fleetctl list shows what is pulled") from None


async def served_dtype(daemon: Daemon, manifest: Manifest) -> str:
    """The dtype a worker chose at load; before any load, the profile's wish."""
    for w in await daemon.workers():
        info = w["models"].get(manifest.name)
        if info and info.get("dtype"):
            return str(info["dtype"])
    return manifest.profile.dtype


async def batch_budget(daemon: Daemon, manifest: Manifest) -> dict[str, Any]:
    """The batch budget a worker serves the model with now (its live profile, after any
    SIGHUP); before any load, the catalog entry's default profile, else the manifest's."""
    for view in live_profiles(await daemon.workers(), manifest.name):
        if "max_batch_tokens" in view.settings:
            return view.settings
    try:
        entry = load_catalog(daemon.settings.home).find(manifest.name)
    except BadRequest:
        entry = None
    return msgspec.structs.asdict(entry.profile if entry is not None else manifest.profile)


def read_json(daemon: Daemon, manifest: Manifest, rel: str) -> dict[str, Any]:
    """A small JSON file of the stored model (config), or {} when it has none."""
    if not any(f.path == rel for f in manifest.files):
        return {}
    try:
        return json.loads((daemon.store.path(manifest.name) / rel).read_text())
    except (OSError, ValueError):
        return {}


def model_type(daemon: Daemon, manifest: Manifest) -> dict[str, Any]:
    kind = TASK_MODEL_TYPE.get(manifest.task)
    if kind is None:
        raise BadRequest(f"model {manifest.name!r} serves {manifest.task!r}; TEI describes embed, rerank and "
                         f"classify models")
    if kind == "embedding":
        pooling = read_json(daemon, manifest, "1_Pooling/config.json")
        modes = [k[len("pooling_mode_"):].removesuffix("_token").removesuffix("_tokens")
                 for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True]
        return {"embedding": {"pooling": modes[0] if modes else "cls"}}
    id2label = {str(k): str(v) for k, v in read_json(daemon, manifest, "config.json").get("id2label", {}).items()}
    return {kind: {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}}


def max_input_length(daemon: Daemon, manifest: Manifest) -> int:
    if manifest.max_seq_len:
        return manifest.max_seq_len
    limits = [read_json(daemon, manifest, rel).get(key) for rel, key in (
        ("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length"),
        ("config.json", "max_position_embeddings"))]
    return next((int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000), 512)


class TeiController(Controller):
    tags = ["TEI"]

    @post("/embed", status_code=200)
    async def embed(self, request: Request, daemon: Daemon) -> Response:
        _, res, headers = await tei_embed(request, daemon, "dense")
        vectors = tasks.vectors(res)
        return await build_reply(vectors.size, lambda: reply(request, vectors.tolist(), headers=headers))

    @post("/embed_sparse", status_code=200)
    async def embed_sparse(self, request: Request, daemon: Daemon) -> Response:
        _, res, headers = await tei_embed(request, daemon, "sparse")
        out = [[TeiSparseValue(i, v) for i, v in zip(indices, values)] for indices, values in tasks.sparse_vectors(res)]
        return reply(request, out, headers=headers)

    @post("/embed_all", status_code=200)
    async def embed_all(self, request: Request, daemon: Daemon) -> Response:
        req, res, headers = await tei_embed(request, daemon, "tokens")
        values = token_replies.check_after(daemon, req.model, res.shapes, token_format(request))
        encode = codec.encode_msgpack if wants_msgpack(request) else _json
        # One input's lists at a time, off the event loop when large (daemon.token_replies).
        return await build_reply(values, lambda: reply(request, token_replies.encoded_blocks(res, encode),
                                                       headers=headers))

    @post("/rerank", status_code=200)
    async def rerank(self, request: Request, daemon: Daemon) -> Response:
        """TEI's rerank: `texts`, `raw_scores`, `return_text`; a bare list, best first. A body
        with `documents` (Infinity's, vLLM's) is answered in Infinity's shape."""
        tei, dropped = codec.decode_lenient(await request.body(), TeiRerankRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported(None, tei.truncation_direction)
        req = RerankRequest(model=tei.model or default_model(daemon, "rerank"), query=tei.query,
                            documents=tei.documents, texts=tei.texts, top_n=tei.top_n, return_text=tei.return_text,
                            raw_scores=tei.raw_scores, truncate=True if tei.truncate is None else tei.truncate,
                            timeout_ms=tei.timeout_ms, return_documents=tei.return_documents)
        hits, usage, answer = await tasks.rerank(daemon, req, codec.encode_msgpack(req))
        headers = {**answer_headers(answer), **fields.ignored_header(dropped)}
        if tei.documents is not None:
            results = [InfinityRank(h.score, h.index, h.document.text if h.document else None) for h in hits]
            tokens = usage.input_tokens or 0
            return reply(request, InfinityRerankReply(results, req.model, InfinityUsage(tokens, tokens),
                                                      secrets.token_hex(16), int(time.time())), headers=headers)
        out = [TeiRank(h.index, h.score, h.text) for h in hits]
        return reply(request, out, headers=headers)

    @post("/predict", status_code=200)
    async def predict(self, request: Request, daemon: Daemon) -> Response:
        """Every label of the model, best first, per input; one list for one input, a list per input for a
        batch. Called at a model's URL (`POST /`, HF's clients): a list per input, and zero-shot classification
        for `parameters.candidate_labels`."""
        tei, dropped = codec.decode_lenient(await request.body(), TeiPredictRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported(None, tei.truncation_direction)
        texts, batch = predict_texts(tei.inputs)
        params = tei.parameters or TeiPredictParameters()
        labels = params.candidate_labels
        if labels.__class__ is str:  # the HF Inference API's "a, b, c"
            labels = [x.strip() for x in labels.split(",") if x.strip()]
        zero_shot = labels is not None
        not_applied = [f"parameters.{name}" for name, given in (
            ("function_to_apply", zero_shot and params.function_to_apply is not None),
            ("multi_label", not zero_shot and params.multi_label is not None),
            ("hypothesis_template", not zero_shot and params.hypothesis_template is not None)) if given]
        req = ClassifyRequest(model=tei.model or default_model(daemon, "classify"), inputs=texts,
                              top_k=params.top_k, raw_scores=tei.raw_scores or params.function_to_apply == "none",
                              multi_label=params.multi_label if zero_shot else
                              {"sigmoid": True, "softmax": False}.get(params.function_to_apply or ""),
                              truncate=True if tei.truncate is None else tei.truncate, timeout_ms=tei.timeout_ms,
                              candidate_labels=labels, hypothesis_template=params.hypothesis_template if zero_shot
                              else None)
        results, _, answer = await tasks.classify(daemon, req, codec.encode_msgpack(req))
        rows = [[TeiPrediction(x.score, x.label) for x in labels] for labels in results]
        headers = {**answer_headers(answer), **fields.ignored_header(dropped + not_applied)}
        if request.scope.get(SCOPE_ROOT) and not zero_shot:
            # The HF Inference API's text classification: a list of labels per input, one input too.
            return reply(request, rows, headers=headers)
        return reply(request, rows if batch else rows[0], headers=headers)

    @post("/tokenize", status_code=200)
    async def tokenize(self, request: Request, daemon: Daemon) -> Response:
        """Tokens of each input in the model's own vocabulary (always a list per input, as TEI answers)."""
        tei, dropped = codec.decode_lenient(await request.body(), TeiTokenizeRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported(tei.prompt_name, None)
        texts = [tei.inputs] if tei.inputs.__class__ is str else tei.inputs
        tasks.check_inputs(daemon, texts)
        limit = daemon.settings.max_tokenize_bytes
        if (size := text_bytes_over(texts, limit)) is not None:
            raise too_large("the UTF-8 bytes of `inputs`", size, "max_tokenize_bytes", limit, param="inputs")
        name = tei.model or default_model(daemon, "embed")
        manifest = stored(daemon, name) if tei.model else daemon.manifest(name, "embed")
        msgpack = wants_msgpack(request)

        def tokenize() -> bytes:
            tokenizer = load_tokenizer(daemon.store, manifest)
            encodings = tokenizer.encode_batch(texts, add_special_tokens=tei.add_special_tokens)
            return codec.encode([tokens_of(t, enc) for t, enc in zip(texts, encodings)], msgpack=msgpack)

        # Tokenizing, TEI's token objects and their encoding (~250x the text in memory) run
        # off the event loop, at most API_WORK_THREADS at once (daemon.offload).
        content = await off_loop(sum(map(len, texts)), tokenize)
        return Response(content=content, media_type=codec.MSGPACK if msgpack else codec.JSON,
                        headers=fields.ignored_header(dropped))

    @get("/info")
    async def info(self, request: Request, daemon: Daemon, model: str | None = None) -> Response:
        """TEI's model card for `?model=` (default: the embedding default)."""
        name = model or default_model(daemon, "embed")
        manifest = stored(daemon, name)
        s = daemon.settings
        budget = await batch_budget(daemon, manifest)
        return reply(request, TeiInfo(
            model_id=manifest.name, model_sha=manifest.revision, model_dtype=await served_dtype(daemon, manifest),
            served_model_name=manifest.name, model_type=model_type(daemon, manifest),
            max_concurrent_requests=s.queue_max_depth, max_input_length=max_input_length(daemon, manifest),
            max_batch_tokens=budget["max_batch_tokens"], max_batch_requests=budget["max_batch_items"],
            max_client_batch_size=s.max_inputs, auto_truncate=True, tokenization_workers=1, version=__version__,
        ))
