"""One short request: fleet's round trip and its worker's inference against the same model in-process.

Alternates, one at a time: a single-text embed request to fleet over HTTP
(MessagePack, one keep-alive connection, a blocking client: a lone agent
waiting for each answer), then `SentenceTransformer.encode` of the same text in
this process as a user gets it: torch's defaults (OpenMP threads spin when
idle) and the faster dtype (bf16 where the CPU has native bf16,
runtimes.device.fast_dtypes; else fp32): the reference. Then the same call in a
child process in fp32 with OpenMP set as fleet's workers set it
(OMP_WAIT_POLICY=PASSIVE, runtimes/process.py): the second line, what the
worker's forward would cost with nothing done about the passive policy.
Alternating puts the box's drifts on all sides alike; after each in-process
call the bench idles GAP_MS so the reference's spinning OpenMP threads stop
before fleet's request (they would otherwise take a core from the worker).

Reported, with the machine's load average:
- the worker's inference for one item (`X-Inference-Ms`: its `run_batch`,
  tokenize to result) against the reference; goal p50 within 5 %;
- the latency serving adds: the round trip's percentile minus the reference's
  (goals p50 <= 1 ms, p99 <= 3 ms), and per request the round trip minus
  the worker's own inference (the serving path alone: HTTP, queue, wake-ups,
  reply; the model's noise, tens of ms at the tail here, drops out).

Usage: flock /tmp/fleet-bench.lock python -m fleet.bench inference-compare [--requests 400] [--url URL]
       [--out bench/results/latency-<time>.json]
(without --url: starts `fleetctl serve` on a free loopback port with a temporary FLEET_HOME).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from fleet.bench import report
from fleet.bench.daemon import LocalDaemon
from fleet.bench.httpclient import BlockingConn, Endpoint, build_request
from fleet.bench.tokens import package_model_dir
from fleet.bench.cli import OUT, REQUESTS, URL, bench, option

MODEL = "all-minilm-l6-v2"
TEXTS = ["How do I reset my router password?", "Best hiking trails near Lyon", "What is a tax deduction?",
         "Fix a slow laptop"]
WARMUP = 20
#: Idle after each in-process call: libgomp's default spin (300 000 pauses, a few ms)
#: ends before the next measurement starts.
GAP_MS = 15.0
GOAL_RATIO, GOAL_ADDED_P50_MS, GOAL_ADDED_P99_MS = 1.05, 1.0, 3.0


def load_local(dtype: str = "float32"):
    """sentence-transformers' model, on the CPU in `dtype`, with whatever OpenMP
    policy this process's torch was loaded with."""
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True)
    st.eval()
    return st.to(getattr(torch, dtype)) if dtype != "float32" else st


def fast_dtype() -> str:
    """The dtype a user picks on this CPU: the faster one (runtimes.device.fast_dtypes)."""
    from fleet.runtimes.device import fast_dtypes

    return next(iter(fast_dtypes("cpu")), "float32")


def child_main(dtype: str) -> int:
    """`--child DTYPE`: one encode per text index read from stdin, its ms written back."""
    st = load_local(dtype)
    sys.stdout.write("ready\n")  # loading takes seconds: the parent waits before its first request
    sys.stdout.flush()
    for line in sys.stdin:
        text = TEXTS[int(line)]
        t0 = time.perf_counter()
        st.encode([text])
        sys.stdout.write(f"{(time.perf_counter() - t0) * 1e3:.4f}\n")
        sys.stdout.flush()
    return 0


class Passive:
    """The second line: fp32 in a child process started with OMP_WAIT_POLICY=PASSIVE.

    Ready when constructed: the child's load (seconds on a busy box) must not fall
    between two requests of `alternate`, where it would outlast the daemon's
    keep-alive timeout and the next request would find its connection closed.
    """

    def __init__(self) -> None:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fleet.bench", "inference-compare", "--child", "float32"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if (line := self.proc.stdout.readline()) != "ready\n":
            self.proc.kill()
            raise RuntimeError(f"the passive child did not start: {line!r}")

    def encode(self, k: int) -> float:
        self.proc.stdin.write(f"{k}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alternate(url: str, st, texts: list[str], requests: int, *, passive: Passive | None = None,
              warmup: int = WARMUP) -> dict[str, np.ndarray]:
    """`requests` rounds (after `warmup`): one fleet request, then `st.encode` of the same
    text, then the passive child's. Arrays in ms: rtt (client round trip), inference (the
    worker's X-Inference-Ms), local (in-process reference), passive (the child's encode)."""
    ep = Endpoint(url)
    prepared = [build_request(ep, "/v1/embed", msgspec.msgpack.encode({"model": MODEL, "inputs": [t]}),
                              "application/msgpack", "application/msgpack") for t in texts]
    conn = BlockingConn(ep)
    rtt, inference, local, passive_ms = [], [], [], []
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
            time.sleep(GAP_MS / 1e3)
            p = passive.encode(k) if passive is not None else float("nan")
            if i >= warmup:
                rtt.append((t1 - t0) * 1e3)
                inference.append(float(headers[b"x-inference-ms"]))
                local.append((t2 - t1) * 1e3)
                passive_ms.append(p)
    finally:
        conn.close()
    runs = {"rtt": np.array(rtt), "inference": np.array(inference), "local": np.array(local)}
    return runs | ({"passive": np.array(passive_ms)} if passive is not None else {})


def summarize(runs: dict[str, np.ndarray]) -> dict[str, float]:
    rtt, inference, local = runs["rtt"], runs["inference"], runs["local"]
    path = rtt - inference
    series = [("rtt", rtt), ("inference", inference), ("local", local), ("path", path)]
    if "passive" in runs:
        series.append(("passive", runs["passive"]))
    pct = {f"{name}_p{q}_ms": float(np.percentile(v, q)) for name, v in series for q in (50, 95, 99)}
    return pct | {
        "n": int(len(rtt)),
        "worker_over_local_p50": float(np.median(inference) / np.median(local)),
        "added_p50_ms": pct["rtt_p50_ms"] - pct["local_p50_ms"],
        "added_p95_ms": pct["rtt_p95_ms"] - pct["local_p95_ms"],
        "added_p99_ms": pct["rtt_p99_ms"] - pct["local_p99_ms"],
    }


@bench("inference-compare", REQUESTS.but(default=400, help="alternating rounds (default %(default)s)"), URL, OUT,
       option("--no-passive", action="store_true", help="leave out the PASSIVE fp32 second line"),
       option("--child", default=None, help=argparse.SUPPRESS))
def main(args: argparse.Namespace) -> int:
    if args.child:
        return child_main(args.child)
    dtype = fast_dtype()
    st = load_local(dtype)
    import torch

    passive = None if args.no_passive else Passive()
    load_before = os.getloadavg()
    daemon = None if args.url else LocalDaemon(tempfile.mkdtemp(prefix="fleet-bench-home-"))
    url = args.url or daemon.url  # type: ignore[union-attr]
    try:
        runs = alternate(url, st, TEXTS, args.requests, passive=passive)
    finally:
        if daemon:
            daemon.stop()
        if passive is not None:
            passive.close()
    load_after = os.getloadavg()
    s = summarize(runs)
    goals = {"worker_within_5pct": s["worker_over_local_p50"] <= GOAL_RATIO,
             "added_p50_le_1ms": s["added_p50_ms"] <= GOAL_ADDED_P50_MS,
             "added_p99_le_3ms": s["added_p99_ms"] <= GOAL_ADDED_P99_MS}

    def row(label: str, key: str) -> str:
        return f"{label:46s} {s[f'{key}_p50_ms']:8.2f} {s[f'{key}_p95_ms']:8.2f} {s[f'{key}_p99_ms']:8.2f}"

    cpu = cpu_model()
    print(f"one short request, {s['n']} alternating rounds, {torch.get_num_threads()} threads, {cpu}")
    print(f"{'ms':46s} {'p50':>8s} {'p95':>8s} {'p99':>8s}")
    print(row("fleet round trip (HTTP/msgpack)", "rtt"))
    print(row(f"in-process encode {dtype}, torch defaults", "local"))
    if "passive_p50_ms" in s:
        print(row("in-process encode float32, PASSIVE", "passive"))
    print(f"{'added by serving (rtt - reference)':46s} {s['added_p50_ms']:8.2f} {s['added_p95_ms']:8.2f} "
          f"{s['added_p99_ms']:8.2f}")
    print(row("worker X-Inference-Ms", "inference"))
    print(row("serving path (rtt - inference)", "path"))
    print(f"worker / in-process p50: {s['worker_over_local_p50']:.3f}")
    for goal, ok in goals.items():
        print(f"goal {goal}: {'met' if ok else 'missed'}")
    print(f"load average before {' / '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' / '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    doc = report.document("latency", "fleet.bench", args.argv) | {
        "settings": {"url": url, "started_daemon": daemon is not None, "requests": args.requests, "warmup": WARMUP,
                     "threads": torch.get_num_threads(), "reference_dtype": dtype,
                     "reference_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                     "second_line": None if passive is None else "float32, OMP_WAIT_POLICY=PASSIVE, child process",
                     "gap_ms": GAP_MS, "cpu": cpu},
        "load_before": load_before, "load_after": load_after,
        "summary": s, "goals": goals,
        "runs_ms": {k: [round(float(x), 4) for x in v] for k, v in runs.items()},
    }
    out = report.save(doc, args.out, "latency")
    print(f"results: {out}")
    return 0


def cpu_model() -> str:
    """The CPU's model name and whether it has native bf16 (figures are per CPU)."""
    from fleet.runtimes.device import cpu_flags

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    bf16 = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())
    return f"{name} ({', '.join(bf16) or 'no native bf16'})"
