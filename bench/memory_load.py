"""Model load timings (issue: memory manager), against a real daemon.

    flock /tmp/fleet-bench.lock python -m fleet.bench memory-load [--repeat 5] [--json]

1. In-process phases of one load of all-minilm-l6-v2 (imports already done):
   store open + sha256 verify, SentenceTransformer(), dtype check, warm-up.
2. Daemon, one CPU worker, no preload: `POST /v1/models/M/unload` then
   `/load` (cold load from the store with the OS cache warm and the libraries
   imported), then the first answer.
3. Pressure: two float32 copies of MiniLM under two names (catalog overlay:
   fixed size, no dtype check) and a budget that holds one; each request for
   the absent one evicts the other and loads it: time from request to answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from fleet.bench.daemon import admin_headers
from fleet.bench.cli import JSON, bench, option

MODEL = "all-minilm-l6-v2"
TWINS = ("minilm-fp32-a", "minilm-fp32-b")


def phases(home: Path) -> dict[str, float]:
    import torch  # noqa: F401  (imports are not part of a load)
    from sentence_transformers import SentenceTransformer

    from fleet.config import load_settings
    from fleet.runtimes.resolve import store_resolver
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    settings = load_settings(home=str(home))
    resolve = store_resolver(settings)
    resolve(MODEL)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    spec = resolve(MODEL)
    out["resolve_verify_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    SentenceTransformer(str(spec.path), device="cpu", local_files_only=True)
    out["st_construct_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    adapter = SentenceTransformerEmbedder(spec, "cpu")
    adapter.load()
    out["adapter_load_total_ms"] = (time.perf_counter() - t0) * 1e3
    out["adapter_dtype"] = adapter.dtype  # type: ignore[assignment]
    out["measured_bytes"] = adapter.footprint_bytes()
    return out


def post(url: str, path: str) -> dict:
    r = httpx.post(url + path, headers=admin_headers(url), timeout=300)  # load, unload: the operator's
    r.raise_for_status()
    return r.json()


def embed_ms(url: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/embed", content=msgspec.msgpack.encode({"model": model, "inputs": ["first answer"]}),
                   headers={"Content-Type": "application/msgpack"}, timeout=300)
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1e3


@bench("memory-load", option("--repeat", type=int, default=5, help="load cycles and swaps (default %(default)s)"),
       JSON)
def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fleet.runtimes.footprint import estimate_footprint
    from tests.conftest import default_model_dir, start_daemon

    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "FLEET_HOME": str(home)}
        home.mkdir(parents=True)
        (home / "models.toml").write_text("".join(
            f'[models."{name}"]\nsource = "path:{default_model_dir()}"\ntask = "embed"\n'
            f'runtime = "sentence-transformers"\nprofile = {{ dtype = "float32" }}\n\n' for name in TWINS))
        for target in (MODEL, *TWINS):
            subprocess.run([sys.executable, "-m", "fleetctl", "pull", target], env=env, check=True, capture_output=True)
        result["phases"] = phases(home)
        print(json.dumps({"phases": result["phases"]}), flush=True)
        fp = estimate_footprint(home / "models" / TWINS[0], "sentence-transformers", dtype="float32")
        # 2. Explicit unload/load cycles, budget for both.
        d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",", "FLEET_DEVICE": "cpu", "FLEET_WORKERS": "1"})
        try:
            post(d.url, f"/v1/models/{MODEL}/load")  # imports + OS cache warm
            embed_ms(d.url, MODEL)
            loads, firsts, totals = [], [], []
            for _ in range(args.repeat):
                post(d.url, f"/v1/models/{MODEL}/unload")
                t0 = time.perf_counter()
                done = post(d.url, f"/v1/models/{MODEL}/load")["results"][0]
                first = embed_ms(d.url, MODEL)
                totals.append((time.perf_counter() - t0) * 1e3)
                loads.append(done["load_ms"])
                firsts.append(first)
            result["cold_load"] = {"worker_load_ms": loads, "first_answer_ms": firsts, "unload_to_answer_ms": totals,
                                   "median_total_ms": statistics.median(totals)}
            print(json.dumps({"cold_load": result["cold_load"]}), flush=True)
        finally:
            d.stop()
        # 3. Pressure: room for one.
        budget = fp.activation_bytes + int(1.5 * fp.weights_bytes)
        d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",", "FLEET_DEVICE": "cpu", "FLEET_WORKERS": "1",
                                          "FLEET_CPU_BUDGET_BYTES": str(budget)})
        try:
            embed_ms(d.url, TWINS[0])
            swaps = [embed_ms(d.url, TWINS[(i + 1) % 2]) for i in range(args.repeat)]
            log = d.log()
            result["evict_and_load"] = {"request_to_answer_ms": swaps, "median_ms": statistics.median(swaps),
                                        "evictions_logged": log.count("evicting "), "budget_bytes": budget}
        finally:
            d.stop()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(key, value)
