"""`fleetctl tune`'s search: pure (plain data in, plain data out, no clocks or I/O).

A `Space` of ladders per dimension (dtype, max batch tokens, max batch items, linger,
workers per device), a start point from the model's size and the device
(`start_point`), and `coordinate_search`: from the start, walk one dimension at a time
one ladder step up (or down) while the knee improves by more than `min_gain`, then the
next dimension, passes until a whole pass changes nothing or the evaluation budget is
spent. Measurements are cached, so a candidate is never measured twice. Not a grid:
with 5 dimensions of 4-6 values a grid is thousands of candidates, a pass is about a
dozen.

A module of its own because it needs nothing of a daemon: tests/test_tune.py runs it
in milliseconds against a synthetic cost model, while the measuring
(`bench.tune_measure`) starts processes and the run (`bench.tune`) wires the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace


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
