"""One short request: fleet's round trip and its worker's inference against the same model in-process.

Alternates, one at a time: a single-text embed request to fleet over HTTP
(MessagePack, one keep-alive connection, a blocking client: a lone agent
waiting for each answer), then `SentenceTransformer.encode` of the same text in
this process, fp32 (what fleet serves on a CPU without native bf16), with
torch's OpenMP set as fleet's workers set it (OMP_WAIT_POLICY=PASSIVE,
runtimes/process.py). Alternating puts the box's drifts on both sides alike.

Reported, with the machine's load average:
- the worker's inference for one item (`X-Inference-Ms`: its `run_batch`,
  tokenize to result) against the in-process call; goal p50 within 5 %;
- the latency serving adds: the round trip's percentile minus the in-process
  call's (goals p50 <= 1 ms, p99 <= 3 ms), and per request the round trip minus
  the worker's own inference (the serving path alone: HTTP, queue, wake-ups,
  reply; the model's noise, tens of ms at the tail here, drops out).

Usage: flock /tmp/fleet-bench.lock python -m bench.inference_compare [--requests 400] [--url URL]
       [--out bench/results/latency-<time>.json]
(without --url: starts `fleetctl serve` on a free loopback port with a temporary FLEET_HOME).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from bench import report
from bench.daemon import LocalDaemon
from bench.httpclient import BlockingConn, Endpoint, build_request
from bench.tokens import package_model_dir

MODEL = "all-minilm-l6-v2"
TEXTS = ["How do I reset my router password?", "Best hiking trails near Lyon", "What is a tax deduction?",
         "Fix a slow laptop"]
WARMUP = 20
GOAL_RATIO, GOAL_ADDED_P50_MS, GOAL_ADDED_P99_MS = 1.05, 1.0, 3.0


def load_local():
    """The in-process side: the model fleet serves, fp32, on the CPU, with OpenMP's
    threads sleeping when idle as in fleet's workers (OMP_WAIT_POLICY=PASSIVE unless
    the environment says otherwise; read once, when torch loads, so it applies only
    if torch is not loaded yet). The variable is put back afterwards: processes
    started later run at their own defaults."""
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = before or "PASSIVE"
    try:
        from sentence_transformers import SentenceTransformer
    finally:
        if before is None:
            del os.environ["OMP_WAIT_POLICY"]
    st = SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True)
    st.eval()
    st.omp_wait_policy = before or "PASSIVE"
    return st


def alternate(url: str, st, texts: list[str], requests: int, *, warmup: int = WARMUP) -> dict[str, np.ndarray]:
    """`requests` pairs (after `warmup`): one fleet request, then `st.encode` of the same
    text. Arrays in ms: rtt (client round trip), inference (the worker's X-Inference-Ms),
    local (in-process encode)."""
    ep = Endpoint(url)
    prepared = [build_request(ep, "/v1/embed", msgspec.msgpack.encode({"model": MODEL, "inputs": [t]}),
                              "application/msgpack", "application/msgpack") for t in texts]
    conn = BlockingConn(ep)
    rtt, inference, local = [], [], []
    try:
        for i in range(warmup + requests):
            k = i % len(texts)
            t0 = time.perf_counter()
            status, headers, _ = conn.exchange(prepared[k])
            t1 = time.perf_counter()
            if status != 200:
                raise RuntimeError(f"request {i} answered {status}")
            st.encode([texts[k]])
            t2 = time.perf_counter()
            if i >= warmup:
                rtt.append((t1 - t0) * 1e3)
                inference.append(float(headers[b"x-inference-ms"]))
                local.append((t2 - t1) * 1e3)
    finally:
        conn.close()
    return {"rtt": np.array(rtt), "inference": np.array(inference), "local": np.array(local)}


def summarize(runs: dict[str, np.ndarray]) -> dict[str, float]:
    rtt, inference, local = runs["rtt"], runs["inference"], runs["local"]
    path = rtt - inference
    pct = {f"{name}_p{q}_ms": float(np.percentile(v, q))
           for name, v in (("rtt", rtt), ("inference", inference), ("local", local), ("path", path))
           for q in (50, 95, 99)}
    return pct | {
        "n": int(len(rtt)),
        "worker_over_local_p50": float(np.median(inference) / np.median(local)),
        "added_p50_ms": pct["rtt_p50_ms"] - pct["local_p50_ms"],
        "added_p95_ms": pct["rtt_p95_ms"] - pct["local_p95_ms"],
        "added_p99_ms": pct["rtt_p99_ms"] - pct["local_p99_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--url", default=None, help="a running daemon (default: start one)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    st = load_local()
    import torch

    load_before = os.getloadavg()
    daemon = None if args.url else LocalDaemon(tempfile.mkdtemp(prefix="fleet-bench-home-"))
    url = args.url or daemon.url  # type: ignore[union-attr]
    try:
        runs = alternate(url, st, TEXTS, args.requests)
    finally:
        if daemon:
            daemon.stop()
    load_after = os.getloadavg()
    s = summarize(runs)
    goals = {"worker_within_5pct": s["worker_over_local_p50"] <= GOAL_RATIO,
             "added_p50_le_1ms": s["added_p50_ms"] <= GOAL_ADDED_P50_MS,
             "added_p99_le_3ms": s["added_p99_ms"] <= GOAL_ADDED_P99_MS}

    def row(label: str, key: str) -> str:
        return f"{label:34s} {s[f'{key}_p50_ms']:8.2f} {s[f'{key}_p95_ms']:8.2f} {s[f'{key}_p99_ms']:8.2f}"

    print(f"one short request, {s['n']} alternating pairs, fp32, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={st.omp_wait_policy}")
    print(f"{'ms':34s} {'p50':>8s} {'p95':>8s} {'p99':>8s}")
    print(row("fleet round trip (HTTP/msgpack)", "rtt"))
    print(row("in-process encode", "local"))
    print(f"{'added by serving (difference)':34s} {s['added_p50_ms']:8.2f} {s['added_p95_ms']:8.2f} "
          f"{s['added_p99_ms']:8.2f}")
    print(row("worker X-Inference-Ms", "inference"))
    print(row("serving path (rtt - inference)", "path"))
    print(f"worker / in-process p50: {s['worker_over_local_p50']:.3f}")
    for goal, ok in goals.items():
        print(f"goal {goal}: {'met' if ok else 'missed'}")
    print(f"load average before {' / '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' / '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    doc = report.document("latency", "bench.inference_compare", argv) | {
        "settings": {"url": url, "started_daemon": daemon is not None, "requests": args.requests, "warmup": WARMUP,
                     "threads": torch.get_num_threads(), "omp_wait_policy": st.omp_wait_policy},
        "load_before": load_before, "load_after": load_after,
        "summary": s, "goals": goals,
        "runs_ms": {k: [round(float(x), 4) for x in v] for k, v in runs.items()},
    }
    stamp = doc["created_utc"].replace(":", "").replace("-", "").replace("+0000", "Z")
    out = args.out or report.RESULTS_DIR / f"{stamp}-latency.json"
    report.write_json(doc, out)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
