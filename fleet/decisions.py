"""Typed decisions (task `decide`): what a worker is asked and answers, and the
formulas every route shapes its answers with.

A decision request is one `state` (a text) and questions about it, each of a kind:

- `noul`: yes or no; two options, the first meaning yes;
- `choice`: one of up to MAX_OPTIONS named options;
- `score`: one of up to MAX_LEVELS ordered levels, the first worth 0.

The daemon renders every route's shape (System One's, OpenAI's Decisions) into a
`DecideRequest`: structured instructions and descriptions become compact JSON
text, question ids stay in the daemon, so a model never sees them (renaming a
question cannot move its answer). The worker answers a probability per option,
per question, in request order (`DecideResult`); confidence, the choice, the
expected score and the reply's shape are the daemon's (`confidence`,
`expected_score` here).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

#: The question kinds, in the order a temperature table lists them.
KINDS: tuple[str, ...] = ("noul", "choice", "score")
Kind = Literal["noul", "choice", "score"]
#: Most options of a choice question and levels of a score question (System One's documented limits).
MAX_OPTIONS = 255
MAX_LEVELS = 10
#: Option counts that share a temperature, per kind: (first, last) inclusive.
BUCKETS: tuple[tuple[int, int], ...] = ((1, 2), (3, 5), (6, 10), (11, 26), (27, MAX_OPTIONS))
#: Stored models of another task that answer decisions too, by (task, runtime): a
#: generator's worker reads them from the weights it holds (runtimes/adapters/decide_shared.py).
SHARED_DECIDERS: frozenset[tuple[str, str]] = frozenset({("generate", "transformers")})


class DecideQuestion(msgspec.Struct, frozen=True, array_like=True):
    """One question as the model reads it. `options` are the lines listed under the
    question (an option's name with its description); `names` the short strings
    scored by their likelihood when the options outnumber the model's single-token
    labels (runtimes/adapters/decide.py). Both in the request's option order."""

    kind: Kind
    text: str
    options: list[str]
    names: list[str]


class DecideRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a decision model's lane carries: the state and its questions, rendered.

    `raw` (calibration, fleet.calibration; no route takes it from a client): the
    answer holds each question's option scores before any temperature instead of
    probabilities, 2n floats a question: the scores in the first order, then those
    of the second order put back in the first's (the same twice where the model
    reads one order). The probabilities are `fleet.calibration.answer_probs` of them.

    `state_json`: the state was sent as an object or array, and `state` is it as
    compact JSON; a checkpoint whose package renders JSON its own way renders it so
    (runtimes/adapters/decide_heads.py)."""

    model: str
    state: str
    questions: list[DecideQuestion]
    timeout_ms: int | None = None
    adapter: str | None = None
    raw: bool = False
    state_json: bool = False


class DecideResult(msgspec.Struct, frozen=True, array_like=True):
    """Per question in request order, a probability per option (float64, little-endian,
    laid end to end: question i's options follow question i-1's), and the tokens the
    model read for this request (the state once, each question's rows).
    `temperatures_from`: the model whose calibration the probabilities used (a LoRA
    adapter's own, else its base's; "" none: 1.0), for the reply's `x_temperatures_from`."""

    probs: bytes
    input_tokens: int
    temperatures_from: str = ""


def bucket(n: int) -> str:
    """The option-count bucket of `n` options ("1-2", "3-5", ...): a temperature's key part."""
    for lo, hi in BUCKETS:
        if lo <= n <= hi:
            return f"{lo}-{hi}"
    raise ValueError(f"{n} options is outside every bucket; this is a bug")


def temperature_key(kind: str, n: int) -> str:
    """`kind:bucket`, the key of a temperature in a model's table."""
    return f"{kind}:{bucket(n)}"


def decide_temperatures(spec: Any) -> dict[str, float]:
    """A decision model's live temperatures (`kind:bucket` -> T; 1.0 where missing): its
    catalog calibration, which a worker's ModelSpec carries in `extra`."""
    return spec.extra.get("decide_temperatures") or {}


def choice_confidence(p: np.ndarray) -> float:
    """System One's choice confidence: (p_max - 1/n) / (1 - 1/n); 1 for one option."""
    n = len(p)
    if n <= 1:
        return 1.0
    return float(min(1.0, max(0.0, (p.max() - 1 / n) / (1 - 1 / n))))


def score_confidence(p: np.ndarray) -> float:
    """System One's score confidence from the spread: 1 - sum p_i |i - mode| over the
    same spread of the uniform distribution; 1 for one level."""
    n = len(p)
    if n <= 1:
        return 1.0
    levels = np.arange(n)
    spread = float(p @ np.abs(levels - int(np.argmax(p))))
    uniform = float(np.abs(levels - (n - 1) / 2).mean())
    return float(min(1.0, max(0.0, 1 - spread / uniform)))


def expected_score(p: np.ndarray) -> float:
    """sum i * p_i: the score a score answer reports."""
    return float(p @ np.arange(len(p)))


def split_probs(res: DecideResult, counts: list[int]) -> list[np.ndarray]:
    """A result's probabilities per question (`counts`: options of each, in order), each
    renormalised to sum to 1 (the worker's float rounding)."""
    flat = np.frombuffer(res.probs, dtype="<f8")
    if len(flat) != sum(counts):
        raise RuntimeError(f"decide: {len(flat)} probabilities for {sum(counts)} options; this is a bug")
    ends = np.cumsum(counts)
    return [p / p.sum() for p in np.split(flat, ends[:-1])]
