"""Simulated models and the seeded, open-loop arrival trace both schedulers get.

Units: device times in milliseconds, arrival times in seconds from the step's
start, tokens are input tokens (summed over a request's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleet.runtimes.base import Profile


@dataclass(frozen=True)
class SizeClass:
    """Device cost law of a model size: batch ms = a_ms + b_ms_per_token * tokens."""

    name: str
    a_ms: float
    b_ms_per_token: float
    #: Loading the model onto a device that does not hold it (host RAM -> GPU, warm-up).
    swap_ms: float


# Chosen up front from typical GPU figures for small encoder models (fixed
# per-forward overhead dominates small batches; throughput per token grows
# with size), not tuned to either scheduler.
SMALL = SizeClass("small", a_ms=2.0, b_ms_per_token=0.001, swap_ms=50.0)  # MiniLM-class, ~1M tok/s
BASE = SizeClass("base", a_ms=4.0, b_ms_per_token=0.003, swap_ms=120.0)  # BERT-base-class, ~330k tok/s
LARGE = SizeClass("large", a_ms=8.0, b_ms_per_token=0.010, swap_ms=300.0)  # large encoder, ~100k tok/s
SIZE_CLASSES = (SMALL, BASE, LARGE)


@dataclass(frozen=True)
class SimModel:
    index: int
    name: str
    size: SizeClass
    profile: Profile

    def batch_ms(self, tokens: int) -> float:
        return self.size.a_ms + self.size.b_ms_per_token * tokens

    @property
    def swap_ms(self) -> float:
        return self.size.swap_ms


#: Every simulated model's profile unless a run names another (frozen: one serves all).
DEFAULT_PROFILE = Profile()


def make_models(n: int, profile: Profile = DEFAULT_PROFILE) -> list[SimModel]:
    """n models; sizes cycle small, base, large down the popularity ranks, so every
    size class has popular and rare models (model i has popularity rank i + 1)."""
    return [SimModel(i, f"sim-m{i:02d}-{SIZE_CLASSES[i % 3].name}", SIZE_CLASSES[i % 3], profile) for i in range(n)]


def zipf_weights(n: int, s: float) -> np.ndarray:
    """P(rank k) proportional to 1 / k**s, k = 1..n."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


@dataclass(frozen=True)
class TrafficSpec:
    models: int = 20
    zipf_s: float = 1.0
    #: Inputs per request, drawn log-uniformly (most requests are small).
    min_inputs: int = 1
    max_inputs: int = 32
    #: Tokens per input, uniform.
    min_tokens: int = 10
    max_tokens: int = 80


@dataclass(frozen=True)
class Trace:
    rate: float  # offered requests/s
    duration_s: float
    t_s: np.ndarray  # float64 arrival times, increasing, in [0, duration_s)
    model: np.ndarray  # int32 model index
    inputs: np.ndarray  # int32 inputs per request
    tokens: np.ndarray  # int64 input tokens per request

    def __len__(self) -> int:
        return len(self.t_s)


def make_trace(rate: float, duration_s: float, spec: TrafficSpec, seed: int) -> Trace:
    """Poisson arrivals at `rate` for `duration_s`. Deterministic in (seed, rate,
    duration, spec): pull and push replay the very same trace at a given load.

    The count is fixed at round(rate x duration) and the times are sorted
    uniform draws over the window: a Poisson process conditioned on its count,
    so a short step offers exactly its nominal rate."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    rng = np.random.default_rng([seed, int(round(rate * 1000)), int(round(duration_s * 1000))])
    t = np.sort(rng.uniform(0.0, duration_s, int(round(rate * duration_s))))
    n = len(t)
    model = rng.choice(spec.models, size=n, p=zipf_weights(spec.models, spec.zipf_s)).astype(np.int32)
    lo, hi = np.log(spec.min_inputs), np.log(spec.max_inputs + 1)
    inputs = np.minimum(np.exp(rng.uniform(lo, hi, n)).astype(np.int32), spec.max_inputs)
    inputs = np.maximum(inputs, spec.min_inputs)
    per_input = rng.integers(spec.min_tokens, spec.max_tokens + 1, int(inputs.sum()))
    starts = np.concatenate([[0], np.cumsum(inputs)[:-1]]) if n else np.zeros(0, np.int64)
    tokens = np.add.reduceat(per_input, starts).astype(np.int64) if n else np.zeros(0, np.int64)
    return Trace(rate, duration_s, t, model, inputs, tokens)
