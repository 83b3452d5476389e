"""Runs a bench: warm up each target, ramp its load step by step, find its knee.

Targets are benched in one session, interleaved: each round runs the next
step of every target that is not finished yet, so slow drifts of the box
(another tenant, clocks, caches) fall on all of them alike. Each target has its
own ramp (`bench.knee.plan_next`) and its own generator processes; servers run
in their own processes, the in-process sentence-transformers target in its own
spawned process. This module never imports torch.

Step loop for one target, per round:
  1. ask the ramp (or the explicit list) for the next offered load; none = done;
  2. run the step in the generator processes while the sampler watches the box;
  3. turn the raw counts into a `StepResult` (+ generator health, box usage);
  4. judge all steps so far; the display shows the verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleet.bench.knee import CLOSED, OPEN, Criteria, Knee, Ramp, StepResult, find_knee, plan_next
from fleet.bench.loadgen import Generator, Merged, Setup, StepPlan
from fleet.bench.sampler import Sampler

#: A generator firing arrivals later than this (p99) is too busy to be trusted.
MAX_LAG_MS = 10.0
#: ... or using more than this share of its cores.
MAX_GEN_CPU_SHARE = 0.85


@dataclass
class TargetSpec:
    #: Label in tables and results: "fleet", "infinity", "st-fp32", ...
    name: str
    #: fleet | fleet-json | openai | infinity | st
    kind: str
    url: str = ""
    #: st only: fp32 | bf16
    dtype: str = "fp32"
    #: st only: torch (sentence-transformers) | openvino (fleet's adapter, bench/st_local.py)
    engine: str = "torch"
    #: st only: length-sorted batches of the texts (the offline limit) instead of the request windows
    sorted: bool = False
    #: Server processes to sample (their children are included).
    pids: list[int] = field(default_factory=list)


@dataclass
class Plan:
    model: str
    task: str = "embed"
    #: Inputs per request.
    batch: int = 32
    duration_s: float = 10.0
    #: Open loop: a step lasts long enough to offer this many requests (percentiles
    #: of 4 requests mean nothing), up to `max_step_s`.
    min_requests: int = 30
    max_step_s: float = 120.0
    mode: str = OPEN
    #: Explicit offered loads (requests/s open loop, clients closed loop); None = ramp.
    loads: list[float] | None = None
    start: float | None = None
    factor: float = 1.5
    resolution: float = 0.03
    max_steps: int = 16
    criteria: Criteria = field(default_factory=Criteria)
    generators: int = 1
    grace_s: float = 10.0
    warmup_s: float = 3.0
    encoding: str = "base64"
    api_key: str = ""
    #: Steps the in-process target runs (one caller each; its result is their median).
    st_steps: int = 3
    device: str = "cpu"


@dataclass
class StepRecord:
    result: StepResult
    lag_p99_ms: float
    gen_cpu_pct: float
    generator_bound: bool
    #: Input tokens of the successful requests (bench tokenizer count).
    tokens: int
    server_tokens: int
    error_codes: dict[int, int]
    error_sample: str
    #: Medians of the server's own X-Queue-Ms / X-Inference-Ms (None: it sends none).
    server_queue_p50_ms: float | None
    server_inference_p50_ms: float | None
    started_unix: float
    ended_unix: float
    box: dict


@dataclass
class TargetRun:
    spec: TargetSpec
    driver: object
    mode: str
    ramp: Ramp | None
    loads: list[float] | None
    steps: list[StepRecord] = field(default_factory=list)
    warmup: StepRecord | None = None
    done: bool = False
    #: fleet targets: what each worker holding the model serves it with after the
    #: warm-up (`served_by`); a fleet target's numbers depend on its engine choice.
    served: list[dict] | None = None

    @property
    def results(self) -> list[StepResult]:
        return [s.result for s in self.steps]

    def next_load(self, plan: Plan) -> float | None:
        if self.spec.kind == "st":
            return 1.0 if len(self.steps) < plan.st_steps else None
        if self.loads is not None:
            return self.loads[len(self.steps)] if len(self.steps) < len(self.loads) else None
        return plan_next(self.results, self.ramp, plan.criteria)

    def knee(self, criteria: Criteria) -> Knee:
        if self.spec.kind == "st":
            return st_summary(self.results)
        return find_knee(self.results, criteria)


def st_summary(steps: list[StepResult]) -> Knee:
    """The in-process target has no knee to find: its median step is its compute limit."""
    ordered = sorted(steps, key=lambda s: s.throughput_rps)
    mid = ordered[len(ordered) // 2]
    return Knee(knee=mid, first_bad=None, capacity_rps=mid.throughput_rps,
                capacity_tokens_per_s=mid.tokens_per_s, base_p95_ms=mid.p95_ms)


def to_step_result(m: Merged, offered: float, mode: str) -> StepResult:
    lat = m.latencies_ms
    p50, p95, p99 = (np.percentile(lat, [50, 95, 99]).tolist() if lat.size else [float("nan")] * 3)
    return StepResult(
        offered=offered,
        throughput_rps=m.ok / m.elapsed_s,
        tokens_per_s=m.tokens_ok / m.elapsed_s,
        p50_ms=p50, p95_ms=p95, p99_ms=p99,
        sent=m.sent, ok=m.ok, errors=m.errors, mode=mode,
    )


class NullDisplay:
    """What the runner tells a display; this one shows nothing (tests, --quiet)."""

    def step_started(self, run: TargetRun, offered: float, index: int, duration_s: float) -> None: ...
    def progress(self, sent: int, done: int, errors: int) -> None: ...
    def step_done(self, run: TargetRun, rec: StepRecord) -> None: ...
    def note(self, text: str) -> None: ...


#: The display of a run nobody watches; it keeps no state, so one serves every call.
NULL_DISPLAY = NullDisplay()


def open_run(spec: TargetSpec, plan: Plan, texts: list[str], lengths: list[int], model_dir: Path | None) -> TargetRun:
    if spec.kind == "st":
        from fleet.bench.st_local import LocalST, STSetup

        if model_dir is None:
            raise ValueError("the in-process target needs the model folder")
        driver = LocalST(STSetup(str(model_dir), spec.dtype, plan.device, texts, lengths, plan.batch,
                                 engine=spec.engine, sorted=spec.sorted, model=plan.model))
        return TargetRun(spec, driver, CLOSED, None, None)
    setup = Setup(kind=spec.kind, task=plan.task, url=spec.url, model=plan.model, texts=texts,
                  lengths=lengths, batch=plan.batch, encoding=plan.encoding, api_key=plan.api_key)
    driver = Generator(setup, plan.generators)
    integer = plan.mode == CLOSED
    ramp = Ramp(start=plan.start or 1.0, factor=plan.factor if not integer else max(plan.factor, 2.0),
                resolution=plan.resolution, max_steps=plan.max_steps, integer=integer)
    return TargetRun(spec, driver, plan.mode, ramp, list(plan.loads) if plan.loads else None)


def run_step(run: TargetRun, plan: Plan, offered: float, index: int, sampler: Sampler | None,
             display=NULL_DISPLAY, mode: str | None = None, duration_s: float | None = None) -> StepRecord:
    mode = mode or run.mode
    duration = duration_s or plan.duration_s
    if duration_s is None and mode == OPEN:
        duration = min(max(duration, plan.min_requests / offered), max(plan.max_step_s, plan.duration_s))
    display.step_started(run, offered, index, duration)
    t0 = time.time()
    merged = run.driver.run(
        StepPlan(index=index, mode=mode, offered=offered, duration_s=duration, grace_s=plan.grace_s, seed=index + 1),
        on_progress=display.progress,
    )
    t1 = time.time()
    result = to_step_result(merged, offered, mode)
    procs = len(getattr(run.driver, "procs", [None]))
    gen_cpu = 100.0 * merged.cpu_s / merged.elapsed_s
    bound = run.spec.kind != "st" and (
        (mode == OPEN and merged.lag_p99_ms > MAX_LAG_MS) or gen_cpu > 100.0 * MAX_GEN_CPU_SHARE * procs
    )
    return StepRecord(
        result=result, lag_p99_ms=merged.lag_p99_ms, gen_cpu_pct=gen_cpu, generator_bound=bound,
        tokens=merged.tokens_ok, server_tokens=merged.server_tokens, error_codes=merged.error_codes, error_sample=merged.error_sample,
        server_queue_p50_ms=_median(merged.server_queue_ms), server_inference_p50_ms=_median(merged.server_inference_ms),
        started_unix=t0, ended_unix=t1, box=sampler.window(t0, t1) if sampler else {},
    )


def settle(run: TargetRun, plan: Plan, display=NULL_DISPLAY) -> None:
    """After a step the bench gave up on (replies still owed), let the server drain.

    Requests the generator stopped waiting for may still be queued in the server;
    left there, they would slow the next step of this or another target. Waiting
    `grace_s` again gives that backlog (at most what arrived past capacity) time to go.
    """
    display.note(f"{run.spec.name}: waiting {plan.grace_s:g} s for the server to drain its backlog")
    time.sleep(plan.grace_s)


def _median(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


def warm_up(run: TargetRun, plan: Plan, sampler: Sampler | None, display=NULL_DISPLAY) -> None:
    """One client, back to back: loads lazy models and measures the unloaded rate the ramp starts from."""
    if run.spec.kind == "st" or plan.warmup_s <= 0:
        return
    rec = run_step(run, plan, 1.0, -1, sampler, display, mode=CLOSED, duration_s=plan.warmup_s)
    run.warmup = rec
    if rec.result.ok == 0:
        raise RuntimeError(
            f"{run.spec.name}: no successful reply during warm-up ({rec.error_codes}): {rec.error_sample}"
        )
    if run.spec.kind in ("fleet", "fleet-json"):
        run.served = served_by(run.spec.url, plan.model, plan.api_key)
    if plan.start is None and run.ramp is not None and run.mode == OPEN:
        # Half of what one serial client gets is comfortably below the knee of any
        # server, batching or not, and near enough that the ramp needs few steps.
        start = max(0.5, 0.5 * rec.result.throughput_rps)
        run.ramp = Ramp(start=start, factor=run.ramp.factor, resolution=run.ramp.resolution,
                        max_steps=run.ramp.max_steps, integer=run.ramp.integer)


#: What `served_by` keeps of a worker's model entry in `/v1/ps`.
SERVED_KEYS = ("dtype", "engine", "forward", "fixed_tokens", "threads")


def served_by(url: str, model: str, api_key: str = "") -> list[dict]:
    """What each of the daemon's workers holding `model` serves it with (`/v1/ps`): its
    dtype, engine and how that was chosen; [] when the daemon cannot say."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        ps = httpx.get(url.rstrip("/") + "/v1/ps", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return []
    return [{"worker": w.get("index"), **{k: m[k] for k in SERVED_KEYS if k in m}}
            for w in ps.get("workers", []) if (m := w.get("models", {}).get(model))]


def bench(specs: list[TargetSpec], plan: Plan, texts: list[str], lengths: list[int], *,
          model_dir: Path | None = None, display=NULL_DISPLAY, sampler: Sampler | None = None) -> list[TargetRun]:
    runs: list[TargetRun] = []
    try:
        for spec in specs:
            display.note(f"starting {spec.name}")
            run = open_run(spec, plan, texts, lengths, model_dir)
            runs.append(run)
            if sampler is not None:
                sampler.track(f"{spec.name}:generator", getattr(run.driver, "pids", []) if spec.kind != "st" else [])
                sampler.track(f"{spec.name}:server", spec.pids if spec.kind != "st" else run.driver.pids)
        for run in runs:
            warm_up(run, plan, sampler, display)
        index = 0
        # Bounded: every target stops after max_steps (or its explicit list / st_steps).
        while not all(r.done for r in runs):
            for run in runs:
                if run.done:
                    continue
                offered = run.next_load(plan)
                if offered is None:
                    run.done = True
                    continue
                rec = run_step(run, plan, offered, index, sampler, display)
                index += 1
                run.steps.append(rec)
                if rec.error_codes.get(-1):
                    settle(run, plan, display)
                display.step_done(run, rec)
    finally:
        for run in runs:
            run.driver.close()
    return runs


def compare_ratios(runs: list[TargetRun], criteria: Criteria) -> dict[str, dict[str, float]]:
    """tokens/s at each target's knee, divided by every other target's."""
    tps = {}
    for run in runs:
        k = run.knee(criteria)
        tps[run.spec.name] = (k.knee.tokens_per_s if k.knee else 0.0)
    return {
        a: {b: round(tps[a] / tps[b], 3) for b in tps if b != a and tps[b] > 0}
        for a in tps
    }
