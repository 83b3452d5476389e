"""One offered-load step, run the same way against either scheduler.

1. Replay the trace open loop: each request is submitted at its scheduled
   time (lateness is recorded; latency counts from the *scheduled* arrival).
2. At the end of the window, let the backlog drain for up to `drain_s`, then
   drop what is still queued (counted as errors, like a deadline) and wait for
   the batches in flight. Every request ends exactly once: done, rejected
   (queue full) or dropped; anything else raises.
3. Throughput counts requests finished inside the window; latency
   percentiles are over every finished request.
All reported times are device (simulated) time: wall time / time_scale.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import psutil

from fleet.bench.knee import StepResult
from fleet.bench.sim.device import DeviceStats
from fleet.bench.sim.traffic import SimModel, Trace


class Recorder:
    """End time (monotonic ns) per request of the current step; 0 = not finished.

    Written by worker / collector threads, one element per request id, read by
    the step thread: each element is written once, so no lock is needed."""

    def __init__(self) -> None:
        self.base = 0
        self.end_ns = np.zeros(0, np.int64)

    def begin(self, base: int, n: int) -> None:
        self.end_ns = np.zeros(n, np.int64)
        self.base = base

    def done(self, rid: int, end_ns: int) -> None:
        i = rid - self.base
        if not 0 <= i < len(self.end_ns) or self.end_ns[i]:
            raise RuntimeError(f"result for request {rid} outside its step or twice: this is a bug")
        self.end_ns[i] = end_ns

    def finished(self) -> int:
        return int(np.count_nonzero(self.end_ns))


@dataclass(frozen=True)
class StepOutcome:
    result: StepResult
    rejected: int
    dropped: int
    #: Arrival thread lateness, device ms (a late generator under-offers load).
    gen_lag_p99_ms: float
    #: This process's CPU over the step, % of one core (2 cores here: 200 is all of it).
    cpu_pct: float
    #: The whole machine's CPU over the step, % of all cores (others share this box).
    host_cpu_pct: float
    swaps: int
    batches: int
    items_per_batch: float
    #: Device time issued during the step (swaps included) / (devices x the step's wall
    #: span, window and drain); an operation is counted when issued, so it can pass 1.
    device_busy: float
    swap_share: float  # fraction of busy device time spent loading models
    #: Distinct models resident on some device at the step's end (of all models; a
    #: herd of workers loading the same models shows up as a small number here).
    resident_distinct: int


def _sum_stats(devices) -> DeviceStats:
    out = DeviceStats()
    for d in devices:
        s = d.stats
        out.batches += s.batches
        out.items += s.items
        out.tokens += s.tokens
        out.swaps += s.swaps
        out.busy_ns += s.busy_ns
        out.swap_ns += s.swap_ns
    return out


def run_step(system, trace: Trace, models: list[SimModel], recorder: Recorder, base_rid: int, *,
             time_scale: float, drain_s: float, payload: memoryview) -> StepOutcome:
    n = len(trace)
    scale_ns = time_scale * 1e9
    recorder.begin(base_rid, n)
    before = _sum_stats(system.devices)
    cpu0 = os.times()
    psutil.cpu_percent(None)  # starts the machine-wide CPU window
    t0 = time.monotonic_ns() + 2_000_000
    arrive = t0 + (trace.t_s * scale_ns).astype(np.int64)
    window_end = t0 + int(trace.duration_s * scale_ns)
    lag = np.zeros(n, np.int64)
    rejected = 0
    tokens = trace.tokens.tolist()
    pick = [models[m] for m in trace.model.tolist()]
    arrive_l = arrive.tolist()
    submit = system.submit
    # 1. Open-loop replay.
    for i in range(n):
        wait = arrive_l[i] - time.monotonic_ns()
        if wait > 200_000:
            time.sleep(wait / 1e9)
        lag[i] = time.monotonic_ns() - arrive_l[i]
        if not submit(base_rid + i, pick[i], tokens[i], payload[:tokens[i] * 4]):
            rejected += 1
    wait = window_end - time.monotonic_ns()
    if wait > 0:
        time.sleep(wait / 1e9)
    # 2. Drain, then drop what still waits and let the batches in flight end.
    deadline = window_end + int(drain_s * scale_ns)
    while recorder.finished() + rejected < n and time.monotonic_ns() < deadline:
        time.sleep(0.005)
    dropped = system.cancel_waiting()
    settle = time.monotonic_ns() + int(30 * scale_ns)
    while recorder.finished() + rejected + dropped < n:
        if time.monotonic_ns() > settle:
            raise RuntimeError(f"{system.name}: {n - recorder.finished() - rejected - dropped} requests "
                               "neither finished nor dropped: this is a bug")
        time.sleep(0.005)
    end_all = time.monotonic_ns()
    cpu1 = os.times()
    host_cpu = psutil.cpu_percent(None)
    after = _sum_stats(system.devices)
    # 3. Measure.
    end = recorder.end_ns
    ok = end > 0
    lat_ms = (end[ok] - arrive[ok]) / 1e6 / time_scale
    in_window = ok & (end <= window_end)
    dur = trace.duration_s
    p50, p95, p99 = (np.percentile(lat_ms, [50, 95, 99]).tolist() if lat_ms.size else [float("nan")] * 3)
    result = StepResult(
        offered=trace.rate,
        throughput_rps=float(in_window.sum()) / dur,
        tokens_per_s=float(trace.tokens[in_window].sum()) / dur,
        p50_ms=p50, p95_ms=p95, p99_ms=p99,
        sent=n, ok=int(ok.sum()), errors=rejected + dropped,
    )
    batches = after.batches - before.batches
    busy = after.busy_ns - before.busy_ns
    span = (end_all - t0) * len(system.devices)
    wall = (end_all - t0) / 1e9
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return StepOutcome(
        result=result, rejected=rejected, dropped=dropped,
        gen_lag_p99_ms=float(np.percentile(lag, 99)) / 1e6 / time_scale if n else 0.0,
        cpu_pct=100.0 * cpu / wall,
        host_cpu_pct=host_cpu,
        swaps=after.swaps - before.swaps, batches=batches,
        items_per_batch=(after.items - before.items) / batches if batches else 0.0,
        device_busy=busy / span if span else 0.0,
        swap_share=(after.swap_ns - before.swap_ns) / busy if busy else 0.0,
        resident_distinct=len(set().union(*(set(d.resident) for d in system.devices))),
    )
