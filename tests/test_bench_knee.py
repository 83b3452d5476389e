"""The knee finder and the ramp: pure functions, tables of cases, no I/O."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.bench.knee import CLOSED, OPEN, Criteria, Ramp, StepResult, find_knee, judge_steps, plan_next


def step(offered, thr=None, p95=10.0, errors=0, sent=None, mode=OPEN, p50=None):
    thr = offered if thr is None else thr
    sent = sent if sent is not None else max(1, int(offered * 10))
    return StepResult(
        offered=offered, throughput_rps=thr, tokens_per_s=thr * 100, p50_ms=p50 or p95 / 2, p95_ms=p95,
        p99_ms=p95 * 1.2, sent=sent, ok=sent - errors, errors=errors, mode=mode,
    )


# (name, steps, criteria, knee offered or None, first bad offered or None, reason fragment of first bad)
KNEE_CASES = [
    ("throughput flattens",
     [step(10), step(20), step(40), step(80, thr=50, p95=900)], Criteria(), 40, 80, "behind"),
    ("latency climbs while throughput keeps up",
     [step(10, p95=10), step(20, p95=12), step(40, p95=25), step(60, p95=45)], Criteria(), 40, 60, "p95 45 ms > 3x"),
    ("errors past the limit",
     [step(10), step(20), step(30, errors=9, sent=300)], Criteria(), 20, 30, "errors 3.0%"),
    ("a few errors are tolerated",
     [step(10), step(20, errors=1, sent=200)], Criteria(), 20, None, None),
    ("never saturated",
     [step(5), step(10), step(20)], Criteria(), 20, None, None),
    ("even the lowest load fails",
     [step(10, thr=3, p95=5000), step(20, thr=3, p95=9000)], Criteria(), None, 10, "behind"),
    ("a healthy step above a failure does not move the knee",
     [step(10), step(20), step(30, thr=20, p95=400), step(40, p95=11)], Criteria(), 20, 30, "behind"),
    ("order of arrival does not matter (bisection steps come last)",
     [step(80, thr=50, p95=900), step(10), step(60, p95=12), step(40), step(70, thr=55, p95=300)],
     Criteria(), 60, 70, "behind"),
    ("an SLO cuts below the factor",
     [step(10, p95=10), step(20, p95=18), step(30, p95=24)], Criteria(max_p95_ms=20), 20, 30, "SLO 20 ms"),
    ("keep-up tolerance is configurable",
     [step(10), step(20, thr=17)], Criteria(keep_up_tol=0.2), 20, None, None),
    ("closed loop: doubling clients adds too little",
     [step(1, thr=10, mode=CLOSED), step(2, thr=19, mode=CLOSED), step(4, thr=36, mode=CLOSED),
      step(8, thr=38, mode=CLOSED, p95=20)], Criteria(), 4, 8, "flat"),
    ("closed loop: no successful reply",
     [step(1, thr=10, mode=CLOSED), step(2, thr=0, errors=20, sent=20, mode=CLOSED)], Criteria(), 1, 2, "errors"),
]


@pytest.mark.parametrize("name,steps,criteria,knee,bad,reason", KNEE_CASES, ids=[c[0] for c in KNEE_CASES])
def test_find_knee_table(name, steps, criteria, knee, bad, reason):
    k = find_knee(steps, criteria)
    assert (k.knee.offered if k.knee else None) == knee
    assert (k.first_bad.offered if k.first_bad else None) == bad
    assert k.saturated == (bad is not None)
    assert k.capacity_rps == max(s.throughput_rps for s in steps)
    if reason:
        verdict = next(v for v in k.verdicts if v.step is k.first_bad)
        assert any(reason in r for r in verdict.reasons), verdict.reasons


def test_base_latency_is_the_lowest_step_with_answers():
    steps = [step(40, p95=31), step(10, p95=10), step(20, p95=12)]
    assert find_knee(steps).base_p95_ms == 10
    verdicts = judge_steps(steps)
    assert [v.step.offered for v in verdicts] == [10, 20, 40]
    assert verdicts[-1].reasons == ("p95 31 ms > 3x base 10 ms",)


def test_find_knee_needs_steps():
    with pytest.raises(ValueError):
        find_knee([])


# (name, steps, ramp, expected next offered)
PLAN_CASES = [
    ("first step is the start", [], Ramp(start=4), 4),
    ("grow geometrically while healthy", [step(4), step(6)], Ramp(start=4, factor=1.5), 9),
    ("bisect between the knee and the first failure", [step(10), step(20), step(40, thr=25, p95=500)],
     Ramp(start=10, factor=2), 30),
    ("stop once the bracket is within resolution", [step(100), step(102, thr=80, p95=500)],
     Ramp(start=100, resolution=0.03), None),
    ("stop at the step budget", [step(1), step(2), step(4)], Ramp(start=1, factor=2, max_steps=3), None),
    ("stop at the load cap", [step(8)], Ramp(start=8, max_offered=8), None),
    ("cap the next load", [step(6)], Ramp(start=6, factor=2, max_offered=10), 10),
    ("step below a failing start", [step(8, thr=2, p95=900)], Ramp(start=8, factor=2), 4),
    ("give up far below the start", [step(8, thr=0.01, p95=900), step(0.1, thr=0.01, p95=900)],
     Ramp(start=8, factor=100), None),
    ("integer ramp for clients", [step(1, thr=10, mode=CLOSED), step(2, thr=20, mode=CLOSED)],
     Ramp(start=1, factor=2, integer=True), 4),
    ("integer bisection", [step(4, thr=40, mode=CLOSED), step(8, thr=41, mode=CLOSED)],
     Ramp(start=1, factor=2, integer=True), 6),
    ("integer bracket exhausted", [step(4, thr=40, mode=CLOSED), step(5, thr=40, mode=CLOSED)],
     Ramp(start=1, factor=2, integer=True, resolution=0.1), None),
]


@pytest.mark.parametrize("name,steps,ramp,expected", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_next_table(name, steps, ramp, expected):
    assert plan_next(steps, ramp) == expected


def simulated_server(capacity: float, base_ms: float):
    """A server model: keeps up below capacity with flat latency, queues above it."""

    def run(offered: float) -> StepResult:
        rho = offered / capacity
        if rho < 1.0:
            p95 = base_ms * (1.0 + 0.5 * rho)
            return step(offered, thr=offered, p95=p95)
        return step(offered, thr=capacity, p95=base_ms * (3.0 + 50.0 * (rho - 1.0)) + 1000.0 * (rho - 1.0))

    return run


@settings(max_examples=60, deadline=None)
@given(capacity=st.floats(2.0, 5000.0), start_share=st.floats(0.02, 0.6), base_ms=st.floats(1.0, 500.0),
       factor=st.floats(1.3, 3.0))
def test_ramp_pins_the_knee_within_its_resolution(capacity, start_share, base_ms, factor):
    server = simulated_server(capacity, base_ms)
    ramp = Ramp(start=capacity * start_share, factor=factor, resolution=0.03, max_steps=24)
    steps: list[StepResult] = []
    while (nxt := plan_next(steps, ramp)) is not None:
        steps.append(server(nxt))
    k = find_knee(steps)
    assert k.saturated
    assert k.knee is not None
    assert 0.95 * capacity <= k.knee.throughput_rps <= capacity
    assert k.first_bad.offered <= k.knee.offered * 1.03 + 1e-9
    assert len(steps) <= math.ceil(math.log(1 / start_share, factor)) + 12
