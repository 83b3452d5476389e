"""`POST /v1/generate` (native) and OpenAI `POST /v1/completions`, `/v1/chat/completions`.

All three queue one `fleet.protocol.GenerateRequest` per completion through
`daemon.tasks.generate`, or `daemon.text_stream.TextStream` with `stream: true`: the
reply is then server-sent events, one per piece the worker publishes. Errors
before the first piece of text answer with their status; later ones end the
stream with an `error` event. A client that goes away mid-stream cancels its
request: the worker drops the sequence at its next step.

OpenAI fields map onto the native request: `tools`, `tool_choice` and history calls
onto the same (daemon.controllers.tool_calls), `response_format` onto `format`
(grammar-constrained decoding in the worker), `logprobs`/`top_logprobs` onto
the same; `stream_options.include_usage` adds the usage event. Fields fleet
does not implement answer 400 `unsupported` naming the field when they ask for
something; those that ask for nothing fleet could honour (`user`, `metadata`,
cache hints) are named in the `X-Fleet-Ignored-Fields` reply header.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError, Unsupported
from fleet.messages import CallPiece, GenerateResult
from fleet.messages import TokenLogprob as WireLogprob
from fleet.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionReply, ChatCompletionRequest,
    ChatDelta, ChatLogprobs, ChatMessage, CompletionChoice, CompletionLogprobs, CompletionReply, CompletionRequest,
    ErrorBody, ErrorReply, FunctionDelta, GenerateChunkReply, GenerateReply, GenerateRequest, OpenAICompletionUsage,
    ResponseFormat, ToolCallDelta, Usage,
)

from fleet.daemon import codec, fields, tasks
from fleet.daemon.controllers import tool_calls
from fleet.daemon.controllers.common import decode_request
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply
from fleet.daemon.tasks import length_limit_headers, token_logprobs
from fleet.daemon.text_stream import TextStream


#: Most likely tokens per step of the legacy completions' `logprobs` (OpenAI's limit).
MAX_LEGACY_LOGPROBS = 5
#: Most choices one chat request may ask for (`n`; OpenAI's limit is 128).
MAX_CHOICES = 16
#: OpenAI chat fields fleet does not implement: a request that sets one is refused by name
#: (`functions` and `function_call` are the deprecated spelling of `tools`: send those).
UNSUPPORTED_CHAT = ("functions", "function_call", "logit_bias", "audio", "prediction", "store",
                    "reasoning_effort", "verbosity", "web_search_options", "moderation")
UNSUPPORTED_COMPLETION = ("echo", "suffix", "logit_bias")
#: Message fields fleet does not take: the deprecated function call, audio.
UNSUPPORTED_MESSAGE = ("function_call", "audio")
#: OpenAI fields accepted and not applied (they ask for nothing fleet could honour):
#: named in the reply's `X-Fleet-Ignored-Fields`.
IGNORED_CHAT = ("user", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                "prompt_cache_options", "safety_identifier")
IGNORED_MESSAGE = ("name", "refusal")
IGNORED_COMPLETION = ("user",)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest, fields: tuple[str, ...]) -> None:
    """400 `unsupported` for the first field that asks for something fleet does not do."""
    if req.n != 1 and (isinstance(req, CompletionRequest) or req.stream):
        when = "" if isinstance(req, CompletionRequest) else " when streamed"
        raise Unsupported(f"n must be 1{when} (one choice per request), got {req.n}", param="n")
    if not 1 <= req.n <= MAX_CHOICES:
        raise BadRequest(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
    for name in fields:
        if getattr(req, name) not in (None, False, [], {}):
            raise Unsupported(f"`{name}` is not supported by this server", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise Unsupported(f"`{name}` is not supported by this server (send 0 or leave it out)", param=name)


def refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    refuse_unsupported(req, UNSUPPORTED_CHAT)
    if req.modalities not in (None, ["text"]):
        raise Unsupported("only text output is supported: `modalities` may be [\"text\"]", param="modalities")
    for i, message in enumerate(req.messages):
        asked = fields.set_fields(message, UNSUPPORTED_MESSAGE)
        if asked:
            raise Unsupported(f"`messages[{i}].{asked[0]}` is not supported by this server (send `tool_calls`; "
                              "no audio)", param=f"messages[{i}].{asked[0]}")


def chat_request(oreq: ChatCompletionRequest) -> GenerateRequest:
    """The native request of an OpenAI chat one."""
    max_tokens = oreq.max_completion_tokens or oreq.max_tokens
    messages = tool_calls.named_results([
        ChatMessage(m.role, m.content, tool_calls.chat_calls(m.tool_calls, f"messages[{i}].tool_calls"),
                    m.tool_call_id)
        for i, m in enumerate(oreq.messages)])
    return GenerateRequest(model=oreq.model, messages=messages, temperature=oreq.temperature,
                           top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream,
                           format=output_format(oreq.response_format),
                           regex=output_regex(oreq.response_format), logprobs=oreq.logprobs,
                           top_logprobs=oreq.top_logprobs or 0, max_tokens=max_tokens,
                           tools=tool_calls.chat_tools(oreq.tools), tool_choice=tool_calls.tool_choice(oreq.tool_choice),
                           parallel_tool_calls=oreq.parallel_tool_calls is not False)


def chat_choice(index: int, res: GenerateResult, logprobs: bool) -> ChatChoice:
    """One choice: the text (null when the model only called tools) and the calls."""
    calls = tool_calls.reply_calls(res.tool_calls) if res.tool_calls else msgspec.UNSET
    content = None if res.tool_calls and not res.text else res.text
    return ChatChoice(index, AssistantMessage(content, tool_calls=calls), res.finish_reason,
                      ChatLogprobs(token_logprobs(res.logprobs)) if logprobs else None, limit_field(res))


def call_deltas(pieces: list[CallPiece], ids: dict[int, str]) -> list[ToolCallDelta]:
    """Streamed pieces of calls as OpenAI's deltas: a call's first gives its id (minted
    here, kept in `ids`), type and name, the next ones characters of its arguments."""
    out = []
    for p in pieces:
        if p.index in ids:
            out.append(ToolCallDelta(p.index, FunctionDelta(arguments=p.arguments)))
        else:
            ids[p.index] = tool_calls.call_id()
            out.append(ToolCallDelta(p.index, FunctionDelta(p.name, p.arguments), ids[p.index], "function"))
    return out


def ignored_chat_fields(req: ChatCompletionRequest) -> list[str]:
    """What a chat request sets that fleet accepts and does not apply (the header's names)."""
    return fields.set_fields(req, IGNORED_CHAT) + [
        f"messages[{i}].{name}" for i, m in enumerate(req.messages) for name in fields.set_fields(m, IGNORED_MESSAGE)]


def output_format(rf: ResponseFormat | None) -> str | dict | None:
    """OpenAI `response_format` as the native `format` (TGI's `json_object`/`json` with a
    schema in `value` as that schema; its `regex` is `output_regex`'s)."""
    if rf is None or rf.type in ("text", "regex"):
        return None
    if rf.type in ("json_object", "json"):
        if rf.value is None:
            return "json"
        if not isinstance(rf.value, dict):
            raise BadRequest("response_format `value` must be a JSON Schema object", param="response_format")
        return rf.value
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise BadRequest("response_format of type json_schema needs `json_schema.schema`", param="response_format")
    return rf.json_schema.schema


def output_regex(rf: ResponseFormat | None) -> str | None:
    """TGI's `response_format` `{"type": "regex", "value": pattern}` as the native `regex`."""
    if rf is None or rf.type != "regex":
        return None
    if not isinstance(rf.value, str) or not rf.value:
        raise BadRequest("response_format of type regex needs `value`: the regular expression",
                         param="response_format")
    return rf.value


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


def sse(obj: object) -> bytes:
    return b"data: " + codec.json_line(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def error_events(stream: TextStream, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure after the stream started ends it with an error event (headers are sent)."""
    try:
        async for event in events:
            yield event
    except FleetError as exc:
        yield sse(ErrorReply(ErrorBody(exc.code, exc.message)))


def event_stream(events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> Stream:
    return Stream(events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


def completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def limit_field(res: GenerateResult) -> str | msgspec.UnsetType:
    """A reply's `length_limit`: there only when a server limit ended the text."""
    return res.length_limit or msgspec.UNSET


def openai_usage(res: GenerateResult) -> OpenAICompletionUsage:
    return OpenAICompletionUsage(res.input_tokens, res.output_tokens, res.input_tokens + res.output_tokens)


class GenerateController(Controller):
    path = "/v1"

    @post("/generate", status_code=200)
    async def generate(self, request: Request, daemon: Daemon) -> Response | Stream:
        req, payload = await decode_request(request, GenerateRequest)
        if not req.stream:
            res, answer = await tasks.generate(daemon, req, payload)
            usage = Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens)
            return reply(request, GenerateReply(req.model, res.text, res.finish_reason, usage,
                                                token_logprobs(res.logprobs), res.length_limit or None,
                                                tool_calls.reply_calls(res.tool_calls) or None),
                         headers={**answer_headers(answer), **length_limit_headers(res)})
        stream = TextStream(daemon, req, payload)
        await stream.started()

        async def events() -> AsyncIterator[bytes]:
            async for text, lps in stream.deltas():
                yield sse(GenerateChunkReply(req.model, text, logprobs=token_logprobs(lps)))
            res = stream.result
            yield sse(GenerateChunkReply(req.model, "", res.finish_reason,
                                         Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens),
                                         length_limit=res.length_limit or None,
                                         tool_calls=tool_calls.reply_calls(res.tool_calls) or None))
            yield SSE_DONE

        return event_stream(error_events(stream, events()))

    @post("/completions", status_code=200)
    async def completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        oreq = codec.decode(await request.body(), CompletionRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported(oreq, UNSUPPORTED_COMPLETION)
        if oreq.best_of not in (None, 1):
            raise Unsupported(f"best_of must be 1, got {oreq.best_of}", param="best_of")
        if oreq.logprobs is not None and not 0 <= oreq.logprobs <= MAX_LEGACY_LOGPROBS:
            raise BadRequest(f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}, got {oreq.logprobs}",
                             param="logprobs")
        prompts = [oreq.prompt] if isinstance(oreq.prompt, str) else oreq.prompt
        if not prompts:
            raise BadRequest("`prompt` is empty")
        ignored = fields.ignored_header(fields.set_fields(oreq, IGNORED_COMPLETION))
        fmt = output_format(oreq.response_format)
        reqs = [GenerateRequest(model=oreq.model, prompt=p, max_tokens=oreq.max_tokens, temperature=oreq.temperature,
                                top_p=oreq.top_p, seed=oreq.seed, stop=oreq.stop, stream=oreq.stream, format=fmt,
                                regex=output_regex(oreq.response_format),
                                logprobs=oreq.logprobs is not None, top_logprobs=oreq.logprobs or 0)
                for p in prompts]
        cid, created = completion_id("cmpl"), int(time.time())
        if not oreq.stream:
            done = await asyncio.gather(*(tasks.generate(daemon, r, codec.encode_msgpack(r)) for r in reqs))
            choices = [CompletionChoice(i, res.text, res.finish_reason, completion_logprobs(res.logprobs))
                       for i, (res, _) in enumerate(done)]
            usage = OpenAICompletionUsage(
                sum(r.input_tokens for r, _ in done), sum(r.output_tokens for r, _ in done),
                sum(r.input_tokens + r.output_tokens for r, _ in done),
            )
            return reply(request, CompletionReply(cid, created, oreq.model, choices, usage),
                         headers={**answer_headers(done[0][1]), **ignored})
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

        return event_stream(error_events(stream, events()), ignored)

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, daemon: Daemon) -> Response | Stream:
        oreq = codec.decode(await request.body(), ChatCompletionRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported_chat(oreq)
        ignored = fields.ignored_header(ignored_chat_fields(oreq))
        req = chat_request(oreq)
        payload = codec.encode_msgpack(req)
        cid, created = completion_id("chatcmpl"), int(time.time())
        if not oreq.stream:
            # n choices: n generations of the same request (seeded ones with seed, seed + 1, ...).
            reqs = [req] + [msgspec.structs.replace(req, seed=None if req.seed is None else req.seed + i)
                            for i in range(1, oreq.n)]
            done = await asyncio.gather(*(tasks.generate(daemon, r, payload if r is req else codec.encode_msgpack(r))
                                          for r in reqs))
            choices = [chat_choice(i, res, oreq.logprobs) for i, (res, _) in enumerate(done)]
            out = sum(res.output_tokens for res, _ in done)
            usage = OpenAICompletionUsage(done[0][0].input_tokens, out, done[0][0].input_tokens + out)
            return reply(request, ChatCompletionReply(cid, created, oreq.model, choices, usage),
                         headers={**answer_headers(done[0][1]), **length_limit_headers(done[0][0]), **ignored})
        stream = TextStream(daemon, req, payload)
        await stream.started()
        include_usage = oreq.stream_options is not None and oreq.stream_options.include_usage

        async def events() -> AsyncIterator[bytes]:
            yield sse(ChatCompletionChunk(cid, created, oreq.model, [ChatChunkChoice(0, ChatDelta(role="assistant"))]))
            ids: dict[int, str] = {}  # each call's id, minted with its first piece
            async for text, lps, calls in stream.parts():
                if text or lps:
                    logprobs = ChatLogprobs(token_logprobs(lps)) if oreq.logprobs else None
                    yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                                  [ChatChunkChoice(0, ChatDelta(content=text), None, logprobs)]))
                if calls:
                    yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                                  [ChatChunkChoice(0, ChatDelta(tool_calls=call_deltas(calls, ids)))]))
            res = stream.result
            yield sse(ChatCompletionChunk(cid, created, oreq.model,
                                          [ChatChunkChoice(0, ChatDelta(), res.finish_reason, None,
                                                           limit_field(res))]))
            if include_usage:
                yield sse(ChatCompletionChunk(cid, created, oreq.model, [], openai_usage(res)))
            yield SSE_DONE

        return event_stream(error_events(stream, events()), ignored)
