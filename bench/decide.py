"""Typed decisions: decisions/s and p50 through one daemon, and what the shared prefix saves.

Measured over HTTP (JSON, `POST /v1/systemone`) against a `fleetctl serve` this script
starts (free loopback port, throwaway FLEET_HOME, one CPU worker; stopped by PID), on
causal LMs with random weights built from a config and pulled `--task decide`:
  - `tiny`: the tests' Llama (2 layers, width 64) and their byte-level BPE, trained on
    five sentences (so ~1.2 characters a token on the corpus: questions are long);
  - `minilm`: a Llama of all-MiniLM-L6-v2's size (6 layers, width 384, 12 heads, MLP
    1024: 1.77 M parameters a layer, as MiniLM's; its 30522-token vocabulary in the
    embeddings and an untied LM head: 34 M in all) with MiniLM's own WordPiece
    tokenizer (~4 characters a token, as real text reads).
Per model, interleaved over `--rounds` rounds (medians reported):
  1. one client, one request at a time, each on a new state (~`--state-chars`
     characters of the bench corpus behind a nonce, so no state is cached): p50 of a
     request asking 1 question and of one asking 8 (3-option choices), and their ratio
     (the state is read once per request, however many questions ask about it);
  2. the same 8 questions on a state already read (its cache kept between requests);
  3. `--clients` concurrent clients, closed loop for `--duration` s, 1 question per
     request on new states: decisions/s (questions answered a second) and p50.

Usage (the measured rounds take /tmp/fleet-bench.lock themselves, see --lock):
  python -m fleet.bench decide [--rounds 3] [--duration 8] [--clients 8] [--requests 20] [--state-chars 2000]
      [--models tiny,minilm] [--out bench/results/decide.json]
"""

from __future__ import annotations

import argparse
import fcntl
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

from fleet.bench.corpus import CORPUS_PATH
from fleet.bench.daemon import LocalDaemon
from fleet.bench.cli import CLIENTS, DURATION, LOCK, OUT, REQUESTS, ROUNDS, THREADS, bench, option

TEAMS = ["Billing", "Technical", "Sales"]
QUESTIONS = [f"Which team should handle message {k}?" for k in range(8)]


def build(folder: Path, size: str) -> Path:
    """A causal LM of `size` with the tests' byte-level BPE tokenizer, random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers import AutoTokenizer

    from fleet.bench.tokens import package_model_dir
    from tests.gen_models import build_llama

    if size == "tiny":
        return build_llama(folder, max_positions=2048)
    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(package_model_dir())
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                      bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def pull(home: Path, folder: Path, name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", name,
                          "--task", "decide"], env={**os.environ, "FLEET_HOME": str(home)}, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    if out.returncode:
        raise RuntimeError(out.stderr)


class States:
    """New states on demand: a nonce, then corpus text up to `chars` characters."""

    def __init__(self, chars: int) -> None:
        self.texts = [t for t in CORPUS_PATH.read_text().splitlines() if t]
        self.chars = chars
        self.n = 0
        self.lock = threading.Lock()

    def new(self) -> str:
        with self.lock:
            self.n += 1
            k = self.n
        out, i = [f"Message {k}."], k
        while sum(map(len, out)) < self.chars:
            out.append(self.texts[i % len(self.texts)])
            i += 7
        return " ".join(out)


def body(model: str, state: str, count: int) -> dict:
    return {"model": model, "state": state, "questions": {
        f"q{k}": {"type": "choice", "instructions": QUESTIONS[k], "criteria": dict.fromkeys(TEAMS)}
        for k in range(count)}}


def timed(client: httpx.Client, payload: dict) -> float:
    t0 = time.perf_counter()
    resp = client.post("/v1/systemone", json=payload)
    ms = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise RuntimeError(f"{resp.status_code}: {resp.text[:300]}")
    return ms


def latency(url: str, model: str, states: States, requests: int) -> dict:
    """p50 of 1 and 8 questions on new states (alternating), and of 8 on one state read before."""
    with httpx.Client(base_url=url, timeout=120) as client:
        one, eight, cached = [], [], []
        seen = states.new()
        timed(client, body(model, seen, 8))
        for _ in range(requests):
            one.append(timed(client, body(model, states.new(), 1)))
            eight.append(timed(client, body(model, states.new(), 8)))
            cached.append(timed(client, body(model, seen, 8)))
    p1, p8, pc = (statistics.median(x) for x in (one, eight, cached))
    return {"p50_1q_ms": p1, "p50_8q_ms": p8, "ratio_8q_1q": p8 / p1, "p50_8q_cached_ms": pc}


def throughput(url: str, model: str, states: States, clients: int, duration: float) -> dict:
    """Closed loop: `clients` threads, 1-question requests on new states, for `duration` s."""
    times: list[float] = []
    errors = [0]
    stop = time.perf_counter() + duration

    def run() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.perf_counter() < stop:
                try:
                    ms = timed(client, body(model, states.new(), 1))
                except RuntimeError:
                    errors[0] += 1
                    continue
                times.append(ms)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return {"decisions_per_s": len(times) / elapsed, "p50_ms": statistics.median(times) if times else None,
            "errors": errors[0]}


@bench("decide", ROUNDS, DURATION, CLIENTS, REQUESTS.but(help="requests of each kind per latency round"),
       option("--state-chars", type=int, default=2000, help="characters of each state (~a page)"),
       option("--models", default="tiny,minilm"), THREADS.but(type=str, default="2"), OUT, LOCK)
def main(args: argparse.Namespace) -> int:

    sizes = [s for s in args.models.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-decide-"))
    home = work / "home"
    names = {size: f"decide-{size}" for size in sizes}
    for size in sizes:
        pull(home, build(work / size, size), names[size])
    states = States(args.state_chars)
    daemon = LocalDaemon(home, args=("--workers", "1"), env={"FLEET_PRELOAD": ",".join(names.values()),
                                                             "FLEET_CPU_THREADS": args.threads})
    rounds: dict[str, list[dict]] = {size: [] for size in sizes}
    try:
        for size in sizes:  # warm-up: first shapes, first states
            latency(daemon.url, names[size], states, 2)
        lock = open(args.lock, "a") if args.lock else None
        if lock is not None:
            print(f"waiting for {args.lock} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the process exits
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        for r in range(args.rounds):
            for size in sizes:
                res = {**latency(daemon.url, names[size], states, args.requests),
                       **throughput(daemon.url, names[size], states, args.clients, args.duration)}
                rounds[size].append(res)
                print(f"round {r + 1} {size}: " + ", ".join(f"{k}={v:.2f}" for k, v in res.items() if v is not None),
                      flush=True)
        load = os.getloadavg()
    finally:
        daemon.stop()
    summary = {size: {k: statistics.median(x[k] for x in v if x[k] is not None) for k in v[0]}
               for size, v in rounds.items()}
    print("\n| model | decisions/s | p50 ms (8 clients) | 1 question p50 ms | 8 questions p50 ms | 8q / 1q "
          "| 8 questions, state read before |\n| --- | --- | --- | --- | --- | --- | --- |")
    for size, s in summary.items():
        print(f"| {size} | {s['decisions_per_s']:.1f} | {s['p50_ms']:.1f} | {s['p50_1q_ms']:.1f} | "
              f"{s['p50_8q_ms']:.1f} | {s['ratio_8q_1q']:.2f} | {s['p50_8q_cached_ms']:.1f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"started": started, "args": vars(args) | {"out": str(args.out)},
                                        "cpu_count": os.cpu_count(), "loadavg_end": load, "rounds": rounds,
                                        "summary": summary}, indent=2, default=str))
    return 0
