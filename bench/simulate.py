"""Pull vs push at scale, simulated: N GPUs, M models, skewed traffic of small requests.

    flock /tmp/fleet-bench.lock python -m fleet.bench simulate             # full comparison (a few minutes)
    python -m fleet.bench simulate --quick                                 # coarse, under a minute

Both schedulers drive the same simulated GPUs (`bench.sim.device`: bounded
resident models, LRU-style eviction, swap cost, batch time a + b*tokens) with
the same seeded open-loop trace at each offered load (`bench.sim.traffic`).
Pull is the real `local_queue` served by real `runtimes.worker.WorkerCore`s
whose models and device are simulated (`bench.sim.pull`); push is an
expected-completion router with model affinity and a stale view of worker
load (`bench.sim.push`). The offered load is ramped
per side with `bench.knee.plan_next` (geometric, then bisection) and the knee is
`bench.knee.find_knee`: the highest load whose throughput is within
--keep-up of offered, with p95 under --slo-ms and under 1% errors. The two
ramps are interleaved step by step so that drift in the machine's load hits
both alike. Tables go to stdout, progress to stderr, a JSON record to
bench/results/simulate-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fleet.bench.knee import Criteria, Knee, Ramp, StepResult, find_knee, plan_next
from fleet.bench.sim.pull import PullSystem
from fleet.bench.sim.push import PushSystem
from fleet.bench.sim.step import Recorder, StepOutcome, run_step
from fleet.bench.sim.traffic import SIZE_CLASSES, TrafficSpec, make_models, make_trace, zipf_weights
from fleet.bench.cli import OUT, Option, bench, option

RESULTS_DIR = Path(__file__).with_name("results")


@dataclass(frozen=True)
class Config:
    workers: int = 8
    models: int = 20
    slots: int = 3  # resident models per simulated GPU
    zipf_s: float = 1.0
    seed: int = 1
    #: Wall seconds per simulated second: > 1 slows everything down evenly, so the
    #: host work of the simulation (2 cores) stays small next to simulated device time.
    time_scale: float = 2.0
    duration_s: float = 3.0  # simulated seconds of arrivals per step
    drain_s: float = 1.5
    #: Unmeasured warm-up per side, long enough that even the rarest model is loaded somewhere.
    warmup_s: float = 3.0
    warmup_rps: float = 400.0
    start_rps: float = 100.0
    factor: float = 2.0
    resolution: float = 0.05
    max_steps: int = 12
    slo_ms: float = 250.0
    keep_up: float = 0.95
    refresh_ms: float = 50.0  # push router's view refresh period
    #: Steps below this load are not run (a step of a few requests says nothing).
    min_rps: float = 10.0
    #: Keep each side's system from step to step instead of a fresh, warmed one per step.
    carry_state: bool = False
    #: Schedulers to compare: pull (the real WorkerCore), push.
    sides: tuple[str, ...] = ("pull", "push")

    @classmethod
    def quick(cls, **over) -> Config:
        base = dict(duration_s=1.0, drain_s=0.5, warmup_s=1.0, time_scale=1.5, start_rps=400.0, factor=3.0,
                    resolution=0.5, max_steps=4, carry_state=True)
        base.update(over)
        return cls(**base)

    @property
    def criteria(self) -> Criteria:
        # Absolute SLO only: the two sides have different unloaded latencies, so a
        # bound relative to each one's own base would judge them by different bars.
        return Criteria(keep_up_tol=1.0 - self.keep_up, p95_factor=math.inf, max_p95_ms=self.slo_ms)


@dataclass
class Side:
    name: str
    steps: list[StepOutcome] = field(default_factory=list)
    warmup: StepOutcome | None = None
    #: The step at push's knee load, for latency side by side.
    at_common: StepOutcome | None = None

    @property
    def results(self) -> list[StepResult]:
        return [s.result for s in self.steps]

    def knee(self, criteria: Criteria) -> Knee:
        return find_knee(self.results, criteria)

    def outcome_of(self, step: StepResult | None) -> StepOutcome | None:
        return next((s for s in self.steps if s.result is step), None)


def _payload() -> memoryview:
    # Request bodies: about 4 bytes of text per token, copied into the queue's slab on put.
    return memoryview(b"x" * (4 * 80 * 32))


class _Bench:
    """Runs steps for the sides; owns the request-id counter and the systems."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.models = make_models(cfg.models)
        self.spec = TrafficSpec(models=cfg.models, zipf_s=cfg.zipf_s)
        self.recorder = Recorder()
        self.payload = _payload()
        self.rid = 0
        self.live: dict[str, object] = {}  # carried-over systems (--carry-state)

    def make(self, name: str):
        cfg, models, rec = self.cfg, self.models, self.recorder
        if name == "pull":
            return PullSystem(models, cfg.workers, cfg.slots, rec, time_scale=cfg.time_scale)
        if name == "push":
            return PushSystem(models, cfg.workers, cfg.slots, rec, time_scale=cfg.time_scale,
                              refresh_ms=cfg.refresh_ms)
        raise ValueError(f"unknown side {name!r}: choose from {', '.join(SIDES)}")

    def _run(self, system, rate: float, duration_s: float, seed: int) -> StepOutcome:
        trace = make_trace(rate, duration_s, self.spec, seed)
        out = run_step(system, trace, self.models, self.recorder, self.rid, time_scale=self.cfg.time_scale,
                       drain_s=self.cfg.drain_s, payload=self.payload)
        self.rid += len(trace)
        return out

    def _warm(self, system) -> StepOutcome:
        # Not measured: the system starts out holding models, placed by its own policy.
        return self._run(system, self.cfg.warmup_rps, self.cfg.warmup_s, self.cfg.seed + 7919)

    def step(self, side: Side, offered: float) -> StepOutcome:
        cfg = self.cfg
        if cfg.carry_state:
            system = self.live.get(side.name)
            if system is None:
                system = self.live[side.name] = self.make(side.name)
                system.start()
                side.warmup = self._warm(system)
            return self._run(system, offered, cfg.duration_s, cfg.seed)
        # A fresh, warmed system per step: a step that collapsed (a swap storm) does not
        # leave its scrambled placement to the next one, so steps do not depend on order.
        system = self.make(side.name)
        system.start()
        try:
            side.warmup = self._warm(system)
            return self._run(system, offered, cfg.duration_s, cfg.seed)
        finally:
            system.close()

    def close(self) -> None:
        for system in self.live.values():
            system.close()


SIDES = ("pull", "push")


def simulate(cfg: Config, console_err: Console | None = None) -> list[Side]:
    """Run every side's ramp, interleaved step by step; returns the sides in cfg.sides order."""
    err = console_err or Console(stderr=True)
    unknown = set(cfg.sides) - set(SIDES)
    if unknown:
        raise ValueError(f"unknown side(s) {sorted(unknown)}: choose from {', '.join(SIDES)}")
    ramp = Ramp(start=cfg.start_rps, factor=cfg.factor, resolution=cfg.resolution, max_steps=cfg.max_steps)
    bench = _Bench(cfg)
    sides = [Side(name) for name in cfg.sides]
    try:
        active = list(sides)
        while active:
            for side in list(active):
                offered = plan_next(side.results, ramp, cfg.criteria)
                if offered is None or offered < cfg.min_rps:
                    active.remove(side)
                    continue
                out = bench.step(side, offered)
                side.steps.append(out)
                r = out.result
                err.print(f"[dim]{side.name:12} {r.offered:7.0f} r/s offered -> {r.throughput_rps:7.0f} r/s, "
                          f"p95 {r.p95_ms:7.1f} ms, errors {r.errors}, sim cpu {out.cpu_pct:.0f}%, "
                          f"box cpu {out.host_cpu_pct:.0f}%[/]")
        # Latency side by side at one load: push's knee (rerun where a side's ramp did
        # not visit it, so every side is measured at exactly that load).
        push = next((side.knee(cfg.criteria).knee for side in sides if side.name == "push"), None)
        if push is not None:
            for side in sides:
                side.at_common = next((o for o in side.steps if o.result.offered == push.offered), None)
                if side.at_common is None:
                    side.at_common = bench.step(side, push.offered)
    finally:
        bench.close()
    return sides


# -- report --------------------------------------------------------------------

def steps_table(side: Side, criteria: Criteria) -> Table:
    knee = side.knee(criteria)
    verdicts = {id(v.step): v.reasons for v in knee.verdicts}
    t = Table(title=f"{side.name}: steps (device time)", title_justify="left")
    for col in ("offered r/s", "req/s", "tok/s", "p50 ms", "p95 ms", "p99 ms", "err", "items/batch", "swaps",
                "dev busy", "swap share", "models held", "gen lag p99", "sim cpu%", "box cpu%", "verdict"):
        t.add_column(col, justify="left" if col == "verdict" else "right")
    for out in sorted(side.steps, key=lambda o: o.result.offered):
        s = out.result
        reasons = verdicts.get(id(s), ())
        verdict = ("[bold green]knee[/] " if knee.knee is s else "") + (
            "[red]" + "; ".join(reasons) + "[/]" if reasons else "ok")
        t.add_row(f"{s.offered:.0f}", f"{s.throughput_rps:.0f}", f"{s.tokens_per_s:,.0f}", f"{s.p50_ms:.1f}",
                  f"{s.p95_ms:.1f}", f"{s.p99_ms:.1f}", str(s.errors), f"{out.items_per_batch:.1f}", str(out.swaps),
                  f"{out.device_busy:.0%}", f"{out.swap_share:.0%}", str(out.resident_distinct),
                  f"{out.gen_lag_p99_ms:.1f}",
                  f"{out.cpu_pct:.0f}", f"{out.host_cpu_pct:.0f}", verdict)
    return t


def summary(sides: list[Side], criteria: Criteria) -> dict:
    """Each side's knee, and each pull side's ratios to push (when both have a knee)."""
    doc: dict = {}
    for side in sides:
        k = side.knee(criteria)
        s = k.knee
        doc[side.name] = {
            "knee": None if s is None else {
                "offered": s.offered, "throughput_rps": s.throughput_rps, "tokens_per_s": s.tokens_per_s,
                "p50_ms": s.p50_ms, "p95_ms": s.p95_ms, "p99_ms": s.p99_ms},
            "saturated": k.saturated, "capacity_rps": k.capacity_rps,
            "at_common_load": None if side.at_common is None else {
                "offered": side.at_common.result.offered, "throughput_rps": side.at_common.result.throughput_rps,
                "p50_ms": side.at_common.result.p50_ms, "p95_ms": side.at_common.result.p95_ms,
                "p99_ms": side.at_common.result.p99_ms},
        }
    push = next((side.knee(criteria) for side in sides if side.name == "push"), None)
    ratios = {}
    for side in sides:
        k = side.knee(criteria)
        if side.name == "push" or push is None or k.knee is None or push.knee is None:
            continue
        ratios[f"{side.name}/push"] = {
            "throughput_rps": k.knee.throughput_rps / push.knee.throughput_rps,
            "tokens_per_s": k.knee.tokens_per_s / push.knee.tokens_per_s,
            "p95_ms": k.knee.p95_ms / push.knee.p95_ms,
            "p95_at_common_load": doc[side.name]["at_common_load"]["p95_ms"] / doc["push"]["at_common_load"]["p95_ms"]
            if doc[side.name]["at_common_load"] and doc["push"]["at_common_load"] else None,
            "capacity_rps": k.capacity_rps / push.capacity_rps if push.capacity_rps else None,
        }
    doc["ratios"] = ratios
    return doc


def knee_table(sides: list[Side], criteria: Criteria) -> Table:
    t = Table(title="knee: highest offered load kept up with (device time)", title_justify="left")
    for col in ("scheduler", "knee r/s", "tok/s", "p50 ms", "p95 ms", "p99 ms", "items/batch", "swaps",
                "max req/s", "saturated"):
        t.add_column(col, justify="left" if col == "scheduler" else "right")
    for side in sides:
        k = side.knee(criteria)
        s, out = k.knee, side.outcome_of(k.knee)
        if s is None:
            t.add_row(side.name, "-", "-", "-", "-", "-", "-", "-", f"{k.capacity_rps:.0f}", str(k.saturated))
            continue
        t.add_row(side.name, f"{s.throughput_rps:.0f}", f"{s.tokens_per_s:,.0f}", f"{s.p50_ms:.1f}",
                  f"{s.p95_ms:.1f}", f"{s.p99_ms:.1f}", f"{out.items_per_batch:.1f}", str(out.swaps),
                  f"{k.capacity_rps:.0f}", str(k.saturated))
    return t


def common_table(sides: list[Side]) -> Table | None:
    rows = [(side.name, side.at_common) for side in sides if side.at_common is not None]
    if not rows:
        return None
    t = Table(title=f"at one load, push's knee: {rows[0][1].result.offered:.0f} r/s offered (device time)",
              title_justify="left")
    for col in ("scheduler", "req/s", "p50 ms", "p95 ms", "p99 ms", "items/batch", "swaps", "dev busy"):
        t.add_column(col, justify="left" if col == "scheduler" else "right")
    for name, o in rows:
        r = o.result
        t.add_row(name, f"{r.throughput_rps:.0f}", f"{r.p50_ms:.1f}", f"{r.p95_ms:.1f}", f"{r.p99_ms:.1f}",
                  f"{o.items_per_batch:.1f}", str(o.swaps), f"{o.device_busy:.0%}")
    return t


def result_doc(cfg: Config, sides: list[Side], argv: list[str]) -> dict:
    from fleet.bench.report import machine, versions

    def step_doc(o: StepOutcome, reasons=()) -> dict:
        d = asdict(o)
        d["result"] = asdict(o.result)
        d["reasons"] = list(reasons)
        return d

    def side_doc(side: Side) -> dict:
        k = side.knee(cfg.criteria)
        reasons = {id(v.step): v.reasons for v in k.verdicts}
        return {"steps": [step_doc(o, reasons.get(id(o.result), ())) for o in
                          sorted(side.steps, key=lambda o: o.result.offered)],
                "warmup": step_doc(side.warmup) if side.warmup else None,
                "at_common_load": step_doc(side.at_common) if side.at_common else None}

    c = cfg.criteria
    return {
        "schema": 1,
        "kind": "simulate",
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": argv,
        "machine": machine(),
        "versions": versions(),
        "config": asdict(cfg),
        "criteria": {"keep_up_tol": c.keep_up_tol, "max_p95_ms": c.max_p95_ms, "max_error_rate": c.max_error_rate},
        "size_classes": [asdict(s) for s in SIZE_CLASSES],
        "popularity": zipf_weights(cfg.models, cfg.zipf_s).tolist(),
        "models": [{"name": m.name, "size": m.size.name} for m in make_models(cfg.models)],
        "sides": {side.name: side_doc(side) for side in sides},
        "summary": summary(sides, cfg.criteria),
    }


def write_json(doc: dict, path: Path | None = None) -> Path:
    import json

    if path is None:
        stamp = doc["created_utc"].replace(":", "").replace("-", "").replace("+0000", "Z")
        path = RESULTS_DIR / f"simulate-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return path


def config_options() -> list[Option]:
    """`--quick`, then one option per Config field (default None: the Config's own)."""
    options = [option("--quick", action="store_true", help="short steps, coarse ramp (under a minute)")]
    d = Config()
    for name, typ, text in (
        ("seed", int, "trace seed"), ("workers", int, "simulated GPUs"), ("models", int, "models"),
        ("slots", int, "resident models per GPU"), ("zipf-s", float, "popularity skew: P(rank k) ~ 1/k^s"),
        ("time-scale", float, "wall seconds per simulated second"),
        ("duration-s", float, "simulated seconds of arrivals per step"),
        ("drain-s", float, "simulated seconds a step's backlog may drain before the rest is dropped"),
        ("warmup-s", float, "unmeasured warm-up per side"), ("warmup-rps", float, "warm-up load"),
        ("start-rps", float, "first offered load"),
        ("factor", float, "ramp growth per step until the knee is passed"),
        ("resolution", float, "bisect until first-bad / knee <= 1 + this"), ("max-steps", int, "steps per side"),
        ("slo-ms", float, "p95 bound of a healthy step"), ("keep-up", float, "throughput / offered of a healthy step"),
        ("refresh-ms", float, "push router's view refresh period"), ("min-rps", float, "lowest load a ramp runs"),
    ):
        default = getattr(d, name.replace("-", "_"))
        options.append(option(f"--{name}", type=typ, default=None, help=f"{text} (default {default})"))
    return [*options,
            option("--sides", default=None, help=f"comma-separated, from pull, push (default {','.join(d.sides)})"),
            option("--carry-state", action="store_true", default=None,
                   help="keep each side's system across steps (default: a fresh, warmed one per step)"),
            OUT.but(help="JSON path (default bench/results/simulate-<UTC>.json)"),
            option("--no-save", action="store_true", help="do not write the JSON record")]


def config_of(a: argparse.Namespace) -> Config:
    over = {k: v for k, v in vars(a).items()
            if v is not None and k in Config.__dataclass_fields__}
    if a.sides is not None:
        over["sides"] = tuple(x.strip() for x in a.sides.split(",") if x.strip())
    return Config.quick(**over) if a.quick else Config(**over)


@bench("simulate", *config_options())
def main(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    # Short GIL hand-offs: a simulated GPU whose sleep ended must not wait 5 ms for another thread.
    sys.setswitchinterval(0.0002)
    # Piped stdout (a results file, a README): wide enough that no column is cut.
    out, err = Console(width=None if sys.stdout.isatty() else 240), Console(stderr=True)
    err.print(f"[bold]pull vs push[/]: {cfg.workers} GPUs x {cfg.slots} slots, {cfg.models} models "
              f"(zipf s={cfg.zipf_s}), seed {cfg.seed}, time scale {cfg.time_scale}, {cfg.duration_s} s steps")
    sides = simulate(cfg, err)
    for side in sides:
        out.print(steps_table(side, cfg.criteria))
    out.print(knee_table(sides, cfg.criteria))
    common = common_table(sides)
    if common is not None:
        out.print(common)
    for pair, r in summary(sides, cfg.criteria)["ratios"].items():
        same = f", p95 at one load {r['p95_at_common_load']:.2f}x" if r["p95_at_common_load"] is not None else ""
        out.print(f"{pair} at the knee: [bold]{r['throughput_rps']:.2f}x[/] req/s, {r['tokens_per_s']:.2f}x tok/s, "
                  f"p95 {r['p95_ms']:.2f}x{same}")
    if not args.no_save:
        path = write_json(result_doc(cfg, sides, ["python", "-m", "fleet.bench", *args.argv]), args.out)
        err.print(f"wrote {path}")
    return 0
