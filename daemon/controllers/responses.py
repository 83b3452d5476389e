"""OpenAI's Responses API: `POST /v1/responses` (what `client.responses.create` and
new agents speak), with the shapes of the `openai` package (openai/types/responses).

One response is one native generation through `daemon.tasks.generate` (or
`TextStream` with `stream: true`): `input` as a text (one user turn) or message
items (`role` system/developer/user/assistant, `content` a text or
`input_text`/`output_text` parts) rendered with the model's chat template;
`instructions` as the first system turn; `max_output_tokens`, `temperature`,
`top_p`; `text.format` json_schema / json_object enforced while decoding;
function `tools`, `tool_choice` and `parallel_tool_calls` (daemon.controllers.
tool_calls), with `function_call` and `function_call_output` input items as
the history's calls and results. The reply is a `response` object: one
assistant `message` whose one part is `output_text` (left out when the model
only called tools) and a `function_call` item per call; `status` "incomplete"
with `incomplete_details.reason` "max_output_tokens" when the budget ended it.
A stream is OpenAI's typed events (`event:` + `data:` lines): response.created,
response.in_progress, then for text response.output_item.added,
response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done,
response.output_item.done, for each call response.output_item.added,
response.function_call_arguments.delta, .done, response.output_item.done, then
response.completed or response.incomplete.

fleet keeps no responses: `previous_response_id`, `store: true`, `background`,
`conversation` and hosted tools answer 400 `unsupported` naming the field. As on
the other OpenAI routes, unknown fields are refused and fields accepted but not
applied (`user`, `metadata`, cache hints) are named in `X-Fleet-Ignored-Fields`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from fleet.errors import BadRequest, FleetError, Unsupported
from fleet.messages import GenerateResult
from fleet.protocol import ChatMessage, FunctionCall, GenerateRequest, ToolCall

from fleet.daemon import codec, fields, tasks
from fleet.daemon.controllers import tool_calls
from fleet.daemon.controllers.generate import SSE_HEADERS
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply
from fleet.daemon.text_stream import TextStream

#: Fields that ask for what fleet does not do (it keeps no responses).
UNSUPPORTED = ("previous_response_id", "background", "conversation", "prompt", "reasoning",
               "max_tool_calls", "include")
IGNORED = ("user", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
           "truncation", "stream_options")
ROLES = ("system", "developer", "user", "assistant")


class TextFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema: dict | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: int | None = None
    include: list[str] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    stream_options: dict[str, Any] | None = None
    timeout_ms: int | None = None


class OutputText(msgspec.Struct, frozen=True):
    text: str
    annotations: list[Any] = []
    type: str = "output_text"
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, frozen=True, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, frozen=True, tag_field="type", tag="function_call"):
    """A call the model made (`call_id` is what its `function_call_output` answers)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(msgspec.Struct, frozen=True):
    """`length_limit` (fleet's): the server limit that ended the text, when one did
    (GenerateReply's); the reason stays OpenAI's "max_output_tokens"."""

    reason: str
    length_limit: str | msgspec.UnsetType = msgspec.UNSET


class ResponseObject(msgspec.Struct, frozen=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputMessage | FunctionCallItem]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    text: dict[str, Any]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    object: str = "response"
    parallel_tool_calls: bool = False
    tool_choice: Any = "none"
    tools: list[Any] = []
    store: bool = False
    metadata: dict[str, str] = {}


def refuse_unsupported(req: ResponsesRequest) -> None:
    for name in UNSUPPORTED:
        if getattr(req, name) not in (None, False, [], {}):
            why = "fleet keeps no responses" if name in ("previous_response_id", "conversation", "background") \
                else "not supported by this server"
            raise Unsupported(f"`{name}`: {why}; send the whole conversation in `input`", param=name)
    if req.store:
        raise Unsupported("`store`: fleet keeps no responses (send store: false or leave it out)", param="store")


def part_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"`{where}.content` must be a text or a list of parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise Unsupported(f"`{where}.content[{j}]` of type {kind!r}: only text parts are supported",
                              param=f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def messages_of(req: ResponsesRequest) -> list[ChatMessage]:
    """The chat turns of `instructions` and `input`: messages, and the history's calls
    (consecutive `function_call` items are one assistant turn) and their results."""
    out = [ChatMessage("system", req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return out + [ChatMessage("user", req.input)]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "function_call":
            call = history_call(item, f"input[{i}]")
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1] = msgspec.structs.replace(out[-1], tool_calls=[*out[-1].tool_calls, call])
            else:
                out.append(ChatMessage("assistant", None, [call]))
            continue
        if kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else part_text(output, f"input[{i}].output")
            out.append(ChatMessage("tool", text, tool_call_id=str(item.get("call_id", ""))))
            continue
        if kind != "message" or item.get("role") not in ROLES:
            raise Unsupported(f"`input[{i}]` of type {kind!r}: only messages (role {', '.join(ROLES)}), "
                              "function_call and function_call_output items are supported", param=f"input[{i}]")
        out.append(ChatMessage(item["role"], part_text(item.get("content"), f"input[{i}]")))
    if not out:
        raise BadRequest("`input` is empty", param="input")
    return tool_calls.named_results(out)


def history_call(item: dict[str, Any], where: str) -> ToolCall:
    name, arguments, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id", "")
    if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise BadRequest(f"`{where}`: a function_call item needs `name`, `arguments` (JSON text) and `call_id`",
                         param=where)
    return ToolCall(FunctionCall(name, arguments), id=call_id)


def output_format(text: TextConfig | None) -> str | dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json"
    if fmt.schema is None:
        raise BadRequest("text.format of type json_schema needs `schema`", param="text.format.schema")
    return fmt.schema


def native(req: ResponsesRequest) -> GenerateRequest:
    kw: dict[str, Any] = {"max_tokens": req.max_output_tokens} if req.max_output_tokens is not None else {}
    return GenerateRequest(model=req.model, messages=messages_of(req), stream=req.stream,
                           temperature=1.0 if req.temperature is None else req.temperature,
                           top_p=1.0 if req.top_p is None else req.top_p, format=output_format(req.text),
                           timeout_ms=req.timeout_ms, tools=tool_calls.responses_tools(req.tools),
                           tool_choice=tool_calls.tool_choice(req.tool_choice, flat=True),
                           parallel_tool_calls=req.parallel_tool_calls is not False, **kw)


class Shaper:
    """One response's ids and echoes of the request, for the object and every event."""

    def __init__(self, req: ResponsesRequest, gen: GenerateRequest) -> None:
        self.req, self.gen = req, gen
        self.id, self.msg_id = f"resp_{secrets.token_hex(24)}", f"msg_{secrets.token_hex(24)}"
        self.created = int(time.time())
        fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
        self.text = {"format": msgspec.to_builtins(fmt)}

    def response(self, status: str, text: str | None, res: GenerateResult | None = None,
                 calls: list[FunctionCallItem] = ()) -> ResponseObject:
        """The response object; its output: the message (none when the model only called
        tools), then the calls."""
        output: list[OutputMessage | FunctionCallItem] = [] if text is None or (calls and not text) else \
            [self.message(text, "completed" if status == "completed" else status)]
        usage = ResponseUsage(res.input_tokens, res.output_tokens, res.input_tokens + res.output_tokens) \
            if res is not None else None
        incomplete = IncompleteDetails("max_output_tokens", (res.length_limit if res is not None else "")
                                       or msgspec.UNSET) if status == "incomplete" else None
        return ResponseObject(self.id, self.created, self.req.model, status, [*output, *calls],
                              self.req.instructions, self.req.max_output_tokens, self.gen.temperature,
                              self.gen.top_p, self.text, usage, incomplete,
                              parallel_tool_calls=self.gen.parallel_tool_calls,
                              tool_choice=self.req.tool_choice or ("auto" if self.req.tools else "none"),
                              tools=self.req.tools or [], metadata=self.req.metadata or {})

    def message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(self.msg_id, status, [OutputText(text)] if status != "in_progress" else [])

    def calls(self, res: GenerateResult) -> list[FunctionCallItem]:
        """The result's calls; one a length limit cut is "incomplete" (its arguments as
        written so far), as the response is."""
        return [FunctionCallItem(f"fc_{secrets.token_hex(24)}", c.id, c.function.name, c.function.arguments,
                                 "incomplete" if status_of(res) == "incomplete" and not parses(c.function.arguments)
                                 else "completed")
                for c in tool_calls.reply_calls(res.tool_calls)]


def parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def status_of(res: GenerateResult) -> str:
    return "incomplete" if res.finish_reason == "length" else "completed"


def event(kind: str, seq: int, **data: Any) -> bytes:
    body = codec.json_line({"type": kind, "sequence_number": seq, **data})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


async def events(shape: Shaper, stream: TextStream) -> AsyncIterator[bytes]:
    seq = 0

    def nxt() -> int:
        nonlocal seq
        seq += 1
        return seq - 1

    where = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
    yield event("response.created", nxt(), response=shape.response("in_progress", None))
    yield event("response.in_progress", nxt(), response=shape.response("in_progress", None))

    def opened() -> list[bytes]:  # the message item begins with its first text
        return [event("response.output_item.added", nxt(), output_index=0, item=shape.message("", "in_progress")),
                event("response.content_part.added", nxt(), part=OutputText(""), **where)]

    started = False
    try:
        async for text, _ in stream.deltas():
            if not started:
                for e in opened():
                    yield e
                started = True
            yield event("response.output_text.delta", nxt(), delta=text, logprobs=[], **where)
    except FleetError as exc:
        yield event("error", nxt(), code=exc.code, message=exc.message, param=exc.param)
        return
    res = stream.result
    status = status_of(res)
    calls = shape.calls(res)
    if started or not calls:
        if not started:
            for e in opened():
                yield e
        yield event("response.output_text.done", nxt(), text=res.text, logprobs=[], **where)
        yield event("response.content_part.done", nxt(), part=OutputText(res.text), **where)
        yield event("response.output_item.done", nxt(), output_index=0, item=shape.message(res.text, status))
    first = 1 if started or not calls else 0
    for index, call in enumerate(calls, first):
        at = {"item_id": call.id, "output_index": index}
        yield event("response.output_item.added", nxt(), output_index=index,
                    item=msgspec.structs.replace(call, arguments="", status="in_progress"))
        yield event("response.function_call_arguments.delta", nxt(), delta=call.arguments, **at)
        yield event("response.function_call_arguments.done", nxt(), arguments=call.arguments, **at)
        yield event("response.output_item.done", nxt(), output_index=index, item=call)
    yield event(f"response.{status}", nxt(), response=shape.response(status, res.text, res, calls))


class ResponsesController(Controller):
    @post("/v1/responses", status_code=200)
    async def create(self, request: Request, daemon: Daemon) -> Response | Stream:
        req = codec.decode(await request.body(), ResponsesRequest, msgpack=body_is_msgpack(request))
        refuse_unsupported(req)
        gen = native(req)
        shape = Shaper(req, gen)
        ignored = fields.ignored_header(fields.set_fields(req, IGNORED))
        if not req.stream:
            res, answer = await tasks.generate(daemon, gen, codec.encode_msgpack(gen))
            return reply(request, shape.response(status_of(res), res.text, res, shape.calls(res)),
                         headers={**answer_headers(answer), **tasks.length_limit_headers(res), **ignored})
        stream = TextStream(daemon, gen, codec.encode_msgpack(gen))
        await stream.started()
        return Stream(events(shape, stream), media_type="text/event-stream", headers={**SSE_HEADERS, **ignored})
