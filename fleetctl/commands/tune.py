"""`fleetctl tune MODEL`: search the model's serving profile on this device; `--write` keeps it.

The verb wires `bench/tune.py` together: the model's default profile is measured
first (its daemon's load-time dtype check decides the reduced dtype allowed),
then `coordinate_search` walks the dimensions from a start sized to the model,
each candidate measured by `DaemonMeasurer` (a daemon of its own on loopback,
the bench's knee finder). Progress and the trials table go to stderr and stdout;
every run writes `bench/results/<time>-tune-<model>.json` (or `--out`).
`--write` stores the winner in `FLEET_HOME/models.toml` as
`[models."<name>".profiles."<device class>"]` with a `tuned` table beside it.
Nothing here imports torch (device_class does, for CUDA devices only).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import typer

from fleet.errors import BadRequest


def _model_params(folder: Path) -> int:
    """Parameters, from the safetensors files' sizes (4 bytes each: fp32 weights);
    only sizes the start point, so the estimate need not be exact."""
    size = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    return max(1, size // 4)


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _finite(obj):
    """JSON has no inf/NaN: a missing p95 is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def register(app: typer.Typer) -> None:
    @app.command()
    def tune(
        model: str = typer.Argument(..., help="Model name (catalog or store)."),
        device: str = typer.Option(None, "--device", help="cpu | cuda[:K] (default: cuda when NVML sees a GPU, else cpu)."),
        budget_minutes: float = typer.Option(10.0, "--budget-minutes", help="Wall-clock budget for the search."),
        write: bool = typer.Option(False, "--write", help="Store the chosen profile in FLEET_HOME/models.toml."),
        confirm: bool = typer.Option(False, "--confirm", help="Re-measure the default and the chosen profile "
                                     "once more, one after the other, for the reported ratio."),
        max_candidates: int = typer.Option(24, "--max-candidates", help="Candidates measured, at most."),
        min_gain: float = typer.Option(0.05, "--min-gain", help="A move must raise the knee by more than this "
                                       "fraction (noise below it is not a win)."),
        duration: float = typer.Option(4.0, "--duration", help="Seconds per bench step of a candidate."),
        max_steps: int = typer.Option(6, "--max-steps", help="Bench steps per candidate, at most."),
        batch: int = typer.Option(32, "--batch", help="Inputs per request."),
        workers_max: int = typer.Option(None, "--workers-max", help="Most worker processes to try per device "
                                        "(default: CPU cores up to 4; 2 per GPU)."),
        out: Path = typer.Option(None, "--out", help="Results JSON (default: bench/results/<time>-tune-<model>.json)."),
    ) -> None:
        """Search MODEL's serving profile (dtype, batch budget, linger, workers) by its measured knee."""
        from fleetctl.commands.bench import _import_bench

        _import_bench()
        from rich.console import Console
        from rich.panel import Panel
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from bench import corpus, report
        from bench.sampler import describe_gpus
        from bench.targets import TASKS
        from bench.tokens import TokenCounter, resolve_model_dir
        from bench.tune import (
            BenchKnobs, Candidate, DaemonMeasurer, better, coordinate_search, default_space, start_point, trial_doc,
        )
        from fleet.catalog import Profile, TunedInfo, load_catalog, validate_name, write_tuned_profile
        from fleet.config import load_settings
        from fleet.store import Store
        from runtimes.device import device_class

        validate_name(model)
        if budget_minutes <= 0 or max_candidates < 1 or duration <= 0 or max_steps < 2 or batch < 1:
            raise typer.BadParameter("--budget-minutes, --max-candidates, --duration, --batch must be positive, "
                                     "--max-steps at least 2")
        err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
        out_console = Console(width=None if sys.stdout.isatty() else 160)
        settings = load_settings()
        home = settings.home_path
        catalog = load_catalog(home)
        entry = catalog.find(model)
        store = Store(settings.store_path)
        manifest = store.get(model) if store.exists(model) else None
        if entry is None and manifest is None:
            raise BadRequest(f"{model!r} is neither in the catalog nor in the store",
                             hint=f"fleetctl pull {model}, or pull a folder with --name {model}")
        task = entry.task if entry is not None else manifest.task
        if task not in TASKS:
            raise BadRequest(f"{model!r} serves {task!r}; the bench measures {', '.join(TASKS)} only")
        folder = store.path(model) if manifest is not None else resolve_model_dir(model)
        if not (folder / "tokenizer.json").is_file():
            folder = resolve_model_dir(model)
        dev = device or ("cuda" if describe_gpus()["gpus"] else "cpu")
        if dev == "cuda":
            dev = "cuda:0"
        klass = device_class(dev)
        cores = len(os.sched_getaffinity(0))
        default = asdict_profile(entry.profile if entry is not None else manifest.profile)
        new_entry = None
        if entry is None:
            new_entry = {"source": manifest.source, "task": manifest.task, "runtime": manifest.runtime,
                         "base": manifest.base, "max_seq_len": manifest.max_seq_len,
                         "trust_remote_code": manifest.trust_remote_code, "allow_pickle": manifest.allow_pickle}

        texts = corpus.load()
        lengths = TokenCounter(folder).count(texts)
        knobs = BenchKnobs(batch=batch, duration_s=duration, max_steps=max_steps)
        deadline = time.time() + budget_minutes * 60
        seconds: list[float] = []

        def out_of_time() -> bool:
            # Stop before a candidate that would end past the budget (its typical length).
            typical = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
            return time.time() + typical > deadline

        err.print(f"[bold]tune[/] {model} ({task}) on {dev} · device class [bold]{klass}[/] · {cores} cores · "
                  f"budget {budget_minutes:g} min · {len(texts)} texts, {batch} per request")
        measurer = DaemonMeasurer(model=model, task=task, device=dev, cores=cores, user_home=home, texts=texts,
                                  lengths=lengths, knobs=knobs, device_class=klass, new_entry=new_entry,
                                  note=lambda s: err.print(f"[dim]{s}[/]"))
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[best]}"), TimeElapsedColumn(), console=err, transient=True)
        rows: list[dict] = []
        try:
            with progress:
                bar = progress.add_task("default profile", total=budget_minutes * 60, best="")
                t_start = time.time()

                def measure(c: Candidate):
                    progress.update(bar, description=f"measuring {c.label()}",
                                    completed=min(time.time() - t_start, budget_minutes * 60))
                    m = measurer(c)
                    seconds.append(m.seconds)
                    progress.update(bar, completed=min(time.time() - t_start, budget_minutes * 60))
                    return m

                # 1. The default profile as shipped (dtype as its load-time check decides).
                base_c = Candidate(dtype=str(default["dtype"]), max_batch_tokens=int(default["max_batch_tokens"]),
                                   max_batch_items=int(default["max_batch_items"]),
                                   linger_ms=float(default["linger_ms"]), workers=1)
                base_m = measure(base_c)
                progress.console.print(f"default: {base_c.label()} -> {_fmt(base_m.tokens_per_s)} tok/s, "
                                       f"p95 {_fmt(base_m.p95_ms)} ms, served {base_m.dtype or '?'} "
                                       f"({base_m.note})")
                if not base_m.ok and not base_m.dtype:
                    raise BadRequest(f"the default profile did not serve: {base_m.note}")
                served = base_m.dtype or "float32"
                # Only what the check let through (or the default's explicit dtype), and fp32.
                dtypes = tuple(dict.fromkeys([served, "float32"]))
                space = default_space(dev, cores, dtypes)
                if workers_max:
                    space = replace(space, workers=tuple(w for w in space.workers if w <= workers_max) or (1,))
                # The default, with its dtype made explicit, is a measured point of the space if on its ladders.
                seeded = replace(base_c, dtype=served)
                seed = {space.snap(seeded): base_m} if space.snap(seeded) == seeded else {}
                start = start_point(space, params=_model_params(folder), device=dev,
                                    default={**default, "dtype": served})

                def on_trial(t):
                    m = t.measurement
                    mark = "[green]best[/]" if t.best_so_far else ""
                    progress.console.print(f"#{t.index:>2} {t.move:<18} {t.candidate.label():<52} "
                                           f"{_fmt(m.tokens_per_s):>8} tok/s  p95 {_fmt(m.p95_ms):>6} ms  "
                                           f"{m.seconds:4.0f}s {mark} {'' if m.ok else m.note}")
                    if t.best_so_far:
                        progress.update(bar, best=f"best {_fmt(m.tokens_per_s)} tok/s")

                result = coordinate_search(space, start, measure, max_evals=max_candidates - 1, min_gain=min_gain,
                                           out_of_time=out_of_time, seed=seed, on_trial=on_trial)
                best_c, best_m = result.best, result.best_measurement
                if base_m.ok and not better(best_m, base_m, 0.0):
                    # Nothing tried beat the default (or the budget ran out first): keep it, dtype explicit.
                    best_c, best_m = seeded, base_m
                confirm_doc = None
                if confirm:
                    progress.update(bar, description="confirming: default, then chosen")
                    again_base = measurer(base_c)
                    again_best = measurer(best_c)
                    confirm_doc = {"default": asdict(again_base), "chosen": asdict(again_best)}
        finally:
            measurer.close()

        # 2. What it tried, and the choice.
        table = Table("#", "move", "dtype", "batch tokens", "batch items", "linger ms", "workers",
                      "knee tok/s", "knee req/s", "p95 ms", "s", "", title=f"tune {model} on {klass}")
        for t in result.trials:
            c, m = t.candidate, t.measurement
            table.add_row(str(t.index), t.move, c.dtype, str(c.max_batch_tokens), str(c.max_batch_items),
                          f"{c.linger_ms:g}", str(c.workers), _fmt(m.tokens_per_s), _fmt(m.rps, 2), _fmt(m.p95_ms),
                          f"{m.seconds:.0f}", "best" if c == best_c else ("" if m.ok else m.note[:40]))
            rows.append(trial_doc(t))
        out_console.print(table)
        ratio = best_m.tokens_per_s / base_m.tokens_per_s if base_m.ok and base_m.tokens_per_s > 0 else None
        lines = [f"profile for [bold]{klass}[/]: dtype {best_c.dtype}, max_batch_tokens {best_c.max_batch_tokens}, "
                 f"max_batch_items {best_c.max_batch_items}, linger_ms {best_c.linger_ms:g}; workers {best_c.workers}",
                 f"knee {_fmt(best_m.tokens_per_s)} tokens/s ({_fmt(best_m.rps, 2)} req/s of {batch}), "
                 f"p95 {_fmt(best_m.p95_ms)} ms",
                 f"default profile: {_fmt(base_m.tokens_per_s)} tokens/s, p95 {_fmt(base_m.p95_ms)} ms"
                 + (f"  ->  {ratio:.2f}x" if ratio else ""),
                 f"{len(result.trials)} candidates + default in {(time.time() - t_start) / 60:.1f} min "
                 f"(search {result.stopped}; a full grid would be {space.grid_size})"]
        if confirm_doc:
            a, b = confirm_doc["default"]["tokens_per_s"], confirm_doc["chosen"]["tokens_per_s"]
            lines.append(f"confirm run: default {_fmt(a)} tok/s, chosen {_fmt(b)} tok/s"
                         + (f"  ->  {b / a:.2f}x" if a else ""))
        if best_c.workers != 1:
            lines.append(f"workers is a daemon setting: serve with --workers {best_c.workers} "
                         f"(FLEET_CPU_THREADS={max(1, cores // best_c.workers)}) to get this knee")
        if measurer.dtype_log:
            lines.append("dtype check (load time, vs fp32): " + "; ".join(dict.fromkeys(measurer.dtype_log)))
        out_console.print(Panel("\n".join(lines), title="chosen"))

        versions = report.versions()
        doc = {"kind": "tune", "model": model, "task": task, "device": dev, "device_class": klass,
               "machine": report.machine(), "versions": versions, "command": ["fleetctl", *sys.argv[1:]],
               "budget_minutes": budget_minutes, "knobs": asdict(knobs), "space": asdict(space),
               "default": {"candidate": asdict(base_c), "measurement": asdict(base_m)},
               "start": asdict(result.start), "trials": rows, "stopped": result.stopped,
               "chosen": {"candidate": asdict(best_c), "measurement": asdict(best_m)},
               "ratio_vs_default": ratio, "confirm": confirm_doc, "dtype_check": measurer.dtype_log}
        path = out or (Path(__file__).resolve().parents[2] / "bench" / "results"
                       / f"{time.strftime('%Y%m%d-%H%M%S')}-tune-{model}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(doc), indent=1) + "\n")
        err.print(f"[dim]results: {path}[/]")

        if write:
            if not best_m.ok:
                raise BadRequest("no candidate reached a knee: nothing to write")
            info = TunedInfo(
                tuned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                knee_tokens_per_s=round(best_m.tokens_per_s, 1), knee_p95_ms=round(best_m.p95_ms, 1),
                knee_rps=round(best_m.rps, 3),
                baseline_tokens_per_s=round(base_m.tokens_per_s, 1) if base_m.ok else None,
                workers=best_c.workers, cpu_threads=max(1, cores // best_c.workers) if dev == "cpu" else 0,
                dtype_check="; ".join(dict.fromkeys(measurer.dtype_log)), candidates=len(result.trials) + 1,
                budget_minutes=budget_minutes,
                versions={k: str(v) for k, v in versions.items()
                          if k in ("fleet", "torch", "transformers", "sentence-transformers", "git_commit", "python")},
            )
            written = write_tuned_profile(home, model, klass, Profile(**best_c.profile()), info, new_entry=new_entry)
            err.print(f"wrote [bold]models.\"{model}\".profiles.\"{klass}\"[/] to {written}")
        if not best_m.ok:
            raise typer.Exit(1)


def asdict_profile(profile) -> dict:
    import msgspec

    return msgspec.structs.asdict(profile)
