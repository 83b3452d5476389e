"""fleet's tasks as Model Context Protocol tools (DESIGN.md, "MCP"), shared by both
transports: `fleetctl mcp` (stdio, for a desktop agent's config file; it calls the
daemon over HTTP) and the daemon's own `/mcp` (streamable HTTP; it calls its routes
in-process, daemon/mcp_http.py).

A tool is one route: its arguments are the route's body (the JSON Schema below names
the fields agents use, each of them a field of the route's request, which
`tests/test_mcp.py` checks against the route's Struct), its result is the route's
JSON reply as the call's structured content (and the same JSON as text, for clients
that read only text), and a refusal is a tool error whose text is the daemon's own
message. So the daemon checks and answers a tool call exactly as it does the route:
no second validator to drift from it.

The `mcp` package is imported only inside `build_server` (it costs ~1 s of imports
and the `mcp` extra may be missing): the tool table itself is plain data.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: The server's name in MCP's `initialize` answer.
SERVER_NAME = "fleet"
INSTRUCTIONS = ("Small open models served by this box's fleet daemon: embeddings, reranking, classification, "
                "entity extraction, typed decisions and text generation. Call `models` first to see which "
                "models are stored and which are resident (loaded); a model may be left out where the box has "
                "a default for the task.")


class ToolFailure(Exception):
    """The daemon refused or failed a tool's request: `message` is its own words."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


#: `call(method, path, body, request)`: the route's JSON reply as a dict, or raises
#: ToolFailure. `request` is the transport's request (the HTTP one on `/mcp`), or None.
Call = Callable[[str, str, "dict[str, Any] | None", Any], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ToolSpec:
    """One tool: the route it calls, its arguments' schema, its result's schema."""

    name: str
    title: str
    description: str
    method: str
    path: str
    properties: dict[str, Any]
    required: tuple[str, ...] = ()
    #: Top-level keys every successful reply has (its output schema requires them).
    result_keys: tuple[str, ...] = ()
    #: Body fields the tool sets itself, over the arguments (a tool answers once: no streams).
    fixed: dict[str, Any] = field(default_factory=dict)
    #: Body fields a call leaves out that the route requires (System One's `model`).
    defaults: dict[str, Any] = field(default_factory=dict)

    def input_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": self.properties, "required": list(self.required),
                "additionalProperties": False}

    def output_schema(self) -> dict[str, Any]:
        return {"type": "object", "required": list(self.result_keys),
                "properties": {k: {} for k in self.result_keys}}

    def body(self, arguments: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.method == "GET":
            return None
        return {**self.defaults, **(arguments or {}), **self.fixed}


def _text(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _texts(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "minItems": 1, "description": description}


MODEL = _text("A model's name (see the `models` tool); left out: this box's default model for the task.")
TIMEOUT = {"type": "integer", "minimum": 1, "maximum": 600_000,
           "description": "Milliseconds the answer may take (default: the daemon's timeout_ms)."}
TRUNCATE = {"type": "boolean", "description": "Cut inputs longer than the model reads (default true); "
                                              "false: such an input is an error."}
ADAPTER = _text("A LoRA adapter of the model to run with.")

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "embed", "Embed texts",
        "Embedding vectors of texts (or images, for a multimodal embedder): one vector per input, "
        "normalised unless told otherwise. Reply: {model, embeddings: [[float]], shape: [n, d], usage}.",
        "POST", "/v1/embed",
        {"model": MODEL,
         "inputs": {"type": "array", "minItems": 1, "description": "Texts, or {image: base64} objects.",
                    "items": {"anyOf": [{"type": "string"},
                                        {"type": "object", "properties": {"image": {"type": "string"}},
                                         "required": ["image"], "additionalProperties": False}]}},
         "normalize": {"type": "boolean", "description": "Unit-length vectors (default true)."},
         "truncate": TRUNCATE,
         "output": {"enum": ["dense", "tokens", "sparse"],
                    "description": "dense (default): one vector per input; tokens: one per token; "
                                   "sparse: vocabulary weights (sparse models)."},
         "dimensions": {"type": "integer", "minimum": 1, "description": "Cut vectors to this width, then normalise."},
         "prompt_name": _text("One of the model's named prompts (e.g. query, document)."),
         "prompt": _text("Text put before each input."),
         "output_dtype": {"enum": ["float32", "float16", "int8", "uint8", "binary", "ubinary"]},
         "adapter": ADAPTER, "timeout_ms": TIMEOUT},
        ("inputs",), ("model", "embeddings", "usage")),
    ToolSpec(
        "rerank", "Rerank documents",
        "Order documents by relevance to a query, best first. Reply: {model, results: [{index, "
        "relevance_score, document?}], usage}; `index` is the document's position in the request.",
        "POST", "/v1/rerank",
        {"model": MODEL, "query": _text("What the documents are ranked for."),
         "documents": _texts("The texts to rank."),
         "top_n": {"type": "integer", "minimum": 1, "description": "Return only the best n."},
         "return_documents": {"type": "boolean", "description": "Include each document's text in its result."},
         "instruction": _text("An LLM reranker's task instruction."),
         "truncate": TRUNCATE, "adapter": ADAPTER, "timeout_ms": TIMEOUT},
        ("query", "documents"), ("model", "results", "usage")),
    ToolSpec(
        "classify", "Classify texts",
        "Labels with scores for each text, best first: a classifier's own labels, or `candidate_labels` "
        "on a zero-shot (NLI) model. Reply: {model, results: [[{label, score}]], usage}.",
        "POST", "/v1/classify",
        {"model": MODEL, "inputs": _texts("The texts to classify."),
         "top_k": {"type": "integer", "minimum": 1, "description": "Labels per text (default: all)."},
         "multi_label": {"type": "boolean", "description": "Score each label on its own (sigmoid) rather than "
                                                          "against the others (softmax)."},
         "candidate_labels": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                              "description": "Zero-shot labels (NLI models)."},
         "hypothesis_template": _text("Zero-shot: the hypothesis, with {} for the label."),
         "truncate": TRUNCATE, "adapter": ADAPTER, "timeout_ms": TIMEOUT},
        ("inputs",), ("model", "results", "usage")),
    ToolSpec(
        "extract", "Extract entities",
        "Named entities in each text, with character offsets: a token-classification model's own tags, "
        "or any `labels` on a zero-shot (GLiNER) model. Reply: {model, results: [[{entity, text, start, end, "
        "score}]], usage}.",
        "POST", "/v1/extract",
        {"model": MODEL, "inputs": _texts("The texts to read."),
         "labels": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                    "description": "Entity types to find (zero-shot models)."},
         "truncate": TRUNCATE, "adapter": ADAPTER, "timeout_ms": TIMEOUT},
        ("inputs",), ("model", "results", "usage")),
    ToolSpec(
        "decide", "Typed decisions",
        "Ask typed questions of a state (text or JSON): `noul` (yes/no; criteria {true, false}), `choice` "
        "(criteria {option: description or null}) or `score` (criteria [level, ...]). Each answer carries "
        "probabilities and a confidence. Reply: {model, answers: {id: answer}, usage}.",
        "POST", "/v1/systemone",
        {"model": _text("A decision model's name; left out: this box's default decision model."),
         "state": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}],
                   "description": "What the questions are asked of."},
         "questions": {
             "type": "object", "minProperties": 1, "description": "Questions by id.",
             "additionalProperties": {
                 "type": "object", "required": ["type"],
                 "properties": {"type": {"enum": ["noul", "choice", "score"]},
                                "instructions": {"description": "The question (text, or JSON)."},
                                "criteria": {"description": "noul: {true, false}; choice: {option: description "
                                                            "or null}; score: [level, ...]."}}}},
         "x_timeout_ms": TIMEOUT, "x_adapter": ADAPTER},
        ("state", "questions"), ("model", "answers", "usage"), defaults={"model": "jev-latest"}),
    ToolSpec(
        "generate", "Generate text",
        "Text from a small generator: a `prompt`, or chat `messages` rendered with the model's chat "
        "template. Reply: {model, text, finish_reason, usage}.",
        "POST", "/v1/generate",
        {"model": _text("A generator's name (see the `models` tool)."),
         "prompt": _text("Text to continue (or give `messages`)."),
         "messages": {"type": "array", "minItems": 1, "description": "Chat turns (or give `prompt`).",
                      "items": {"type": "object", "required": ["role", "content"],
                                "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                               "content": {"type": "string"}}}},
         "max_tokens": {"type": "integer", "minimum": 1,
                        "description": "Most tokens to generate (default: until the model stops)."},
         "temperature": {"type": "number", "minimum": 0, "description": "0: greedy (default 1)."},
         "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
         "seed": {"type": "integer", "description": "Makes sampling reproducible."},
         "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                  "description": "The text ends before the first of these."},
         "format": {"anyOf": [{"const": "json"}, {"type": "object"}],
                    "description": "\"json\", or a JSON Schema the text must match (enforced while decoding)."},
         "adapter": ADAPTER, "timeout_ms": TIMEOUT},
        ("model",), ("model", "text", "finish_reason", "usage"), fixed={"stream": False}),
    ToolSpec(
        "models", "List models",
        "The models this box stores: each one's task, runtime, capabilities, whether it is resident "
        "(`loaded`) and pinned. Reply: {object, data: [{id, task, runtime, loaded, pinned, capabilities}]}.",
        "GET", "/v1/models", {}, (), ("data",)),
)

TOOLS_BY_NAME: dict[str, ToolSpec] = {t.name: t for t in TOOLS}


def error_message(status: int, body: bytes) -> str:
    """The daemon's words for a failed reply: `{error: {message}}`, or System One's
    `{detail: [...]}` / `{detail: {message}}`; else the status and the start of the body."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err, detail = data.get("error"), data.get("detail")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(detail, list):
            return "; ".join(f"{'.'.join(map(str, d.get('loc', [])[1:])) or 'body'}: {d.get('msg')}"
                             for d in detail if isinstance(d, dict))
        if isinstance(detail, dict) and isinstance(detail.get("message"), str):
            return detail["message"]
    return f"HTTP {status}: {body[:200].decode(errors='replace')}"


def build_server(call: Call) -> Any:
    """The MCP server (the `mcp` SDK's low-level `Server`) whose tools run through `call`."""
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError

    from fleet import __version__

    listed = types.ListToolsResult(tools=[
        types.Tool(name=t.name, title=t.title, description=t.description, input_schema=t.input_schema(),
                   output_schema=t.output_schema(),
                   annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False))
        for t in TOOLS])

    async def list_tools(ctx: Any, params: Any) -> Any:
        return listed

    async def call_tool(ctx: Any, params: Any) -> Any:
        spec = TOOLS_BY_NAME.get(params.name)
        if spec is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}; fleet's tools are "
                                                 f"{', '.join(TOOLS_BY_NAME)}")
        try:
            reply = await call(spec.method, spec.path, spec.body(params.arguments), ctx.request)
        except ToolFailure as exc:
            return types.CallToolResult(content=[types.TextContent(text=exc.message)], is_error=True)
        text = json.dumps(reply, separators=(",", ":"))
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=reply)

    return Server(SERVER_NAME, version=__version__, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                  on_call_tool=call_tool)
