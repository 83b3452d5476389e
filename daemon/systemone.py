"""TypeSafe's System One shape (`POST /v1/systemone`), as its official SDK
(`typesafe-sdk`) sends and reads it: the request checked field by field, rendered
into the native `fleet.decisions.DecideRequest`, and the worker's probabilities
shaped into its answers.

Request: `{model, state, questions: {id: question}, assets?}`; a question is
`noul` (`instructions`, `criteria: {true, false}`), `choice` (`criteria: {option:
description | null}`, 1-255 options) or `score` (`criteria: [level, ...]`, 1-10
levels); instructions and descriptions are text, objects or arrays (objects and
arrays are read as compact JSON). Unknown fields are ignored, as the original
server does, and named in `X-Fleet-Ignored-Fields`; fleet's own fields carry the
`x_` prefix: `x_timeout_ms`, and `x_adapter` (a LoRA adapter of the model, stored
with it as its base: the reply's `x_adapter` names it, and `x_temperatures_from` the
model whose calibration its answers used, its own or its base's, null for none).

Errors: a request that does not fit the schema is 422 with `{"detail": [{loc, msg,
type, input?, ctx?}]}` (every problem found, `loc` starting at "body"); any other
refusal is `{"detail": {"error_type", "message"}}` with its status (daemon.codec),
413 for a request over a budget. A bad request is never a 5xx: the SDK retries those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fleet.decisions import (
    MAX_LEVELS, MAX_OPTIONS, DecideQuestion, DecideRequest, DecideResult, choice_confidence, expected_score,
    score_confidence, split_probs,
)
from fleet.errors import FleetError

#: The model name the SDK sends by default: this box's default decision model.
DEFAULT_ALIAS = "jev-latest"
QUESTION_TYPES = ("noul", "choice", "score", "box")
TOP_FIELDS = ("model", "state", "questions", "assets", "x_timeout_ms", "x_adapter")
QUESTION_FIELDS = {"noul": ("type", "instructions", "criteria"), "choice": ("type", "instructions", "criteria"),
                   "score": ("type", "instructions", "criteria"), "box": ("type", "instructions")}
#: What a question without instructions asks.
DEFAULT_TEXT = {"noul": "Is this true?", "choice": "Which option fits best?", "score": "Which level fits best?"}
_MISSING = object()


class Invalid(FleetError):
    """A request that does not fit the schema: 422 with every problem in `detail`."""

    code, status = "validation_error", 422

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, d['loc'][1:]))}: {d['msg']}" for d in detail))
        self.detail = detail


@dataclass
class Parsed:
    """A checked request: what goes to the worker, and what the answers need."""

    model: str
    state: str
    ids: list[str]
    kinds: list[str]
    names: list[list[str]]  # per question: its options' names (choice), "0".."n-1" (score), yes/no (noul)
    levels: list[list[Any]]  # per score question: its criteria as sent (the legend); [] otherwise
    questions: list[DecideQuestion]
    timeout_ms: int | None
    ignored: list[str] = field(default_factory=list)
    unsupported: str | None = None  # why fleet cannot answer a request the schema allows
    state_json: bool = False  # the state was an object or array (`state` is its compact JSON)
    adapter: str | None = None  # `x_adapter`: a LoRA adapter of the model

    def request(self, model: str) -> DecideRequest:
        return DecideRequest(model=model, state=self.state, questions=self.questions, timeout_ms=self.timeout_ms,
                             adapter=self.adapter, state_json=self.state_json)


def problem(loc: list[Any], msg: str, type_: str, value: Any = _MISSING, ctx: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    out: dict[str, Any] = {"loc": ["body", *loc], "msg": msg, "type": type_}
    if value is not _MISSING:
        out["input"] = value
    if ctx:
        out["ctx"] = ctx
    return out


def is_content(x: Any) -> bool:
    """Text, or an object or array read as JSON (the schema's `str | dict | list`)."""
    return x.__class__ in (str, dict, list)


def text(x: Any) -> str:
    return x if x.__class__ is str else msgspec.json.encode(x).decode()


def check_content(x: Any, loc: list[Any], errors: list[dict[str, Any]], *, nullable: bool) -> None:
    if x is None and nullable:
        return
    if not is_content(x):
        errors.append(problem(loc, "Input should be a valid string, object or array", "union_type", x))


def check_size(x: Any, loc: list[Any], what: str, lo: int, hi: int, errors: list[dict[str, Any]]) -> None:
    if len(x) < lo:
        errors.append(problem(loc, f"{what} should have at least {lo} item{'s' * (lo != 1)} after validation, "
                                   f"not {len(x)}", "too_short", x,
                              {"field_type": what, "min_length": lo, "actual_length": len(x)}))
    elif len(x) > hi:
        errors.append(problem(loc, f"{what} should have at most {hi} items after validation, not {len(x)}",
                              "too_long", None, {"field_type": what, "max_length": hi, "actual_length": len(x)}))


def parse(body: Any) -> Parsed:
    """The request `body` (decoded JSON) checked against the schema; raises `Invalid`."""
    errors: list[dict[str, Any]] = []
    if body.__class__ is not dict:
        raise Invalid([problem([], "Input should be a valid dictionary or object to extract fields from",
                               "model_attributes_type", body)])
    ignored = [k for k in body if k not in TOP_FIELDS]
    model, state, questions = body.get("model", _MISSING), body.get("state", _MISSING), body.get("questions", _MISSING)
    for name, value in (("model", model), ("state", state), ("questions", questions)):
        if value is _MISSING:
            errors.append(problem([name], "Field required", "missing", body))
    if model is not _MISSING and model.__class__ is not str:
        errors.append(problem(["model"], "Input should be a valid string", "string_type", model))
    if state is not _MISSING:
        check_content(state, ["state"], errors, nullable=False)
    timeout = body.get("x_timeout_ms")
    if timeout is not None and (timeout.__class__ is not int or timeout < 1):
        errors.append(problem(["x_timeout_ms"], "Input should be an integer greater than or equal to 1",
                              "greater_than_equal", timeout, {"ge": 1}))
    adapter = body.get("x_adapter")
    if adapter is not None and (adapter.__class__ is not str or not adapter):
        errors.append(problem(["x_adapter"], "Input should be a valid string of at least 1 character",
                              "string_type", adapter))
    assets = body.get("assets")
    parsed = Parsed(model if model.__class__ is str else "", text(state) if is_content(state) else "",
                    [], [], [], [], [], timeout, ignored, state_json=state.__class__ in (dict, list),
                    adapter=adapter if adapter.__class__ is str and adapter else None)
    if assets is not None:
        parsed.unsupported = "assets: fleet's decision models read text; images need a vision-language model"
    if questions is not _MISSING:
        if questions.__class__ is not dict:
            errors.append(problem(["questions"], "Input should be a valid dictionary", "dict_type", questions))
        else:
            check_size(questions, ["questions"], "Dictionary", 1, 1 << 31, errors)
            for qid, q in questions.items():
                parse_question(qid, q, parsed, errors)
    if errors:
        raise Invalid(errors)
    return parsed


def parse_question(qid: str, q: Any, parsed: Parsed, errors: list[dict[str, Any]]) -> None:
    """One question into `parsed` (its rendering, names and levels), or its problems into `errors`."""
    loc: list[Any] = ["questions", qid]
    if q.__class__ is not dict:
        errors.append(problem(loc, "Input should be a valid dictionary or object to extract fields from",
                              "model_attributes_type", q))
        return
    kind = q.get("type", _MISSING)
    if kind is _MISSING:
        errors.append(problem(loc, "Unable to extract tag using discriminator 'type'", "union_tag_not_found", q,
                              {"discriminator": "'type'"}))
        return
    if kind not in QUESTION_TYPES:
        tags = ", ".join(f"'{t}'" for t in QUESTION_TYPES)
        errors.append(problem(loc, f"Input tag '{kind}' found using 'type' does not match any of the expected "
                                   f"tags: {tags}", "union_tag_invalid", q,
                              {"discriminator": "'type'", "tag": str(kind), "expected_tags": tags}))
        return
    loc = [*loc, kind]
    parsed.ignored.extend(f"questions.{qid}.{k}" for k in q if k not in QUESTION_FIELDS[kind])
    instructions = q.get("instructions")
    check_content(instructions, [*loc, "instructions"], errors, nullable=True)
    criteria = q.get("criteria", _MISSING)
    before = len(errors)
    if kind == "box":
        parsed.unsupported = parsed.unsupported or f"questions.{qid}: box questions locate things in an image; " \
                                                   "fleet's decision models read text"
        return
    if kind == "noul":
        true = false = None
        if criteria is not _MISSING and criteria is not None:
            if criteria.__class__ is not dict:
                errors.append(problem([*loc, "criteria"], "Input should be a valid dictionary or instance of "
                                                          "NoulCriteria", "model_type", criteria))
            else:
                true, false = criteria.get("true"), criteria.get("false")
                check_content(true, [*loc, "criteria", "true"], errors, nullable=True)
                check_content(false, [*loc, "criteria", "false"], errors, nullable=True)
                parsed.ignored.extend(f"questions.{qid}.criteria.{k}" for k in criteria if k not in ("true", "false"))
        if instructions is None and true is None and false is None and len(errors) == before:
            errors.append(problem([*loc], "Value error, a noul question needs instructions or a described "
                                          "outcome (criteria.true or criteria.false)", "value_error", q))
        if len(errors) == before:
            yes = "Yes" if true is None else f"Yes: {text(true)}"
            no = "No" if false is None else f"No: {text(false)}"
            add(parsed, qid, "noul", instructions, [yes, no], ["Yes", "No"], ["true", "false"], [])
        return
    if criteria is _MISSING:
        errors.append(problem([*loc, "criteria"], "Field required", "missing", q))
        return
    if kind == "choice":
        if criteria.__class__ is not dict:
            errors.append(problem([*loc, "criteria"], "Input should be a valid dictionary", "dict_type", criteria))
            return
        check_size(criteria, [*loc, "criteria"], "Dictionary", 1, MAX_OPTIONS, errors)
        for name, desc in criteria.items():
            check_content(desc, [*loc, "criteria", name], errors, nullable=True)
        if len(errors) == before:
            names = list(criteria)
            lines = [n if d is None else f"{n}: {text(d)}" for n, d in criteria.items()]
            add(parsed, qid, "choice", instructions, lines, names, names, [])
        return
    if criteria.__class__ is not list:
        errors.append(problem([*loc, "criteria"], "Input should be a valid list", "list_type", criteria))
        return
    check_size(criteria, [*loc, "criteria"], "List", 1, MAX_LEVELS, errors)
    for i, level in enumerate(criteria):
        check_content(level, [*loc, "criteria", i], errors, nullable=False)
    if len(errors) == before:
        lines = [text(level) for level in criteria]
        add(parsed, qid, "score", instructions, lines, lines, [str(i) for i in range(len(criteria))], criteria)


def add(parsed: Parsed, qid: str, kind: str, instructions: Any, lines: list[str], names: list[str],
        keys: list[str], levels: list[Any]) -> None:
    parsed.ids.append(qid)
    parsed.kinds.append(kind)
    parsed.names.append(keys)
    parsed.levels.append(levels)
    parsed.questions.append(DecideQuestion(kind, DEFAULT_TEXT[kind] if instructions is None else text(instructions),
                                           lines, names))


def answers(parsed: Parsed, res: DecideResult) -> dict[str, dict[str, Any]]:
    """System One's answers, keyed by question id, from the worker's probabilities."""
    out: dict[str, dict[str, Any]] = {}
    probs = split_probs(res, [len(q.options) for q in parsed.questions])
    for qid, kind, keys, levels, p in zip(parsed.ids, parsed.kinds, parsed.names, parsed.levels, probs):
        if kind == "noul":
            out[qid] = {"type": "noul", "noul": float(p[0])}
        elif kind == "choice":
            out[qid] = {"type": "choice", "choice": keys[int(np.argmax(p))],
                        "probabilities": dict(zip(keys, p.tolist())), "confidence": choice_confidence(p)}
        else:
            out[qid] = {"type": "score", "score": expected_score(p), "legend": dict(zip(keys, levels)),
                        "probabilities": dict(zip(keys, p.tolist())), "confidence": score_confidence(p)}
    return out


# ---- the route's document (daemon/controllers/openapi.py) ---------------------------------------------------

_CONTENT = {"oneOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
_NULLABLE = {"oneOf": [*_CONTENT["oneOf"], {"type": "null"}]}
_PROBS = {"type": "object", "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1}}
_UNIT = {"type": "number", "minimum": 0, "maximum": 1}
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "state", "questions"],
    "properties": {
        "model": {"type": "string", "description": f"A decision model, or {DEFAULT_ALIAS!r}: this box's default."},
        "state": {**_CONTENT, "description": "What every question is about: text, or JSON read as compact text."},
        "questions": {"type": "object", "minProperties": 1, "description": "Questions by the ids you choose.",
                      "additionalProperties": {"oneOf": [
                          {"type": "object", "required": ["type"], "properties": {
                              "type": {"const": "noul"}, "instructions": _NULLABLE,
                              "criteria": {"oneOf": [{"type": "null"}, {"type": "object", "properties": {
                                  "true": _NULLABLE, "false": _NULLABLE}}]}}},
                          {"type": "object", "required": ["type", "criteria"], "properties": {
                              "type": {"const": "choice"}, "instructions": _NULLABLE,
                              "criteria": {"type": "object", "minProperties": 1, "maxProperties": MAX_OPTIONS,
                                           "additionalProperties": _NULLABLE}}},
                          {"type": "object", "required": ["type", "criteria"], "properties": {
                              "type": {"const": "score"}, "instructions": _NULLABLE,
                              "criteria": {"type": "array", "minItems": 1, "maxItems": MAX_LEVELS,
                                           "items": _CONTENT}}},
                      ]}},
        "x_timeout_ms": {"type": "integer", "minimum": 1, "description": "fleet: this request's deadline."},
        "x_adapter": {"type": "string", "minLength": 1, "description": "fleet: a LoRA adapter of the model."},
    },
}
REPLY_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "answers", "usage"],
    "properties": {
        "model": {"type": "string", "description": "The model that answered."},
        "x_adapter": {"type": "string", "description": "fleet: the LoRA adapter that answered (`x_adapter`)."},
        "x_temperatures_from": {"type": ["string", "null"], "description": "fleet, with `x_adapter`: the model "
                                "whose calibration the answers used (the adapter's own, else its base's); null: none"},
        "answers": {"type": "object", "additionalProperties": {"oneOf": [
            {"type": "object", "properties": {"type": {"const": "noul"}, "noul": _UNIT}},
            {"type": "object", "properties": {"type": {"const": "choice"}, "choice": {"type": "string"},
                                              "probabilities": _PROBS, "confidence": _UNIT}},
            {"type": "object", "properties": {"type": {"const": "score"}, "score": {"type": "number"},
                                              "legend": {"type": "object"}, "probabilities": _PROBS,
                                              "confidence": _UNIT}},
        ]}},
        "usage": {"type": "object", "properties": {"input_tokens": {"type": "integer"},
                                                   "output_tokens": {"type": "integer"}}},
    },
}
ERROR_SCHEMA: dict[str, Any] = {"type": "object", "required": ["detail"], "properties": {"detail": {"oneOf": [
    {"type": "array", "description": "422: what does not fit the schema.", "items": {
        "type": "object", "required": ["loc", "msg", "type"],
        "properties": {"loc": {"type": "array"}, "msg": {"type": "string"}, "type": {"type": "string"}}}},
    {"type": "object", "description": "Any other refusal.", "required": ["error_type", "message"],
     "properties": {"error_type": {"type": "string"}, "message": {"type": "string"}}},
]}}}
