"""Temperatures for typed decisions, fitted from labelled answers (`fleetctl calibrate`).

A decision model's answers are softmaxes of its option scores over one temperature
per question kind and option-count bucket (`fleet.decisions.temperature_key`). A
model nobody calibrated answers at 1.0 everywhere: a tiny or badly prompted model
is then under- or over-confident, and its probabilities say less than they look.

Calibration reads labelled examples (System One requests with the right answers),
asks the worker for each question's scores before any temperature (a `raw`
`DecideRequest`: per question two n-vectors, the two option orders the answer
averages), and per bucket picks the temperature that minimises the negative
log-likelihood of the labels (a bounded one-dimensional search on log T; the loss
is smooth there). It reports the expected calibration error (ECE: the top answer's
probability against how often it is right, in ECE_BINS equal-width bins) before,
at the temperatures the model had, and after. A bucket with fewer than
MIN_QUESTIONS labelled questions keeps its temperature: a fit on a handful says
nothing.

Everything here is numpy over whole buckets: no per-example Python in the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from fleet.decisions import BUCKETS, KINDS

#: Bins of the expected calibration error (equal width over the top probability).
ECE_BINS = 10
#: Questions a bucket needs before its temperature is fitted.
MIN_QUESTIONS = 8
#: The temperatures a fit may choose: beyond them the answers are one-hot or uniform.
T_MIN, T_MAX = 0.02, 50.0


class Calibration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A model's decision temperatures and where they came from (models.toml
    `[models."<name>".calibration]`)."""

    #: `kind:bucket` -> temperature; a key not listed answers at 1.0.
    temperatures: dict[str, float]
    #: Who set them: "fleetctl calibrate", or "models.toml" for a hand-written table.
    source: str = "models.toml"
    calibrated_at: str | None = None
    #: The labelled file's sha256 and how many examples and questions it held.
    file_sha256: str | None = None
    examples: int | None = None
    questions: int | None = None
    #: Expected calibration error over all its questions, at the temperatures before and after.
    ece_before: float | None = None
    ece_after: float | None = None


def calibration_extra(cal: Calibration | None) -> dict[str, Any]:
    """A decision model's temperatures and where they came from, as a worker's
    `ModelSpec.extra` carries them (fleet.decisions.decide_temperatures reads them;
    runtimes.info shows them)."""
    if cal is None:
        return {"decide_temperatures": None, "calibration": None}
    return {"decide_temperatures": dict(cal.temperatures),
            "calibration": {k: v for k, v in msgspec.structs.asdict(cal).items() if k != "temperatures"}}


def temperature_keys() -> list[str]:
    """Every key a temperature table may hold, in a stable order."""
    return [f"{kind}:{lo}-{hi}" for kind in KINDS for lo, hi in BUCKETS]


def check_temperatures(temperatures: dict[str, Any]) -> list[str]:
    """What is wrong with a temperature table (unknown keys, values out of range)."""
    keys = set(temperature_keys())
    problems = [f"{k!r} is no temperature key (kind:bucket, e.g. choice:3-5)" for k in temperatures if k not in keys]
    problems += [f"{k} = {v!r} is not a temperature between {T_MIN} and {T_MAX}" for k, v in temperatures.items()
                 if k in keys and not (isinstance(v, (int, float)) and not isinstance(v, bool) and T_MIN <= v <= T_MAX)]
    return problems


def answer_probs(first: np.ndarray, second: np.ndarray, t: float | np.ndarray) -> np.ndarray:
    """Probabilities of (questions, options) scores read in two orders, at temperature `t`
    (a scalar or one per question): the mean of the two softmaxes, as the workers answer."""
    t = np.asarray(t, dtype=np.float64).reshape(-1, 1) if np.ndim(t) else float(t)
    return (_softmax(first / t) + _softmax(second / t)) / 2


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def nll(first: np.ndarray, second: np.ndarray, labels: np.ndarray, t: float) -> float:
    """Mean negative log-likelihood of `labels` (option index per question) at `t`."""
    p = answer_probs(first, second, t)[np.arange(len(labels)), labels]
    return float(-np.log(np.maximum(p, 1e-300)).mean())


def ece(top: np.ndarray, right: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: per equal-width bin of the top probability, |accuracy -
    mean probability|, weighted by the bin's share of questions."""
    if len(top) == 0:
        return 0.0
    which = np.minimum((top * bins).astype(np.int64), bins - 1)
    count = np.bincount(which, minlength=bins)
    conf = np.bincount(which, weights=top, minlength=bins)
    acc = np.bincount(which, weights=right.astype(np.float64), minlength=bins)
    used = count > 0
    return float(np.abs(acc[used] - conf[used]).sum() / len(top))


def fit_temperature(first: np.ndarray, second: np.ndarray, labels: np.ndarray) -> float:
    """The temperature in [T_MIN, T_MAX] with the least NLL (golden-section search on log T)."""
    lo, hi = math.log(T_MIN), math.log(T_MAX)
    ratio = (math.sqrt(5) - 1) / 2

    def loss(x: float) -> float:
        return nll(first, second, labels, math.exp(x))

    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(60):  # the interval shrinks to ~1e-12 of its width
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = loss(b)
    return float(math.exp((lo + hi) / 2))


@dataclass
class BucketFit:
    key: str
    questions: int
    t_before: float
    t_after: float
    nll_before: float
    nll_after: float
    ece_before: float
    ece_after: float
    fitted: bool  # False: too few questions, the temperature was kept


def fit(groups: dict[str, list[tuple[np.ndarray, np.ndarray, int]]],
        before: dict[str, float]) -> tuple[list[BucketFit], float, float]:
    """Per bucket (`kind:bucket` -> its questions' (first, second, label)), the fitted
    temperature against `before`; and the ECE over every question before and after.
    Questions of one bucket may have different option counts: each count is one array."""
    fits: list[BucketFit] = []
    tops: dict[str, list[np.ndarray]] = {"before": [], "after": []}
    rights: dict[str, list[np.ndarray]] = {"before": [], "after": []}
    for key in temperature_keys():
        rows = groups.get(key)
        if not rows:
            continue
        by_n: dict[int, list[tuple[np.ndarray, np.ndarray, int]]] = {}
        for row in rows:
            by_n.setdefault(len(row[0]), []).append(row)
        arrays = [(np.stack([r[0] for r in g]), np.stack([r[1] for r in g]), np.array([r[2] for r in g]))
                  for g in by_n.values()]
        t0 = float(before.get(key, 1.0))
        fitted = len(rows) >= MIN_QUESTIONS
        t1 = _fit_many(arrays) if fitted else t0
        parts = {}
        for name, t in (("before", t0), ("after", t1)):
            total_nll, top_all, right_all = 0.0, [], []
            for first, second, labels in arrays:
                p = answer_probs(first, second, t)
                total_nll += nll(first, second, labels, t) * len(labels)
                top_all.append(p.max(axis=1))
                right_all.append(p.argmax(axis=1) == labels)
            top, right = np.concatenate(top_all), np.concatenate(right_all)
            tops[name].append(top)
            rights[name].append(right)
            parts[name] = (total_nll / len(rows), ece(top, right))
        fits.append(BucketFit(key, len(rows), t0, t1, parts["before"][0], parts["after"][0],
                              parts["before"][1], parts["after"][1], fitted))
    overall = {name: ece(np.concatenate(tops[name]), np.concatenate(rights[name])) if tops[name] else 0.0
               for name in ("before", "after")}
    return fits, overall["before"], overall["after"]


def _fit_many(arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """One temperature for several option counts: the NLL summed over them."""
    if len(arrays) == 1:
        return fit_temperature(*arrays[0])
    # Pad to one width with -inf scores: a padded option has probability 0 at every T.
    width = max(a[0].shape[1] for a in arrays)

    def pad(x: np.ndarray) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=-1e30)

    first = np.concatenate([pad(a[0]) for a in arrays])
    second = np.concatenate([pad(a[1]) for a in arrays])
    return fit_temperature(first, second, np.concatenate([a[2] for a in arrays]))
