"""What micro-batch size buys inside one request: the same request windows, cut shorter.

The 15 request windows of 32 corpus texts every `fleetctl bench` target sends
(`bench.targets.request_windows`), each length-sorted and cut into micro-batches
of m, encoded back to back in this process: torch bf16 by
`SentenceTransformer.encode(batch_size=m)` (it sorts by length, then cuts), and
with `--openvino` fleet's own dense adapter with OpenVINO bf16 forced and
`Profile.micro_batch_items=m` (its `run_batch`, one request per call). tokens/s
per side, medians of `--rounds` interleaved rounds, with the load average.
A request of 32 random texts in one micro-batch pads 53 % of its forward; cut
in 8s, 17 % (bench/README, issue 27).

Usage: flock /tmp/fleet-bench.lock python -m fleet.bench micro-batches [--openvino] [--rounds 3]
       [--out bench/results/<time>-micro-batches.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from fleet.bench import corpus, report
from fleet.bench.targets import request_windows
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import OUT, ROUNDS, bench, option

TORCH_SIZES, OPENVINO_SIZES = (32, 16, 8, 4), (64, 16, 8)


@bench("micro-batches", option("--openvino", action="store_true", help="also fleet's adapter on OpenVINO bf16"),
       ROUNDS, OUT)
def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as fleet's workers and bench/st_local.py
    import torch
    from sentence_transformers import SentenceTransformer

    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    windows = request_windows(len(texts), 32)[:15]
    batches = [[texts[i] for i in w] for w in windows]
    tokens = sum(lengths[i] for w in windows for i in w)
    st = SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True).eval().to(torch.bfloat16)
    sides = {f"st-bf16 micro {m}": (lambda b, m=m: st.encode(b, batch_size=m)) for m in TORCH_SIZES}
    if args.openvino:
        from fleet.protocol import EmbedRequest
        from fleet.runtimes.base import ModelSpec, Profile
        from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

        for m in OPENVINO_SIZES:
            a = SentenceTransformerEmbedder(ModelSpec("m", package_model_dir(), "embed", "sentence-transformers",
                                                      profile=Profile(engine="openvino", dtype="bfloat16",
                                                                      micro_batch_items=m)), "cpu")
            a.load()
            sides[f"ov-bf16 adapter micro {m}"] = lambda b, a=a: a.run_batch([EmbedRequest(model="m", inputs=b)])
    for f in sides.values():
        for b in batches[:2]:
            f(b)
    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, f in sides.items():
            t0 = time.perf_counter()
            for b in batches:
                f(b)
            runs[name].append(tokens / (time.perf_counter() - t0))
    load_after = os.getloadavg()
    out = {k: {"runs": v, "median": float(np.median(v))} for k, v in runs.items()}
    for k, v in out.items():
        print(f"{k:28s} median {v['median']:8.0f} tokens/s  runs " + " / ".join(f"{x:.0f}" for x in v["runs"]))
    print(f"load average before {load_before}, after {load_after}")
    doc = report.document("micro-batches", "fleet.bench", args.argv) | {
        "load_before": load_before, "load_after": load_after, "tokens_per_round": tokens, "sides": out}
    path = report.save(doc, args.out, "micro-batches")
    print(f"results: {path}", file=sys.stderr)
    return 0
