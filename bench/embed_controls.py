"""What prompts, Matryoshka `dimensions` and compact `output_dtype`s cost per request.

Three measurements, each request variant against the plain request (no prompt,
all 384 dimensions, float32):

0. **steps** (microseconds, no model): what the variant adds outside the
   forward pass: the daemon's check (`tasks.check_embed_controls`: the prompt
   name looked up in the manifest's table) and the worker's last step
   (`runtimes.adapters.dense.finish_dense`: cut, normalise, convert, result bytes) on
   384-wide rows, median of `--reps` x 50 calls. These do not need a quiet box.
1. **worker** (in-process, the real all-MiniLM-L6-v2 in float32): `SentenceTransformerEmbedder.run_batch([request])`,
   the worker's whole call for one request (prompt resolution, tokenizing,
   forward, pooling, cut, normalise, quantize, result bytes), on one torch thread.
2. **http** (`--http`, optional): the request through a `fleetctl serve` this
   script starts (free loopback port, throwaway FLEET_HOME, one worker with one
   thread; stopped by PID at the end), MessagePack in and out, one client in a
   closed loop: adds the daemon's checks (the prompt name looked up in the
   manifest) and the smaller reply.

Variants run interleaved in a shuffled order per round, so drift on a shared
box hits them alike; the median over `--reps` rounds is reported with the
difference to `plain`. A prompt costs mostly its tokens in the forward pass
(the `query: ` prompt below is 3 tokens, the long one 11); the cut and the
conversion are numpy over the request's own rows.

Usage:
  python -m fleet.bench embed-controls [--reps 300] [--texts 1,32] [--http] [--steps-only] [--out FILE]
  python -m fleet.bench embed-controls --int8-quality
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from fleet.bench.tokens import package_model_dir
from fleet.bench.cli import OUT, bench, option

MODEL = "all-minilm-l6-v2"
PROMPTS = {"query": "query: "}
LONG_PROMPT = "Represent this sentence for searching relevant passages: "
#: name -> the request's extra fields.
VARIANTS: dict[str, dict] = {
    "plain": {},
    "prompt_name": {"prompt_name": "query"},
    "prompt (11 tokens)": {"prompt": LONG_PROMPT},
    "dimensions 128": {"dimensions": 128},
    "float16": {"output_dtype": "float16"},
    "int8": {"output_dtype": "int8"},
    "ubinary": {"output_dtype": "ubinary"},
    "prompt_name + 128 + int8": {"prompt_name": "query", "dimensions": 128, "output_dtype": "int8"},
}
SENTENCES = [
    "The cat sat on the mat.",
    "Quarterly revenue grew 12% year over year, driven by strong demand for cloud services in Europe.",
    "Reset your password from the account settings page, then sign in again on every device.",
    "Emergency rooms reported a sharp increase in respiratory infections during the first week of January.",
]


def texts_of(n: int) -> list[str]:
    return [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(n)]


def interleaved(run, reps: int, seed: int = 7) -> dict[str, list[float]]:
    """Milliseconds per call of `run(variant)`, variants shuffled per round."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for v in order:
            t0 = time.perf_counter()
            run(v)
            times[v].append((time.perf_counter() - t0) * 1e3)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    base = statistics.median(times["plain"])
    return {v: {"median_ms": round(statistics.median(t), 4), "over_plain_ms": round(statistics.median(t) - base, 4),
                "p90_ms": round(statistics.quantiles(t, n=10)[-1], 4)} for v, t in times.items()}


def steps(reps: int, n: int) -> dict[str, dict[str, float]]:
    """Microseconds per call of the daemon's check and the worker's finishing step."""
    import numpy as np

    from fleet.daemon import tasks
    from fleet.protocol import EmbedRequest
    from fleet.store import Manifest
    from fleet.runtimes.adapters.dense import finish_dense

    class Store:  # the one store call the check may make (a manifest that predates prompts)
        def path(self, name: str) -> Path:
            return package_model_dir()

    class Daemon:
        store = Store()
        manifest_ = Manifest(name=MODEL, source="pkg:x", task="embed", runtime="sentence-transformers", files=[],
                             created_at="", prompts=PROMPTS)

        def manifest(self, name: str, task: str) -> Manifest:
            return self.manifest_

    daemon = Daemon()
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(n, 384)).astype(np.float32)
    tokens = np.full(n, 12, dtype=np.int64)
    texts = texts_of(n)
    requests = {v: EmbedRequest(model=MODEL, inputs=texts, **extra) for v, extra in VARIANTS.items()}
    out: dict[str, dict[str, float]] = {}
    for v, req in requests.items():
        results: list = [None]

        def check(req: EmbedRequest = req) -> None:
            tasks.check_embed_controls(daemon, req)

        def finish(req: EmbedRequest = req, results: list = results) -> None:
            finish_dense(vectors, tokens, [req], [0], results)

        row = {}
        for label, call in (("check_us", check), ("finish_us", finish)):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(50):
                    call()
                times.append((time.perf_counter() - t0) / 50 * 1e6)
            row[label] = round(statistics.median(times), 2)
        out[v] = row
    for v in out:
        out[v]["over_plain_us"] = round(out[v]["check_us"] + out[v]["finish_us"] - out["plain"]["check_us"]
                                        - out["plain"]["finish_us"], 2)
    return out


def worker(reps: int, n: int) -> dict[str, dict[str, float]]:
    import torch

    from fleet.protocol import EmbedRequest
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    torch.set_num_threads(1)
    spec = ModelSpec(MODEL, package_model_dir(), "embed", "sentence-transformers", max_seq_len=256,
                     profile=Profile(dtype="float32"), extra={"prompts": PROMPTS, "default_prompt_name": None})
    adapter = SentenceTransformerEmbedder(spec, "cpu")
    adapter.load()
    texts = texts_of(n)
    requests = {v: EmbedRequest(model=MODEL, inputs=texts, **extra) for v, extra in VARIANTS.items()}
    for req in requests.values():  # warm every path once
        adapter.run_batch([req])
    out = summary(interleaved(lambda v: adapter.run_batch([requests[v]]), reps))
    for v, req in requests.items():
        out[v]["result_bytes"] = len(adapter.run_batch([req])[0].data)
    adapter.unload()
    return out


def http(reps: int, n: int) -> dict[str, dict[str, float]]:
    import httpx

    from fleet.bench.daemon import LocalDaemon

    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "models.toml").write_text(
            f'[models."{MODEL}"]\nprompts = {{ query = "query: " }}\n[models."{MODEL}".profile]\ndtype = "float32"\n')
        with LocalDaemon(home, env={"FLEET_CPU_THREADS": "1", "FLEET_PRELOAD": MODEL}) as d, \
                httpx.Client(base_url=d.url, timeout=60) as client:
            texts = texts_of(n)
            bodies = {v: msgspec.msgpack.encode({"model": MODEL, "inputs": texts, **extra})
                      for v, extra in VARIANTS.items()}
            headers = {"Content-Type": "application/msgpack"}

            def run(v: str) -> None:
                resp = client.post("/v1/embed", content=bodies[v], headers=headers)
                resp.raise_for_status()

            for v in VARIANTS:
                run(v)
            return summary(interleaved(run, reps))


def int8_quality(n: int = 1000) -> dict[str, float]:
    """How much the fixed int8 range [-1, 1] keeps, on corpus texts: each dequantized
    vector's cosine to its float vector, against ranges calibrated on the same
    vectors (sentence-transformers' default, which a server cannot use: a row would
    depend on its batch), and how many of each text's 10 nearest neighbours int8
    dot products keep (the first 100 texts)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util.quantization import quantize_embeddings

    from fleet.bench.corpus import CORPUS_PATH
    from fleet.vectors import RANGE_START, STEP, quantize

    texts = [t for t in Path(CORPUS_PATH).read_text().splitlines() if t.strip()][:n]
    x = SentenceTransformer(str(package_model_dir()), device="cpu").encode(texts, normalize_embeddings=True)

    def cosines(a: np.ndarray) -> np.ndarray:
        return np.sum(a * x, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(x, axis=1)

    q = quantize(x, "int8").astype(np.float32)
    fixed = cosines((q + 128.5) * STEP + RANGE_START)
    ranges = np.vstack([x.min(0), x.max(0)])
    qb = quantize_embeddings(x, precision="int8", ranges=ranges).astype(np.float32)
    calibrated = cosines((qb + 128.5) * (ranges[1] - ranges[0]) / 255 + ranges[0])
    k = min(100, len(x))
    near_f = np.argsort(-(x[:k] @ x.T), axis=1)[:, 1:11]
    near_q = np.argsort(-(q[:k] @ q.T), axis=1)[:, 1:11]
    kept = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(near_f, near_q)])
    return {"texts": len(texts), "largest_component": round(float(np.abs(x).max()), 4),
            "fixed_min_cos": round(float(fixed.min()), 5), "fixed_mean_cos": round(float(fixed.mean()), 5),
            "calibrated_min_cos": round(float(calibrated.min()), 5), "top10_kept": round(float(kept), 3)}


@bench("embed-controls", option("--reps", type=int, default=300),
       option("--texts", default="1,32", help="inputs per request, comma-separated"),
       option("--http", action="store_true", help="also through a daemon over HTTP"), OUT.but(help="the result JSON"),
       option("--steps-only", action="store_true", help="only the microsecond steps (no model)"),
       option("--int8-quality", action="store_true", help="only what the fixed int8 range keeps"))
def main(args: argparse.Namespace) -> None:
    if args.int8_quality:
        print(json.dumps(int8_quality(), indent=1))
        return
    result: dict = {"model": MODEL, "reps": args.reps, "steps": {}, "worker": {}, "http": {}}
    for n in map(int, args.texts.split(",")):
        result["steps"][n] = steps(args.reps, n)
        if args.steps_only:
            continue
        result["worker"][n] = worker(args.reps, n)
        if args.http:
            result["http"][n] = http(args.reps, n)
    for n, rows in result["steps"].items():
        print(f"\nsteps, {n} input(s) per request: daemon check + worker finish, median us (over plain)")
        for v, r in rows.items():
            print(f"  {v:28s} {r['check_us']:8.2f} + {r['finish_us']:8.2f}  ({r['over_plain_us']:+.2f})")
    for where in ("worker", "http"):
        for n, rows in result[where].items():
            print(f"\n{where}, {n} input(s) per request: median ms (over plain)")
            for v, r in rows.items():
                extra = f"  {r['result_bytes']} B" if "result_bytes" in r else ""
                print(f"  {v:28s} {r['median_ms']:8.3f}  ({r['over_plain_ms']:+.3f}){extra}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
