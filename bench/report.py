"""Showing and keeping bench results: live display, rich tables, JSON, PNG plot.

Data goes to stdout (the final tables, or JSON with --json); the live
progress display goes to stderr. The JSON document carries the machine, the
versions and the command, so runs made on different days or boxes can be put
side by side (`bench/results/*.json`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleet.bench.knee import CLOSED, Criteria, Knee, judge_steps
from fleet.bench.runner import Plan, StepRecord, TargetRun, compare_ratios
from fleet.bench.sampler import describe_gpus

SCHEMA = 1
RESULTS_DIR = Path(__file__).with_name("results")


def _mib(n: int | float) -> str:
    return f"{n / (1 << 20):.0f}"


def _load_label(mode: str) -> str:
    return "clients" if mode == CLOSED else "offered r/s"


def reasons_by_step(run: TargetRun, criteria: Criteria) -> dict[int, tuple[str, ...]]:
    """id(StepResult) -> why that step is past the knee (judged over all the run's steps)."""
    if run.spec.kind == "st":
        return {}
    return {id(v.step): v.reasons for v in judge_steps(run.results, criteria)}


def _queue_infer(rec: StepRecord) -> str:
    """The server's own split of a reply's time (fleet's X-Queue-Ms / X-Inference-Ms), medians."""
    if rec.server_queue_p50_ms is None and rec.server_inference_p50_ms is None:
        return "-"
    q, i = rec.server_queue_p50_ms, rec.server_inference_p50_ms
    return f"{'-' if q is None else f'{q:.1f}'} / {'-' if i is None else f'{i:.1f}'}"


def steps_table(run: TargetRun, criteria: Criteria) -> Table:
    knee = run.knee(criteria) if run.steps else None
    why = reasons_by_step(run, criteria)
    t = Table(title=f"{run.spec.name} ({run.spec.kind}{'' if run.spec.kind == 'st' else ' ' + run.spec.url})",
              title_justify="left", show_lines=False)
    for col in (_load_label(run.mode), "req/s", "tok/s", "p50 ms", "p95 ms", "p99 ms", "err",
                "gen cpu%", "lag p99", "server cpu%", "srv queue/infer ms", "verdict"):
        t.add_column(col, justify="right" if col != "verdict" else "left")
    server_key = f"{run.spec.name}:server"
    for rec in sorted(run.steps, key=lambda r: r.result.offered):
        s = rec.result
        mark = ""
        if knee and knee.knee is s:
            mark = "[bold green]knee[/] "
        reasons = why.get(id(s), ())
        verdict = mark + ("[red]" + "; ".join(reasons) + "[/]" if reasons else "ok")
        if rec.generator_bound:
            # Late arrivals: the generator could not keep its schedule (its own CPU, or a saturated box).
            verdict += f" [yellow](generator late: lag p99 {rec.lag_p99_ms:.0f} ms)[/]"
        t.add_row(
            f"{s.offered:.1f}" if run.mode != CLOSED else f"{s.offered:.0f}",
            f"{s.throughput_rps:.1f}", f"{s.tokens_per_s:,.0f}",
            f"{s.p50_ms:.1f}", f"{s.p95_ms:.1f}", f"{s.p99_ms:.1f}",
            f"{s.errors}" if s.errors else "0",
            f"{rec.gen_cpu_pct:.0f}" if run.spec.kind != "st" else "-",
            f"{rec.lag_p99_ms:.1f}" if run.spec.kind != "st" else "-",
            f"{rec.box.get('cpu_pct', {}).get(server_key, float('nan')):.0f}",
            _queue_infer(rec),
            verdict,
        )
    return t


def knee_table(runs: list[TargetRun], criteria: Criteria) -> Table:
    t = Table(title="knee per target (highest load kept up with)", title_justify="left")
    for col in ("target", "load", "req/s", "tok/s", "p50 ms", "p95 ms", "p99 ms", "capacity req/s",
                "server cpu%", "server rss MiB", "gpu util%", "gpu mem MiB", "note"):
        t.add_column(col, justify="left" if col in ("target", "note") else "right")
    for run in runs:
        k = run.knee(criteria)
        rec = _record_of(run, k)
        if k.knee is None:
            t.add_row(run.spec.name, "-", "-", "-", "-", "-", "-", f"{k.capacity_rps:.1f}",
                      "-", "-", "-", "-", "even the lowest load failed")
            continue
        s = k.knee
        box = rec.box if rec else {}
        key = f"{run.spec.name}:server"
        gpu_u = box.get("gpu_util_pct")
        gpu_m = box.get("gpu_mem_bytes")
        note = "" if k.saturated or run.spec.kind == "st" else "not saturated: raise the load"
        if run.spec.kind == "st":
            note = ("offline limit: length-sorted batches (1 caller)" if run.spec.sorted
                    else "in-process compute limit (1 caller)")
        t.add_row(
            run.spec.name, f"{s.offered:.1f} {'clients' if s.mode == CLOSED else 'r/s'}",
            f"{s.throughput_rps:.1f}", f"{s.tokens_per_s:,.0f}", f"{s.p50_ms:.1f}", f"{s.p95_ms:.1f}",
            f"{s.p99_ms:.1f}", f"{k.capacity_rps:.1f}",
            f"{box.get('cpu_pct', {}).get(key, float('nan')):.0f}",
            _mib(box.get("rss_bytes", {}).get(key, 0)),
            ",".join(f"{u:.0f}" for u in gpu_u) if gpu_u else "-",
            ",".join(_mib(m) for m in gpu_m) if gpu_m else "-",
            note,
        )
    return t


def skipped_table(skipped: dict[str, str]) -> Table:
    """The targets asked for that did not run here, each with why (and what sets it up)."""
    t = Table(title="skipped (not run here)", title_justify="left")
    t.add_column("target")
    t.add_column("why")
    for name, why in skipped.items():
        t.add_row(escape(name), escape(why))  # "[openvino]" is text, not markup
    return t


def ratios_table(runs: list[TargetRun], criteria: Criteria) -> Table:
    ratios = compare_ratios(runs, criteria)
    names = [r.spec.name for r in runs]
    t = Table(title="tokens/s at the knee: row / column", title_justify="left")
    t.add_column("")
    for n in names:
        t.add_column(n, justify="right")
    for a in names:
        t.add_row(a, *("-" if a == b else (f"{ratios[a][b]:.2f}x" if b in ratios[a] else "n/a") for b in names))
    return t


def _record_of(run: TargetRun, knee: Knee) -> StepRecord | None:
    return next((r for r in run.steps if r.result is knee.knee), None)


class LiveDisplay:
    """Progress of the current step plus the steps so far, on stderr."""

    def __init__(self, criteria: Criteria, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.criteria = criteria
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(), console=self.console,
        )
        self.task = None
        self.runs: list[TargetRun] = []
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
        self._duration = 1.0
        self._t0 = 0.0

    def _render(self):
        parts = [steps_table(r, self.criteria) for r in self.runs if r.steps]
        parts.append(self.bar)
        return Group(*parts)

    def __enter__(self) -> "LiveDisplay":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def note(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/]")

    def step_started(self, run: TargetRun, offered: float, index: int, duration_s: float) -> None:
        if run not in self.runs:
            self.runs.append(run)
        what = "warm-up" if index < 0 else f"step {index + 1}"
        unit = "clients" if (run.mode == CLOSED or index < 0) else "r/s"
        desc = f"{run.spec.name} {what}: {offered:.1f} {unit}"
        self._duration, self._t0 = duration_s, time.time()
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(desc, total=duration_s, counts="")
        self.live.update(self._render())

    def progress(self, sent: int, done: int, errors: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=min(self._duration, time.time() - self._t0),
                            counts=f"sent {sent} done {done} err {errors}")

    def step_done(self, run: TargetRun, rec: StepRecord) -> None:
        self.live.update(self._render())


def machine() -> dict:
    mem = psutil.virtual_memory()
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model or platform.processor(),
        "cpus_logical": psutil.cpu_count(logical=True),
        "cpus_physical": psutil.cpu_count(logical=False),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count(),
        "memory_bytes": mem.total,
        # Other tenants of a shared box skew every number: keep what they were doing.
        "load_avg_1_5_15": [round(x, 2) for x in psutil.getloadavg()],
        **describe_gpus(),
    }


def versions(extra: dict[str, str] | None = None) -> dict:
    from fleet import __version__

    # fleet's own from the package (its distribution is fleet-serve, and PyPI's unrelated
    # `fleet` may be installed too); the rest from package metadata: importing torch here
    # is exactly what must not happen.
    out = {"python": platform.python_version(), "fleet": __version__}
    for dist in ("torch", "transformers", "sentence-transformers", "tokenizers", "msgspec",
                 "numpy", "litestar", "uvicorn", "uvloop", "psutil", "nvidia-ml-py"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        root = Path(__file__).resolve().parents[1]
        out["git_commit"] = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    out.update(extra or {})
    return out


def _num(x: float) -> float | None:
    """JSON has no NaN: a percentile over zero replies is null."""
    return x if math.isfinite(x) else None


def _step_doc(rec: StepRecord, reasons: tuple[str, ...] = ()) -> dict:
    s = rec.result
    return {
        "offered": s.offered, "mode": s.mode, "throughput_rps": s.throughput_rps, "tokens_per_s": s.tokens_per_s,
        "p50_ms": _num(s.p50_ms), "p95_ms": _num(s.p95_ms), "p99_ms": _num(s.p99_ms), "sent": s.sent, "ok": s.ok,
        "errors": s.errors, "tokens": rec.tokens, "error_codes": {str(k): v for k, v in rec.error_codes.items()},
        "error_sample": rec.error_sample, "server_tokens": rec.server_tokens,
        "server_queue_p50_ms": rec.server_queue_p50_ms, "server_inference_p50_ms": rec.server_inference_p50_ms,
        "generator_cpu_pct": rec.gen_cpu_pct, "generator_lag_p99_ms": rec.lag_p99_ms,
        "generator_bound": rec.generator_bound, "reasons": list(reasons),
        "started_unix": rec.started_unix, "ended_unix": rec.ended_unix, "box": rec.box,
    }


def result_doc(runs: list[TargetRun], plan: Plan, corpus: dict, *, argv: list[str] | None = None,
               extra_versions: dict[str, str] | None = None, skipped: dict[str, str] | None = None) -> dict:
    """The run as JSON; `skipped`: each target asked for that did not run here -> why."""
    targets = []
    for run in runs:
        k = run.knee(plan.criteria)
        rec = _record_of(run, k)
        why = reasons_by_step(run, plan.criteria)
        targets.append({
            "name": run.spec.name, "kind": run.spec.kind, "url": run.spec.url,
            "dtype": run.spec.dtype if run.spec.kind == "st" else None,
            "engine": run.spec.engine if run.spec.kind == "st" else None,
            "batches": ("length-sorted" if run.spec.sorted else "request windows") if run.spec.kind == "st" else None,
            "process": getattr(run.driver, "info", None),  # in-process target: torch, threads, OpenMP policy
            "served": run.served,  # fleet target: each worker's dtype and engine after the warm-up
            "mode": run.mode,
            "warmup": _step_doc(run.warmup) if run.warmup else None,
            "steps": [_step_doc(r, why.get(id(r.result), ())) for r in sorted(run.steps, key=lambda r: r.result.offered)],
            "knee": _step_doc(rec) if rec else None,
            "saturated": k.saturated,
            "capacity_rps": k.capacity_rps,
            "capacity_tokens_per_s": k.capacity_tokens_per_s,
            "base_p95_ms": k.base_p95_ms if math.isfinite(k.base_p95_ms) else None,
        })
    c = plan.criteria
    return {
        "schema": SCHEMA,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": argv if argv is not None else sys.argv,
        "machine": machine(),
        "versions": versions(extra_versions),
        "corpus": corpus,
        "tokens": "counted up front with the model's tokenizer.json (special tokens included); "
                  "server-reported usage kept per step as server_tokens",
        "plan": {
            "model": plan.model, "task": plan.task, "batch": plan.batch, "duration_s": plan.duration_s,
            "mode": plan.mode, "loads": plan.loads, "factor": plan.factor, "resolution": plan.resolution,
            "max_steps": plan.max_steps, "generators": plan.generators, "encoding": plan.encoding,
            "criteria": {"keep_up_tol": c.keep_up_tol, "p95_factor": c.p95_factor, "max_p95_ms": c.max_p95_ms,
                         "max_error_rate": c.max_error_rate, "min_gain": c.min_gain},
        },
        "targets": targets,
        "skipped": dict(skipped or {}),
        "ratios_tokens_per_s": compare_ratios(runs, plan.criteria) if len(runs) > 1 else {},
    }


def corpus_doc(path: Path, lengths: list[int]) -> dict:
    from fleet.bench.tokens import length_stats

    data = path.read_bytes()
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "tokens_per_text": length_stats(lengths)}


def stamp(doc: dict) -> str:
    """The document's creation time as a file-name prefix: 20261204T141351Z."""
    return doc["created_utc"].replace(":", "").replace("-", "").replace("+0000", "Z")


def save(doc: dict, out: Path | None, name: str) -> Path:
    """Write `doc` to `out`, or to bench/results/<stamp>-<name>.json."""
    return write_json(doc, out or RESULTS_DIR / f"{stamp(doc)}-{name}.json")


def default_out(doc: dict) -> Path:
    names = "-".join(t["name"] for t in doc["targets"])
    return RESULTS_DIR / f"{stamp(doc)}-{doc['plan']['task']}-{names}.json"


def document(kind: str, module: str, argv: list[str] | None) -> dict:
    """The head every result document starts with: schema, kind, when, the command
    that made it (`python -m <module> <argv>`), the machine and the versions."""
    return {
        "schema": SCHEMA, "kind": kind,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "command": [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])],
        "machine": machine(), "versions": versions(),
    }


def write_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False, default=_json_default) + "\n")
    return path


def _json_default(obj):
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def plot(doc: dict, path: Path) -> Path:
    """Throughput and latency against offered load, one line per target, knees marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'fleet-serve[bench]' (or pip install matplotlib)") from exc
    fig, (ax_t, ax_l) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
    top = 0.0
    http = [t for t in doc["targets"] if t["kind"] != "st" and t["steps"]]
    for i, t in enumerate(http):
        xs = [s["offered"] for s in t["steps"]]
        ys = [s["throughput_rps"] for s in t["steps"]]
        top = max(top, max(xs))
        (line,) = ax_t.plot(xs, ys, marker="o", label=t["name"], color=f"C{i}")
        ax_l.plot(xs, [_nan(s["p50_ms"]) for s in t["steps"]], marker=".", ls=":", color=line.get_color())
        ax_l.plot(xs, [_nan(s["p95_ms"]) for s in t["steps"]], marker="o", color=line.get_color(), label=f"{t['name']} p95")
        ax_l.plot(xs, [_nan(s["p99_ms"]) for s in t["steps"]], marker="x", ls="--", color=line.get_color())
        if t["knee"]:
            k = t["knee"]
            ax_t.scatter([k["offered"]], [k["throughput_rps"]], s=160, facecolors="none",
                         edgecolors=line.get_color(), linewidths=2, zorder=5)
            ax_t.annotate(f"knee {k['throughput_rps']:.3g} r/s\n{k['tokens_per_s']:,.0f} tok/s",
                          (k["offered"], k["throughput_rps"]), textcoords="offset points", xytext=(8, -28),
                          fontsize=8, color=line.get_color())
            ax_l.axvline(k["offered"], color=line.get_color(), alpha=0.3)
    local = [t for t in doc["targets"] if t["kind"] == "st" and t["knee"]]
    for j, t in enumerate(local):
        ax_t.axhline(t["knee"]["throughput_rps"], ls="-.", alpha=0.7, color=f"C{len(http) + j}",
                     label=f"{t['name']} in-process, 1 caller ({t['knee']['throughput_rps']:.3g} r/s)")
    closed = any(t["mode"] == CLOSED for t in http)
    if top and not closed:
        ax_t.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="offered = achieved")
    ax_t.set_ylabel("achieved requests/s")
    plan = doc["plan"]
    ax_t.set_title(f"{plan['task']} {plan['model']}, {plan['batch']} inputs/request — {doc['machine']['cpu'][:40]}",
                   fontsize=9)
    ax_t.legend(fontsize=8)
    ax_t.grid(alpha=0.3)
    ax_l.set_yscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax_l.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_l.yaxis.set_major_formatter(ScalarFormatter())
    ax_l.yaxis.set_minor_formatter(NullFormatter())
    ax_l.set_ylabel("latency ms (p50 dotted, p95 solid, p99 dashed)")
    ax_l.set_xlabel("clients" if closed else "offered requests/s (Poisson)")
    ax_l.grid(alpha=0.3, which="both")
    ax_l.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_summary(console: Console, runs: list[TargetRun], plan: Plan, skipped: dict[str, str] | None = None) -> None:
    for run in runs:
        console.print(steps_table(run, plan.criteria))
    console.print(knee_table(runs, plan.criteria))
    if skipped:
        console.print(skipped_table(skipped))
    if len(runs) > 1:
        console.print(ratios_table(runs, plan.criteria))
