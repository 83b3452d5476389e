"""A CPU encoder's forward recorded once as a TorchScript graph: the model's Python runs at load, not per batch.

A short text's forward on the CPU is a hundred-odd small operators, and
transformers' modules spend about 2 ms of Python around them per call
(MiniLM, one 10-token text, OMP_WAIT_POLICY=PASSIVE, AMD EPYC Zen 3: eager
10.4-12.3 ms, traced 8.1-9.9 ms on one thread; 12.2-14.2 vs 8.5-8.9 ms on two).
`torch.jit.trace` records the operators the forward ran on an example; the
recorded graph replays them from C++ on the same module's weights (no copy).

A trace keeps what Python decided for its example: a branch taken on a shape or
a value is fixed in the graph. So a trace serves only where it has been shown
to give what the eager forward gives:
- the example is padded (texts of different lengths): masking stays in the graph;
- every probe (one text, a padded batch, the longest input probed beside a short one) must give
  the eager forward's output (`disagreement`: allclose, the same kernels run);
- longer inputs than the longest probe (PROBE_TOKENS, or the model's limit)
  run eagerly: there the operators' own time dwarfs the Python around them;
- it must be measured faster than the eager forward on the model's own small
  shapes, in interleaved rounds (`engines.time_all`, `ROUNDS` of them);
- a batch whose feature keys or non-tensor entries differ from the example's
  runs eagerly (`TracedForward.__call__` answers None).
Otherwise the model runs eagerly and the log says why; `fleetctl ps` shows the verdict.

A trace is made once per model, not once per load (`kept_trace`). The tracer
registers every traced module's class and graph in torch's one process-wide
compilation unit, which never frees them: each load of a traced model left its
graphs and their execution plans behind after the unload (issue 42: +25 MiB a
load/unload cycle of a 265 MB reranker, linear). So the graph is saved with its
weights left out, with the verdict, beside the model in the store
(`fleet.derived`, keyed by torch's version, the dtype, the thread count and the
probes), and every load serves it loaded from there (`torch.jit.load`: a
compilation unit of its own, freed with the model) with the model's own tensors
bound in; one short probe checks it against the eager forward. A reload neither
traces nor probes nor times again, and a verdict of eager is kept too.

`torch.jit.trace` is deprecated in favour of torch.compile and torch.export
(torch 2.13 warns). Neither serves this: an exported program replays through
Python (MiniLM, one text: 11.9 ms against eager 11.1-12.3, no gain) and
torch.compile's CPU backend builds C++ at load, with a compiler not every box
has. torch is pinned (scripts/setup.sh); if a later torch drops the tracer, the
trace fails and the model runs eagerly, as it did before.

Policy over one forward only: which batch runs it is the adapter's.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

from fleet.runtimes.adapters import engines, kept
from fleet.runtimes.device import device_class

log = logging.getLogger("fleet.worker")

#: Timing rounds per shape (eager and traced, order alternating), after one warm-up run each.
ROUNDS = 3
#: The trace must be at least this much faster (eager / traced, geometric mean over
#: the timed shapes) to serve: a tie keeps eager, the code the model's authors ran.
MIN_SPEEDUP = 1.0
#: Probes must agree this closely (torch.allclose on float32 outputs).
RTOL, ATOL = 1e-4, 1e-5
#: The longest input probed, in tokens (the model's limit when lower); the trace
#: serves up to it. Its forwards at load (eager and traced) stay cheap.
PROBE_TOKENS = 512
#: A kept trace's files (`kept_trace`): the graph without its weights, and the verdict.
GRAPH, VERDICT = "graph.pt", "verdict.json"

Run = Callable[[list[Any], dict[str, Any]], Any]


class TracedForward:
    """`run(modules, features)` as a recorded graph; call it with a batch's features."""

    def __init__(self, graph: Any, keys: tuple[str, ...], fixed: dict[str, Any], max_tokens: int) -> None:
        self._graph = graph
        #: Tensor entries, in the graph's argument order.
        self.keys = keys
        #: Longer batches (tokens per row) run eagerly: the probes went this far.
        self.max_tokens = max_tokens
        #: Non-tensor entries as they were when traced (e.g. sentence-transformers' `modality`).
        self.fixed = fixed
        self._names = frozenset(keys) | frozenset(fixed)
        #: Eager / traced time on the timed shapes (geometric mean), as measured at load.
        self.speedup = 1.0

    def __call__(self, features: dict[str, Any]) -> Any | None:
        """The forward's output for `features`, or None when they are not shaped as the
        traced example's or longer than the probes went."""
        if features.keys() != self._names or any(features[k] != v for k, v in self.fixed.items()):
            return None
        tensors = [features[k] for k in self.keys]
        if tensors[0].shape[-1] > self.max_tokens:
            return None
        return self._graph(*tensors)

    def info(self) -> dict[str, Any]:
        return {"traced": True, "speedup": round(self.speedup, 2), "up_to_tokens": self.max_tokens}


def trace(torch: Any, name: str, modules: list[Any], run: Run, example: dict[str, Any],
          probes: list[dict[str, Any]], timed: list[dict[str, Any]], *,
          clock: Callable[[], float] = time.perf_counter) -> tuple[TracedForward | None, str]:
    """(the traced forward or None, why) for `run(modules, features)` on the CPU.

    `example`: features of texts of different lengths (padded) to record from;
    `probes`: features the trace must agree on with `run` (the longest sets how far
    the trace serves; `cut` one to PROBE_TOKENS); `timed`: the model's small shapes
    (one short input first) both are timed on. Call under `torch.inference_mode()`."""
    keys = tuple(k for k, v in example.items() if isinstance(v, torch.Tensor))
    fixed = {k: v for k, v in example.items() if k not in keys}

    class Positional(torch.nn.Module):
        """`run` with the tensors as positional arguments (what the tracer takes);
        the modules are held so that their weights are the graph's parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.held = torch.nn.ModuleList(modules)

        def forward(self, *tensors: Any) -> Any:
            return run(list(self.held), {**fixed, **dict(zip(keys, tensors))})

    try:
        with warnings.catch_warnings():
            # The tracer's notes on Python values it fixed, and its own deprecation: the probes decide.
            warnings.simplefilter("ignore")
            graph = torch.jit.trace(Positional().eval(), tuple(example[k] for k in keys),
                                    strict=False, check_trace=False)
    except Exception as exc:  # a module the tracer cannot record: eager is always correct
        return None, f"trace failed ({type(exc).__name__}: {exc})"
    traced = TracedForward(graph, keys, fixed, max(int(f[keys[0]].shape[-1]) for f in probes))
    for features in probes:
        if (detail := disagreement(torch, run(modules, dict(features)), traced(dict(features)))) is not None:
            shape = tuple(features["attention_mask"].shape) if "attention_mask" in features else "?"
            return None, f"disagrees with eager on a {shape} batch ({detail})"
    shapes = [engines.Workload(str(i), int(f[keys[0]].numel()), lambda forward, f=f: forward(f))
              for i, f in enumerate(timed)]
    ms = engines.time_all({"eager": lambda f: run(modules, dict(f)), "traced": traced}, shapes, clock,
                          rounds=(ROUNDS, ROUNDS))
    eager_ms, traced_ms = ([ms[which][w.label] for w in shapes] for which in ("eager", "traced"))
    traced.speedup = statistics.geometric_mean(e / t for e, t in zip(eager_ms, traced_ms))
    measured = ", ".join(f"{e:.2f} vs {t:.2f} ms" for e, t in zip(eager_ms, traced_ms))
    if traced.speedup <= MIN_SPEEDUP:
        return None, f"no faster than eager ({measured}: eager vs traced)"
    log.info("traced forward %s: %.2fx eager (%s)", name, traced.speedup, measured)
    return traced, f"{traced.speedup:.2f}x eager ({measured})"


def trace_probed(torch: Any, name: str, modules: list[Any], run: Run, tokenized: Callable[[list[Any]], dict[str, Any]],
                 inputs: list[Any], longest: Any, max_tokens: int, *, kept_in: Path | None = None,
                 what: str = "forward") -> tuple[TracedForward | None, str]:
    """`trace` with the probes every encoder takes: recorded on two of `inputs`
    (texts or pairs) padded together, checked on one input, four padded together and
    `longest` (cut to min(`max_tokens`, PROBE_TOKENS) tokens) beside a short one, timed
    on the first two (`long_text` makes a long one). `tokenized`: the adapter's features
    of some inputs, as it serves them. `kept_in`: the model's folder, where the trace
    and its verdict are kept (`kept_trace`; `what` names the forward). The log says
    why when it runs eagerly."""
    tokens = min(max_tokens, PROBE_TOKENS)
    example = tokenized(inputs[:2])

    def measured() -> tuple[TracedForward | None, str]:
        probes = [tokenized(inputs[1:2]), tokenized(inputs[:4]), cut(torch, tokenized([longest, inputs[0]]), tokens)]
        return trace(torch, name, modules, run, example, probes, probes[:2])

    with torch.inference_mode():
        if kept_in is None:
            got, why = measured()
        else:
            got, why = kept_trace(torch, name, modules, run, example, tokenized(inputs[1:2]), kept_in, what, measured)
    if got is None:
        log.info("traced forward %s: off, %s; running eagerly", name, why)
    return got, why


def kept_trace(torch: Any, name: str, modules: list[Any], run: Run, example: dict[str, Any], short: dict[str, Any],
               model_dir: Path, what: str, measured: Callable[[], tuple[TracedForward | None, str]],
               ) -> tuple[TracedForward | None, str]:
    """The verdict `measured()` gives, made once and kept beside the model
    (`fleet.derived`: re-hashed at each read, made again when the model's files or
    the versions change): a graph to serve is saved without its weights, then loaded
    into its own compilation unit with `modules`' tensors bound in and checked
    against the eager forward on `short`. Anything failing here serves what
    `measured()` gives, as before keeping (the log says why)."""
    from fleet.derived import derived

    keys = tuple(k for k, v in example.items() if isinstance(v, torch.Tensor))
    fixed = {k: v for k, v in example.items() if k not in keys}
    tensors = module_tensors(modules)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else "none"
    threads = torch.get_num_threads()
    made: list[tuple[TracedForward | None, str]] = []

    def make(folder: Path) -> None:
        got, why = measured()
        made.append((got, why))
        if got is not None:
            save_unbound(torch, got, folder / GRAPH, tensors)
        (folder / VERDICT).write_text(json.dumps({"on": got is not None, "why": why, "max_tokens": got.max_tokens
                                                  if got is not None else 0,
                                                  "speedup": got.speedup if got is not None else 0.0}))

    try:
        folder = derived(model_dir, f"traced-{what}-{device_class('cpu')}-{dtype}-t{threads}",
                         {**kept.versions(torch), "keys": ",".join(keys), "fixed": repr(sorted(fixed.items())),
                          "probe_tokens": str(PROBE_TOKENS), "rounds": str(ROUNDS)}, make)
        verdict = json.loads((folder / VERDICT).read_text())
        if not verdict["on"]:
            return None, verdict["why"] + ("" if made else " (kept verdict)")
        graph = torch.jit.load(str(folder / GRAPH), map_location="cpu")
        bind(graph, tensors)
    except Exception as exc:  # keeping is an optimisation: a load never fails on it
        log.warning("traced forward %s: cannot keep or read its kept trace (%s: %s)", name, type(exc).__name__, exc)
        return made[0] if made else measured()
    traced = TracedForward(graph, keys, fixed, int(verdict["max_tokens"]))
    traced.speedup = float(verdict["speedup"])
    if (detail := disagreement(torch, run(modules, dict(short)), traced(dict(short)))) is not None:
        return None, f"the kept trace disagrees with eager ({detail})"
    if not made:
        log.info("traced forward %s: %.2fx eager (kept verdict)", name, traced.speedup)
    return traced, verdict["why"] + ("" if made else " (kept verdict)")


def module_tensors(modules: list[Any]) -> dict[str, Any]:
    """Every parameter and buffer of `modules` under its name in the traced graph
    (`trace` holds them as `held.<i>.<name>`)."""
    return {f"held.{i}.{n}": t for i, m in enumerate(modules)
            for n, t in chain(m.named_parameters(), m.named_buffers())}


def bind(graph: Any, tensors: dict[str, Any]) -> None:
    """Set every parameter and buffer of the script module `graph` to the tensor of
    its name (no copy); a graph whose names are not exactly these is refused."""
    names = [n for n, _ in chain(graph.named_parameters(), graph.named_buffers())]
    if sorted(names) != sorted(tensors):
        raise ValueError(f"the graph's {len(names)} tensors are not the model's {len(tensors)}")
    for name in names:
        *path, leaf = name.split(".")
        module = graph
        for part in path:
            module = getattr(module, part)
        setattr(module, leaf, tensors[name])


def save_unbound(torch: Any, traced: TracedForward, path: Path, tensors: dict[str, Any]) -> None:
    """Save `traced`'s graph with empty tensors in place of the model's (kilobytes, not
    the weights again), then bind the model's back (it may still serve)."""
    graph = traced._graph
    try:
        bind(graph, {n: torch.empty(0, dtype=t.dtype) for n, t in tensors.items()})
        torch.jit.save(graph, str(path))
    finally:
        bind(graph, tensors)


def long_text(texts: list[str], max_tokens: int) -> str:
    """`texts` repeated into one text of at least min(`max_tokens`, PROBE_TOKENS)
    tokens (they have 8 or more tokens each): `trace_probed`'s longest probe."""
    return " ".join(texts) * (min(max_tokens, PROBE_TOKENS) // 8 + 1)


def cut(torch: Any, features: dict[str, Any], tokens: int) -> dict[str, Any]:
    """`features` with every (rows, tokens) tensor cut to its first `tokens` tokens."""
    return {k: v[:, :tokens] if isinstance(v, torch.Tensor) and v.ndim == 2 else v for k, v in features.items()}


def disagreement(torch: Any, eager: Any, traced: Any) -> str | None:
    """None when the traced output is the eager one (the same kernels ran), else how it differs."""
    if traced is None:
        return "the trace did not take the features"
    if traced.shape != eager.shape:
        return f"shape {tuple(traced.shape)} vs {tuple(eager.shape)}"
    a, b = eager.float(), traced.float()
    if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
        return f"max abs difference {float((a - b).abs().max()):.3g}"
    return None
