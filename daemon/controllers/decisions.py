"""OpenAI's Decisions API on fleet's port: `POST /v1/decisions`, a translation onto
the typed decisions of `/v1/systemone` (`daemon.tasks.decide`).

`openai.OpenAI(base_url=...).decisions.create(model=..., input=..., questions=[...])`
works unchanged:

* `input` (text, or messages and tool items) is the state: each item a line
  `role: text` (`input_json` parts as compact JSON); images are refused
  (`unsupported`: fleet's decision models read text).
* `questions` (1-400, answered in order): `predicate` is a yes/no question, its
  `probability` the yes; `choice` takes 2-255 `choices` (typed values: the string
  "true" and the boolean true are two options); `score` takes 1-10 ordered
  `levels`, worth 0, 1, ... (`value`), the score their expectation.
* `prompt_cache_key` and `prompt_cache_options` are accepted and named in
  `X-Fleet-Ignored-Fields` (the state's cache is fleet's own: runtimes/adapters/decide.py);
  `safety_identifier` likewise.
* Unknown fields are refused (400 naming the closest known one), as OpenAI does;
  errors are OpenAI's shape (daemon.http).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, post

from fleet.decisions import (
    MAX_LEVELS, MAX_OPTIONS, DecideQuestion, DecideRequest, choice_confidence, expected_score, score_confidence,
    split_probs,
)
from fleet.errors import BadRequest, Unsupported

from fleet.daemon import codec, tasks
from fleet.daemon.defaults import decision_model
from fleet.daemon.core import Daemon
from fleet.daemon.fields import ignored_header, set_fields
from fleet.daemon.http import answer_headers, body_is_msgpack, reply

MAX_QUESTIONS = 400


class InputText(msgspec.Struct, frozen=True, tag_field="type", tag="input_text", forbid_unknown_fields=True):
    text: str
    prompt_cache_breakpoint: dict | None = None


class InputJson(msgspec.Struct, frozen=True, tag_field="type", tag="input_json", forbid_unknown_fields=True):
    data: dict | list


class InputImage(msgspec.Struct, frozen=True, tag_field="type", tag="input_image", forbid_unknown_fields=True):
    image_url: str
    detail: str | None = None
    prompt_cache_breakpoint: dict | None = None


Part = InputText | InputJson | InputImage


class Predicate(msgspec.Struct, frozen=True, tag_field="type", tag="predicate", forbid_unknown_fields=True):
    instructions: str | list[Part]
    name: str | None = None


class ChoiceOption(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    value: str | bool
    description: str | None = None


class Choice(msgspec.Struct, frozen=True, tag_field="type", tag="choice", forbid_unknown_fields=True):
    instructions: str | list[Part]
    choices: list[ChoiceOption]
    name: str | None = None


class Level(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    label: str
    description: str | None = None


class Score(msgspec.Struct, frozen=True, tag_field="type", tag="score", forbid_unknown_fields=True):
    instructions: str | list[Part]
    levels: list[Level]
    name: str | None = None


class DecisionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/decisions`: OpenAI's fields (`input` items are read by `state_text`),
    and fleet's `timeout_ms`."""

    model: str
    input: str | list[dict[str, Any]]
    questions: list[Predicate | Choice | Score]
    prompt_cache_key: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    timeout_ms: int | None = None


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    phase: str | None = None


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function_call", "custom_tool_call"]
    call_id: str
    name: str
    arguments: str | None = None
    input: str | None = None
    id: str | None = None
    namespace: str | None = None
    status: str | None = None


class ToolOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


_PARTS = {"input_text": InputText, "input_json": InputJson, "input_image": InputImage,
          "output_text": None, "refusal": None}


def part_text(part: dict[str, Any], where: str) -> str:
    """One content part as text: input_text and output_text as written, input_json as
    compact JSON, a refusal as its words; an image is refused."""
    kind = part.get("type")
    if kind == "input_image":
        raise Unsupported(f"{where}: images: fleet's decision models read text", param=where)
    if kind == "output_text" and part.get("text").__class__ is str:
        return part["text"]
    if kind == "refusal" and part.get("refusal").__class__ is str:
        return part["refusal"]
    if kind not in _PARTS or _PARTS[kind] is None:
        raise BadRequest(f"{where}: unknown content part type {kind!r}", param=where)
    parsed = msgspec.convert(part, _PARTS[kind])
    return parsed.text if kind == "input_text" else msgspec.json.encode(parsed.data).decode()


def content_text(content: str | list, where: str) -> str:
    if content.__class__ is str:
        return content
    return "\n".join(part_text(p, f"{where}[{i}]") for i, p in enumerate(content))


def state_text(items: str | list[dict[str, Any]]) -> str:
    """`input` as the state: text as sent; items one per line, each named by its role or kind."""
    if items.__class__ is str:
        return items
    lines = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        try:
            kind = item.get("type", "message")
            if kind == "message":
                msg = msgspec.convert(item, Message)
                lines.append(f"{msg.role}: {content_text(msg.content, where + '.content')}")
            elif kind in ("function_call", "custom_tool_call"):
                call = msgspec.convert(item, ToolCall)
                lines.append(f"tool call {call.name} ({call.call_id}): {call.arguments or call.input or ''}")
            elif kind in ("function_call_output", "custom_tool_call_output"):
                out = msgspec.convert(item, ToolOutput)
                lines.append(f"tool output ({out.call_id}): {content_text(out.output, where + '.output')}")
            else:
                raise BadRequest(f"{where}: unknown input item type {kind!r}", param="input")
        except msgspec.ValidationError as exc:
            raise BadRequest(f"{where}: {exc}", param="input") from None
    return "\n".join(lines)


def question_text(instructions: str | list[Part], where: str) -> str:
    if instructions.__class__ is str:
        return instructions
    out = []
    for i, part in enumerate(instructions):
        if part.__class__ is InputImage:
            raise Unsupported(f"{where}[{i}]: images: fleet's decision models read text", param=where)
        out.append(part.text if part.__class__ is InputText else msgspec.json.encode(part.data).decode())
    return "\n".join(out)


def option_name(value: str | bool) -> str:
    return ("true" if value else "false") if value.__class__ is bool else value


def translate(req: DecisionRequest, model: str) -> DecideRequest:
    """The native decision request: the same questions, in order, rendered as System One's are."""
    if not 1 <= len(req.questions) <= MAX_QUESTIONS:
        raise BadRequest(f"questions: ask 1-{MAX_QUESTIONS} questions, not {len(req.questions)}", param="questions")
    questions = []
    for i, q in enumerate(req.questions):
        where = f"questions[{i}]"
        text = question_text(q.instructions, where + ".instructions")
        if q.__class__ is Predicate:
            questions.append(DecideQuestion("noul", text, ["Yes", "No"], ["Yes", "No"]))
        elif q.__class__ is Choice:
            values = [(c.value.__class__, c.value) for c in q.choices]
            if not 2 <= len(values) <= MAX_OPTIONS or len(set(values)) != len(values):
                raise BadRequest(f"{where}.choices: give 2-{MAX_OPTIONS} unique choices, not {len(values)}"
                                 f"{' (some repeat)' if len(set(values)) != len(values) else ''}",
                                 param=where + ".choices")
            names = [option_name(c.value) for c in q.choices]
            lines = [n if c.description is None else f"{n}: {c.description}" for n, c in zip(names, q.choices)]
            questions.append(DecideQuestion("choice", text, lines, names))
        else:
            if not 1 <= len(q.levels) <= MAX_LEVELS:
                raise BadRequest(f"{where}.levels: give 1-{MAX_LEVELS} levels, not {len(q.levels)}",
                                 param=where + ".levels")
            lines = [lv.label if lv.description is None else f"{lv.label}: {lv.description}" for lv in q.levels]
            questions.append(DecideQuestion("score", text, lines, [lv.label for lv in q.levels]))
    return DecideRequest(model=model, state=state_text(req.input), questions=questions, timeout_ms=req.timeout_ms)


def answers(req: DecisionRequest, probs: list) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for q, p in zip(req.questions, probs):
        if q.__class__ is Predicate:
            out.append({"type": "predicate", "name": q.name, "probability": float(p[0])})
        elif q.__class__ is Choice:
            best = int(p.argmax())
            out.append({"type": "choice", "name": q.name, "choice": q.choices[best].value,
                        "confidence": choice_confidence(p),
                        "probabilities": [{"value": c.value, "probability": x}
                                          for c, x in zip(q.choices, p.tolist())]})
        else:
            out.append({"type": "score", "name": q.name, "score": expected_score(p),
                        "confidence": score_confidence(p),
                        "probabilities": [{"label": lv.label, "value": i, "probability": x}
                                          for i, (lv, x) in enumerate(zip(q.levels, p.tolist()))]})
    return out


class DecisionsController(Controller):
    path = "/v1"

    @post("/decisions", status_code=200)
    async def decisions(self, request: Request, daemon: Daemon) -> Response:
        req = codec.decode(await request.body(), DecisionRequest, msgpack=body_is_msgpack(request))
        model = decision_model(daemon, req.model)
        res, answer = await tasks.decide(daemon, translate(req, model))
        probs = split_probs(res, [len(q.choices) if q.__class__ is Choice else len(q.levels)
                                  if q.__class__ is Score else 2 for q in req.questions])
        usage = {"input_tokens": res.input_tokens, "input_tokens_details": {"cache_write_tokens": 0,
                                                                          "cached_tokens": 0},
                 "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": res.input_tokens}
        ignored = set_fields(req, ("prompt_cache_key", "prompt_cache_options", "safety_identifier"))
        return reply(request, {"answers": answers(req, probs), "model": model, "usage": usage},
                     headers={**answer_headers(answer), **ignored_header(ignored)})
