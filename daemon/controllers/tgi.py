"""Hugging Face text-generation-inference (TGI) and the rest of TEI and the HF
Inference API on the same port: `POST /generate`, `/generate_stream`,
`/similarity`, `/decode`, `/pipeline/token-classification`.

Shapes are TGI's router (router/src/lib.rs, server.rs) and TEI's
(router/src/http/types.rs): a client configured with a URL
(`InferenceClient(model="http://host:7744/models/NAME")`, langchain's
`HuggingFaceEndpoint`, haystack's TGI and TEI components) gets what it would
get from TGI or TEI. `POST /` reaches these through `daemon.model_urls`.

- `/generate` takes `{"inputs", "parameters", "stream"?}` and answers
  `{"generated_text", "details"?}` (at the root, TGI's one-item list). It
  queues one native `GenerateRequest` (`daemon.tasks.generate`): TGI's
  greedy default (no `do_sample`, no sampling parameter) is temperature 0;
  `max_new_tokens` defaults to 100 (huggingface_hub's documented default);
  `grammar` `{"type": "json"|"json_object", "value": schema}` and
  `{"type": "regex", "value": pattern}` are enforced while decoding;
  `top_n_tokens` fills `details.top_tokens`; `adapter_id` is fleet's `adapter`.
  Parameters fleet does not apply (`top_k`, `typical_p`, penalties, `watermark`,
  `truncate`, `decoder_input_details`) are named in `X-Fleet-Ignored-Fields`;
  `best_of` > 1 is refused.
- `/generate_stream` answers server-sent events, one per generated token
  (`{"index", "token": {id, text, logprob, special}, "generated_text": null,
  "details": null}`), the last with the whole `generated_text` (and `details`
  when asked), then nothing more (TGI sends no `[DONE]`).
- `/similarity` (TEI): cosine of `source_sentence` with each of `sentences`.
- `/decode` (TEI): token ids to text in the model's own vocabulary.
- `/pipeline/token-classification` (HF Inference API's token-classification
  shape): `[{entity_group, score, word, start, end}]` per input, from `/v1/extract`.

Unknown fields are ignored, as TGI and TEI ignore them, and named in
`X-Fleet-Ignored-Fields`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError, Unsupported
from fleet.messages import GenerateResult
from fleet.messages import TokenLogprob as WireLogprob
from fleet.protocol import EmbedRequest, ExtractRequest, GenerateRequest

from fleet.daemon import codec, fields, tasks
from fleet.daemon.defaults import default_model
from fleet.daemon.controllers.generate import SSE_HEADERS, sse
from fleet.daemon.controllers.tei import TeiParameters, refuse_unsupported, stored
from fleet.daemon.controllers.tokens import check_ids, load_tokenizer
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply, wants_msgpack
from fleet.daemon.model_urls import SCOPE_ROOT
from fleet.daemon.offload import off_loop, too_large
from fleet.daemon.text_stream import TextStream

#: TGI parameters fleet accepts and does not apply (named in X-Fleet-Ignored-Fields when set).
IGNORED_TGI = ("top_k", "typical_p", "repetition_penalty", "frequency_penalty", "watermark", "truncate",
               "decoder_input_details")
#: TGI's words for why a generation ended.
FINISH = {"length": "length", "stop": "eos_token"}
#: HF's token-classification aggregation fleet's taggers answer with (whole entities, one label each).
AGGREGATIONS = (None, "simple", "first", "max", "average")


class TgiGrammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """TGI's `grammar` (and its chat `response_format`): a JSON Schema or a regular expression."""

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any = None


class TgiParameters(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] = []
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: TgiGrammar | None = None
    adapter_id: str | None = None


class TgiGenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    inputs: str
    parameters: TgiParameters = TgiParameters()
    stream: bool = False
    #: fleet's: the model (a per-model URL sets it; TGI serves one model).
    model: str = ""
    timeout_ms: int | None = None


class TgiToken(msgspec.Struct, frozen=True):
    id: int
    text: str
    logprob: float
    special: bool = False


class TgiPrefillToken(msgspec.Struct, frozen=True):
    id: int
    text: str
    logprob: float


class TgiDetails(msgspec.Struct, frozen=True, omit_defaults=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[TgiPrefillToken]
    tokens: list[TgiToken]
    top_tokens: list[list[TgiToken]] = []


class TgiGenerateReply(msgspec.Struct, frozen=True, omit_defaults=True):
    generated_text: str
    details: TgiDetails | None = None


class TgiStreamDetails(msgspec.Struct, frozen=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int


class TgiStreamReply(msgspec.Struct, frozen=True):
    index: int
    token: TgiToken
    generated_text: str | None = None
    details: TgiStreamDetails | None = None
    top_tokens: list[TgiToken] | None = None


class SimilarityInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    source_sentence: str
    sentences: list[str]


class SimilarityRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    inputs: SimilarityInput
    parameters: TeiParameters | None = None
    model: str = ""
    timeout_ms: int | None = None


class DecodeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: One id list, or a batch of them (msgspec takes one list type in a union: checked in `id_lists`).
    ids: list[int | list[int]]
    skip_special_tokens: bool = True
    model: str = ""


class TokenClassificationParameters(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    aggregation_strategy: str | None = None
    ignore_labels: list[str] | None = None
    stride: int | None = None


class TokenClassificationRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    inputs: str | list[str]
    parameters: TokenClassificationParameters | None = None
    model: str = ""
    timeout_ms: int | None = None


class HfEntity(msgspec.Struct, frozen=True):
    entity_group: str
    score: float
    word: str
    start: int
    end: int


# ---- generation ------------------------------------------------------------------------

def grammar_format(grammar: TgiGrammar | None, field: str) -> tuple[Any, str | None]:
    """(native `format`, native `regex`) of TGI's `grammar` (or a chat `response_format` of its kinds)."""
    if grammar is None:
        return None, None
    if grammar.type == "regex":
        if not isinstance(grammar.value, str) or not grammar.value:
            raise BadRequest(f"`{field}` of type regex needs `value`: the regular expression", param=field)
        return None, grammar.value
    value = grammar.value
    if grammar.type == "json_schema" and isinstance(value, dict):
        value = value.get("schema", value)
    if value is None:
        return "json", None
    if not isinstance(value, dict):
        raise BadRequest(f"`{field}.value` must be a JSON Schema object", param=field)
    return value, None


def native_request(tgi: TgiGenerateRequest, model: str, *, stream: bool) -> tuple[GenerateRequest, list[str]]:
    """The native request of a TGI one, and the TGI parameters it does not apply."""
    p = tgi.parameters
    if p.best_of not in (None, 1):
        raise Unsupported(f"best_of must be 1 (one sequence per request), got {p.best_of}",
                          param="parameters.best_of")
    if p.max_new_tokens is not None and p.max_new_tokens < 1:
        raise BadRequest("`max_new_tokens` must be strictly positive", param="parameters.max_new_tokens")
    # TGI samples when asked (`do_sample`) or when a sampling parameter is set; else it is greedy.
    sampling = p.do_sample or (p.temperature not in (None, 1.0)) or (p.top_p not in (None, 1.0))
    fmt, regex = grammar_format(p.grammar, "parameters.grammar")
    top = p.top_n_tokens or 0
    req = GenerateRequest(
        model=model, prompt=tgi.inputs, adapter=p.adapter_id, stream=stream, timeout_ms=tgi.timeout_ms,
        # No max_new_tokens: until the model stops or its context is full, as TGI does.
        max_tokens=p.max_new_tokens,
        temperature=(p.temperature if p.temperature is not None else 1.0) if sampling else 0.0,
        top_p=p.top_p if p.top_p is not None else 1.0, seed=p.seed, stop=p.stop or None, format=fmt, regex=regex,
        logprobs=stream or p.details or top > 0, top_logprobs=top,
    )
    not_applied = [f"parameters.{n}" for n in fields.set_fields(p, IGNORED_TGI)
                   if not (n == "repetition_penalty" and p.repetition_penalty == 1.0)]
    return req, not_applied


def finish_reason(req: GenerateRequest, res: GenerateResult) -> str:
    """TGI's name; fleet's `stop` is an end-of-sequence token, or a stop string when some were sent."""
    if res.finish_reason == "stop" and req.stop:
        return "stop_sequence"
    return FINISH.get(res.finish_reason, res.finish_reason)


def token_text(t: WireLogprob) -> str:
    return t.token.decode("utf-8", "replace")


def tgi_token(t: WireLogprob) -> TgiToken:
    return TgiToken(t.id, token_text(t), t.logprob)


def top_tokens(t: WireLogprob) -> list[TgiToken]:
    return [TgiToken(i, b.decode("utf-8", "replace"), lp) for i, b, lp in zip(t.top_ids, t.top_tokens,
                                                                             t.top_logprobs)]


def details_of(req: GenerateRequest, res: GenerateResult) -> TgiDetails:
    lps = res.logprobs or []
    return TgiDetails(finish_reason(req, res), res.output_tokens, req.seed, [], [tgi_token(t) for t in lps],
                      [top_tokens(t) for t in lps] if req.top_logprobs else [])


def split_delta(text: str, lps: list[WireLogprob] | None) -> list[tuple[str, WireLogprob | None]]:
    """A streamed piece as one (text, token) per token it completes: each token's own
    text when they spell the piece, else the piece on its last token (a stop cut, or
    a character split across tokens)."""
    if not lps:
        return [(text, None)]
    texts = [token_text(t) for t in lps]
    if "".join(texts) != text:
        texts = [""] * (len(lps) - 1) + [text]
    return list(zip(texts, lps))


async def stream_events(req: GenerateRequest, tgi: TgiGenerateRequest, stream: TextStream
                        ) -> AsyncIterator[bytes]:
    """One event per token; the last one (held back until the result is in) carries
    the whole text, and `details` when asked, as TGI's last event does."""
    index, pending = 0, None
    try:
        async for text, lps in stream.deltas():
            for piece, t in split_delta(text, lps):
                if pending is not None:
                    yield sse(pending)
                index += 1
                token = TgiToken(t.id, piece, t.logprob) if t is not None else TgiToken(-1, piece, 0.0)
                pending = TgiStreamReply(index, token, top_tokens=top_tokens(t) if t and req.top_logprobs else None)
        res = stream.result
        prefix = tgi.inputs if tgi.parameters.return_full_text else ""
        details = TgiStreamDetails(finish_reason(req, res), res.output_tokens, req.seed, res.input_tokens) \
            if tgi.parameters.details else None
        if pending is None:  # nothing generated: one event for the end, as TGI's end-of-sequence token
            pending = TgiStreamReply(1, TgiToken(-1, "", 0.0, special=True))
        yield sse(msgspec.structs.replace(pending, generated_text=prefix + res.text, details=details))
    except FleetError as exc:
        yield sse(codec.hf_error(exc))  # TGI's error event: huggingface_hub reads its `error` string


async def stream_reply(daemon: Daemon, tgi: TgiGenerateRequest, model: str, dropped: list[str]) -> Stream:
    req, not_applied = native_request(tgi, model, stream=True)
    stream = TextStream(daemon, req, codec.encode_msgpack(req))
    await stream.started()
    return Stream(stream_events(req, tgi, stream), media_type="text/event-stream",
                  headers={**SSE_HEADERS, **fields.ignored_header(dropped + not_applied)})


async def tgi_request(request: Request, daemon: Daemon) -> tuple[TgiGenerateRequest, str, list[str]]:
    tgi, dropped = codec.decode_lenient(await request.body(), TgiGenerateRequest, msgpack=body_is_msgpack(request))
    if not tgi.inputs:
        raise BadRequest("`inputs` is empty", param="inputs")
    return tgi, tgi.model or default_model(daemon, "generate"), dropped


# ---- the others ------------------------------------------------------------------------

def id_lists(ids: list[int | list[int]]) -> list[list[int]]:
    """TEI's `ids`: one list of ids, or a list of them (not a mix)."""
    if all(x.__class__ is int for x in ids):
        return [ids]  # type: ignore[list-item]
    if any(x.__class__ is int for x in ids):
        raise BadRequest("`ids` mixes ids with id lists: send one list of ids, or a list of id lists", param="ids")
    return ids  # type: ignore[return-value]


def entities(found: list[Any], ignore: list[str]) -> list[HfEntity]:
    return [HfEntity(e.entity, e.score, e.text, e.start, e.end) for e in found if e.entity not in ignore]


class TgiController(Controller):
    tags = ["TGI"]

    @post("/generate", status_code=200)
    async def generate(self, request: Request, daemon: Daemon) -> Response | Stream:
        tgi, model, dropped = await tgi_request(request, daemon)
        if tgi.stream:  # as TGI's root does with `stream: true`
            return await stream_reply(daemon, tgi, model, dropped)
        req, not_applied = native_request(tgi, model, stream=False)
        res, answer = await tasks.generate(daemon, req, codec.encode_msgpack(req))
        prefix = tgi.inputs if tgi.parameters.return_full_text else ""
        out = TgiGenerateReply(prefix + res.text, details_of(req, res) if tgi.parameters.details else None)
        headers = {**answer_headers(answer), **fields.ignored_header(dropped + not_applied)}
        # TGI's root answers a one-item list ("to match api-inference"); /generate the object.
        return reply(request, [out] if request.scope.get(SCOPE_ROOT) else out, headers=headers)

    @post("/generate_stream", status_code=200)
    async def generate_stream(self, request: Request, daemon: Daemon) -> Stream:
        tgi, model, dropped = await tgi_request(request, daemon)
        return await stream_reply(daemon, tgi, model, dropped)

    @post("/similarity", status_code=200)
    async def similarity(self, request: Request, daemon: Daemon) -> Response:
        """TEI's sentence similarity: the cosine of the source sentence with each sentence."""
        sim, dropped = codec.decode_lenient(await request.body(), SimilarityRequest, msgpack=body_is_msgpack(request))
        params = sim.parameters or TeiParameters()
        refuse_unsupported(None, params.truncation_direction)
        if not sim.inputs.sentences:
            raise BadRequest("`inputs.sentences` is empty: send at least one sentence", param="inputs.sentences")
        req = EmbedRequest(model=sim.model or default_model(daemon, "embed"),
                           inputs=[sim.inputs.source_sentence, *sim.inputs.sentences], normalize=True,
                           truncate=True if params.truncate is None else params.truncate,
                           timeout_ms=sim.timeout_ms)
        res, answer = await tasks.embed(daemon, req, codec.encode_msgpack(req))
        vectors = tasks.vectors(res).astype(np.float32)
        not_applied = [f"parameters.{n}" for n in fields.set_fields(params, ("normalize", "dimensions", "prompt_name"))]
        return reply(request, (vectors[1:] @ vectors[0]).tolist(),
                     headers={**answer_headers(answer), **fields.ignored_header(dropped + not_applied)})

    @post("/decode", status_code=200)
    async def decode(self, request: Request, daemon: Daemon) -> Response:
        """TEI's decode: one text per id list, in the model's own vocabulary."""
        dec, dropped = codec.decode_lenient(await request.body(), DecodeRequest, msgpack=body_is_msgpack(request))
        ids = id_lists(dec.ids)
        tasks.check_inputs(daemon, ids)
        limit, count = daemon.settings.max_token_ids, sum(map(len, ids))
        if count > limit:
            raise too_large("the token ids sent", count, "max_token_ids", limit, param="ids")
        name = dec.model or default_model(daemon, "embed")
        manifest = stored(daemon, name) if dec.model else daemon.manifest(name, "embed")
        msgpack = wants_msgpack(request)

        def decode() -> bytes:
            tokenizer = load_tokenizer(daemon.store, manifest)
            check_ids(ids, tokenizer.get_vocab_size(with_added_tokens=True), manifest.name)
            return codec.encode(tokenizer.decode_batch(ids, skip_special_tokens=dec.skip_special_tokens),
                                msgpack=msgpack)

        # Decoding and encoding the texts (bounded above) run off the event loop (daemon.offload).
        return Response(content=await off_loop(count, decode), media_type=codec.MSGPACK if msgpack else codec.JSON,
                        headers=fields.ignored_header(dropped))

    @post("/pipeline/token-classification", status_code=200)
    async def token_classification(self, request: Request, daemon: Daemon) -> Response:
        """HF's token-classification shape over `/v1/extract`: one list of entities for one
        text, a list per text for several."""
        tc, dropped = codec.decode_lenient(await request.body(), TokenClassificationRequest,
                                           msgpack=body_is_msgpack(request))
        params = tc.parameters or TokenClassificationParameters()
        if params.aggregation_strategy not in AGGREGATIONS:
            raise Unsupported(f"aggregation_strategy {params.aggregation_strategy!r}: fleet's taggers answer whole "
                              f"entities (simple)", param="parameters.aggregation_strategy")
        texts = [tc.inputs] if isinstance(tc.inputs, str) else tc.inputs
        req = ExtractRequest(model=tc.model or default_model(daemon, "extract"), inputs=texts,
                             timeout_ms=tc.timeout_ms)
        results, _, answer = await tasks.extract(daemon, req, codec.encode_msgpack(req))
        ignore = params.ignore_labels if params.ignore_labels is not None else ["O"]
        rows = [entities(found, ignore) for found in results]
        not_applied = [f"parameters.{n}" for n in fields.set_fields(params, ("stride",))]
        return reply(request, rows[0] if isinstance(tc.inputs, str) else rows,
                     headers={**answer_headers(answer), **fields.ignored_header(dropped + not_applied)})
