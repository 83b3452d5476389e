"""What merging requests into one batch buys fleet's dense adapter, against the length-sorted limit.

The adapter that serves all-minilm-l6-v2 (runtimes/adapters/sentence_transformer.py:
tokenize-ahead, length-sorted micro-batches cut where padding costs more than a
forward, the traced forward) runs batches of K of the 32-text request windows every
`fleetctl bench` target sends (`bench.targets.request_windows`), through its
`run_batch`, in this process; beside it the offline limit `fleetctl bench --compare`
calls `sorted`: the whole corpus length-sorted, encoded in batches of 32. Both in
bf16 on torch (`--openvino`: OpenVINO bf16 for both). Rounds interleave the sides,
`--duration` seconds each; medians of tokens/s (the corpus tokenizer's counts) and
each side / the limit.

What it separates: a daemon at saturation runs as fast as the batches its worker forms
let this adapter run. On 2 Zen 4 cores, one request a batch ran at 0.79x the limit, two
at 0.85x, eight at 1.07x (0.88-0.91x while the adapter sorted by characters; bench/README,
"MiniLM saturated").

Usage: flock /tmp/fleet-bench.lock python -m fleet.bench request-merging [--per-batch 1,2,8]
       [--openvino] [--rounds 3] [--duration 3] [--out bench/results/<time>-request-merging.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from fleet.bench import corpus, report
from fleet.bench.cli import DURATION, OUT, ROUNDS, UsageError, bench, option
from fleet.bench.targets import request_windows
from fleet.bench.tokens import TokenCounter, package_model_dir

#: Texts a request: every `fleetctl bench` target's request window.
TEXTS = 32


def timed(run: Callable[[], int], seconds: float) -> float:
    """Tokens/s of `run` (it returns the tokens it read) called back to back for `seconds`."""
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += run()
    return tokens / (time.perf_counter() - t0)


@bench("request-merging", option("--per-batch", default="1,2,8", help="requests a batch, comma-separated"),
       option("--openvino", action="store_true", help="OpenVINO bf16 for the adapter and the limit"),
       ROUNDS, DURATION.but(default=3.0, help="seconds per side per round (default %(default)s)"), OUT)
def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as fleet's workers and bench/st_local.py
    try:
        per_batch = sorted({int(k) for k in args.per_batch.split(",")})
    except ValueError as exc:
        raise UsageError(f"--per-batch: {exc}") from exc
    if not per_batch or per_batch[0] < 1:
        raise UsageError("--per-batch: whole numbers of 1 or more")
    from fleet.protocol import EmbedRequest
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder
    from fleet.runtimes.base import ModelSpec, Profile

    model_dir = package_model_dir()
    texts = corpus.load()
    lengths = TokenCounter(model_dir).count(texts)
    windows = request_windows(len(texts), TEXTS)
    window_tokens = [sum(lengths[i] for i in w) for w in windows]
    requests = [EmbedRequest(model="m", inputs=[texts[i] for i in w]) for w in windows]
    engine = "openvino" if args.openvino else "torch"
    adapter = SentenceTransformerEmbedder(ModelSpec("m", model_dir, "embed", "sentence-transformers",
                                                    profile=Profile(engine=engine, dtype="bfloat16")), "cpu")
    adapter.load()
    # The limit as `fleetctl bench --compare` runs it (bench/st_local.py): sentence-transformers'
    # encode in bf16, or on OpenVINO fleet's adapter with the engine forced, one batch a call.
    order = np.argsort(lengths, kind="stable")
    ordered = [[texts[i] for i in order[lo:lo + TEXTS]] for lo in range(0, len(order), TEXTS)]
    corpus_tokens = sum(lengths)
    if args.openvino:
        encode = adapter.run_batch
        batches = [[EmbedRequest(model="m", inputs=b)] for b in ordered]
    else:
        import torch
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True).eval().to(torch.bfloat16)
        encode, batches = (lambda b: st.encode(b, batch_size=TEXTS)), ordered

    def sorted_limit() -> int:
        for b in batches:
            encode(b)
        return corpus_tokens

    def merged(k: int) -> Callable[[], int]:
        at = [0]

        def run() -> int:
            lo = at[0]
            at[0] = (lo + k) % (len(requests) - k + 1)
            adapter.run_batch(requests[lo:lo + k])
            return sum(window_tokens[lo:lo + k])
        return run

    sides = {"sorted limit": sorted_limit} | {f"adapter, {k} a batch": merged(k) for k in per_batch}
    for run in sides.values():  # warm-up: kernel selection, the first shapes
        run()
    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        names = list(sides)
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(timed(sides[name], args.duration))
    load_after = os.getloadavg()
    medians = {name: float(np.median(v)) for name, v in runs.items()}
    out = {name: {"tokens_per_s": runs[name], "median": medians[name],
                  "of_limit": medians[name] / medians["sorted limit"]} for name in sides}
    print(f"fleet's adapter ({adapter.engine} {adapter.dtype}) and the length-sorted limit, {TEXTS}-text requests, "
          f"medians of {args.rounds} rounds x {args.duration:g} s:")
    for name, v in out.items():
        print(f"  {name:22s} {v['median']:9,.0f} tokens/s  {v['of_limit']:5.2f}x the limit   runs "
              + " / ".join(f"{x:,.0f}" for x in v["tokens_per_s"]))
    print(f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}")
    doc = report.document("request-merging", "fleet.bench", args.argv) | {
        "engine": adapter.engine, "dtype": adapter.dtype, "texts_per_request": TEXTS, "rounds": args.rounds,
        "duration_s": args.duration, "load_before": load_before, "load_after": load_after, "sides": out}
    path = report.save(doc, args.out, "request-merging")
    print(f"results: {path}", file=sys.stderr)
    return 0
