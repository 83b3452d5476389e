"""`fleetctl tune MODEL`: search the model's serving profile on this device; `--write` keeps it.

The run is `bench/tune.py`'s (`search_profile`: the default profile first, then
`bench.tune_search.coordinate_search`, each candidate measured by
`bench.tune_measure.DaemonMeasurer`, a daemon of its own on loopback); this verb parses the arguments, shows progress on
stderr, prints the trials table and the choice on stdout, writes
`bench/results/<time>-tune-<model>.json` (or `--out`) on every run, and with
`--write` stores the winner in `FLEET_HOME/models.toml` as
`[models."<name>".profiles."<device class>"]` (its engine named with its dtype: the
engine the default's load chose, held through the search) with a `tuned` table beside it.
Nothing here imports torch (device_class does, for CUDA devices only).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import typer

from fleet.errors import BadRequest


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


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
        """Search MODEL's serving profile (dtype, batch budget, linger, workers) by its measured knee,
        on the engine its default profile's load chose (kept in the profile)."""
        from fleetctl.commands.bench import _import_bench

        _import_bench()
        from rich.console import Console
        from rich.panel import Panel
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from fleet.bench import corpus, report
        from fleet.bench.tokens import TokenCounter
        from fleet.bench.tune import finite, resolve_target, result_doc, search_profile, tuned_info
        from fleet.bench.tune_measure import BenchKnobs, DaemonMeasurer
        from fleet.catalog import Profile, validate_name, write_tuned_profile

        validate_name(model)
        if budget_minutes <= 0 or max_candidates < 1 or duration <= 0 or max_steps < 2 or batch < 1:
            raise typer.BadParameter("--budget-minutes, --max-candidates, --duration, --batch must be positive, "
                                     "--max-steps at least 2")
        err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
        out_console = Console(width=None if sys.stdout.isatty() else 160)
        target = resolve_target(model, device)
        dev, klass, cores = target.device, target.device_class, target.cores
        texts = corpus.load()
        lengths = TokenCounter(target.folder).count(texts)
        knobs = BenchKnobs(batch=batch, duration_s=duration, max_steps=max_steps)
        deadline = time.time() + budget_minutes * 60

        err.print(f"[bold]tune[/] {model} ({target.task}) on {dev} · device class [bold]{klass}[/] · {cores} cores · "
                  f"budget {budget_minutes:g} min · {len(texts)} texts, {batch} per request")
        measurer = DaemonMeasurer(model=model, task=target.task, device=dev, cores=cores, user_home=target.home,
                                  texts=texts, lengths=lengths, knobs=knobs, device_class=klass,
                                  new_entry=target.new_entry, note=lambda s: err.print(f"[dim]{s}[/]"))
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[best]}"), TimeElapsedColumn(), console=err, transient=True)
        try:
            with progress:
                bar = progress.add_task("default profile", total=budget_minutes * 60, best="")
                t_start = time.time()

                def measure(c):
                    progress.update(bar, description=f"measuring {c.label()}",
                                    completed=min(time.time() - t_start, budget_minutes * 60))
                    m = measurer(c)
                    progress.update(bar, completed=min(time.time() - t_start, budget_minutes * 60))
                    return m

                def on_default(c, m):
                    progress.console.print(f"default: {c.label()} -> {_fmt(m.tokens_per_s)} tok/s, "
                                           f"p95 {_fmt(m.p95_ms)} ms, served {_served(m)} ({m.note})")

                def on_trial(t):
                    m = t.measurement
                    mark = "[green]best[/]" if t.best_so_far else ""
                    progress.console.print(f"#{t.index:>2} {t.move:<18} {t.candidate.label():<52} "
                                           f"{_fmt(m.tokens_per_s):>8} tok/s  p95 {_fmt(m.p95_ms):>6} ms  "
                                           f"{m.seconds:4.0f}s {mark} {'' if m.ok else m.note}")
                    if t.best_so_far:
                        progress.update(bar, best=f"best {_fmt(m.tokens_per_s)} tok/s")

                tuned = search_profile(
                    target, measure, deadline=deadline, max_candidates=max_candidates, min_gain=min_gain,
                    workers_max=workers_max, confirm_with=measurer if confirm else None,
                    on_default=on_default, on_trial=on_trial,
                    on_confirm=lambda: progress.update(bar, description="confirming: default, then chosen"))
        finally:
            measurer.close()

        # What it tried, and the choice.
        out_console.print(_trials_table(tuned, f"tune {model} on {klass}"))
        lines = _choice_lines(tuned, klass=klass, batch=batch, cores=cores, dtype_log=measurer.dtype_log,
                              minutes=(time.time() - t_start) / 60, engine_table=measurer.engine_table)
        out_console.print(Panel("\n".join(lines), title="chosen"))

        versions = report.versions()
        doc = result_doc(target, tuned, budget_minutes=budget_minutes, knobs=knobs, dtype_log=measurer.dtype_log,
                         machine=report.machine(), versions=versions, command=["fleetctl", *sys.argv[1:]],
                         engine_table=measurer.engine_table)
        path = out or (Path(__file__).resolve().parents[2] / "bench" / "results"
                       / f"{time.strftime('%Y%m%d-%H%M%S')}-tune-{model}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite(doc), indent=1) + "\n")
        err.print(f"[dim]results: {path}[/]")

        if write:
            if not tuned.chosen_measurement.ok:
                raise BadRequest("no candidate reached a knee: nothing to write")
            info = tuned_info(tuned, device=dev, cores=cores, dtype_log=measurer.dtype_log,
                              budget_minutes=budget_minutes, versions=versions,
                              tuned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              engine_table=measurer.engine_table)
            written = write_tuned_profile(target.home, model, klass, Profile(**tuned.chosen.profile()), info,
                                          new_entry=target.new_entry)
            err.print(f"wrote [bold]models.\"{model}\".profiles.\"{klass}\"[/] to {written}")
        if not tuned.chosen_measurement.ok:
            raise typer.Exit(1)


def _trials_table(tuned, title: str):
    from rich.table import Table

    table = Table("#", "move", "engine dtype", "batch tokens", "batch items", "linger ms", "workers",
                  "knee tok/s", "knee req/s", "p95 ms", "s", "", title=title)
    for t in tuned.search.trials:
        c, m = t.candidate, t.measurement
        table.add_row(str(t.index), t.move, c.runs_on, str(c.max_batch_tokens), str(c.max_batch_items),
                      f"{c.linger_ms:g}", str(c.workers), _fmt(m.tokens_per_s), _fmt(m.rps, 2), _fmt(m.p95_ms),
                      f"{m.seconds:.0f}", "best" if c == tuned.chosen else ("" if m.ok else m.note[:40]))
    return table


def _served(m) -> str:
    """What a daemon served: "openvino bfloat16 (measured at load, 10,836 tok/s)"."""
    text = f"{m.engine or 'torch'} {m.dtype or '?'}"
    if m.engine_by:
        text += f" ({m.engine_by} at load" + (f", {_fmt(m.engine_tokens_per_s)} tok/s)" if m.engine_tokens_per_s
                                              else ")")
    return text


def _choice_lines(tuned, *, klass: str, batch: int, cores: int, dtype_log: list[str], minutes: float,
                  engine_table: dict[str, str] | None = None) -> list[str]:
    best_c, best_m, base_m, ratio = tuned.chosen, tuned.chosen_measurement, tuned.default_measurement, tuned.ratio
    lines = [f"profile for [bold]{klass}[/]: [bold]{best_c.runs_on}[/], max_batch_tokens {best_c.max_batch_tokens}, "
             f"max_batch_items {best_c.max_batch_items}, linger_ms {best_c.linger_ms:g}; workers {best_c.workers}",
             f"knee {_fmt(best_m.tokens_per_s)} tokens/s ({_fmt(best_m.rps, 2)} req/s of {batch}), "
             f"p95 {_fmt(best_m.p95_ms)} ms",
             f"default profile: {_fmt(base_m.tokens_per_s)} tokens/s, p95 {_fmt(base_m.p95_ms)} ms"
             + (f"  ->  {ratio:.2f}x" if ratio else ""),
             f"engine: {best_c.engine}, as the default profile's load chose it (served {_served(base_m)}); "
             f"held through the search",
             f"{len(tuned.search.trials)} candidates + default in {minutes:.1f} min "
             f"(search {tuned.search.stopped}; a full grid would be {tuned.space.grid_size})"]
    if tuned.confirm:
        a, b = tuned.confirm["default"]["tokens_per_s"], tuned.confirm["chosen"]["tokens_per_s"]
        lines.append(f"confirm run: default {_fmt(a)} tok/s, chosen {_fmt(b)} tok/s"
                     + (f"  ->  {b / a:.2f}x" if a else ""))
    if best_c.workers != 1:
        lines.append(f"workers is a daemon setting: serve with --workers {best_c.workers} "
                     f"(FLEET_CPU_THREADS={max(1, cores // best_c.workers)}) to get this knee")
    if dtype_log:
        lines.append("dtype check (load time, vs fp32): " + "; ".join(dict.fromkeys(dtype_log)))
    if engine_table:
        lines.append("engines at load: " + "; ".join(f"{k}: {v}" for k, v in engine_table.items()))
    return lines
