"""Which engine (torch, OpenVINO) and dtype serve a model: chosen at load by measurement.

`choose` builds each candidate the device offers (`candidates`: torch in fp32
and its fast dtypes, `runtimes.device.fast_dtypes`; OpenVINO in f32 and bf16
on a CPU that has them, `runtimes.adapters.openvino.dtypes`), keeps those whose outputs
on the check set agree with torch fp32 (the adapter's own check: cosine for
embedders, scores for rerankers, probabilities for classifiers), times the
survivors on the model's own batch shapes (the adapter's workloads: one short
input, a full micro-batch) in interleaved rounds within a bounded budget, and
serves the fastest. A profile may force an engine, a dtype or both
(`Profile.engine`, `Profile.dtype`); a fully forced choice is obeyed unchecked,
as a forced dtype always was.

The verdict is kept beside the model in the store (`fleet.derived.write_note`),
keyed by the model's files, the device class, the thread count, the candidates
and the libraries' versions: a restart serves the same choice without timing
again. The adapter publishes it (`Adapter.choice`: `fleetctl ps` shows the
engine, how it was chosen and the speed measured).

Policy only over what it is given: building, checking and running are the
adapter's (`build`, `outputs`, workloads); no queue, no memory budget.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleet.derived import model_sources, read_note, sources_digest, write_note
from fleet.errors import ModelLoadFailed
from fleet.runtimes.adapters import openvino
from fleet.runtimes.device import device_class, fast_dtypes

log = logging.getLogger("fleet.worker")

ENGINES = ("torch", "openvino")
#: Timing rounds (each runs every workload once per candidate, in rotating order):
#: at least MIN_ROUNDS, then more while under BUDGET_S, at most MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS = 3, 9
BUDGET_S = 3.0


@dataclass(frozen=True)
class Candidate:
    engine: str
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.engine} {self.dtype}"


REFERENCE = Candidate("torch", "float32")


@dataclass(frozen=True)
class Workload:
    """One batch shape of the model's own: `run(serving)` runs it once; `tokens` it holds."""

    label: str
    tokens: int
    run: Callable[[Any], Any]


def repeated(xs: list, n: int) -> list:
    """`xs` repeated to exactly `n` items (a full micro-batch from the check set)."""
    return (xs * (n // len(xs) + 1))[:n]


def short_and_full(run: Callable[[Any, dict[str, Any]], Any], short: dict[str, Any], full: dict[str, Any],
                   unit: str) -> list[Workload]:
    """An encoder's two timed shapes: one short input and one full micro-batch of
    `unit`s (token tensors; `run(serving, features)` runs one)."""
    return [Workload("1 short", int(short["input_ids"].numel()), lambda s: run(s, short)),
            Workload(f"{len(full['input_ids'])} {unit}", int(full["input_ids"].numel()), lambda s: run(s, full))]


@dataclass
class Choice:
    """What serves a model and why (published in the worker's info blob)."""

    candidate: Candidate
    #: "measured" (timed now), "cached" (a kept verdict), "profile" (forced), "only" (one
    #: candidate), "lora" (back to torch fp32 when a LoRA adapter attached: `back_to_torch`).
    by: str
    #: Median ms per workload of the chosen candidate (empty when not timed).
    ms: dict[str, float] = field(default_factory=dict)
    #: Input tokens/s of the chosen candidate on the largest workload (0 when not timed).
    tokens_per_s: float = 0.0
    #: Every candidate: its median ms per workload, or why it was not kept.
    table: dict[str, str] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        return {"engine": self.candidate.engine, "by": self.by, "tokens_per_s": round(self.tokens_per_s),
                "ms": {k: round(v, 2) for k, v in self.ms.items()}}


def candidates(device: str, engine: str = "auto", dtype: str = "auto") -> list[Candidate]:
    """What may serve on `device`, torch fp32 first, within what the profile forces."""
    offered = [Candidate("torch", d) for d in ["float32", *fast_dtypes(device)]]
    offered += [Candidate("openvino", d) for d in openvino.dtypes(device)]
    if engine == "openvino" and not device.startswith("cpu"):
        raise ModelLoadFailed(f"engine 'openvino' runs on the CPU only, not on {device}")
    if engine == "openvino" and not openvino.available():
        raise ModelLoadFailed(f"engine 'openvino' is not installed: {openvino.INSTALL}")
    if engine not in ("auto", *ENGINES):
        raise ModelLoadFailed(f"unknown engine {engine!r}; choose auto, {', '.join(ENGINES)}")
    out = [c for c in offered if engine in ("auto", c.engine) and dtype in ("auto", c.dtype)]
    if not out and engine != "auto" and dtype != "auto":
        out = [Candidate(engine, dtype)]  # forced: obeyed (torch float16 on a CPU, say) as a profile dtype always was
    if not out:
        raise ModelLoadFailed(f"engine {engine!r} has no dtype {dtype!r} on {device}")
    return out


def verdict_key(model_dir: Path, device: str, threads: int, cands: list[Candidate],
                workloads: list[Workload]) -> dict[str, str] | None:
    """What a kept verdict depends on (None outside a store: nothing is kept)."""
    sources = model_sources(model_dir)
    if sources is None:
        return None
    import torch
    import transformers

    versions = {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}
    if any(c.engine == "openvino" for c in cands):
        import openvino as ov

        versions["openvino"] = str(ov.__version__)
    return {"model": sources_digest(sources), "device_class": device_class(device), "threads": str(threads),
            "candidates": ",".join(c.label for c in cands), "workloads": ",".join(w.label for w in workloads),
            **versions}


def choose(name: str, model_dir: Path, device: str, cands: list[Candidate], *, build: Callable[[Candidate], Any],
           outputs: Callable[[Any], np.ndarray], agree: Callable[[np.ndarray, np.ndarray], tuple[bool, str]],
           workloads: list[Workload], threads: int, forced: bool = False,
           clock: Callable[[], float] = time.perf_counter) -> tuple[Any, Choice]:
    """(what serves, the Choice): the fastest candidate that agrees with torch fp32.

    1. One candidate: built and served (`forced`: the profile named it: "profile").
    2. A verdict kept for this model, device class, thread count, candidates and
       versions: its candidate is built and served ("cached").
    3. Else every candidate is built and checked against torch fp32's outputs
       (refused ones, and ones that cannot be built, as a graph the converter
       cannot trace, are dropped at once), the others timed (`time_all`) and the
       fastest served ("measured"); the verdict is kept.
    """
    if len(cands) == 1:
        return build(cands[0]), Choice(cands[0], "profile" if forced else "only")
    key = verdict_key(model_dir, device, threads, cands, workloads)
    kept = read_note(model_dir, note_name(device, threads), key) if key is not None else None
    if kept is not None:
        cand = Candidate(kept["engine"], kept["dtype"])
        if cand in cands:
            log.info("engine %s: %s (kept verdict: %s)", name, cand.label, kept.get("table", {}))
            return build(cand), Choice(cand, "cached", kept.get("ms", {}), kept.get("tokens_per_s", 0.0),
                                       kept.get("table", {}))
    # 3. Build and check; torch fp32 is the reference (and always served as a candidate when offered).
    reference = build(REFERENCE)
    ref_out = outputs(reference)
    alive: dict[Candidate, Any] = {}
    table: dict[str, str] = {}
    for cand in cands:
        try:
            serving = reference if cand == REFERENCE else build(cand)
        except ModelLoadFailed as exc:  # not convertible, say: torch serves instead
            log.warning("engine %s %s: cannot serve (%s)", name, cand.label, exc)
            table[cand.label] = f"refused: {exc}"
            continue
        if cand != REFERENCE:
            ok, detail = agree(ref_out, outputs(serving))
            log.info("engine check %s %s: %s -> %s", name, cand.label, detail, "candidate" if ok else "refused")
            if not ok:
                table[cand.label] = f"refused: {detail}"
                continue
        alive[cand] = serving
    if not alive:
        alive[REFERENCE] = reference
    medians = time_all(alive, workloads, clock)
    base = medians.get(REFERENCE) or next(iter(medians.values()))
    scores = {c: sum(m[w.label] / max(base[w.label], 1e-9) for w in workloads) for c, m in medians.items()}
    best = min(scores, key=scores.__getitem__)
    for cand, m in medians.items():
        table[cand.label] = " ".join(f"{w}={v:.2f}ms" for w, v in m.items())
    largest = max(workloads, key=lambda w: w.tokens)
    ms = medians[best]
    tps = largest.tokens / (ms[largest.label] / 1e3) if ms[largest.label] > 0 else 0.0
    log.info("engine %s: %s, fastest that agrees (%s)", name, best.label, table)
    choice = Choice(best, "measured", ms, tps, table)
    if key is not None:
        write_note(model_dir, note_name(device, threads), key,
                   {"engine": best.engine, "dtype": best.dtype, "ms": ms, "tokens_per_s": tps, "table": table})
    return alive[best], choice


def note_name(device: str, threads: int) -> str:
    return f"engine-{device_class(device)}-t{threads}"


def time_all(alive: dict[Any, Any], workloads: list[Workload], clock: Callable[[], float], *,
             rounds: tuple[int, int] = (MIN_ROUNDS, MAX_ROUNDS)) -> dict[Any, dict[str, float]]:
    """Median ms per (candidate, workload): one warm-up run each (kernel selection,
    a graph's first shapes), then rounds in rotating candidate order so the box's
    drifts fall on every candidate alike, within `rounds` (at least, at most) and BUDGET_S."""
    min_rounds, max_rounds = rounds
    order = list(alive)
    samples: dict[Candidate, dict[str, list[float]]] = {c: {w.label: [] for w in workloads} for c in order}
    for cand in order:
        for w in workloads:
            w.run(alive[cand])
    started = clock()
    done = 0
    while done < max_rounds and (done < min_rounds or clock() - started < BUDGET_S):
        for w in workloads:
            for cand in order[done % len(order):] + order[: done % len(order)]:
                t0 = clock()
                w.run(alive[cand])
                samples[cand][w.label].append((clock() - t0) * 1e3)
        done += 1
    return {c: {w: statistics.median(v) for w, v in s.items()} for c, s in samples.items()}


def serve(adapter: Any, model: Any, *, what: str, forward: Callable[[dict[str, Any]], Any],
          example: dict[str, Any], stand_in: Callable[[Any], Any], outputs: Callable[[Any], np.ndarray],
          agree: Callable[[np.ndarray, np.ndarray], tuple[bool, str]], workloads: list[Workload]) -> Any:
    """What serves `adapter`'s torch `model` (fp32, loaded): sets `adapter.dtype`
    and, when engines were weighed, `adapter.choice`.

    On the CPU with OpenVINO installed, or with a profile engine, the candidates
    (`candidates`) are chosen among by measurement (`choose`): OpenVINO runs the
    graph `what` converted from `forward` (token tensors -> one float tensor,
    `model`'s parameters inside; `example` traces it), called as the adapter calls
    its model through `stand_in(compiled)`. Otherwise torch's dtype alone
    (`hf_common.choose_dtype`), as before OpenVINO."""
    import copy

    import torch

    from fleet.runtimes.adapters.hf_common import choose_dtype

    spec, device = adapter.spec, adapter.device
    profile = spec.profile
    if not (device == "cpu" and (profile.engine != "auto" or openvino.available())):
        if profile.engine not in ("auto", "torch"):
            raise ModelLoadFailed(f"{spec.name}: engine {profile.engine!r} runs on the CPU only "
                                  f"(this model runs on {device})")
        served, adapter.dtype = choose_dtype(model, name=spec.name, wanted=profile.dtype, device=device,
                                             run=outputs, agree=agree, kept_in=spec.path)
        return served
    threads = torch.get_num_threads()
    graph = openvino.Graph(spec.path, spec.name, what, forward, example, model)

    def build(c: Candidate) -> Any:
        if c.engine == "openvino":
            return stand_in(graph.compiled(c.dtype, threads))
        return model if c.dtype == "float32" else copy.deepcopy(model).to(getattr(torch, c.dtype))

    served, adapter.choice = choose(
        spec.name, spec.path, device, candidates(device, profile.engine, profile.dtype), build=build,
        outputs=outputs, agree=agree, workloads=workloads, threads=threads,
        forced=profile.engine != "auto" and profile.dtype != "auto")
    adapter.dtype = adapter.choice.candidate.dtype
    return served


def back_to_torch(adapter: Any) -> bool:
    """Whether `adapter`, served by OpenVINO by its own measurement (profile engine
    `auto`), goes back to torch fp32 (its kept `torch_model`) so that LoRA adapters
    can attach: they patch torch's modules, which a converted graph does not run.
    A profile that forces OpenVINO keeps it (the attach is refused)."""
    choice = adapter.choice
    if choice is None or choice.candidate.engine != "openvino" or adapter.spec.profile.engine != "auto":
        return False
    log.info("engine %s: back to torch float32 for LoRA adapters (was %s)", adapter.spec.name,
             choice.candidate.label)
    adapter.choice = Choice(REFERENCE, "lora", table=choice.table)
    adapter.dtype = "float32"
    return True
