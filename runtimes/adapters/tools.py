"""Tool calls in the worker: tools into the prompt, decoding held to the call format,
calls parsed out of the text.

A request's tools meet its model's chat template (fleet.tools names the format
the template speaks). `Caller` holds one request's side:

1. `render`: the messages and template keywords that put the tools in the
   prompt (`tools=` for Hermes and Llama templates; Phi-4-mini's reads them as
   JSON text from the system turn), history calls with their arguments as
   objects (templates write them with `tojson`).
2. `grammar`: an llguidance lark grammar over the format, the call's JSON held
   to the tools' schemas (`%json`): with "required" one call or more (one with
   `parallel_tool_calls` false), with a named function that one, with "auto"
   text that holds no call (an exclusion, or a special token the text cannot
   spell) or calls, each after free text up to its opening marker (a lazy
   lexeme). The constrained call always parses and fits its schema, with the
   properties the schema declares only unless it allows more (`declared_only`).
3. `split`: the text beside the calls and the calls (name, arguments as JSON),
   valid ones only; `call_start` says where a call may begin, so a stream never
   sends a call's markup as text, and stop strings apply to text only.
4. `call_pieces`: while a stream runs, each call's arguments as the model writes
   them, once its name is written. The grammar spells a call one way (JSON_OPTIONS:
   no free whitespace, the name before the arguments), so the arguments' characters
   are known as they come, and `split` returns them as written: what a stream sent
   is always the beginning of the call's final arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fleet.errors import BadRequest
from fleet.messages import CalledTool, CallPiece
from fleet.protocol import ChatMessage, NamedToolChoice, ToolDef
from fleet.tools import HERMES, LLAMA_JSON, PHI4_MINI, TOOL_CODE, tool_format
from fleet.runtimes.adapters import tool_code
from fleet.runtimes.adapters.grammar import JSON_OPTIONS

#: Opening and closing markers of a call, per format (Llama's JSON has none).
MARKERS = {HERMES: ("<tool_call>", "</tool_call>"), PHI4_MINI: ("<|tool_call|>", "<|/tool_call|>"),
           TOOL_CODE: (tool_code.OPEN, tool_code.CLOSE)}
#: What Llama 3.x writes before a call's JSON (a special token: dropped from the text).
PYTHON_TAG = "<|python_tag|>"
#: Text with no call in it, for "auto" with a marker the text could spell.
NO_CALL = "/(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/"
#: Text that does not begin a Llama JSON call.
NO_JSON_CALL = "/(.|\\n)*/ & ~/[ \\t\\n]*\\{(.|\\n)*/"
EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}
#: A call's JSON up to its arguments as the grammar spells it (module doc, 4), after the
#: block's opening (Phi-4-mini's list: `[`, `, ` between calls).
CALL_HEAD = re.compile(r'[\s\[,]*\{"name": "([A-Za-z0-9_.:-]{1,64})", "(?:arguments|parameters)": ')
#: What a decode of a partial character ends with (held back until it is whole).
REPLACEMENT = "\ufffd"
DECODER = json.JSONDecoder()


def message_text(content: str | list[dict] | None) -> str:
    """A chat message's text: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")


def arguments_value(text: str) -> Any:
    """A history call's arguments as the template writes them: the object its JSON
    text holds (templates apply `tojson`), else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat turns as chat templates read them (transformers' shapes)."""
    out = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": message_text(m.content)}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name,
                                                "arguments": arguments_value(c.function.arguments)}}
                                  for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        out.append(turn)
    return out


def history_turns(template: str | None, messages: list[dict]) -> list[dict]:
    """The turns of a request whose tools are not rendered (it has none, or tool_choice
    "none"): a template with no place for calls and results (Gemma 3's refuses tool
    turns, SmolLM3's drops calls) gets them in its format's text."""
    fmt = tool_format(template)
    if fmt == TOOL_CODE and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return tool_code.history(messages)
    if fmt == HERMES:
        return hermes_history(template or "", messages)
    return messages


def hermes_history(template: str, messages: list[dict]) -> list[dict]:
    """History calls and results for a Hermes template that has no place for them, in the
    blocks the model writes and reads. SmolLM3's writes an assistant turn's content only
    (a call would vanish, leaving an empty turn) and a tool turn as a user turn of its bare
    content (a result would read as the user's words): calls go after the turn's text as
    `<tool_call>` blocks spelled as the grammar spells them, results in `<tool_response>`
    blocks (spelled as Qwen's templates write them). A template that writes calls
    (`tool_calls`) or results (`<tool_response>`) itself gets its turns unchanged."""
    calls_missing, results_bare = "tool_calls" not in template, "<tool_response>" not in template
    out = []
    for m in messages:
        if calls_missing and m.get("tool_calls"):
            blocks = "\n".join(hermes_call(c) for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m["content"] + "\n" if m["content"] else "") + blocks
        elif results_bare and m["role"] == "tool":
            m = {**m, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def hermes_call(call: dict) -> str:
    """A history call as a Hermes model writes it (the grammar's spelling)."""
    f = call["function"]
    body = json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)
    return f"{MARKERS[HERMES][0]}\n{body}\n{MARKERS[HERMES][1]}"


def tool_dict(tool: ToolDef) -> dict:
    f = tool.function
    return {"type": "function", "function": {"name": f.name, "description": f.description or "",
                                             "parameters": f.parameters if f.parameters is not None
                                             else {"type": "object", "properties": {}}}}


class Caller:
    """One request's tools in its model's call format (module doc)."""

    def __init__(self, model: str, tokenizer: Any, tools: list[ToolDef], choice: Any, parallel: bool,
                 engine_token: Callable[[str], int | None]) -> None:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        fmt = tool_format(template)
        if fmt is None:
            raise BadRequest(f"the chat template of {model} cannot express tools (it renders no tool "
                             "definitions or calls): send the request without `tools`", param="tools")
        if fmt == TOOL_CODE:
            tool_code.check(tools, model)
        self.format, self.tools, self.parallel = fmt, tools, parallel
        self.template = template or ""
        self.names = [t.function.name for t in tools]
        self.choice = choice
        self.markers = MARKERS.get(fmt)
        # A call block: its opening marker, its body up to the closing one (or the end).
        self.blocks = re.compile(re.escape(self.markers[0]) + r"(.*?)(?:" + re.escape(self.markers[1]) + r"|$)",
                                 re.S) if self.markers else None
        # A marker that is one added token: the grammar names the token (`engine_token`:
        # the grammar engine holds it apart from text); one the tokenizer calls special is
        # dropped by a plain decode, so such rows decode with special tokens kept.
        self.tokens = {m: tid for m in self.markers or () if (tid := engine_token(m)) is not None}
        self.keeps_special = any(special_id(tokenizer, m) is not None for m in self.markers or ())
        self.strip = [t for t in tokenizer.all_special_tokens if t not in (self.markers or ())]

    # -- 1. the prompt ------------------------------------------------------------------

    def render(self, messages: list[dict]) -> tuple[list[dict], dict[str, Any]]:
        if self.format == TOOL_CODE:  # its template renders no tools: they go in its system turn
            return tool_code.prompt(messages, self.tools), {}
        tools = [tool_dict(t) for t in self.tools]
        if self.format == PHI4_MINI:
            # Its template writes a turn's content only: past calls go there, in its format.
            messages = [{**m, "content": m["content"] + phi4_calls(m["tool_calls"])} if m.get("tool_calls") else m
                        for m in messages]
            listed = json.dumps([t["function"] for t in tools])
            if messages and messages[0]["role"] == "system":
                return [{**messages[0], "tools": listed}, *messages[1:]], {}
            return [{"role": "system", "content": "", "tools": listed}, *messages], {}
        if self.format == HERMES:
            messages = hermes_history(self.template, messages)
        if "xml_tools" in self.template:
            # SmolLM3's template reads the tools under this name and writes each as Python
            # writes a dict; its own usage passes the functions themselves. A later revision
            # takes `tools` in place of `xml_tools` when both are given: only one is sent.
            return messages, {"xml_tools": [t["function"] for t in tools]}
        return messages, {"tools": tools}

    # -- 2. the grammar -----------------------------------------------------------------

    def grammar(self) -> str:
        wanted = self.names if not isinstance(self.choice, NamedToolChoice) else [self.choice.function.name]
        one_call = isinstance(self.choice, NamedToolChoice) or not self.parallel
        args_key = "parameters" if self.format == LLAMA_JSON else "arguments"
        params = {t.function.name: declared_only(t.function.parameters) for t in self.tools}
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, args_key: params[n]},
                           "required": ["name", args_key], "additionalProperties": False} for n in wanted]}
        if self.format == PHI4_MINI:
            call = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one_call else {})}
        body = "%json " + json.dumps({**call, "x-guidance": JSON_OPTIONS})
        auto = self.choice in (None, "auto")
        if self.format == TOOL_CODE:  # one block of calls, one a line
            rules = tool_code.call_rules(self.tools, wanted)
            calls, close = "call" if one_call else 'call ("\\n" call)*', json.dumps(tool_code.CLOSE)
            if not auto:
                return f"start: {json.dumps(tool_code.OPEN)} {calls} {close}\n{rules}"
            no_call = NO_CALL.format(marker=re.escape(tool_code.OPENING))
            return (f"start: PROSE | tagged\ntagged: head {calls} {close}\nhead[lazy]: TEXT {json.dumps(tool_code.OPEN)}\n"
                    f"TEXT: /(.|\\n)*/\nPROSE: {no_call}\n{rules}")
        if self.format == LLAMA_JSON:
            return f"start: {'PROSE | ' if auto else ''}call\ncall: {body}\nPROSE: {NO_JSON_CALL}\n"
        open_, close = self.markers
        sep = '"\\n"' if self.format == HERMES else ""
        opening, closing = self._symbol(open_), self._symbol(close)
        calls = "call" if one_call or self.format == PHI4_MINI else f"call ({sep} call)*"
        if not auto:
            return f"start: {calls}\ncall: {opening} {sep} {body} {sep} {closing}\n"
        # "auto": text with no call, or calls each after free text up to its marker.
        many = "tagged" if one_call or self.format == PHI4_MINI else "tagged+"
        if open_ in self.tokens:
            return (f"start: PROSE | {many}\ntagged: PROSE {opening} {sep} {body} {sep} {closing}\n"
                    f"PROSE: /(.|\\n)*/\n")
        no_call = NO_CALL.format(marker=re.escape(open_).replace("/", "\\/"))
        return (f"start: PROSE | {many}\ntagged: head {sep} {body} {sep} {closing}\n"
                f"head[lazy]: TEXT {json.dumps(open_)}\nTEXT: /(.|\\n)*/\nPROSE: {no_call}\n")

    def _symbol(self, marker: str) -> str:
        tid = self.tokens.get(marker)
        return f"<[{tid}]>" if tid is not None else json.dumps(marker)

    # -- 3. the calls -------------------------------------------------------------------

    def call_start(self, text: str) -> int:
        """Where a call may begin in `text` (len(text): nowhere yet)."""
        if self.format == LLAMA_JSON:
            head = text.lstrip()
            return len(text) - len(head) if not head or head.startswith(("{", PYTHON_TAG)) else len(text)
        open_ = self.markers[0]
        at = text.find(open_)
        if at != -1:
            return at
        for k in range(min(len(open_) - 1, len(text)), 0, -1):  # a marker's beginning, at the end
            if text.endswith(open_[:k]):
                return len(text) - k
        return len(text)

    def split(self, text: str) -> tuple[str, list[CalledTool]]:
        """(the text beside the calls, the calls) of a finished generation: a call that
        does not parse, or names no tool, stays in the text.

        A turn that ends inside a call was cut by a length limit (the grammar closes every
        call it opens before the turn can end): as OpenAI answers such a turn (finish_reason
        "length"), the cut call is a call, its arguments as written so far (they do not
        parse), once its name is written; its markup is never text. Python calls (Gemma
        3's) are not JSON until whole: a cut block of them stays text."""
        if self.format == LLAMA_JSON:
            head = text.strip().removeprefix(PYTHON_TAG)
            written = self._written(head)
            call = written[0] if written is not None and len(written) == 1 else self._call(head, "parameters")
            if call is not None:
                return "", [call]
            if self.call_start(text) < len(text):  # the turn began a call: only a cut ends it there
                return "", self._cut(text)
            return self._clean(text), []
        calls: list[CalledTool] = []
        kept, at = [], 0
        for m in self.blocks.finditer(text):
            found = self._calls(m.group(1).strip())
            if not found and self.format != TOOL_CODE and not m.group(0).endswith(self.markers[1]):
                found = self._cut(m.group(0))  # the last block, cut open
                kept.append(text[at:m.start()])
                calls += found
                at = len(text)
                break
            if not found:
                continue
            calls += found
            kept.append(text[at:m.start()])
            at = m.end()
        kept.append(text[at:])
        rest = self._clean("".join(kept))
        return (rest if rest.strip() else ""), calls

    def _cut(self, text: str) -> list[CalledTool]:
        """The calls of a block a length limit cut (split's doc), the last one unfinished."""
        return [CalledTool(name, args) for name, args in self.calls_so_far(text)]

    def _calls(self, body: str) -> list[CalledTool]:
        if self.format == TOOL_CODE:
            return tool_code.parse(body, self.names)
        written = self._written(body)
        if written is not None:
            return written
        if self.format == PHI4_MINI:
            try:
                items = json.loads(body)
            except ValueError:
                return []
            found = [self._call(json.dumps(i), "arguments") for i in (items if isinstance(items, list) else [items])]
            return [c for c in found if c is not None] if all(found) else []
        call = self._call(body, "arguments")
        return [call] if call is not None else []

    def _call(self, body: str, key: str) -> CalledTool | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        args = value.get(key, value.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return CalledTool(value["name"], json.dumps(args, ensure_ascii=False))

    def _written(self, body: str) -> list[CalledTool] | None:
        """A block's calls as the grammar spells them, with their arguments as written
        (module doc, 4); None when the block is spelled otherwise."""
        calls, at = [], 0
        while (head := CALL_HEAD.match(body, at)) is not None:
            try:
                args, end = DECODER.raw_decode(body, head.end())
            except ValueError:
                return None
            if head.group(1) not in self.names or not isinstance(args, dict) or body[end:end + 1] != "}":
                return None
            calls.append(CalledTool(head.group(1), body[head.end():end]))
            at = end + 1
        closing = ("", "]") if self.format == PHI4_MINI else ("",)  # Phi-4-mini's calls are a list
        return calls if calls and body[at:].strip() in closing else None

    # -- 4. a stream's calls ------------------------------------------------------------

    def calls_so_far(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments as written so far) of each call begun in a growing text whose
        name is written; each is the beginning of what `split` returns for it."""
        if self.format == TOOL_CODE:
            return self._tool_code_so_far(text)
        if self.format == LLAMA_JSON:
            at = self.call_start(text)
            bodies = [text[at:].lstrip().removeprefix(PYTHON_TAG)] if at < len(text) else []
        else:
            bodies = [m.group(1) for m in self.blocks.finditer(text)]
        out = []
        for body in bodies:
            at = 0
            while (head := CALL_HEAD.match(body, at)) is not None and head.group(1) in self.names:
                try:
                    _, end = DECODER.raw_decode(body, head.end())
                except ValueError:  # still being written: all of it is arguments, but a partial character
                    out.append((head.group(1), body[head.end():].rstrip(REPLACEMENT)))
                    break
                out.append((head.group(1), body[head.end():end]))
                at = end + 1  # past the call's closing brace
        return out

    def _tool_code_so_far(self, text: str) -> list[tuple[str, str]]:
        """Python calls are not JSON as written: each is sent whole once its line is
        (a block's last line is whole once the block is closed)."""
        out = []
        for m in self.blocks.finditer(text):
            lines = m.group(1).split("\n")
            for line in lines if m.group(0).endswith(tool_code.CLOSE) else lines[:-1]:
                found = tool_code.parse(line, self.names)
                if len(found) != 1:
                    return out
                out.append((found[0].name, found[0].arguments))
        return out

    def call_pieces(self, text: str, sent: list[int]) -> list[CallPiece]:
        """What a stream sends of its calls now: a new call with its name, then the
        characters of each call's arguments not sent yet. `sent` holds how many each call
        has sent; it grows here."""
        pieces = []
        for i, (name, args) in enumerate(self.calls_so_far(text)):
            if i == len(sent):
                sent.append(0)
                pieces.append(CallPiece(i, name, 0, args))
            elif len(args) > sent[i]:
                pieces.append(CallPiece(i, name, sent[i], args[sent[i]:]))
            sent[i] = len(args)
        return pieces

    def _clean(self, text: str) -> str:
        """Text decoded with special tokens kept, without the special tokens."""
        if self.keeps_special:
            for token in self.strip:
                text = text.replace(token, "")
        return text


def declared_only(params: dict | None) -> dict:
    """A function's arguments as the grammar holds them: the properties its schema
    declares, no others unless the schema says so (JSON Schema allows any by default, and
    a small model sampling an undeclared key makes a call its function refuses)."""
    if params is None:
        return EMPTY_OBJECT
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def phi4_calls(calls: list[dict]) -> str:
    """History calls as Phi-4-mini writes them."""
    listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    return MARKERS[PHI4_MINI][0] + json.dumps(listed) + MARKERS[PHI4_MINI][1]


def added_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer holds it as one added token, else None."""
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if added.content == text:
            return int(tid)
    return None


def special_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer holds it as one special token, else None."""
    tid = added_id(tokenizer, text)
    return tid if tid is not None and tokenizer.added_tokens_decoder[tid].special else None
