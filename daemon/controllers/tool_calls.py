"""Tool calls as each generation route spells them, onto fleet's one shape and back.

fleet.protocol holds the native shapes (OpenAI chat's: `ToolDef`, `ToolChoice`,
`ToolCall` with arguments as JSON text); the worker renders the tools with the
model's chat template and parses its calls (runtimes.adapters.tools). Here: OpenAI chat
and Ollama tools (the same shape), Responses' flat function tools and its
`function_call` / `function_call_output` items, the ids of calls (minted here:
a model writes none), and the history turns their templates read.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import msgspec

from fleet.errors import BadRequest, Unsupported
from fleet.messages import CalledTool
from fleet.protocol import ChatMessage, FunctionCall, FunctionDef, FunctionName, NamedToolChoice, ToolCall, ToolDef

CHOICES = ("none", "auto", "required")


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def function_def(raw: Any, where: str) -> FunctionDef:
    try:
        return msgspec.convert(raw, FunctionDef)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"`{where}`: {exc}".replace("`$.", f"`{where}."), param=where) from None


def chat_tools(raw: list | None, field: str = "tools") -> list[ToolDef] | None:
    """OpenAI chat's (and Ollama's) `tools`: `{"type": "function", "function": {...}}` each."""
    if not raw:
        return None
    out = []
    for i, tool in enumerate(raw):
        where = f"{field}[{i}]"
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function":
            raise Unsupported(f"`{where}` of type {kind!r}: only function tools are supported", param=where)
        out.append(ToolDef(function_def(tool.get("function"), f"{where}.function")))
    return out


def responses_tools(raw: list | None) -> list[ToolDef] | None:
    """Responses' `tools`: `{"type": "function", "name", "description", "parameters", "strict"}` each."""
    if not raw:
        return None
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise Unsupported(f"`tools[{i}]` of type {kind!r}: only function tools are supported (this server "
                              "runs no hosted tools)", param=f"tools[{i}]")
        out.append(ToolDef(function_def({k: v for k, v in tool.items() if k != "type"}, f"tools[{i}]")))
    return out


def tool_choice(raw: Any, *, flat: bool = False) -> str | NamedToolChoice | None:
    """`tool_choice`: "none" | "auto" | "required", or one function (chat's
    `{"type": "function", "function": {"name"}}`, Responses' `{"type": "function", "name"}`)."""
    if raw is None or raw in CHOICES:
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name") if flat else (raw.get("function") or {}).get("name")
        if isinstance(name, str):
            return NamedToolChoice(FunctionName(name))
    raise Unsupported(f"tool_choice {json.dumps(raw)[:80]}: send \"none\", \"auto\", \"required\" or one "
                      "function", param="tool_choice")


def chat_calls(raw: list | None, where: str) -> list[ToolCall] | None:
    """An assistant turn's OpenAI `tool_calls` in history."""
    if not raw:
        return None
    try:
        calls = msgspec.convert(raw, list[ToolCall])
    except msgspec.ValidationError as exc:
        raise BadRequest(f"`{where}`: {exc}".replace("`$", f"`{where}"), param=where) from None
    return calls


def named_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Tool turns with the function's `name` (templates that print it read it), found
    by `tool_call_id` among the calls before them."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for c in m.tool_calls or ():
            names[c.id] = c.function.name
        if m.role == "tool" and m.name is None and m.tool_call_id in names:
            m = msgspec.structs.replace(m, name=names[m.tool_call_id])
        out.append(m)
    return out


def reply_calls(calls: list[CalledTool]) -> list[ToolCall]:
    """A result's calls in OpenAI's shape, each with a fresh id."""
    return [ToolCall(FunctionCall(c.name, c.arguments), id=call_id()) for c in calls]
