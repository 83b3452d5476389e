"""Generation end to end: fleet over HTTP against transformers `generate` in-process,
and multi-LoRA throughput, on a tiny Llama built here (random weights, real code path).

Measured in one run, interleaved in rounds (median of `--rounds`), on the same
prompts, greedy, `--tokens` new tokens per request:
  (a) transformers `model.generate` in-process, the streams' prompts as one
      left-padded batch (static batching: the batch runs until its longest row ends);
  (b) fleet, `/v1/generate` over HTTP, that many concurrent client streams, each
      sending `--requests` requests one after another (continuous batching);
for 1, 8 and 32 concurrent streams; tokens/s counts generated tokens (EOS excluded).
Multi-LoRA: 32 streams over fleet, (c) every request on one adapter vs (d) requests
spread over 10 adapters of the same base, mixed in the same batches; goal (d) >= 0.8 x (c).
Memory: the base's bytes in `/v1/ps` alone and with the 10 adapters attached.

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench generate-compare [--rounds 3] [--tokens 64]
      [--requests 3] [--threads 1] [--out bench/results/<time>-generate-compare.json]
It runs `fleetctl serve` itself (one CPU worker, `--threads` torch threads, the same
as the in-process side) on a free loopback port with a temporary FLEET_HOME, and
stops it by PID at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from fleet.bench.daemon import LocalDaemon
from fleet.bench.cli import OUT, REQUESTS, ROUNDS, THREADS, bench, option

BASE = "bench-llama"
LORAS = [f"bench-lora-{i}" for i in range(10)]
STREAMS = (1, 8, 32)
LORA_STREAMS = 32
GOAL_LORA_MIXED = 0.8
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is fleet",
    "invoices must be paid within thirty days of receipt unless agreed otherwise",
    "a b c d",
    "serving small models from one box",
    "user: what is the capital of france? assistant:",
    "0 1 2 3 4 5 6 7 8 9",
    "z",
]


def build_models(root: Path) -> tuple[Path, list[Path]]:
    """A 4-layer, 256-wide Llama (about 4 M parameters) and 10 LoRA adapters of it."""
    from tests.gen_models import build_llama, build_lora

    base = build_llama(root / BASE, seed=0, hidden=256, layers=4, max_positions=512)
    return base, [build_lora(base, root / name, seed=100 + i, r=8) for i, name in enumerate(LORAS)]


def pull(home: Path, folder: Path, name: str, *extra: str) -> None:
    env = {**os.environ, "FLEET_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", name, *extra],
                         env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if out.returncode:
        raise RuntimeError(out.stderr)


class InProcess:
    """transformers `generate` on the same weights, in this process."""

    def __init__(self, folder: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.eos = self.tok.eos_token_id

    def run(self, streams: int, tokens: int, requests: int) -> dict:
        """`requests` batches of `streams` prompts; tokens/s over generated tokens."""
        torch = self.torch
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        made, t0 = 0, time.perf_counter()
        with torch.inference_mode():
            for _ in range(requests):
                out = self.model.generate(**enc, max_new_tokens=tokens, do_sample=False,
                                          pad_token_id=self.tok.pad_token_id)
                new = out[:, enc["input_ids"].shape[1]:]
                # Tokens up to (not including) each row's first EOS.
                is_eos = (new == self.eos).int()
                made += int((is_eos.cumsum(1) == 0).sum())
        s = time.perf_counter() - t0
        return {"tokens": made, "s": s, "tokens_per_s": made / s}


def fleet_run(url: str, streams: int, tokens: int, requests: int, models: list[str]) -> dict:
    """`streams` client threads, each sending `requests` requests in turn (stream k uses
    models[k % len(models)]); tokens/s over the tokens the replies report. Clients and
    connections are made before the clock starts; all streams start together."""
    clients = [httpx.Client(timeout=600) for _ in range(streams)]
    for c in clients:
        c.get(url + "/healthz").raise_for_status()  # open the keep-alive connection
    start = threading.Barrier(streams + 1)

    def stream(k: int) -> int:
        made = 0
        start.wait()
        for j in range(requests):
            r = clients[k].post(url + "/v1/generate", json={
                "model": models[(k + j) % len(models)], "prompt": PROMPTS[k % len(PROMPTS)],
                "max_tokens": tokens, "temperature": 0})
            r.raise_for_status()
            made += r.json()["usage"]["output_tokens"]
        return made

    try:
        with cf.ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(stream, k) for k in range(streams)]
            start.wait()
            t0 = time.perf_counter()
            made = sum(f.result() for f in futures)
            s = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    return {"tokens": made, "s": s, "tokens_per_s": made / s}


def base_bytes(url: str) -> int:
    ps = httpx.get(url + "/v1/ps", timeout=10).json()
    return next(w["models"][BASE]["bytes"] for w in ps["workers"] if BASE in w["models"])


@bench("generate-compare", ROUNDS, option("--tokens", type=int, default=64, help="new tokens per request"),
       REQUESTS.but(default=3, help="requests per stream (per batch, in-process)"),
       THREADS.but(help="torch threads, both sides"), OUT)
def main(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-gen-"))
    home = work / "home"
    home.mkdir()
    err.print("building the tiny model and 10 adapters ...")
    base, loras = build_models(work / "models")
    pull(home, base, BASE)
    for name, folder in zip(LORAS, loras):
        pull(home, folder, name, "--base", BASE)
    local = InProcess(base, args.threads)
    daemon = LocalDaemon(home, args=("--workers", "1"),
                         env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": str(args.threads), "FLEET_TIMEOUT_MS": "600000"})
    rows: dict[str, list[dict]] = {}
    try:
        # Warm-up: the base loads, then the adapters attach (memory measured in between).
        fleet_run(daemon.url, 1, 4, 1, [BASE])
        alone = base_bytes(daemon.url)
        fleet_run(daemon.url, len(LORAS), 4, 1, LORAS)
        with_loras = base_bytes(daemon.url)
        local.run(2, 4, 1)
        for r in range(args.rounds):
            for n in STREAMS:
                rows.setdefault(f"hf-{n}", []).append(local.run(n, args.tokens, args.requests))
                rows.setdefault(f"fleet-{n}", []).append(fleet_run(daemon.url, n, args.tokens, args.requests,
                                                                   [BASE]))
            rows.setdefault("lora-one", []).append(fleet_run(daemon.url, LORA_STREAMS, args.tokens, args.requests,
                                                             LORAS[:1]))
            rows.setdefault("lora-mixed", []).append(fleet_run(daemon.url, LORA_STREAMS, args.tokens,
                                                               args.requests, LORAS))
            err.print(f"round {r + 1}/{args.rounds} done")
    finally:
        daemon.stop()
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rows.items()}
    table = Table(title=f"generation, {args.tokens} new tokens/request, greedy, {args.threads} thread(s), "
                        f"median of {args.rounds}")
    for col in ("streams", "transformers generate tok/s", "fleet tok/s", "fleet / transformers"):
        table.add_column(col, justify="right")
    for n in STREAMS:
        table.add_row(str(n), f"{med[f'hf-{n}']:.0f}", f"{med[f'fleet-{n}']:.0f}",
                      f"{med[f'fleet-{n}'] / med[f'hf-{n}']:.2f}x")
    Console().print(table)
    ratio = med["lora-mixed"] / med["lora-one"]
    lt = Table(title=f"multi-LoRA, {LORA_STREAMS} streams over fleet")
    for col in ("one adapter tok/s", "10 adapters mixed tok/s", "mixed / one", f"goal >= {GOAL_LORA_MIXED}",
                "base bytes", "with 10 adapters"):
        lt.add_column(col, justify="right")
    lt.add_row(f"{med['lora-one']:.0f}", f"{med['lora-mixed']:.0f}", f"{ratio:.2f}x",
               "met" if ratio >= GOAL_LORA_MIXED else "missed", f"{alone:,}", f"{with_loras:,} "
               f"(+{(with_loras - alone) / alone:.1%})")
    Console().print(lt)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "median_tokens_per_s": med,
              "lora_mixed_over_one": ratio, "base_bytes": alone, "base_bytes_with_10_loras": with_loras,
              "load_average": os.getloadavg(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = args.out or Path("bench/results") / f"{time.strftime('%Y%m%d-%H%M%S')}-generate-compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    err.print(f"results: {out}")
    return 0
