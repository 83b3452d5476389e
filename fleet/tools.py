"""Tool calling: which call format a chat template speaks, and what a model can do.

A model calls tools in its family's own format, and its chat template is what
says which one (never its name): the template renders the tools into the
prompt and the model's past calls into history, in that format.

* `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call (Qwen2.5, Qwen3, SmolLM3 and other Hermes-style templates: the
  template writes `<tool_call>`);
* `llama-json`: the whole answer is `{"name": ..., "parameters": {...}}` (Llama
  3.1-3.3: the template asks for that JSON);
* `phi4-mini`: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`,
  the tools given as JSON text in the system turn's `tools` (Phi-4-mini);
* `tool-code`: Gemma 3's convention, Python calls (`name(key=value, ...)`, one a
  line) in a markdown block tagged tool_code, their results given back in one
  tagged tool_output. Its template renders no tools (it has no place for them) but
  has one for a system turn, which it writes before the first user turn: fleet
  describes the tools there, as Python signatures (runtimes.adapters.tool_code). Recognised
  by its `<start_of_turn>` turns with that system prefix (`first_user_prefix`).

A template that speaks none of them (SmolLM2's, Gemma 2's) cannot express tools:
a request with tools is refused with a 400 saying so.

Light imports only: the API process imports this module.
"""

from __future__ import annotations

import re

from fleet.errors import BadRequest
from fleet.protocol import NamedToolChoice, ToolDef

HERMES = "hermes"
LLAMA_JSON = "llama-json"
PHI4_MINI = "phi4-mini"
TOOL_CODE = "tool-code"
#: A function name as OpenAI takes it.
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
#: Most tools one request may carry (each is a grammar alternative).
MAX_TOOLS = 128


def tool_format(template: str | None) -> str | None:
    """The call format a chat template speaks (module doc), None when it cannot express tools."""
    if not template:
        return None
    if "<tool_call>" in template and "tools" in template:
        return HERMES
    if '"parameters": dictionary of argument name' in template:
        return LLAMA_JSON
    if "<|tool|>" in template and "'tools' in message" in template:
        return PHI4_MINI
    if "<start_of_turn>" in template and "first_user_prefix" in template:
        return TOOL_CODE
    return None


#: Runtimes whose models take images (their inputs: `{image}` items).
IMAGE_RUNTIMES = frozenset({"clip"})


def capabilities(task: str, runtime: str, template: str | None) -> list[str]:
    """What a model can do, for `/v1/models` (fleet's words: embed, rerank, classify,
    extract, decide, completion, chat, tools, vision)."""
    if task == "generate":
        out = ["completion"]
        if template:
            out.append("chat")
        if tool_format(template) is not None:
            out.append("tools")
        return out
    return [task, "vision"] if runtime in IMAGE_RUNTIMES else [task]


def check_tools(tools: list[ToolDef] | None, choice: object) -> None:
    """400 naming the field for tools a request cannot be held to: a name that is not a
    function name or repeats, parameters that are not an object schema, a choice that
    names no tool, a choice without tools."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("`tool_choice` asks for a tool call, and there are no `tools`", param="tool_choice")
        return
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"{len(tools)} tools is more than the limit of {MAX_TOOLS} per request", param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name, params = tool.function.name, tool.function.parameters
        if not NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name {name!r} is not a function name (letters, digits, "
                             "_ . : -, at most 64)", param=f"tools[{i}].function.name")
        if name in seen:
            raise BadRequest(f"two tools are named {name!r}", param=f"tools[{i}].function.name")
        seen.add(name)
        if params is not None and params.get("type", "object") != "object":
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON Schema of an object",
                             param=f"tools[{i}].function.parameters")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not one of `tools` "
                         f"({', '.join(sorted(seen))})", param="tool_choice")
