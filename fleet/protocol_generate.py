"""Contract types of generation: `/v1/generate`, OpenAI `/v1/completions` and
`/v1/chat/completions` (requests, replies, stream chunks), with tools and structured output.

Generation is half of the API's types and changes for its own reasons (tool calls,
logprobs, response formats), so it has its own room; the rules are fleet/protocol.py's
(request Structs forbid unknown fields; a MessagePack request is forwarded to the
worker as the same bytes). `fleet.protocol` re-exports every name here, so callers
import the contract from one place.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fleet.protocol_common import Usage


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
#: (runtimes.adapters.generate). The answer itself runs until the model stops or its context is full.
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
