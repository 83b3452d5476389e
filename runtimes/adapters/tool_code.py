"""Gemma 3's tool calls (fleet.tools TOOL_CODE): the tools described as Python
functions in the system turn, calls written as Python calls in ```tool_code
blocks, their results given back in ```tool_output blocks.

Its chat template renders no tools and takes alternating user / model turns only,
so the prompt is built here before the template renders it:

1. `prompt`: the tools as Python signatures with their docstrings (each argument's
   description), and how to call them, before the system turn's own text (the
   template writes the system turn at the head of the first user turn); history
   calls as their ```tool_code block at the end of their assistant turn, results as
   ```tool_output blocks in a user turn, turns of one role in a row joined.
2. `call_rules`: lark rules of one call held to the tools' schemas: keyword
   arguments in the schema's order, the required ones first; booleans and None as
   Python writes them, strings, numbers and structures as JSON (a JSON string or
   number is a Python literal too; `true`, `false` and `null` inside a structure
   are read as JSON's).
3. `parse`: a block's calls, with their arguments as JSON text. A call is parsed
   (`ast`), never run.
"""

from __future__ import annotations

import ast
import json
import keyword
from typing import Any

from fleet.errors import BadRequest
from fleet.messages import CalledTool
from fleet.protocol import ToolDef
from fleet.runtimes.adapters.grammar import JSON_OPTIONS

OPEN, CLOSE = "```tool_code\n", "\n```"
#: Where a call block begins (what text with no call may not hold).
OPENING = "```tool_code"
RESULT = "```tool_output\n"
#: JSON Schema types as Python annotations.
TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list",
         "object": "dict", "null": "None"}
#: JSON's words for what Python writes True, False and None (inside structures).
JSON_WORDS = {"true": True, "false": False, "null": None}
HOW_TO_CALL = (
    "You can call the Python functions below. To call them, answer with a ```tool_code block "
    "holding one call a line, with keyword arguments, such as:\n```tool_code\nfunction_name(argument=value)\n```\n"
    "The result of each call comes back in a ```tool_output block."
)


def check(tools: list[ToolDef], model: str) -> None:
    """400 for a tool a Python call cannot spell: its name or an argument's is not an identifier."""
    for i, tool in enumerate(tools):
        names = [tool.function.name, *(tool.function.parameters or {}).get("properties", {})]
        bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n)]
        if bad:
            raise BadRequest(f"{model} calls tools as Python calls, and {bad[0]!r} (tools[{i}]) is not a Python "
                             "name: use letters, digits and _", param=f"tools[{i}]")


def arguments(tool: ToolDef) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of a tool's arguments: the required ones first, each
    group in the schema's order (as a Python signature must)."""
    params = tool.function.parameters or {}
    required = set(params.get("required", ()))
    props = [(k, v if isinstance(v, dict) else {}) for k, v in params.get("properties", {}).items()]
    return [(k, v, True) for k, v in props if k in required] + [(k, v, False) for k, v in props if k not in required]


# -- 1. the prompt ------------------------------------------------------------------------

def literal(value: Any) -> str:
    """A JSON value as a Python literal."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def annotation(schema: dict) -> str:
    if isinstance(schema.get("enum"), list):
        return f"Literal[{', '.join(literal(v) for v in schema['enum'])}]"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(TYPES.get(k, "Any") for k in kind)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"list[{annotation(schema['items'])}]"
    return TYPES.get(kind, "Any")


def signature(tool: ToolDef) -> str:
    """A tool as a Python function with its docstring."""
    args = arguments(tool)
    params = ", ".join(f"{k}: {annotation(s)}" + ("" if req else " = None") for k, s, req in args)
    doc = [tool.function.description or ""]
    described = [f"  {k}: {s['description']}" for k, s, _ in args if isinstance(s.get("description"), str)]
    if described:
        doc += ["", "Args:", *described]
    text = "\n".join(doc).strip().replace('"""', "'''")
    body = "\n".join(f"    {line}".rstrip() for line in text.split("\n"))
    return f'def {tool.function.name}({params}):\n' + (f'    """{body[4:]}"""\n' if text else "    ...\n")


def call_text(call: dict) -> str:
    """A history call as the model writes it."""
    name, args = call["function"]["name"], call["function"]["arguments"]
    if not isinstance(args, dict):  # not a JSON object: as it came
        return f"{name}({args})"
    return f"{name}({', '.join(f'{k}={literal(v)}' for k, v in args.items())})"


def history(messages: list[dict]) -> list[dict]:
    """Chat turns with calls and results in the format, as alternating turns."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = (content + "\n" if content else "") + OPEN + "\n".join(map(call_text, m["tool_calls"])) + CLOSE
        elif role == "tool":
            role, content = "user", RESULT + content + CLOSE
        if out and out[-1]["role"] == role != "system":
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": role, "content": content})
    return out


def prompt(messages: list[dict], tools: list[ToolDef]) -> list[dict]:
    """The turns the template renders: the tools described before the system turn's text."""
    turns = history(messages)
    described = HOW_TO_CALL + "\n\n```python\n" + "\n".join(map(signature, tools)) + "```"
    if turns and turns[0]["role"] == "system":
        own = turns[0]["content"]
        return [{"role": "system", "content": described + ("\n\n" + own if own else "")}, *turns[1:]]
    return [{"role": "system", "content": described}, *turns]


# -- 2. the grammar -----------------------------------------------------------------------

def value_rule(schema: dict) -> str:
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(v is None or isinstance(v, (str, int, float, bool)) for v in enum):
        return " | ".join(json.dumps(literal(v), ensure_ascii=False) for v in enum)
    if schema.get("type") == "boolean":
        return '"True" | "False"'
    if schema.get("type") == "null":
        return '"None"'
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def call_rules(tools: list[ToolDef], wanted: list[str]) -> str:
    """Lark rules whose `call` is one call of a wanted tool (module doc, 2)."""
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        if tool.function.name not in wanted:
            continue
        required, optional = [], []
        for j, (name, schema, req) in enumerate(arguments(tool)):
            rules.append(f"v{i}_{j}: {value_rule(schema)}")
            (required if req else optional).append(f'"{name}=" v{i}_{j}')
        if required:  # then each optional one, after a comma, or not
            args = ' ", " '.join(required) + "".join(f' (", " {o})?' for o in optional)
        elif optional:  # the first one given has no comma before it
            args = "(" + " | ".join(o + "".join(f' (", " {p})?' for p in optional[k + 1:])
                                    for k, o in enumerate(optional)) + ")?"
        else:
            args = ""
        rules.append(f'call{i}: "{tool.function.name}(" {args} ")"')
        alternatives.append(f"call{i}")
    return f"call: {' | '.join(alternatives)}\n" + "\n".join(rules) + "\n"


# -- 3. the calls -------------------------------------------------------------------------

def value(node: ast.AST) -> Any:
    """A Python literal's value, with JSON's words for True, False and None."""
    if isinstance(node, ast.Name) and node.id in JSON_WORDS:
        return JSON_WORDS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [value(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (value(v) for v in node.values)))
    return ast.literal_eval(node)


def parse(body: str, names: list[str]) -> list[CalledTool]:
    """The calls of a block's body, one a line; none unless every line is a call of a
    known tool with keyword arguments whose values are literals."""
    try:
        tree = ast.parse(body.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    calls = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id not in names \
                or call.args or any(k.arg is None for k in call.keywords):
            return []
        try:
            args = json.dumps({k.arg: value(k.value) for k in call.keywords}, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return []
        calls.append(CalledTool(call.func.id, args))
    return calls
