"""`POST /v1/generate` (native) and OpenAI `POST /v1/completions`, `/v1/chat/completions`.

All three queue one `fleet.protocol.GenerateRequest` per completion. With
`stream: true` the reply is server-sent events: the worker publishes partial
results (fleet.messages.GenerateChunk) while the item stays claimed, the
broker hands them to this request's `asyncio.Queue`, and the final result
(the whole text) ends the stream, filling in any piece that did not arrive.
Errors before the first piece of text answer with their status; later ones
end the stream with an `error` event. A client that goes away mid-stream
cancels its request: the worker drops the sequence at its next step.

OpenAI fields map onto the native request: `response_format` onto `format`
(grammar-constrained decoding in the worker), `logprobs`/`top_logprobs` onto
the same; `stream_options.include_usage` adds the usage event. Fields fleet
does not implement answer 400 `unsupported` naming the field.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError, ModelNotFound, Unsupported
from fleet.messages import GenerateChunk, GenerateResult
from fleet.messages import TokenLogprob as WireLogprob
from fleet.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionReply, ChatCompletionRequest,
    ChatDelta, ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionReply, CompletionRequest, ErrorBody,
    ErrorReply, GenerateChunkReply, GenerateReply, GenerateRequest, OpenAICompletionUsage, ResponseFormat,
    TokenLogprob, TopLogprob, Usage,
)
from local_queue import Done

from daemon import codec
from daemon.broker import Answer
from daemon.controllers.common import decode_request
from daemon.controllers.embed import answer_headers, estimate_tokens
from daemon.core import Daemon
from daemon.http import reply

_result = msgspec.msgpack.Decoder(GenerateResult)
_chunk = msgspec.msgpack.Decoder(GenerateChunk)
_json = msgspec.json.Encoder()

#: Upper bound checked here; the worker checks the model's own (prompt + max_tokens <= its context).
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOPS = 8
#: Most likely tokens per step: chat and native `top_logprobs` (OpenAI's limit), legacy `logprobs`.
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
#: OpenAI chat fields fleet does not implement: a request that sets one is refused by name.
UNSUPPORTED_CHAT = ("tools", "functions", "function_call", "logit_bias", "audio", "prediction")
UNSUPPORTED_COMPLETION = ("echo", "suffix", "logit_bias")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_generate(req: GenerateRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("send exactly one of `prompt` or `messages`")
    if req.prompt is not None and not req.prompt:
        raise BadRequest("`prompt` is empty")
    if req.messages is not None and not req.messages:
        raise BadRequest("`messages` is empty: send at least one message")
    if not 1 <= req.max_tokens <= MAX_TOKENS_LIMIT:
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


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest, fields: tuple[str, ...]) -> None:
    """400 `unsupported` for the first field that asks for something fleet does not do."""
    if req.n != 1:
        raise Unsupported(f"n must be 1 (one choice per request), got {req.n}", param="n")
    for name in fields:
        if getattr(req, name) not in (None, False, [], {}):
            raise Unsupported(f"`{name}` is not supported by this server", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise Unsupported(f"`{name}` is not supported by this server (send 0 or leave it out)", param=name)


def refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    refuse_unsupported(req, UNSUPPORTED_CHAT)
    if req.tool_choice not in (None, "none", "auto"):
        raise Unsupported("`tool_choice` is not supported by this server (no tool calling)", param="tool_choice")
    if req.modalities not in (None, ["text"]):
        raise Unsupported("only text output is supported: `modalities` may be [\"text\"]", param="modalities")


def output_format(rf: ResponseFormat | None) -> str | dict | None:
    """OpenAI `response_format` as the native `format`."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "json"
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise BadRequest("response_format of type json_schema needs `json_schema.schema`", param="response_format")
    return rf.json_schema.schema


def token_logprobs(wire: list[WireLogprob] | None) -> list[TokenLogprob] | None:
    """The worker's per-token bytes and logprobs in OpenAI's chat shape."""
    if wire is None:
        return None
    return [
        TokenLogprob(t.token.decode("utf-8", "replace"), t.logprob, list(t.token),
                     [TopLogprob(b.decode("utf-8", "replace"), lp, list(b))
                      for b, lp in zip(t.top_tokens, t.top_logprobs)])
        for t in wire
    ]


def completion_logprobs(wire: list[WireLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """The legacy completions shape; `offset` = characters of the text before these tokens."""
    if wire is None:
        return None
    tokens = [t.token.decode("utf-8", "replace") for t in wire]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return CompletionLogprobs(tokens, [t.logprob for t in wire],
                              [{b.decode("utf-8", "replace"): lp for b, lp in zip(t.top_tokens, t.top_logprobs)}
                               for t in wire], offsets)


def target_model(daemon: Daemon, req: GenerateRequest) -> str:
    """The store name the request runs as: the model, or its LoRA `adapter` (which
    must be an adapter of that model)."""
    if req.adapter is None:
        return req.model
    try:
        adapter = daemon.manifest(req.adapter, "generate")
    except ModelNotFound:
        raise ModelNotFound(f"unknown LoRA adapter {req.adapter!r}", hint="fleetctl list shows what is pulled") \
            from None
    if adapter.base is None:
        raise BadRequest(f"{req.adapter!r} is not a LoRA adapter")
    if adapter.base != req.model:
        raise BadRequest(f"LoRA adapter {req.adapter!r} is for base model {adapter.base!r}, not {req.model!r}")
    return req.adapter


async def generate(daemon: Daemon, req: GenerateRequest, payload: bytes) -> tuple[GenerateResult, Answer]:
    check_generate(req)
    answer = await daemon.submit("generate", target_model(daemon, req), payload,
                                 tokens=estimate_tokens(payload, 1) + req.max_tokens, timeout_ms=req.timeout_ms)
    return _result.decode(answer.body), answer


class TextStream:
    """One streaming generation: text deltas as the worker publishes them, then the result."""

    def __init__(self, daemon: Daemon, req: GenerateRequest, payload: bytes) -> None:
        check_generate(req)
        self.pieces: asyncio.Queue[Done] = asyncio.Queue()
        self.task = asyncio.ensure_future(daemon.submit(
            "generate", target_model(daemon, req), payload, tokens=estimate_tokens(payload, 1) + req.max_tokens,
            timeout_ms=req.timeout_ms, on_partial=self.pieces.put_nowait,
        ))
        self.sent = 0  # characters of the final text already sent
        self.logprobs_sent = 0  # token logprobs already sent
        self.result: GenerateResult | None = None
        self._next: asyncio.Future[Done] | None = None

    async def _wait(self) -> Done | None:
        """The next partial result, or None once the final result is in (and no piece is left)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.pieces.get())
        await asyncio.wait({self.task, self._next}, return_when=asyncio.FIRST_COMPLETED)
        if self._next.done():
            piece, self._next = self._next.result(), None
            return piece
        # The broker hands over every piece before it resolves the final result.
        if self.pieces.empty():
            self._next.cancel()
            self._next = None
            return None
        return await self._wait()

    async def started(self) -> None:
        """Wait for the first piece or the end: an error before any text raises here,
        so the client gets it with its HTTP status."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.pieces.get())
        await asyncio.wait({self.task, self._next}, return_when=asyncio.FIRST_COMPLETED)
        if self.task.done() and not self._next.done():
            self.task.result()

    async def deltas(self) -> AsyncIterator[tuple[str, list[WireLogprob] | None]]:
        """New text with the logprobs of the tokens it completes, in order; the final
        result fills in what no piece carried."""
        try:
            while (done := await self._wait()) is not None:
                piece = _chunk.decode(done.result)
                if piece.start == self.sent and piece.text:
                    self.sent += len(piece.text)
                    self.logprobs_sent += len(piece.logprobs or ())
                    yield piece.text, piece.logprobs
            self.result = res = _result.decode(self.task.result().body)
            rest = res.logprobs[self.logprobs_sent:] if res.logprobs is not None else None
            if len(res.text) > self.sent or rest:
                text = res.text[self.sent:]
                self.sent, self.logprobs_sent = len(res.text), self.logprobs_sent + len(rest or ())
                yield text, rest
        finally:
            if self._next is not None:
                self._next.cancel()
            if not self.task.done():
                # The client went away: the broker cancels the queue item, and the
                # worker drops the sequence at its next step.
                self.task.cancel()


def sse(obj: object) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def error_events(stream: TextStream, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure after the stream started ends it with an error event (headers are sent)."""
    try:
        async for event in events:
            yield event
    except FleetError as exc:
        yield sse(ErrorReply(ErrorBody(exc.code, exc.message)))


def event_stream(events: AsyncIterator[bytes]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def openai_usage(res: GenerateResult) -> OpenAICompletionUsage:
    return OpenAICompletionUsage(res.input_tokens, res.output_tokens, res.input_tokens + res.output_tokens)


class GenerateController(Controller):
    path = "/v1"

    @post("/generate", status_code=200)
    async def generate(self, request: Request, daemon: Daemon) -> Response | Stream:
        req, payload = await decode_request(request, GenerateRequest)
        if not req.stream:
            res, answer = await generate(daemon, req, payload)
            usage = Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens)
            return reply(request, GenerateReply(req.model, res.text, res.finish_reason, usage,
                                                token_logprobs(res.logprobs)),
                         headers=answer_headers(answer))
        stream = TextStream(daemon, req, payload)
        await stream.started()

        async def events() -> AsyncIterator[bytes]:
            async for text, lps in stream.deltas():
                yield sse(GenerateChunkReply(req.model, text, logprobs=token_logprobs(lps)))
            res = stream.result
            yield sse(GenerateChunkReply(req.model, "", res.finish_reason,
                                         Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))

    @post("/completions", status_code=200)
    async def completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        body = await request.body()
        oreq = codec.decode(body, CompletionRequest, msgpack=codec.is_msgpack(request.headers.get("content-type")))
        refuse_unsupported(oreq, UNSUPPORTED_COMPLETION)
        if oreq.best_of not in (None, 1):
            raise Unsupported(f"best_of must be 1, got {oreq.best_of}", param="best_of")
        if oreq.logprobs is not None and not 0 <= oreq.logprobs <= MAX_LEGACY_LOGPROBS:
            raise BadRequest(f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}, got {oreq.logprobs}",
                             param="logprobs")
        prompts = [oreq.prompt] if isinstance(oreq.prompt, str) else oreq.prompt
        if not prompts:
            raise BadRequest("`prompt` is empty")
        fmt = output_format(oreq.response_format)
        reqs = [GenerateRequest(model=oreq.model, prompt=p, max_tokens=oreq.max_tokens, temperature=oreq.temperature,
                                top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream, format=fmt,
                                logprobs=oreq.logprobs is not None, top_logprobs=oreq.logprobs or 0)
                for p in prompts]
        cid, created = completion_id("cmpl"), int(time.time())
        if not oreq.stream:
            done = await asyncio.gather(*(generate(daemon, r, codec.encode_msgpack(r)) for r in reqs))
            choices = [CompletionChoice(i, res.text, res.finish_reason, completion_logprobs(res.logprobs))
                       for i, (res, _) in enumerate(done)]
            usage = OpenAICompletionUsage(
                sum(r.input_tokens for r, _ in done), sum(r.output_tokens for r, _ in done),
                sum(r.input_tokens + r.output_tokens for r, _ in done),
            )
            return reply(request, CompletionReply(cid, created, oreq.model, choices, usage),
                         headers=answer_headers(done[0][1]))
        if len(reqs) != 1:
            raise BadRequest("streaming takes one prompt per request")
        stream = TextStream(daemon, reqs[0], codec.encode_msgpack(reqs[0]))
        await stream.started()

        include_usage = oreq.stream_options is not None and oreq.stream_options.include_usage

        async def events() -> AsyncIterator[bytes]:
            offset = 0
            async for text, lps in stream.deltas():
                yield sse(CompletionReply(cid, created, oreq.model,
                                          [CompletionChoice(0, text, None, completion_logprobs(lps, offset))]))
                offset += len(text)
            res = stream.result
            # Without include_usage the finishing event carries the usage (as it always has).
            yield sse(CompletionReply(cid, created, oreq.model, [CompletionChoice(0, "", res.finish_reason)],
                                      None if include_usage else openai_usage(res)))
            if include_usage:
                yield sse(CompletionReply(cid, created, oreq.model, [], openai_usage(res)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        body = await request.body()
        oreq = codec.decode(body, ChatCompletionRequest,
                            msgpack=codec.is_msgpack(request.headers.get("content-type")))
        refuse_unsupported_chat(oreq)
        max_tokens = oreq.max_completion_tokens or oreq.max_tokens
        req = GenerateRequest(model=oreq.model, messages=oreq.messages, temperature=oreq.temperature,
                              top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream,
                              format=output_format(oreq.response_format), logprobs=oreq.logprobs,
                              top_logprobs=oreq.top_logprobs or 0,
                              **({"max_tokens": max_tokens} if max_tokens is not None else {}))
        payload = codec.encode_msgpack(req)
        cid, created = completion_id("chatcmpl"), int(time.time())
        if not oreq.stream:
            res, answer = await generate(daemon, req, payload)
            logprobs = ChatLogprobs(token_logprobs(res.logprobs)) if oreq.logprobs else None
            choice = ChatChoice(0, AssistantMessage(res.text), res.finish_reason, logprobs)
            return reply(request, ChatCompletionReply(cid, created, oreq.model, [choice], openai_usage(res)),
                         headers=answer_headers(answer))
        stream = TextStream(daemon, req, payload)
        await stream.started()
        include_usage = oreq.stream_options is not None and oreq.stream_options.include_usage

        async def events() -> AsyncIterator[bytes]:
            yield sse(ChatCompletionChunk(cid, created, oreq.model, [ChatChunkChoice(0, ChatDelta(role="assistant"))]))
            async for text, lps in stream.deltas():
                logprobs = ChatLogprobs(token_logprobs(lps)) if oreq.logprobs else None
                yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                              [ChatChunkChoice(0, ChatDelta(content=text), None, logprobs)]))
            res = stream.result
            yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                          [ChatChunkChoice(0, ChatDelta(), res.finish_reason)]))
            if include_usage:
                yield sse(ChatCompletionChunk(cid, created, oreq.model, [], openai_usage(res)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))
