"""`fleetctl tune`: search a model's serving profile, measuring each candidate's knee.

Three modules:

* **the search** (`bench.tune_search`): pure coordinate descent over ladders of
  dtype, batch budget, linger and workers;
* **the measuring** (`bench.tune_measure`): a `fleetctl serve` per candidate, its
  knee benched, the dtype and engine its load chose read from `/v1/ps` and its log;
* **the run** (here: `search_profile`, pure but for the `measure` and `clock` passed
  in): measure the default profile, size the space from the engine and dtype it
  served, search from `start_point`, keep the default unless beaten, optionally
  confirm. `resolve_target` finds the model, its folder and the device; `tuned_info`
  and `result_doc` are what `--write` stores and what the results JSON holds. The verb
  (`fleetctl/commands/tune.py`) parses arguments, wires these and prints.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fleet.bench.tune_measure import BenchKnobs
from fleet.bench.tune_search import (
    Candidate, Measurement, SearchResult, Space, Trial, better, coordinate_search, default_space, start_point,
)
from fleet.catalog import TunedInfo
from fleet.errors import BadRequest


# ---- the run: default first, then the search, then the choice ---------------------------


def default_candidate(default: dict) -> Candidate:
    """The default profile as shipped, on one worker (engine and dtype "auto": the load-time check decides)."""
    return Candidate(dtype=str(default["dtype"]), max_batch_tokens=int(default["max_batch_tokens"]),
                     max_batch_items=int(default["max_batch_items"]), linger_ms=float(default["linger_ms"]),
                     workers=1, engine=str(default.get("engine", "auto")))


def held_engine(m: Measurement) -> str:
    """The engine the search holds: the one the default served (a daemon that
    publishes none served torch, as `Adapter.engine` says)."""
    return m.engine or "torch"


def search_space(device: str, cores: int, served: str, workers_max: int | None = None) -> Space:
    """The space once the default has served `served`: only the dtype its check let
    through (or the default's explicit dtype), and fp32; workers capped at `workers_max`."""
    space = default_space(device, cores, tuple(dict.fromkeys([served, "float32"])))
    if workers_max:
        space = replace(space, workers=tuple(w for w in space.workers if w <= workers_max) or (1,))
    return space


def seed_from_default(space: Space, default: Candidate, served: str,
                      measured: Measurement) -> tuple[Candidate, dict[Candidate, Measurement]]:
    """The default with its engine and dtype made explicit, and the search's seed:
    that point with its measurement when it is on the space's ladders (else no seed)."""
    seeded = replace(default, dtype=served, engine=held_engine(measured))
    return seeded, ({seeded: measured} if space.snap(seeded) == seeded else {})


def keep_default_unless_beaten(best: Candidate, best_m: Measurement, default: Candidate,
                               default_m: Measurement) -> tuple[Candidate, Measurement]:
    """The search's best, unless nothing it tried beat the default (or the budget ran
    out first): then the default (`default` with its served engine and dtype explicit)."""
    if default_m.ok and not better(best_m, default_m, 0.0):
        return default, default_m
    return best, best_m


def ratio_vs_default(chosen: Measurement, default: Measurement) -> float | None:
    """Chosen knee / default knee; None when the default has no knee."""
    return chosen.tokens_per_s / default.tokens_per_s if default.ok and default.tokens_per_s > 0 else None


def over_budget(now: float, deadline: float, seconds: list[float]) -> bool:
    """A candidate started `now` would end past `deadline`, taking the typical
    (median) length of those measured so far (s)."""
    typical = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
    return now + typical > deadline


@dataclass
class Tuning:
    """What a run found: the default as measured, the search, the choice."""

    default: Candidate
    default_measurement: Measurement
    space: Space
    search: SearchResult
    chosen: Candidate
    chosen_measurement: Measurement
    #: The confirm run's {"default", "chosen"} measurements (as dicts); None when not asked for.
    confirm: dict | None = None

    @property
    def ratio(self) -> float | None:
        return ratio_vs_default(self.chosen_measurement, self.default_measurement)


def search_profile(
    target: Target,
    measure: Callable[[Candidate], Measurement],
    *,
    deadline: float,
    max_candidates: int,
    min_gain: float,
    workers_max: int | None = None,
    confirm_with: Callable[[Candidate], Measurement] | None = None,
    clock: Callable[[], float] = time.time,
    on_default: Callable[[Candidate, Measurement], None] = lambda c, m: None,
    on_trial: Callable[[Trial], None] = lambda t: None,
    on_confirm: Callable[[], None] = lambda: None,
) -> Tuning:
    """Tune `target`'s profile: `measure` runs a candidate (a `DaemonMeasurer`),
    `clock` against `deadline` (same clock, s) stops the search before a candidate
    that would end past it; `max_candidates` counts the default too."""
    seconds: list[float] = []

    def timed(c: Candidate) -> Measurement:
        m = measure(c)
        seconds.append(m.seconds)
        return m

    # 1. The default profile as shipped (engine and dtype as its load-time check decides).
    base_c = default_candidate(target.default)
    base_m = timed(base_c)
    on_default(base_c, base_m)
    if not base_m.ok and not base_m.dtype:
        raise BadRequest(f"the default profile did not serve: {base_m.note}")
    # 2. The space and start from what the default served (its engine held fixed,
    # named by every candidate); the default is a free point of it.
    served = base_m.dtype or "float32"
    space = search_space(target.device, target.cores, served, workers_max)
    seeded, seed = seed_from_default(space, base_c, served, base_m)
    start = start_point(space, params=target.params, device=target.device,
                        default={**target.default, "dtype": served, "engine": seeded.engine})
    # 3. The search, then the choice.
    result = coordinate_search(space, start, timed, max_evals=max_candidates - 1, min_gain=min_gain,
                               out_of_time=lambda: over_budget(clock(), deadline, seconds), seed=seed,
                               on_trial=on_trial)
    best_c, best_m = keep_default_unless_beaten(result.best, result.best_measurement, seeded, base_m)
    tuning = Tuning(base_c, base_m, space, result, best_c, best_m)
    # 4. The confirm run: both again, one after the other (outside the budget).
    if confirm_with is not None:
        on_confirm()
        again_base = confirm_with(base_c)
        again_best = confirm_with(best_c)
        tuning.confirm = {"default": asdict(again_base), "chosen": asdict(again_best)}
    return tuning


def tuned_info(t: Tuning, *, device: str, cores: int, dtype_log: list[str], budget_minutes: float,
               versions: dict, tuned_at: str, engine_table: dict[str, str] | None = None) -> TunedInfo:
    """The `tuned` table `--write` stores beside the chosen profile: the knee, and
    the engine the default's load chose (how, its speed, `engine_table`: each
    engine's load-time timings or why it was refused, from the daemon log)."""
    best_c, best_m, base_m = t.chosen, t.chosen_measurement, t.default_measurement
    return TunedInfo(
        tuned_at=tuned_at,
        knee_tokens_per_s=round(best_m.tokens_per_s, 1), knee_p95_ms=round(best_m.p95_ms, 1),
        knee_rps=round(best_m.rps, 3),
        baseline_tokens_per_s=round(base_m.tokens_per_s, 1) if base_m.ok else None,
        workers=best_c.workers, cpu_threads=max(1, cores // best_c.workers) if device == "cpu" else 0,
        dtype_check="; ".join(dict.fromkeys(dtype_log)), candidates=len(t.search.trials) + 1,
        engine_choice=f"{held_engine(base_m)} {base_m.dtype}" if base_m.dtype else "",
        engine_by=base_m.engine_by, engine_tokens_per_s=round(base_m.engine_tokens_per_s, 1) or None,
        engine_table=dict(engine_table or {}),
        budget_minutes=budget_minutes,
        versions={k: str(v) for k, v in versions.items()
                  if k in ("fleet", "torch", "transformers", "sentence-transformers", "git_commit", "python")},
    )


def result_doc(target: Target, t: Tuning, *, budget_minutes: float, knobs: BenchKnobs, dtype_log: list[str],
               machine: dict, versions: dict, command: list[str], engine_table: dict[str, str] | None = None) -> dict:
    """The results JSON of a run (`finite` makes it JSON: a missing p95 is null)."""
    return {"kind": "tune", "model": target.model, "task": target.task, "device": target.device,
            "device_class": target.device_class, "machine": machine, "versions": versions, "command": command,
            "budget_minutes": budget_minutes, "knobs": asdict(knobs), "space": asdict(t.space),
            "default": {"candidate": asdict(t.default), "measurement": asdict(t.default_measurement)},
            "start": asdict(t.search.start), "trials": [trial_doc(tr) for tr in t.search.trials],
            "stopped": t.search.stopped,
            "chosen": {"candidate": asdict(t.chosen), "measurement": asdict(t.chosen_measurement)},
            "ratio_vs_default": t.ratio, "confirm": t.confirm, "dtype_check": dtype_log,
            "engine_table": dict(engine_table or {})}


def trial_doc(t: Trial) -> dict:
    return {"index": t.index, "move": t.move, "candidate": asdict(t.candidate),
            "measurement": asdict(t.measurement), "best_so_far": t.best_so_far}


def finite(obj):
    """`obj` with inf and NaN floats as None (JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


# ---- the target: the model, its folder, the device -------------------------------------


@dataclass(frozen=True)
class Target:
    model: str
    task: str
    #: The model's files: tokenizer.json for the bench's token counts.
    folder: Path
    #: "cpu" or "cuda:K".
    device: str
    device_class: str
    cores: int
    #: FLEET_HOME: its models.toml and store are the user's.
    home: Path
    #: The default profile's keys (the catalog entry's, else the stored manifest's).
    default: dict
    #: Parameters, from the weights' size: sizes the start point only.
    params: int
    #: A store-only model's entry, written with its tuned profile; None for a catalog model.
    new_entry: dict | None = None


def resolve_target(model: str, device: str | None) -> Target:
    """`model` from the catalog or the store, on `device` (default: cuda:0 when NVML
    sees a GPU, else cpu). Refuses a model in neither, and a task the bench cannot measure."""
    import msgspec

    from fleet.bench.sampler import describe_gpus
    from fleet.bench.targets import TASKS
    from fleet.bench.tokens import resolve_model_dir
    from fleet.catalog import load_catalog, manifest_entry
    from fleet.config import load_settings
    from fleet.store import Store
    from fleet.runtimes.device import device_class

    settings = load_settings()
    home = settings.home_path
    entry = load_catalog(home).find(model)
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
    new_entry = None
    if entry is None:
        new_entry = manifest_entry(manifest)
    return Target(model=model, task=task, folder=folder, device=dev, device_class=device_class(dev),
                  cores=len(os.sched_getaffinity(0)), home=home,
                  default=msgspec.structs.asdict(entry.profile if entry is not None else manifest.profile),
                  params=model_params(folder), new_entry=new_entry)


def model_params(folder: Path) -> int:
    """Parameters, from the safetensors files' sizes (4 bytes each: fp32 weights);
    only sizes the start point, so the estimate need not be exact."""
    size = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    return max(1, size // 4)
