"""`fleetctl tune`: search a model's serving profile, measuring each candidate's knee.

Three parts:

* **The search** (pure: plain data in, plain data out, no clocks or I/O): a
  `Space` of ladders per dimension (dtype, max batch tokens, max batch items,
  linger, workers per device), a start point from the model's size and the
  device (`start_point`), and `coordinate_search`: from the start, walk one
  dimension at a time one ladder step up (or down) while the knee improves by
  more than `min_gain`, then the next dimension, passes until a whole pass
  changes nothing or the evaluation budget is spent. Measurements are cached,
  so a candidate is never measured twice. Not a grid: with 5 dimensions of
  4-6 values a grid is thousands of candidates, a pass is about a dozen.
* **The measuring** (`DaemonMeasurer`): each candidate runs in its own
  `fleetctl serve` on a free loopback port with a temp FLEET_HOME whose
  `models.toml` (the user's overlay plus the candidate, written as the
  profile of this device class) holds it and whose `models` is the user's store
  (a symlink; nothing is copied) or, for a catalog model not pulled yet, a temp
  store the daemon pulls into; the bench's runner ramps it on the model's own
  task and `bench.knee` finds the knee. The daemon's `/v1/ps` must report the
  candidate's device-class profile in use before it is measured.
* **The run** (`search_profile`, pure but for the `measure` and `clock` passed
  in): measure the default profile, size the space from the engine and dtype it
  served, search from `start_point`, keep the default unless beaten, optionally confirm.
  `resolve_target` finds the model, its folder and the device; `tuned_info` and
  `result_doc` are what `--write` stores and what the results JSON holds. The
  verb (`fleetctl/commands/tune.py`) parses arguments, wires these and prints.

dtype: the daemon's own load-time check (`runtimes.hf_common.choose_dtype`, the
check set against fp32: cosine >= 0.9999 for embedders, ...) decides which
reduced dtype is allowed: the first candidate runs with `dtype = "auto"`, and
the dtype it served (and the check's log line) fixes the dtype ladder to
{that dtype, float32}. A dtype the check refused is never tried.

engine: the same first load also chose the engine (torch, OpenVINO:
`runtimes.engines.choose` timed them on the model's own batch shapes, or a kept
verdict, or the only one offered); `/v1/ps` publishes it (`served_engine`). The
search holds that engine fixed: every candidate names it with its dtype
(`engine = "openvino"`, `dtype = "bfloat16"`: a fully forced choice, served
unchecked), so each measured daemon serves exactly that engine (the measurer
refuses a candidate served otherwise), its float32 rung is that engine's f32, and
`--write` stores a profile that is read against the engine it was measured on.
Engines are not re-timed here: the load-time check did that on the model's own
shapes; its verdict (how chosen, speed, and each engine's timings from the log,
`engine_tables`) goes into the `tuned` table.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fleet.bench.daemon import LocalDaemon
from fleet.catalog import Profile, TunedInfo, write_tuned_profile
from fleet.errors import BadRequest

DIMS: tuple[str, ...] = ("dtype", "max_batch_tokens", "max_batch_items", "linger_ms", "workers")


@dataclass(frozen=True)
class Candidate:
    dtype: str
    max_batch_tokens: int
    max_batch_items: int
    linger_ms: float
    #: Worker processes on the device (a daemon setting, FLEET_WORKERS).
    workers: int = 1
    #: What runs the forward (`Profile.engine`): "auto" only for the default as
    #: shipped; the search holds the engine the default served (not a dimension).
    engine: str = "auto"

    def profile(self) -> dict:
        """The models.toml profile keys (workers is not one: it is a daemon setting)."""
        return {"max_batch_items": self.max_batch_items, "max_batch_tokens": self.max_batch_tokens,
                "dtype": self.dtype, "engine": self.engine, "linger_ms": float(self.linger_ms)}

    @property
    def runs_on(self) -> str:
        """Engine and dtype ("openvino bfloat16"; the dtype alone while the engine is auto)."""
        return self.dtype if self.engine == "auto" else f"{self.engine} {self.dtype}"

    def label(self) -> str:
        return (f"{self.runs_on} tok={self.max_batch_tokens} items={self.max_batch_items} "
                f"linger={self.linger_ms:g}ms w={self.workers}")


@dataclass(frozen=True)
class Measurement:
    #: tokens/s at the knee (0 when there is none: even the lowest load failed).
    tokens_per_s: float
    p95_ms: float
    rps: float = 0.0
    #: The dtype the daemon served (from /v1/ps); "" when unknown.
    dtype: str = ""
    #: The engine it served and how its load chose it (/v1/ps, `served_engine`): "" when unknown.
    engine: str = ""
    engine_by: str = ""
    #: The load-time measurement's tokens/s of that engine (0: not timed, e.g. forced).
    engine_tokens_per_s: float = 0.0
    ok: bool = True
    note: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Space:
    dtypes: tuple[str, ...]
    max_batch_tokens: tuple[int, ...]
    max_batch_items: tuple[int, ...]
    linger_ms: tuple[float, ...]
    workers: tuple[int, ...] = (1,)

    def values(self, dim: str) -> tuple:
        return {"dtype": self.dtypes, "max_batch_tokens": self.max_batch_tokens,
                "max_batch_items": self.max_batch_items, "linger_ms": self.linger_ms, "workers": self.workers}[dim]

    def snap(self, c: Candidate) -> Candidate:
        """`c` with every numeric value moved to the nearest ladder value (log scale); its engine kept."""
        out = {}
        for dim in DIMS:
            vals, v = self.values(dim), getattr(c, dim)
            if dim == "dtype":
                out[dim] = v if v in vals else vals[0]
            else:
                out[dim] = min(vals, key=lambda x: abs(math.log((x or 0.25) / (v or 0.25))))
        return replace(c, **out)

    def step(self, c: Candidate, dim: str, direction: int) -> Candidate | None:
        """The neighbour of `c` one ladder value up (+1) or down (-1) in `dim`, or None at the end."""
        vals = self.values(dim)
        i = vals.index(getattr(c, dim)) + direction
        if not 0 <= i < len(vals):
            return None
        return replace(c, **{dim: vals[i]})

    @property
    def grid_size(self) -> int:
        return math.prod(len(self.values(d)) for d in DIMS)


def ladder(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from `lo` to `hi` (both powers of two)."""
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return tuple(out)


def default_space(device: str, cores: int, dtypes: tuple[str, ...] = ("float32",)) -> Space:
    gpu = device.startswith("cuda")
    return Space(
        dtypes=dtypes,
        max_batch_tokens=ladder(1024, 65536) if not gpu else ladder(4096, 262144),
        max_batch_items=ladder(16, 512),
        linger_ms=(0.0, 1.0, 2.0, 5.0, 10.0),
        # CPU: worker processes split the cores (threads = cores // workers); one per
        # GPU is the norm, two only help a small model that cannot fill the device.
        workers=tuple(range(1, min(cores, 4) + 1)) if not gpu else (1, 2),
    )


def start_point(space: Space, *, params: int, device: str, default: dict) -> Candidate:
    """Where the search begins: the catalog's default profile, with the batch
    budget sized from the model: about 2e11 / params padded tokens per batch on
    a CPU (a 22 M-parameter model: ~8k tokens, i.e. 32 inputs of 256) and 16x
    that on a GPU, which needs wide batches to fill. Snapped to the ladders; the
    default's engine kept."""
    per_batch = 2e11 / max(params, 1) * (16 if device.startswith("cuda") else 1)
    tokens = int(min(max(per_batch, space.max_batch_tokens[0]), space.max_batch_tokens[-1]))
    c = Candidate(
        dtype=default.get("dtype", "auto") if default.get("dtype", "auto") in space.dtypes else space.dtypes[0],
        max_batch_tokens=tokens,
        max_batch_items=int(default.get("max_batch_items", 64)),
        linger_ms=float(default.get("linger_ms", 0.0)),
        workers=space.workers[0],
        engine=str(default.get("engine", "auto")),
    )
    return space.snap(c)


def better(a: Measurement, b: Measurement, min_gain: float) -> bool:
    """`a` beats `b`: more than `min_gain` more knee throughput (noise below that is
    not a win), or within it and with a p95 at least `min_gain` x 3 lower."""
    if not a.ok:
        return False
    if not b.ok:
        return True
    if a.tokens_per_s > b.tokens_per_s * (1.0 + min_gain):
        return True
    return a.tokens_per_s >= b.tokens_per_s * (1.0 - min_gain) and a.p95_ms < b.p95_ms * (1.0 - 3 * min_gain)


@dataclass
class Trial:
    index: int
    candidate: Candidate
    measurement: Measurement
    #: "start", "dim+", "dim-" (the move that proposed it).
    move: str
    best_so_far: bool


@dataclass
class SearchResult:
    best: Candidate
    best_measurement: Measurement
    start: Candidate
    trials: list[Trial] = field(default_factory=list)
    #: Why it stopped: "converged" (a full pass changed nothing), "budget".
    stopped: str = "converged"


def coordinate_search(
    space: Space,
    start: Candidate,
    measure: Callable[[Candidate], Measurement],
    *,
    max_evals: int = 24,
    min_gain: float = 0.03,
    out_of_time: Callable[[], bool] = lambda: False,
    seed: dict[Candidate, Measurement] | None = None,
    on_trial: Callable[[Trial], None] = lambda t: None,
) -> SearchResult:
    """Coordinate descent over `space` from `start` (see the module docstring).

    In each dimension it tries one step up; if that wins it keeps walking up while
    each step wins, else it tries one step down (and keeps walking down). A
    dimension where neither neighbour wins stays. Passes repeat until a pass moves
    nothing. `max_evals` counts measured candidates (cached and `seed` ones are free).
    """
    cache: dict[Candidate, Measurement] = dict(seed or {})
    trials: list[Trial] = []
    start = space.snap(start)
    evals = 0

    class Spent(Exception):
        pass

    def evaluate(c: Candidate, move: str) -> Measurement:
        nonlocal evals
        if c in cache:
            return cache[c]
        if evals >= max_evals or out_of_time():
            raise Spent
        evals += 1
        m = measure(c)
        cache[c] = m
        wins = not trials or better(m, best_m, min_gain)
        trial = Trial(len(trials), c, m, move, wins)
        trials.append(trial)
        on_trial(trial)
        return m

    best, best_m = start, Measurement(0.0, math.inf, ok=False)
    try:
        best_m = evaluate(start, "start")
        if start in (seed or {}):
            trials.append(Trial(0, start, best_m, "start", True))
            on_trial(trials[-1])
        moved = True
        while moved:
            moved = False
            for dim in DIMS:
                for direction in (+1, -1):
                    walked = False
                    while (nxt := space.step(best, dim, direction)) is not None:
                        m = evaluate(nxt, f"{dim}{'+' if direction > 0 else '-'}")
                        if not better(m, best_m, min_gain):
                            break
                        best, best_m, walked, moved = nxt, m, True, True
                    if walked:
                        break  # it moved up: no need to look down from the new point
        stopped = "converged"
    except Spent:
        stopped = "budget"
    return SearchResult(best, best_m, start, trials, stopped)


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


# ---- measuring: a daemon per candidate ------------------------------------------------


_DTYPE_LINE = re.compile(r"dtype check (\S+) (\S+): (.*) -> (keep|fp32)")


def dtype_checks(log_text: str, model: str) -> list[str]:
    """The load-time dtype check's lines for `model` in a daemon log ("bfloat16: min cosine ... -> keep")."""
    return [f"{m.group(2)}: {m.group(3)} -> {m.group(4)}" for m in _DTYPE_LINE.finditer(log_text)
            if m.group(1) == model]


def served_engine(rec: dict) -> dict:
    """What a model's `/v1/ps` record says serves it: engine, dtype, how the engine
    was chosen and its load-time tokens/s (`runtimes.engines.Choice.info`). A record
    without an engine (no engines weighed: a GPU, a CPU without OpenVINO) is torch."""
    e = rec.get("engine") or {}
    return {"engine": str(e.get("engine") or "torch"), "dtype": str(rec.get("dtype", "")),
            "by": str(e.get("by", "")), "tokens_per_s": float(e.get("tokens_per_s") or 0.0)}


def not_as_named(c: Candidate, served: dict) -> str:
    """Why the daemon does not serve what `c` names (its engine and dtype; an "auto"
    engine names nothing), "" when it does: a candidate is measured on exactly that."""
    if c.engine == "auto" or (served["engine"], served["dtype"]) == (c.engine, c.dtype):
        return ""
    return f"daemon serves {served['engine']} {served['dtype']}, not {c.runs_on}"


#: `runtimes.engines.choose`'s verdict line: "engine NAME: ENGINE DTYPE, fastest that
#: agrees ({label: timings or why refused})" or "... (kept verdict: {...})".
_ENGINE_LINE = re.compile(r"^engine (\S+): (\S+ \S+)(?:, fastest that agrees \(| \(kept verdict: )(\{.*\})\)$")


def engine_tables(log_text: str, model: str) -> dict[str, str]:
    """The engine verdict's table for `model` in a daemon log (JSON lines or plain):
    each candidate's load-time ms per workload, or why it was refused; {} when the
    load weighed no engines. The last verdict wins."""
    table: dict[str, str] = {}
    for line in log_text.splitlines():
        if "engine " not in line:
            continue
        try:
            msg = json.loads(line).get("msg", "") if line.startswith("{") else line.split("] ", 1)[-1]
        except (ValueError, AttributeError):
            continue
        m = _ENGINE_LINE.match(msg or "")
        if m and m.group(1) == model:
            try:
                got = ast.literal_eval(m.group(3))
            except (ValueError, SyntaxError):
                continue
            if isinstance(got, dict):
                table = {str(k): str(v) for k, v in got.items()}
    return table


@dataclass
class BenchKnobs:
    """How hard each candidate is benched: short steps, few of them (a noisy box
    gives noisy knees either way; many short candidates beat few long ones)."""

    batch: int = 32
    duration_s: float = 4.0
    min_requests: int = 12
    max_steps: int = 6
    warmup_s: float = 2.0
    grace_s: float = 5.0
    resolution: float = 0.08


#: A DaemonMeasurer's knobs when none are given (read, never changed: one serves all).
DEFAULT_KNOBS = BenchKnobs()


class DaemonMeasurer:
    """Measures a candidate by starting a daemon with it and benching its knee."""

    def __init__(self, *, model: str, task: str, device: str, cores: int, user_home: Path,
                 texts: list[str], lengths: list[int], knobs: BenchKnobs = DEFAULT_KNOBS,
                 device_class: str, new_entry: dict | None = None, start_timeout_s: float = 240.0,
                 note: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.task, self.device, self.cores = model, task, device, cores
        self.user_home, self.texts, self.lengths, self.knobs = Path(user_home), texts, lengths, knobs
        self.device_class, self.new_entry, self.start_timeout_s, self.note = device_class, new_entry, start_timeout_s, note
        self.work = Path(tempfile.mkdtemp(prefix="fleet-tune-"))
        self.home = self.work / "home"
        self.home.mkdir()
        user_store = self.user_home / "models"
        if (user_store / model / "manifest.json").is_file():
            # Shared read-only use of the user's store: the daemon re-hashes, never writes.
            (self.home / "models").symlink_to(user_store.resolve(), target_is_directory=True)
        self.dtype_log: list[str] = []
        #: The engine verdict's table of the last load that weighed engines (the default's).
        self.engine_table: dict[str, str] = {}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def _write_overlay(self, c: Candidate) -> None:
        overlay = self.home / "models.toml"
        user = self.user_home / "models.toml"
        overlay.write_text(user.read_text() if user.is_file() else "")
        write_tuned_profile(self.home, self.model, self.device_class, Profile(**c.profile()),
                            TunedInfo(tuned_at="candidate", knee_tokens_per_s=0.0, knee_p95_ms=0.0),
                            new_entry=self.new_entry)

    def _start(self, c: Candidate) -> LocalDaemon:
        """A daemon for this candidate (the user's FLEET_* settings do not leak in), not waited for."""
        threads = max(1, self.cores // c.workers) if not self.device.startswith("cuda") else 0
        env = {"FLEET_HOST": "127.0.0.1", "FLEET_PRELOAD": self.model, "FLEET_WORKERS": str(c.workers),
               "FLEET_DEVICE": self.device, "FLEET_CPU_THREADS": str(threads), "FLEET_LOG_LEVEL": "info"}
        return LocalDaemon(self.home, env=env, wait=False, inherit_fleet=False,
                           log=self.work / f"daemon-{time.monotonic_ns()}.log")

    def _wait_loaded(self, proc: subprocess.Popen, url: str, log_path: Path) -> dict:
        """Until the model is resident: its /v1/ps record (dtype, profile)."""
        import httpx

        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
            try:
                ps = httpx.get(url + "/v1/ps", timeout=2).json()
                if any(w.get("restarts", 0) for w in ps.get("workers", [])) or any(
                        s.get("restarts", 0) for s in ps.get("slots", [])):
                    # A worker died (bad candidate, broken install): do not wait out the timeout.
                    raise RuntimeError(f"a worker restarted while loading: {log_path.read_text()[-1500:]}")
                for w in ps.get("workers", []):
                    rec = w.get("models", {}).get(self.model)
                    if rec:
                        return rec
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.model} not loaded after {self.start_timeout_s:.0f} s")

    def __call__(self, c: Candidate) -> Measurement:
        from fleet.bench.knee import OPEN, Criteria
        from fleet.bench.runner import Plan, TargetSpec, bench

        t0 = time.time()
        self._write_overlay(c)
        daemon = self._start(c)
        proc, url, log_path = daemon.proc, daemon.url, daemon.log_path
        try:
            rec = self._wait_loaded(proc, url, log_path)
            if rec.get("profile") != self.device_class:
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0,
                                   note=f"daemon serves profile {rec.get('profile')!r}, not {self.device_class!r}")
            log_text = log_path.read_text(errors="replace")
            self.dtype_log += dtype_checks(log_text, self.model)
            self.engine_table = engine_tables(log_text, self.model) or self.engine_table
            s = served_engine(rec)
            on = {"dtype": s["dtype"], "engine": s["engine"], "engine_by": s["by"],
                  "engine_tokens_per_s": s["tokens_per_s"]}
            if why := not_as_named(c, s):
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note=why, **on)
            k = self.knobs
            plan = Plan(model=self.model, task=self.task, batch=k.batch, duration_s=k.duration_s,
                        min_requests=k.min_requests, max_step_s=2 * k.duration_s, mode=OPEN,
                        resolution=k.resolution, max_steps=k.max_steps, criteria=Criteria(),
                        grace_s=k.grace_s, warmup_s=k.warmup_s, device=self.device)
            runs = bench([TargetSpec(name="fleet", kind="fleet", url=url, pids=[proc.pid])], plan,
                         self.texts, self.lengths)
            knee = runs[0].knee(plan.criteria)
            if knee.knee is None:
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note="no healthy step", **on)
            return Measurement(knee.knee.tokens_per_s, knee.knee.p95_ms, knee.knee.throughput_rps, **on,
                               seconds=time.time() - t0, note=f"{len(runs[0].steps)} steps")
        except RuntimeError as exc:
            return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note=str(exc)[:300])
        finally:
            daemon.stop()



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
