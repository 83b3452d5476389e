"""Soak: a real daemon on 127.0.0.1 under a bounded mixed load must not grow in memory.

Models: all-MiniLM-L6-v2 (embed), a tiny BERT reranker and classifier, a tiny Llama
(generate), all in one worker. Load: 4 clients in a loop; each round mixes tasks and
sizes: a small and a 16-text embed (JSON and MessagePack), per-token vectors, one
100 KB text (cut to the model's bound before tokenizing), a rerank of 8 documents of
random lengths, a classify, a short generation, a bad request, an unknown model and a
/metrics scrape, so the request, error and metrics paths and every task run
thousands of times with ever-changing batch shapes.

What is measured is what a leak is: memory still held when the work is done. The
load runs in CYCLES of LOAD_S, each followed by a quiet spell in which every client
has parked: the worker, idle, gives its freed heap back (`WorkerCore.trim_if_due`,
at most TRIM_EVERY_NS after its last batch), and the RSS of the API process and of
the worker (psutil) is read then, the least of QUIET_SAMPLES reads. RSS read under
load swings by ±150 MiB in the worker (a batch's activations, a freed heap not yet
trimmed): a trend read from it measures when the samples fell, not a leak (a first
version of this test failed at +42 MiB/min and passed at -61 MiB/min on one tree).
The quiet reads repeat within a few MiB. The first cycles are warm-up (allocator
pools, caches and the batch-shape mix settle), counted in work done, not in time:
the worker's C heap settles after about 80 rounds (800 requests) whatever the rate
(here: +180 MiB over those, then flat), so a warm-up of two 15-s cycles covered it on
an idle box and not on a loaded one (9 rounds a cycle: the settling read as +139
KiB/request). oneDNN's primitive cache is bounded (1024 primitives, one per op and
shape) but fills for as long as new batch shapes come, over thousands of requests
(~250 MiB of heap and JIT code at 80 rounds here, still growing ~7 KiB/request at 200;
likely CI's +58 KiB/request at 40 rounds a cycle): the soak's daemon runs without it
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=0). PyTorch keeps a second cache of the same kind:
the bf16 matmul primitives of its ideep layer, an LRU of LRU_CACHE_CAPACITY (1024)
entries, one per weight and input shape. Plain sentence-transformers in bf16 (one
thread, 500 batches of 1-8 texts of 1-60 words per step) holds 379 -> 450 MiB of live
heap over 3 000 batches, still rising; in fp32, or with LRU_CACHE_CAPACITY=1, it is
flat from the first step (180 MiB). CI's soak read +28.6 KiB/request from it
(833 -> 899 MiB, slowing every cycle). The soak's daemon runs with a capacity of 1, so
what can grow is ours. Python objects in the
worker stay flat throughout (gc: 478 937 -> 478 997 over 128 rounds). Bounds over the
cycles after the warm-up: the
least-squares slope of the quiet reads over the requests served under
SLOPE_KIB_PER_REQUEST, and the growth from the first quiet read to the last one under
max(10 %, 24 / 48 MiB) for the API process / the worker.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import psutil
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_dir, start_daemon
from tests.gen_models import build_llama, pull

WARMUP_CYCLES = int(os.environ.get("FLEET_SOAK_WARMUP_CYCLES", "2"))
#: Rounds served before the measured cycles, at least (the heap settles in ~80), in
#: WARMUP_CYCLES to MAX_WARMUP_CYCLES cycles.
WARMUP_ROUNDS = 100
MAX_WARMUP_CYCLES = 12
CYCLES = int(os.environ.get("FLEET_SOAK_CYCLES", "8"))
LOAD_S = 15.0
#: The quiet spell: clients parked, then QUIET_SAMPLES reads QUIET_EVERY_S apart,
#: the first one 2 s in (a worker waits 0.25 s per idle round and trims at most
#: once a second: runtimes/worker.TRIM_EVERY_NS).
QUIET_FIRST_S = 2.0
QUIET_SAMPLES = 3
QUIET_EVERY_S = 0.5
MIB = 1 << 20
#: Bound on the trend of the quiet reads, in KiB per request served (per request, not
#: per minute: a faster box serves more requests a minute and settles as much per
#: request). Measured here (2 vCPUs, load 3-7, three runs): the worker +1.4 to +1.8
#: KiB/request over the 8 measured cycles (about 879 -> 882 MiB), the API process +0.5
#: to +0.7. The landed code's worker climbed ~500 MiB/min, hundreds of KiB per request.
SLOPE_KIB_PER_REQUEST = {"api": 4.0, "worker": 8.0}
ROUND = ["embed", "embed-mp", "tokens", "big", "rerank", "classify", "generate", "bad", "unknown", "metrics"]
SEEDS = range(4)
EXPECTED = [200, 200, 200, 200, 200, 200, 200, 400, 404, 200]
WORDS = "fleet serves small open models from one box with a shared queue and pull based workers".split()


def bound(start: int, floor: int) -> int:
    return max(start // 10, floor)


def build_models(root: Path, home: Path) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    for name, labels in (("soak-reranker", 1), ("soak-classifier", 3)):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, num_labels=labels)
        folder = root / name
        BertForSequenceClassification(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        pull(home, folder, name, *(["--task", "rerank"] if labels == 1 else ["--task", "classify"]))
    pull(home, build_llama(root / "soak-llama"), "soak-llama")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def client(url: str, seed: int, go: threading.Event, stop: threading.Event, counts: dict,
           lock: threading.Lock) -> None:
    rng = random.Random(seed)
    mp = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    big = text(rng, 15_000)  # ~100 KB
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            if not go.is_set():  # parked until the quiet spell ends (the test sets `go` on every way out)
                with lock:
                    counts["parked"] += 1
                go.wait()
                with lock:
                    counts["parked"] -= 1
                continue
            sizes = [rng.randint(1, 120) for _ in range(16)]
            got = [
                c.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [text(rng, 2)]}).status_code,
                c.post(url + "/v1/embed", headers=mp, content=msgspec.msgpack.encode(
                    {"model": DEFAULT_MODEL, "inputs": [text(rng, n) for n in sizes]})).status_code,
                c.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "output": "tokens",
                                                "inputs": [text(rng, rng.randint(1, 60))]}).status_code,
                c.post(url + "/v1/embed", headers=mp, content=msgspec.msgpack.encode(
                    {"model": DEFAULT_MODEL, "inputs": [big]})).status_code,
                c.post(url + "/v1/rerank", json={"model": "soak-reranker", "query": text(rng, 5),
                                                 "documents": [text(rng, rng.randint(1, 80)) for _ in range(8)]}
                       ).status_code,
                c.post(url + "/v1/classify", json={"model": "soak-classifier",
                                                   "inputs": [text(rng, rng.randint(1, 40))]}).status_code,
                c.post(url + "/v1/generate", json={"model": "soak-llama", "prompt": text(rng, rng.randint(1, 20)),
                                                   "max_tokens": rng.randint(1, 16)}).status_code,
                c.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": []}).status_code,
                c.post(url + "/v1/embed", json={"model": "no-such-model", "inputs": ["x"]}).status_code,
                c.get(url + "/metrics").status_code,
            ]
            with lock:
                counts["rounds"] += 1
                if got != EXPECTED:
                    counts["unexpected"] += 1
                    counts["last_unexpected"] = dict(zip(ROUND, got))


def rss(pids: list[int]) -> list[int]:
    return [psutil.Process(p).memory_info().rss for p in pids]


def quiet_read(pids: list[int], go: threading.Event, counts: dict, lock: threading.Lock) -> list[int]:
    """Park every client (each finishes its round), let the idle worker trim, and
    return the least RSS of each process over QUIET_SAMPLES reads."""
    go.clear()
    deadline = time.monotonic() + 90  # a round of 10 requests, each under the 60 s client timeout
    while time.monotonic() < deadline:
        with lock:
            if counts["parked"] == len(SEEDS):
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"clients still busy 90 s after the load stopped: {counts}")
    time.sleep(QUIET_FIRST_S)
    reads = []
    for _ in range(QUIET_SAMPLES):
        reads.append(rss(pids))
        time.sleep(QUIET_EVERY_S)
    go.set()
    return [min(r[k] for r in reads) for k in range(len(pids))]


def slope(xs: list[float], values: list[int]) -> float:
    """Least-squares slope of `values` (bytes) over `xs`."""
    return float(np.polyfit(np.asarray(xs, dtype=np.float64), np.asarray(values, dtype=np.float64), 1)[0])


@pytest.mark.slow
def test_soak_memory_flattens(tmp_path):
    home = tmp_path / "home"
    build_models(tmp_path / "models", home)
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
                                      "LRU_CACHE_CAPACITY": "1"})
    go, stop = threading.Event(), threading.Event()
    lock = threading.Lock()
    counts = {"rounds": 0, "unexpected": 0, "parked": 0}
    threads = [threading.Thread(target=client, args=(d.url, seed, go, stop, counts, lock), daemon=True)
               for seed in SEEDS]
    reads: list[list[int]] = []  # quiet RSS [api, worker] after each measured cycle
    served: list[int] = []  # requests served before each of those reads
    try:
        workers = httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"]
        pids = [d.proc.pid, workers[0]["pid"]]
        go.set()
        for t in threads:
            t.start()
        warm_cycles = 0
        while warm_cycles < WARMUP_CYCLES or (counts["rounds"] < WARMUP_ROUNDS and warm_cycles < MAX_WARMUP_CYCLES):
            time.sleep(LOAD_S)
            quiet_read(pids, go, counts, lock)  # the same rhythm of load and rest as measured
            warm_cycles += 1
        warm_rounds = counts["rounds"]
        for _ in range(CYCLES):
            time.sleep(LOAD_S)
            reads.append(quiet_read(pids, go, counts, lock))
            served.append(counts["rounds"] * len(ROUND))
        end_rounds = counts["rounds"]
        stop.set()
        for t in threads:
            t.join(timeout=70)
        # The worker served the whole soak (no restart hid a leak behind a fresh process).
        assert httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"][0]["pid"] == pids[1]
    finally:
        stop.set()
        go.set()
        d.stop()
    rounds = end_rounds - warm_rounds
    minutes = [(i + 1) * LOAD_S / 60 for i in range(len(reads))]  # minutes of load after the warm-up
    series = {who: [r[k] for r in reads] for k, who in enumerate(("api", "worker"))}
    per_min = {who: slope(minutes, series[who]) / MIB for who in series}
    per_request = {who: slope(served, series[who]) / 1024 for who in series}
    warm, end = reads[0], reads[-1]
    print(f"\nsoak: {rounds} rounds ({rounds * len(ROUND)} requests) in {CYCLES} cycles of {LOAD_S:.0f} s after "
          f"{warm_cycles} warm-up cycles ({warm_rounds} rounds); quiet RSS: API {warm[0] / MIB:.1f} -> "
          f"{end[0] / MIB:.1f} MiB "
          f"({per_min['api']:+.2f} MiB/min, {per_request['api']:+.2f} KiB/request), worker {warm[1] / MIB:.1f} -> "
          f"{end[1] / MIB:.1f} MiB ({per_min['worker']:+.2f} MiB/min, {per_request['worker']:+.2f} KiB/request)")
    print("quiet reads (api MiB, worker MiB):", [(round(a / MIB, 1), round(w / MIB, 1)) for a, w in reads])
    assert counts["unexpected"] == 0, counts
    assert rounds >= 20, rounds  # the soak really ran load
    for who in ("api", "worker"):
        assert per_request[who] < SLOPE_KIB_PER_REQUEST[who], \
            f"{who} rss still rising: {per_request[who]:+.2f} KiB per request ({per_min[who]:+.2f} MiB/min)"
    assert end[0] - warm[0] < bound(warm[0], 24 * MIB), f"API process grew {(end[0] - warm[0]) / MIB:.1f} MiB"
    assert end[1] - warm[1] < bound(warm[1], 48 * MIB), f"worker grew {(end[1] - warm[1]) / MIB:.1f} MiB"
