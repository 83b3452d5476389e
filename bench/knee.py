"""Knee finding: pure functions over step results.

A *step* is one period at a fixed offered load: a Poisson arrival rate
(open loop, requests/s) or a number of clients each sending back to back
(closed loop). The *knee* is the highest load the server still keeps up with:
past it, throughput stops following the offered load and latency climbs.

A step is past the knee when any of these holds (reasons are returned, so the
report can say why):
  * errors: more than `max_error_rate` of its requests failed;
  * behind (open loop): achieved throughput < (1 - keep_up_tol) x offered rate;
  * flat (closed loop): going from the previous step's clients to this one's
    added less than `min_gain` of the proportional throughput gain;
  * slow: p95 latency > `p95_factor` x the unloaded p95 (the lowest step's),
    or > `max_p95_ms` when an SLO is given.
The knee is the highest healthy step below the lowest unhealthy one, so one
noisy healthy step above a failure does not move it. `plan_next` is the ramp:
grow the load geometrically until a step fails, then bisect between the knee
and the first failure down to `resolution`.

Everything here is plain data in, plain data out: no clocks, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OPEN, CLOSED = "open", "closed"


@dataclass(frozen=True)
class StepResult:
    #: Offered load: requests/s (open loop) or clients (closed loop).
    offered: float
    #: Successful replies per second over the step.
    throughput_rps: float
    #: Input tokens per second over the step (successful replies only).
    tokens_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    sent: int
    ok: int
    errors: int
    mode: str = OPEN

    @property
    def error_rate(self) -> float:
        return self.errors / self.sent if self.sent else 0.0


@dataclass(frozen=True)
class Criteria:
    keep_up_tol: float = 0.10
    p95_factor: float = 3.0
    max_p95_ms: float | None = None
    max_error_rate: float = 0.01
    #: Closed loop: fraction of the proportional gain a step must still add.
    min_gain: float = 0.25


@dataclass(frozen=True)
class Verdict:
    step: StepResult
    reasons: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Knee:
    #: The highest healthy step below the first unhealthy one (None: even the lowest failed).
    knee: StepResult | None
    #: The lowest unhealthy step (None: the ramp never saturated the server).
    first_bad: StepResult | None
    #: The most requests/s any step achieved (the plateau once saturated).
    capacity_rps: float
    capacity_tokens_per_s: float
    #: Unloaded p95 the latency threshold is relative to.
    base_p95_ms: float
    verdicts: tuple[Verdict, ...] = field(default=())

    @property
    def saturated(self) -> bool:
        return self.first_bad is not None


def judge_steps(steps: list[StepResult], criteria: Criteria = Criteria()) -> list[Verdict]:
    """Each step with the reasons it is past the knee, sorted by offered load."""
    ordered = sorted(steps, key=lambda s: s.offered)
    if not ordered:
        return []
    base_p95 = _base_p95(ordered)
    threshold = criteria.p95_factor * base_p95
    verdicts: list[Verdict] = []
    prev: StepResult | None = None
    for step in ordered:
        reasons: list[str] = []
        if step.error_rate > criteria.max_error_rate:
            reasons.append(f"errors {step.error_rate:.1%}")
        if step.mode == OPEN and step.throughput_rps < (1.0 - criteria.keep_up_tol) * step.offered:
            reasons.append(f"behind: {step.throughput_rps / step.offered:.0%} of offered")
        if step.mode == CLOSED and prev is not None and prev.offered > 0 and prev.throughput_rps > 0:
            wanted = criteria.min_gain * (step.offered / prev.offered - 1.0)
            got = step.throughput_rps / prev.throughput_rps - 1.0
            if got < wanted:
                reasons.append(f"flat: {got:+.0%} throughput for {step.offered / prev.offered - 1.0:+.0%} load")
        if step.ok and step.p95_ms > threshold:
            reasons.append(f"p95 {step.p95_ms:.0f} ms > {criteria.p95_factor:g}x base {base_p95:.0f} ms")
        if step.ok and criteria.max_p95_ms is not None and step.p95_ms > criteria.max_p95_ms:
            reasons.append(f"p95 {step.p95_ms:.0f} ms > SLO {criteria.max_p95_ms:.0f} ms")
        if step.ok == 0:
            reasons.append("no successful reply")
        verdicts.append(Verdict(step, tuple(reasons)))
        prev = step
    return verdicts


def find_knee(steps: list[StepResult], criteria: Criteria = Criteria()) -> Knee:
    verdicts = judge_steps(steps, criteria)
    if not verdicts:
        raise ValueError("find_knee needs at least one step")
    first_bad = next((v.step for v in verdicts if not v.healthy), None)
    below = [v.step for v in verdicts if v.healthy and (first_bad is None or v.step.offered < first_bad.offered)]
    best = max(verdicts, key=lambda v: v.step.throughput_rps).step
    return Knee(
        knee=below[-1] if below else None,
        first_bad=first_bad,
        capacity_rps=best.throughput_rps,
        capacity_tokens_per_s=max(v.step.tokens_per_s for v in verdicts),
        base_p95_ms=_base_p95([v.step for v in verdicts]),
        verdicts=tuple(verdicts),
    )


@dataclass(frozen=True)
class Ramp:
    start: float
    factor: float = 1.5
    #: Stop bisecting once first_bad / knee <= 1 + resolution.
    resolution: float = 0.03
    max_steps: int = 16
    max_offered: float = math.inf
    #: Closed loop: clients are whole numbers.
    integer: bool = False


def plan_next(steps: list[StepResult], ramp: Ramp, criteria: Criteria = Criteria()) -> float | None:
    """The next offered load to try, or None when the knee is pinned down (or the budget is spent)."""
    if not steps:
        return _clip(ramp.start, ramp)
    if len(steps) >= ramp.max_steps:
        return None
    knee = find_knee(steps, criteria)
    tried = {s.offered for s in steps}
    if knee.first_bad is None:
        top = max(tried)
        if top >= ramp.max_offered:
            return None
        nxt = _clip(top * ramp.factor, ramp)
        if ramp.integer and nxt <= top:
            nxt = top + 1
        return None if nxt in tried else nxt
    hi = knee.first_bad.offered
    lo = knee.knee.offered if knee.knee is not None else 0.0
    if lo == 0.0:
        # Even the lowest load failed: step down below it, unless it is already tiny.
        nxt = hi / ramp.factor
        if ramp.integer:
            nxt = math.floor(nxt)
        return nxt if nxt > 0 and nxt not in tried and nxt >= ramp.start / 64 else None
    if hi <= lo * (1.0 + ramp.resolution):
        return None
    mid = (lo + hi) / 2.0
    if ramp.integer:
        mid = float(math.floor(mid))
        if mid <= lo:
            return None
    return None if mid in tried else mid


def _clip(value: float, ramp: Ramp) -> float:
    value = min(value, ramp.max_offered)
    return float(max(1, round(value))) if ramp.integer else value


def _base_p95(ordered: list[StepResult]) -> float:
    """Unloaded p95: the lowest-load step that got answers (its latency is the server's floor)."""
    for step in sorted(ordered, key=lambda s: s.offered):
        if step.ok:
            return step.p95_ms
    return math.inf
