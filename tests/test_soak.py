"""Soak: a real daemon on 127.0.0.1 under a bounded mixed load must not grow in memory.

Models: all-MiniLM-L6-v2 (embed), a tiny BERT reranker and classifier, a tiny Llama
(generate), all in one worker. Load: 4 clients in a loop; each round mixes tasks and
sizes: a small and a 16-text embed (JSON and MessagePack), per-token vectors, one
100 KB text (cut to the model's bound before tokenizing), a rerank of 8 documents of
random lengths, a classify, a short generation, a bad request, an unknown model and a
/metrics scrape, so the request, error and metrics paths and every task run
thousands of times with ever-changing batch shapes.

RSS of the API process and of the worker (psutil) is sampled every SAMPLE_S after a
warm-up (allocator pools, caches and the batch-shape mix settle by then). A sample
taken while a batch runs carries that batch's transient buffers (+20-50 MiB in the
worker), so the trend is read from each window's floor (the least of WINDOW
samples): what stays allocated between batches. Bounds: the least-squares slope of
the floors under SLOPE_MIB_PER_MIN (the landed code's worker climbed ~500 MiB/min;
a leak of a few KB per request at the soak's load is a few MiB/min), and the growth
from the first window's floor to the last one's under max(10 %, 24 / 48 MiB) for
the API process / the worker.
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

WARMUP_S = float(os.environ.get("FLEET_SOAK_WARMUP_S", "30"))
SOAK_S = float(os.environ.get("FLEET_SOAK_S", "120"))
SAMPLE_S = 5.0
WINDOW = 4
MIB = 1 << 20
SLOPE_MIB_PER_MIN = {"api": 2.0, "worker": 4.0}
ROUND = ["embed", "embed-mp", "tokens", "big", "rerank", "classify", "generate", "bad", "unknown", "metrics"]
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


def client(url: str, seed: int, stop: threading.Event, counts: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    mp = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    big = text(rng, 15_000)  # ~100 KB
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
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


def floors(samples: list[tuple[float, list[int]]], k: int) -> tuple[list[float], list[int]]:
    """(window start times, least RSS of process k in each window of WINDOW samples)."""
    wins = [samples[i:i + WINDOW] for i in range(0, len(samples) - WINDOW + 1, WINDOW)]
    return [w[0][0] for w in wins], [min(r[k] for _, r in w) for w in wins]


def slope_mib_per_min(times: list[float], values: list[int]) -> float:
    return float(np.polyfit(np.asarray(times) / 60.0, np.asarray(values, dtype=np.float64) / MIB, 1)[0])


@pytest.mark.slow
def test_soak_memory_flattens(tmp_path):
    home = tmp_path / "home"
    build_models(tmp_path / "models", home)
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1"})
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"rounds": 0, "unexpected": 0}
    threads = [threading.Thread(target=client, args=(d.url, seed, stop, counts, lock), daemon=True)
               for seed in range(4)]
    samples: list[tuple[float, list[int]]] = []
    try:
        workers = httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"]
        pids = [d.proc.pid, workers[0]["pid"]]
        for t in threads:
            t.start()
        time.sleep(WARMUP_S)
        warm_rounds = counts["rounds"]
        t0 = time.monotonic()
        while time.monotonic() - t0 < SOAK_S:
            samples.append((time.monotonic() - t0, rss(pids)))
            time.sleep(SAMPLE_S)
        samples.append((time.monotonic() - t0, rss(pids)))
        end_rounds = counts["rounds"]
        stop.set()
        for t in threads:
            t.join(timeout=70)
        # The worker served the whole soak (no restart hid a leak behind a fresh process).
        assert httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"][0]["pid"] == pids[1]
    finally:
        stop.set()
        d.stop()
    rounds = end_rounds - warm_rounds
    lows = {who: floors(samples, k) for k, who in enumerate(("api", "worker"))}
    slopes = {who: slope_mib_per_min(*lows[who]) for who in lows}
    warm, end = [lows[w][1][0] for w in lows], [lows[w][1][-1] for w in lows]
    print(f"\nsoak: {rounds} rounds ({rounds * len(ROUND)} requests) in {SOAK_S:.0f} s after {WARMUP_S:.0f} s "
          f"warm-up; floors: API rss {warm[0] / MIB:.1f} -> {end[0] / MIB:.1f} MiB (slope {slopes['api']:+.2f} MiB/min), "
          f"worker rss {warm[1] / MIB:.1f} -> {end[1] / MIB:.1f} MiB (slope {slopes['worker']:+.2f} MiB/min)")
    print("samples (s, api MiB, worker MiB):", [(round(t), round(r[0] / MIB, 1), round(r[1] / MIB, 1))
                                                for t, r in samples])
    assert counts["unexpected"] == 0, counts
    assert rounds >= 20, rounds  # the soak really ran load
    for who in ("api", "worker"):
        assert slopes[who] < SLOPE_MIB_PER_MIN[who], f"{who} rss still rising: {slopes[who]:+.2f} MiB/min"
    assert end[0] - warm[0] < bound(warm[0], 24 * MIB), f"API process grew {(end[0] - warm[0]) / MIB:.1f} MiB"
    assert end[1] - warm[1] < bound(warm[1], 48 * MIB), f"worker grew {(end[1] - warm[1]) / MIB:.1f} MiB"
