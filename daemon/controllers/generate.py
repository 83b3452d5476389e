"""`POST /v1/generate` (native) and OpenAI `POST /v1/completions`, `/v1/chat/completions`.

All three queue one `fleet.protocol.GenerateRequest` per completion. With
`stream: true` the reply is server-sent events: the worker publishes partial
results (fleet.messages.GenerateChunk) while the item stays claimed, the
broker hands them to this request's `asyncio.Queue`, and the final result
(the whole text) ends the stream, filling in any piece that did not arrive.
Errors before the first piece of text answer with their status; later ones
end the stream with an `error` event.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError, ModelNotFound
from fleet.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionReply, ChatCompletionRequest,
    ChatDelta, CompletionChoice, CompletionReply, CompletionRequest, ErrorBody, ErrorReply, GenerateChunkReply,
    GenerateReply, GenerateRequest, OpenAICompletionUsage, Usage,
)
from local_queue import Done
from fleet.messages import GenerateChunk, GenerateResult

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

    async def deltas(self) -> AsyncIterator[str]:
        """New text, in order; the final result's text fills in what no piece carried."""
        try:
            while (done := await self._wait()) is not None:
                piece = _chunk.decode(done.result)
                if piece.start == self.sent and piece.text:
                    self.sent += len(piece.text)
                    yield piece.text
            self.result = _result.decode(self.task.result().body)
            if len(self.result.text) > self.sent:
                rest = self.result.text[self.sent:]
                self.sent = len(self.result.text)
                yield rest
        finally:
            if self._next is not None:
                self._next.cancel()
            if not self.task.done():
                self.task.cancel()  # the client went away: stop waiting (the worker finishes the sequence)


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
            return reply(request, GenerateReply(req.model, res.text, res.finish_reason, usage),
                         headers=answer_headers(answer))
        stream = TextStream(daemon, req, payload)
        await stream.started()

        async def events() -> AsyncIterator[bytes]:
            async for text in stream.deltas():
                yield sse(GenerateChunkReply(req.model, text))
            res = stream.result
            yield sse(GenerateChunkReply(req.model, "", res.finish_reason,
                                         Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))

    @post("/completions", status_code=200)
    async def completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        body = await request.body()
        oreq = codec.decode(body, CompletionRequest, msgpack=codec.is_msgpack(request.headers.get("content-type")))
        if oreq.n != 1:
            raise BadRequest(f"n must be 1, got {oreq.n}")
        prompts = [oreq.prompt] if isinstance(oreq.prompt, str) else oreq.prompt
        if not prompts:
            raise BadRequest("`prompt` is empty")
        reqs = [GenerateRequest(model=oreq.model, prompt=p, max_tokens=oreq.max_tokens, temperature=oreq.temperature,
                                top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream)
                for p in prompts]
        cid, created = completion_id("cmpl"), int(time.time())
        if not oreq.stream:
            done = await asyncio.gather(*(generate(daemon, r, codec.encode_msgpack(r)) for r in reqs))
            choices = [CompletionChoice(i, res.text, res.finish_reason) for i, (res, _) in enumerate(done)]
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

        async def events() -> AsyncIterator[bytes]:
            async for text in stream.deltas():
                yield sse(CompletionReply(cid, created, oreq.model, [CompletionChoice(0, text, None)]))
            res = stream.result
            yield sse(CompletionReply(cid, created, oreq.model, [CompletionChoice(0, "", res.finish_reason)],
                                      openai_usage(res)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        body = await request.body()
        oreq = codec.decode(body, ChatCompletionRequest,
                            msgpack=codec.is_msgpack(request.headers.get("content-type")))
        if oreq.n != 1:
            raise BadRequest(f"n must be 1, got {oreq.n}")
        max_tokens = oreq.max_completion_tokens or oreq.max_tokens
        req = GenerateRequest(model=oreq.model, messages=oreq.messages, temperature=oreq.temperature,
                              top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream,
                              **({"max_tokens": max_tokens} if max_tokens is not None else {}))
        payload = codec.encode_msgpack(req)
        cid, created = completion_id("chatcmpl"), int(time.time())
        if not oreq.stream:
            res, answer = await generate(daemon, req, payload)
            choice = ChatChoice(0, AssistantMessage(res.text), res.finish_reason)
            return reply(request, ChatCompletionReply(cid, created, oreq.model, [choice], openai_usage(res)),
                         headers=answer_headers(answer))
        stream = TextStream(daemon, req, payload)
        await stream.started()

        async def events() -> AsyncIterator[bytes]:
            yield sse(ChatCompletionChunk(cid, created, oreq.model, [ChatChunkChoice(0, ChatDelta(role="assistant"))]))
            async for text in stream.deltas():
                yield sse(ChatCompletionChunk(cid, created, oreq.model, [ChatChunkChoice(0, ChatDelta(content=text))]))
            res = stream.result
            yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                          [ChatChunkChoice(0, ChatDelta(), res.finish_reason)]))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))
