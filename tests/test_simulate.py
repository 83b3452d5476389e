"""fleet.bench.simulate: the trace generator, the push router's rule, the device model,
pull's real WorkerCores on simulated devices, and a real --quick run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleet.bench.sim.device import SimDevice
from fleet.bench.sim.pull import PullSystem
from fleet.bench.sim.push import PushRouter, WorkerView, added_ms, assign_worker, load_penalty_ms
from fleet.bench.sim.step import Recorder
from fleet.bench.sim.traffic import SMALL, TrafficSpec, make_models, make_trace, zipf_weights
from fleet.runtimes.memory import LOAD, WAIT

ROOT = Path(__file__).resolve().parents[1]
SPEC = TrafficSpec()


# -- trace -----------------------------------------------------------------------

def test_trace_is_seeded_and_replayable():
    a = make_trace(300.0, 5.0, SPEC, seed=3)
    b = make_trace(300.0, 5.0, SPEC, seed=3)
    c = make_trace(300.0, 5.0, SPEC, seed=4)
    for field in ("t_s", "model", "inputs", "tokens"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.model, c.model)
    assert not np.array_equal(a.t_s, c.t_s)


def test_trace_offers_exactly_its_rate_in_its_window():
    for rate, dur in ((250.0, 2.0), (1234.0, 3.0), (7.0, 1.0)):
        tr = make_trace(rate, dur, SPEC, seed=1)
        assert len(tr) == round(rate * dur)
        assert np.all(np.diff(tr.t_s) >= 0)
        assert tr.t_s[0] >= 0 and tr.t_s[-1] < dur


def test_trace_arrivals_are_poisson():
    # Gaps of a Poisson process are exponential: mean 1/rate and coefficient of variation 1.
    tr = make_trace(2000.0, 10.0, SPEC, seed=5)
    gaps = np.diff(tr.t_s)
    assert gaps.mean() == pytest.approx(1 / 2000.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_trace_popularity_follows_zipf():
    tr = make_trace(5000.0, 10.0, SPEC, seed=2)  # 50,000 requests
    p = zipf_weights(20, 1.0)
    freq = np.bincount(tr.model, minlength=20) / len(tr)
    n = len(tr)
    for k in range(20):
        sigma = math.sqrt(p[k] * (1 - p[k]) / n)
        assert abs(freq[k] - p[k]) < 5 * sigma, (k, freq[k], p[k])
    assert freq[0] / freq[1] == pytest.approx(2.0, rel=0.08)  # 1/k: rank 1 twice rank 2
    assert freq[0] > 15 * freq[19]


def test_zipf_weights_skew_grows_with_s():
    flat, skewed = zipf_weights(20, 0.0), zipf_weights(20, 1.5)
    assert np.allclose(flat, 1 / 20)
    assert skewed.sum() == pytest.approx(1.0)
    assert skewed[0] / skewed[1] == pytest.approx(2 ** 1.5)


def test_trace_requests_are_small_and_mostly_tiny():
    tr = make_trace(5000.0, 4.0, SPEC, seed=9)
    assert tr.inputs.min() >= 1 and tr.inputs.max() <= 32
    assert np.all(tr.tokens >= 10 * tr.inputs) and np.all(tr.tokens <= 80 * tr.inputs)
    # Log-uniform over 1..32: P(inputs <= 4) = ln 5 / ln 33 ~ 0.46; a uniform draw would give 0.125.
    assert np.mean(tr.inputs <= 4) == pytest.approx(math.log(5) / math.log(33), abs=0.03)
    assert tr.tokens.mean() == pytest.approx(45 * tr.inputs.mean(), rel=0.05)


def test_trace_rejects_empty_load():
    with pytest.raises(ValueError):
        make_trace(0.0, 1.0, SPEC, seed=1)


def test_models_mix_sizes_across_popularity():
    models = make_models(20)
    assert [m.size.name for m in models[:3]] == ["small", "base", "large"]
    assert len({m.name for m in models}) == 20
    assert models[0].batch_ms(1000) == pytest.approx(SMALL.a_ms + SMALL.b_ms_per_token * 1000)


# -- push router -----------------------------------------------------------------

SWAP = 100.0


@pytest.mark.parametrize("views, model, slots, expected, why", [
    ([WorkerView(0, set()), WorkerView(0, {7})], 7, 3, 1, "idle holder beats idle stranger"),
    ([WorkerView(0, set()), WorkerView(60, {7})], 7, 3, 1, "busy holder beats idle stranger while backlog < swap"),
    ([WorkerView(0, set()), WorkerView(150, {7})], 7, 3, 0, "stranger with a free slot once backlog > swap"),
    ([WorkerView(0, {1, 2, 3}), WorkerView(150, {7})], 7, 3, 1, "a full stranger is charged the swap twice"),
    ([WorkerView(0, {1, 2, 3}), WorkerView(250, {7})], 7, 3, 0, "... and wins past twice the swap"),
    ([WorkerView(30, {7}), WorkerView(20, {7}), WorkerView(20, {7})], 7, 3, 1, "least backlog, ties to lower index"),
    ([WorkerView(0, {1, 2, 3}), WorkerView(0, {4})], 9, 3, 1, "no holder: the worker that need not evict"),
])
def test_assign_worker_rule(views, model, slots, expected, why):
    assert assign_worker(views, model, SWAP, slots) == expected, why


def test_load_penalty():
    assert load_penalty_ms(WorkerView(0, {5}), 5, SWAP, 3) == 0.0
    assert load_penalty_ms(WorkerView(0, {1}), 5, SWAP, 3) == SWAP
    assert load_penalty_ms(WorkerView(0, {1, 2, 3}), 5, SWAP, 3) == 2 * SWAP


def test_added_ms_counts_the_batch_a_request_joins():
    m = make_models(1)[0]
    assert added_ms(WorkerView(0, {0}, tail_model=0), m, 500) == pytest.approx(m.size.b_ms_per_token * 500)
    assert added_ms(WorkerView(0, {0}, tail_model=3), m, 500) == pytest.approx(m.batch_ms(500))


class _Snap:
    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def snapshot(self) -> WorkerView:
        return WorkerView(self.view.backlog_ms, set(self.view.models), self.view.tail_model)


def test_router_counts_its_own_assignments_between_refreshes():
    m = make_models(3)[2]  # large: a = 8 ms
    workers = [_Snap(WorkerView(0, {2})), _Snap(WorkerView(0, {2}))]
    router = PushRouter(workers, slots=3)
    router.refresh()
    # Both hold the model and look idle: a burst alternates instead of piling onto worker 0.
    got = [router.route(m, 400) for _ in range(4)]
    assert got == [0, 1, 0, 1]
    assert sum(v.backlog_ms for v in router.views) == pytest.approx(2 * m.batch_ms(400) + 2 * 0.01 * 400)


def test_router_view_is_stale_until_refresh():
    m = make_models(1)[0]
    w0, w1 = _Snap(WorkerView(0, {0})), _Snap(WorkerView(0, set()))
    router = PushRouter([w0, w1], slots=3)
    router.refresh()
    w0.view = WorkerView(0, set())  # worker 0 evicted the model; the router has not looked yet
    w1.view = WorkerView(0, {0})
    assert router.route(m, 100) == 0
    router.refresh()
    assert router.route(m, 100) == 1


# -- device and load rules -------------------------------------------------------

def test_device_evicts_per_runtimes_memory():
    a, b, c, d = make_models(10)[0:10:3]  # four small models: same reload cost
    dev = SimDevice(slots=2, time_scale=0.01)  # 1 device ms = 10 us of wall time
    assert dev.ensure(a, {}) is True
    assert dev.ensure(a, {}) is False
    dev.ensure(b, {})
    time.sleep(0.002)
    dev.run(a, 1, 100)  # a used last: b is now least recent
    # Room for c is made by evicting an idle model, least recently used first.
    assert dev.plan_load(c, {}).evict == (str(b.index),)
    assert dev.plan_load(c, {b.index: 5}).evict == (str(a.index),)  # b has work waiting: spare it
    # Both residents busier than the newcomer: plan_load says wait; a push worker evicts anyway.
    assert dev.plan_load(c, {a.index: 5, b.index: 5, c.index: 1}).verdict == WAIT
    assert dev.plan_load(c, {a.index: 5, b.index: 5, c.index: 9}).verdict == LOAD
    assert dev.ensure(c, {a.index: 5, b.index: 5, c.index: 1}) is True
    assert len(dev.resident) == 2 and dev.holds(c.index)
    assert dev.stats.swaps == 3
    with pytest.raises(RuntimeError, match="not resident"):
        dev.run(d, 1, 100)


def test_device_keeps_exact_device_time():
    # Back to back, device time is the sum of the spans, whatever the sleep overshoot.
    m = make_models(1)[0]
    dev = SimDevice(slots=1, time_scale=1.0, slack_ns=50_000_000)  # generous: the CPU is shared
    dev.ensure(m, {})
    t = [dev.run(m, 1, 1000) for _ in range(5)]
    span = int(m.batch_ms(1000) * 1e6)
    assert np.diff(t).tolist() == [span] * 4
    assert dev.stats.busy_ns == int(m.swap_ms * 1e6) + 5 * span


def test_pull_runs_the_real_worker_core_on_simulated_devices():
    from fleet.bench.sim.pull import keep_freed
    from fleet.runtimes.worker import WorkerCore

    models = make_models(3)
    rec = Recorder()
    rec.begin(1, 40)
    system = PullSystem(models, 2, 1, rec)
    try:
        assert all(type(c) is WorkerCore and c.residency.return_freed is keep_freed for c in system.cores)
        system.start()
        payload = memoryview(b"x" * 400)
        for rid in range(1, 41):
            assert system.submit(rid, models[rid % 3], 100, payload)
        end = time.monotonic() + 10
        while rec.finished() < 40 and time.monotonic() < end:
            time.sleep(0.02)
        assert rec.finished() == 40
        # One slot per device, three models: the real core evicted to load them, and
        # the devices hold what the cores say they hold.
        for core, dev in zip(system.cores, system.devices):
            assert {models[i].name for i in dev.resident} == set(core.residency.models)
        assert sum(dev.stats.swaps for dev in system.devices) >= 3
    finally:
        system.close()


# -- the real thing, short -------------------------------------------------------

def test_quick_run_reports_knees_and_answers_every_request(tmp_path):
    out = tmp_path / "sim.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fleet.bench", "simulate", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60, f"--quick took {elapsed:.0f} s"
    doc = json.loads(out.read_text())
    assert doc["kind"] == "simulate" and doc["command"][:4] == ["python", "-m", "fleet.bench", "simulate"]
    assert doc["machine"]["cpus_logical"] >= 1 and "numpy" in doc["versions"]
    summary = doc["summary"]
    for name in ("pull", "push"):
        knee = summary[name]["knee"]
        assert knee is not None, f"{name}: no knee"
        assert knee["throughput_rps"] >= 0.95 * knee["offered"] and knee["p95_ms"] <= doc["config"]["slo_ms"]
    assert "pull/push" in summary["ratios"]
    for name, side in doc["sides"].items():
        assert side["steps"], f"{name} ran no step"
        for step in side["steps"]:
            r = step["result"]
            # Every request ended once: finished, rejected or dropped at the end of its step.
            assert r["ok"] + r["errors"] == r["sent"] == round(r["offered"] * doc["config"]["duration_s"])
            assert r["errors"] == step["rejected"] + step["dropped"]
    assert "knee" in proc.stdout and "pull/push" in proc.stdout
