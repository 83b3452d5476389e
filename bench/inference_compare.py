"""The worker's inference for one item vs the same model called in-process.

Alternates, one at a time: a single-text embed request to fleet (its
`X-Inference-Ms`: the worker's `run_batch`, tokenize to result) and
`SentenceTransformer.encode` of the same text in this process, fp32 (what fleet
serves on a CPU without native bf16), with torch's OpenMP set as fleet's workers
set it (OMP_WAIT_POLICY=PASSIVE, runtimes/process.py). Alternating puts the box's
drifts on both sides alike. Goal: worker p50 within 5 % of in-process.

Usage: flock /tmp/fleet-bench.lock python -m bench.inference_compare [--requests 240]
(starts `fleetctl serve` on a free loopback port with a temporary FLEET_HOME).
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (read once, at load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import http.client  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from bench.daemon import LocalDaemon  # noqa: E402
from bench.tokens import package_model_dir  # noqa: E402

MODEL = "all-minilm-l6-v2"
TEXTS = ["How do I reset my router password?", "Best hiking trails near Lyon", "What is a tax deduction?",
         "Fix a slow laptop"]
WARMUP = 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=240)
    args = ap.parse_args(argv)
    import torch
    from sentence_transformers import SentenceTransformer

    daemon = LocalDaemon(tempfile.mkdtemp(prefix="fleet-bench-home-"))
    try:
        st = SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True)
        st.eval()
        host, _, port = daemon.url.removeprefix("http://").partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        worker, local = [], []
        for i in range(WARMUP + args.requests):
            text = TEXTS[i % len(TEXTS)]
            conn.request("POST", "/v1/embed", body=msgspec.msgpack.encode({"model": MODEL, "inputs": [text]}),
                         headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
            resp = conn.getresponse()
            resp.read()
            t0 = time.perf_counter()
            st.encode([text])
            ms = (time.perf_counter() - t0) * 1e3
            if i >= WARMUP:
                worker.append(float(resp.headers["X-Inference-Ms"]))
                local.append(ms)
        conn.close()
    finally:
        daemon.stop()
    w, l = np.array(worker), np.array(local)
    ratio = float(np.median(w) / np.median(l))
    print(f"one item, {len(w)} alternating calls, fp32, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"worker X-Inference-Ms  p50 {np.median(w):.2f}  p90 {np.percentile(w, 90):.2f}")
    print(f"in-process encode      p50 {np.median(l):.2f}  p90 {np.percentile(l, 90):.2f}")
    print(f"worker / in-process p50: {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'missed'}); "
          f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
