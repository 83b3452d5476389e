"""Where a typed decision's time goes on the CPU: the state's forward, the questions' rows,
and what any forward costs before its first token (bench/README, "Typed decisions").

In-process (no daemon, no HTTP: the worker's own `DecisionLM.batch`), one torch thread,
process CPU time (what the box's other load does not inflate), medians of `--requests`
requests each asking 1 and 8 three-option choices on a new state of `--state-chars`
characters (bench.decide's states and questions), on bench.decide's MiniLM-size Llama:
  - `batch`: the whole decision; `state`: its state's forward (`_run_prefixes`);
    `rows`: the questions' forward on the state's cache (`_run_rows`);
  - `forward of N tokens`: the bare model on N new tokens, no cache, logits at 2
    positions: what a forward costs whatever it reads (its weights streamed once).

Usage:
  python -m fleet.bench decide-split [--state-chars 400] [--requests 15] [--folder DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.bench.decide import QUESTIONS, TEAMS, States, build
from fleet.bench.cli import REQUESTS, bench, option


def cpu_ms(run: Callable[[], Any]) -> float:
    t0 = time.process_time()
    run()
    return (time.process_time() - t0) * 1e3


@bench("decide-split", option("--state-chars", type=int, default=400), REQUESTS.but(default=15),
       option("--folder", type=Path, default=None, help="the model's folder (built there when empty)"))
def main(args: argparse.Namespace) -> None:

    import torch

    from fleet.decisions import DecideQuestion, DecideRequest
    from fleet.runtimes.base import BatchContext, ModelSpec, run_through
    from fleet.runtimes.adapters.decide import DecisionLM

    torch.set_num_threads(1)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="fleet-decide-split-")) / "minilm"
    if not (folder / "config.json").exists():
        build(folder, "minilm")
    split: dict[str, float] = {}

    class Timed(DecisionLM):
        """DecisionLM that adds each stage's CPU time into `split`."""

        def _run_prefixes(self, *a: Any, **kw: Any):
            t0 = time.process_time()
            yield from super()._run_prefixes(*a, **kw)
            split["state"] = split.get("state", 0.0) + (time.process_time() - t0) * 1e3

        def _run_rows(self, *a: Any, **kw: Any):
            t0 = time.process_time()
            yield from super()._run_rows(*a, **kw)
            split["rows"] = split.get("rows", 0.0) + (time.process_time() - t0) * 1e3

    adapter = Timed(ModelSpec("minilm", folder, "decide", "transformers"), "cpu")
    adapter.load()
    states = States(args.state_chars)

    def request(n: int) -> DecideRequest:
        return DecideRequest("minilm", states.new(), [DecideQuestion("choice", QUESTIONS[k], list(TEAMS), list(TEAMS))
                                                      for k in range(n)])

    rows: dict[int, dict[str, list[float]]] = {1: {}, 8: {}}
    for k in range(args.requests + 3):
        for n in (1, 8):
            req = request(n)
            split.clear()
            total = cpu_ms(lambda req=req: run_through(adapter.batch([req], BatchContext())))
            if k >= 3:  # the first rounds warm the kernels up
                for key, ms in {"batch": total, **split}.items():
                    rows[n].setdefault(key, []).append(ms)
    tokens = len(adapter._prefix_ids([states.new()])[0])
    print(f"state of {args.state_chars} characters: {tokens} tokens (with the frame); CPU ms, medians:")
    for n in (1, 8):
        med = {key: statistics.median(v) for key, v in rows[n].items()}
        print(f"  {n} question{'s' * (n > 1)}: batch {med['batch']:.1f}, state {med['state']:.1f}, "
              f"rows {med['rows']:.1f}")
    one, eight = (statistics.median(rows[n]["batch"]) for n in (1, 8))
    print(f"  8q / 1q: {eight / one:.2f}")
    model = adapter.model
    with torch.inference_mode():
        for n in (8, 32, 128, 256):
            ids = torch.randint(5, 1000, (1, n))
            ms = statistics.median(cpu_ms(lambda ids=ids: model(input_ids=ids, use_cache=False, logits_to_keep=2))
                                   for _ in range(args.requests))
            print(f"  forward of {n} tokens: {ms:.1f}")
