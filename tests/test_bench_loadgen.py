"""The load generator and the ramp against a real synthetic server with a known capacity.

The server (`bench.synthetic`) is its own process on 127.0.0.1 serving at most
C requests/s; the generator runs in its own spawned process, as in a real
bench. Every loop is bounded by the ramp's step budget and each step's grace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from fleet.bench import corpus
from fleet.bench.knee import CLOSED, OPEN
from fleet.bench.loadgen import Generator, Setup, StepPlan
from fleet.bench.runner import Plan, TargetSpec, bench
from fleet.bench.sampler import Sampler
from fleet.bench.tokens import TokenCounter

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def synthetic(capacity: float, burst: float | None = None, latency_ms: float = 10.0) -> Iterator[str]:
    args = [sys.executable, "-m", "fleet.bench", "synthetic", "--capacity", str(capacity), "--latency-ms", str(latency_ms)]
    if burst is not None:
        args += ["--burst", str(burst)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        yield f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def inputs() -> tuple[list[str], list[int]]:
    texts = corpus.load()
    return texts, TokenCounter.for_default_model().count(texts)


def setup_for(url: str, inputs, batch: int = 4, kind: str = "fleet") -> Setup:
    texts, lengths = inputs
    return Setup(kind=kind, task="embed", url=url, model="synthetic", texts=texts, lengths=lengths, batch=batch)


@pytest.mark.slow
def test_ramp_finds_the_knee_within_10_percent_of_capacity(inputs):
    capacity = 200.0
    texts, lengths = inputs
    with synthetic(capacity, burst=40) as url, Sampler(interval_s=0.25) as sampler:
        plan = Plan(model="synthetic", batch=4, duration_s=2.0, warmup_s=1.0, grace_s=5.0, max_steps=14)
        runs = bench([TargetSpec("synthetic", "fleet", url)], plan, texts, lengths, sampler=sampler)
    run = runs[0]
    k = run.knee(plan.criteria)
    assert k.saturated, [(s.result.offered, s.reasons) for s in run.steps]
    assert abs(k.knee.throughput_rps - capacity) <= 0.1 * capacity, k.knee
    assert abs(k.capacity_rps - capacity) <= 0.1 * capacity
    # The generator was never the bottleneck: its own CPU stayed low at every step.
    assert max(s.gen_cpu_pct for s in run.steps) < 50
    # Tokens/s is requests/s times the tokens the prepared requests carry.
    per_request = k.knee.tokens_per_s / k.knee.throughput_rps
    assert 4 * 10 <= per_request <= 4 * 80
    # The sampler saw the generator process at work during the steps.
    assert any(s.box.get("cpu_pct", {}).get("synthetic:generator", 0) > 0 for s in run.steps)


@pytest.mark.slow
def test_open_loop_keeps_offering_when_the_server_is_slow(inputs):
    """A slow server cannot slow the offered load down; latency shows the queue instead."""
    with synthetic(20.0, burst=1) as url, Generator(setup_for(url, inputs)) as gen:
        m = gen.run(StepPlan(index=0, mode=OPEN, offered=60.0, duration_s=2.0, grace_s=10.0, seed=3))
    assert m.sent == 120  # exactly rate x duration, on schedule
    # Arrivals fired on time (a loose bound: the 2-core box is shared with the server).
    assert m.lag_p99_ms < 50
    assert m.ok == 120 and m.errors == 0
    assert 20 * 0.85 <= m.ok / m.elapsed_s <= 20 * 1.15
    # The last requests waited for ~(120 - 20*2) / 20 = 4 s of backlog.
    assert np.percentile(m.latencies_ms, 95) > 2500
    # ... and the server's own X-Queue-Ms says where that time went.
    assert np.percentile(m.server_queue_ms, 95) > 2000
    assert np.allclose(m.server_inference_ms, 10.0)


@pytest.mark.slow
def test_closed_loop_clients_each_wait_for_their_reply(inputs):
    with synthetic(10_000.0, latency_ms=20.0) as url, Generator(setup_for(url, inputs)) as gen:
        one = gen.run(StepPlan(index=0, mode=CLOSED, offered=1, duration_s=1.5))
        four = gen.run(StepPlan(index=1, mode=CLOSED, offered=4, duration_s=1.5))
    rate_one = one.ok / one.elapsed_s
    assert 20 <= rate_one <= 50  # ~1 / 21 ms, less when the shared box is busy
    assert 3.0 <= (four.ok / four.elapsed_s) / rate_one <= 4.5
    assert np.median(four.latencies_ms) >= 20


@pytest.mark.slow
def test_rejected_requests_are_errors_not_throughput(inputs):
    # JSON bodies to a MessagePack-only server: every reply is a 400.
    with synthetic(500.0) as url, Generator(setup_for(url, inputs, kind="fleet-json")) as gen:
        m = gen.run(StepPlan(index=0, mode=OPEN, offered=50.0, duration_s=1.0))
    assert m.sent == 50
    assert m.ok == 0 and m.errors == 50
    assert m.error_codes == {400: 50}
    assert "bad_request" in m.error_sample


@pytest.mark.slow
def test_generator_processes_split_the_load(inputs):
    with synthetic(10_000.0) as url, Generator(setup_for(url, inputs), processes=2) as gen:
        assert len(set(gen.pids)) == 2
        m = gen.run(StepPlan(index=0, mode=OPEN, offered=200.0, duration_s=1.0))
    assert m.sent == 200 and m.ok == 200


def test_load_generator_side_never_imports_torch():
    code = (
        "import sys, bench.loadgen, bench.runner, bench.report, bench.targets, bench.st_local, bench.peers, "
        "fleetctl.commands.bench; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"

