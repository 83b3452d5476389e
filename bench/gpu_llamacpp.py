"""The llama.cpp runtime on one device, beside llama.cpp's own `Llama` on the same file:
offload, greedy parity and output tokens/s (issue 34; run on a GPU by bench/gpu_llamacpp.sh).

In one run, on `--device` (cpu or cuda:K):
  1. a random Llama of `--shape` (tiny: bench/models.py's 2 layers; smollm2: SmolLM2-135M's
     sizes, 30 layers, ~106M parameters, with this bench's 320-token vocabulary) whose LM head
     never picks EOS (every answer runs to max_tokens), pulled through fleet's own path
     (`pull_model ... --quantize`, fleet/gguf_convert.py) as one GGUF;
  2. `fleetctl serve --device DEVICE --workers 1` with it preloaded: `/v1/ps` says whether
     the model is offloaded (engine `gpu`, `gpu_layers` = layers + output, and `device_bytes`,
     what the load took from the GPU's free memory, at least the KV cache) and its bytes;
  3. greedy text over HTTP equals `Llama(n_gpu_layers=-1 on a GPU, else 0)`'s in this process
     on the same file and prompts (flash attention on, as the runtime's "auto" picks);
  4. output tokens/s: `--streams` concurrent requests of `--max-tokens` each (median of
     `--rounds`), and `Llama` alone (one sequence at a time: its API does not batch).
Exits 1 when the text differs, or on a GPU when the model is not offloaded.

Usage (the llama.cpp extra importable; on a GPU, a build with CUDA: bench/gpu_llamacpp.sh):
  PYTHONPATH=.venv/llamacpp python -m fleet.bench gpu-llamacpp --device cpu [--shape tiny]
      [--max-tokens 64] [--streams 1,16] [--rounds 3] [--threads 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from fleet.bench import report
from fleet.bench.cli import DEVICE, OUT, ROUNDS, THREADS, bench, option

MODEL = "rand-llama"
PROMPTS = ["the quick brown fox", "hello world, this is", "small models serve"]
#: LlamaConfig sizes per --shape (bench/models.build_llama's defaults for tiny).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "max_position_embeddings": 2048},
}
EOS_ID = 1  # bench/models.build_llama's


def build_model(root: Path, shape: str, quantize: str) -> tuple[Path, Path]:
    """(the store's home, the GGUF file): a random Llama that never ends, pulled as fleet pulls."""
    from safetensors.torch import load_file, save_file

    from fleet.bench.models import build_llama
    from fleet.pull import pull_model
    from fleet.store import Store

    folder = build_llama(root / "llama", **SHAPES[shape])
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][EOS_ID] = 0.0  # EOS's logit 0, far below the best: answers run to max_tokens
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    home = root / "home"
    store = Store(home / "models")
    pull_model(store, f"path:{folder}", name=MODEL, quantize=quantize)
    _, held = store.open(MODEL)
    (gguf,) = sorted(held.glob("*.gguf"))
    return home, gguf


def offload_of(url: str) -> dict[str, Any]:
    """What `/v1/ps` shows of the model: its engine facts and bytes."""
    ps = httpx.get(f"{url}/v1/ps", timeout=30).json()
    held = [m for w in ps.get("workers", []) for name, m in w.get("models", {}).items() if name == MODEL]
    if not held:
        raise SystemExit(f"{MODEL} is not resident: {ps}")
    engine = held[0].get("engine") or {}
    return {"bytes": held[0].get("bytes"), "dtype": held[0].get("dtype"), "device": ps["workers"][0].get("device"),
            **{k: engine.get(k) for k in ("engine", "gpu", "gpu_layers", "threads", "threads_ms", "threads_probe",
                                          "weights_bytes", "kv_bytes", "device_bytes")}}


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=600)
    r.raise_for_status()
    return r.json()


def fleet_text(url: str, prompt: str, max_tokens: int) -> str:
    return complete(url, prompt, max_tokens)["choices"][0]["text"]


def llama_text(llm: Any, prompt: str, max_tokens: int) -> str:
    """`Llama`'s greedy answer (its `generate` at temperature 0, as `create_completion`
    samples) decoded as fleet decodes: a random model's tokens split UTF-8 characters,
    which fleet shows as U+FFFD where `create_completion`'s text drops them."""
    llm.reset()
    ids = []
    for token in llm.generate(llm.tokenize(prompt.encode()), temp=0.0):
        ids.append(token)
        if len(ids) == max_tokens:
            break
    return llm.detokenize(ids).decode("utf-8", "replace")


def daemon_round(url: str, streams: int, max_tokens: int) -> dict:
    """`streams` requests sent together: generated tokens over the wall time from the
    first send to the last answer."""
    start = threading.Barrier(streams)
    got: list[tuple[float, float, int]] = []

    def one(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        body = complete(url, PROMPTS[i % len(PROMPTS)], max_tokens)
        got.append((t0, time.perf_counter(), body["usage"]["completion_tokens"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(got) != streams:
        raise SystemExit(f"{streams - len(got)} of {streams} requests failed (above)")
    wall = max(e for _, e, _ in got) - min(s for s, _, _ in got)
    tokens = sum(n for _, _, n in got)
    return {"output_tokens": tokens, "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 1)}


def median_round(runs: list[dict]) -> dict:
    return {**sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2], "rounds": runs}


def daemon_rate(url: str, streams: int, max_tokens: int, rounds: int) -> dict:
    """Output tokens/s of `streams` concurrent requests, the median of `rounds`."""
    return median_round([daemon_round(url, streams, max_tokens) for _ in range(rounds)])


def reference(gguf: Path, device: str, threads: int) -> Any:
    """llama.cpp's own `Llama` on the file: every layer on the worker's GPU, or none."""
    from llama_cpp import Llama
    import llama_cpp.llama_cpp as L

    from fleet.runtimes.adapters.llamacpp_offload import cuda_index

    k = cuda_index(device)
    return Llama(str(gguf), n_gpu_layers=0 if k is None else -1, split_mode=L.LLAMA_SPLIT_MODE_NONE,
                 main_gpu=-1 if k is None else k, flash_attn=True, n_ctx=0, n_threads=threads, verbose=False)


def llama_rate(llm: Any, max_tokens: int, rounds: int) -> dict:
    runs = []
    for i in range(rounds):
        llm.reset()  # no cached prefix: the daemon reuses none
        t0 = time.perf_counter()
        out = llm.create_completion(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0)
        wall = time.perf_counter() - t0
        tokens = out["usage"]["completion_tokens"]
        runs.append({"output_tokens": tokens, "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 1)})
    return median_round(runs)


def run_check(*, device: str, shape: str, quantize: str, max_tokens: int, streams: list[int], rounds: int,
              threads: int, log=lambda line: None) -> dict:
    from fleet.bench.daemon import LocalDaemon

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the runtime runs llama.cpp
    with tempfile.TemporaryDirectory(prefix="fleet-gpu-llamacpp-") as tmp:
        t0 = time.perf_counter()
        home, gguf = build_model(Path(tmp), shape, quantize)
        gguf_bytes = gguf.stat().st_size
        built_s = time.perf_counter() - t0
        log(f"model: {shape} {quantize}, {gguf_bytes / 2**20:.1f} MiB, built and pulled in {built_s:.1f} s")
        t0 = time.perf_counter()
        daemon = LocalDaemon(home, env={"FLEET_PRELOAD": MODEL, "FLEET_CPU_THREADS": str(threads)},
                             args=["--workers", "1", "--device", device])
        try:
            ready_s = time.perf_counter() - t0
            held = offload_of(daemon.url)
            layers = SHAPES[shape].get("num_hidden_layers", 2)
            # The runtime's word (its GPU, every layer and the output) and CUDA's: the load took
            # at least the KV cache from the GPU's free memory.
            offloaded = (held["gpu"] is not None and held["gpu_layers"] == layers + 1
                         and (held["device_bytes"] or 0) >= held["kv_bytes"])
            log(f"daemon ready in {ready_s:.1f} s on {device}: {held}")
            ours = [fleet_text(daemon.url, p, max_tokens) for p in PROMPTS]
            llm = reference(gguf, device, held["threads"] or threads)
            theirs = [llama_text(llm, p, max_tokens) for p in PROMPTS]
            same = [a == b for a, b in zip(ours, theirs)]
            log(f"greedy text equal to Llama's: {same}")
            rates = {}
            for s in streams:
                rates[f"fleet_{s}"] = daemon_rate(daemon.url, s, max_tokens, rounds)
                log(f"fleet, {s} stream(s): {rates[f'fleet_{s}']['output_tokens_per_s']} output tokens/s")
            rates["llama_cpp_1"] = llama_rate(llm, max_tokens, rounds)
            log(f"Llama, 1 stream: {rates['llama_cpp_1']['output_tokens_per_s']} output tokens/s")
        finally:
            code = daemon.stop()
    return {"device": device, "shape": shape, "quantize": quantize, "gguf_bytes": gguf_bytes,
            "max_tokens": max_tokens, "threads": threads, "built_s": round(built_s, 1), "ready_s": round(ready_s, 1),
            "ps": held, "offloaded": offloaded, "parity": {"same": same, "fleet": ours, "llama_cpp": theirs},
            "rates": rates, "daemon_exit": code}


@bench("gpu-llamacpp", DEVICE, option("--shape", choices=sorted(SHAPES), default="tiny"),
       option("--quantize", default="f16", help="the GGUF's type: f16 | q8_0 | q4_k_m (default %(default)s)"),
       option("--max-tokens", type=int, default=64), option("--streams", default="1,16",
                                                              help="concurrent streams, comma-separated"),
       ROUNDS, THREADS.but(default=2, help="FLEET_CPU_THREADS of the worker (and Llama's threads)"), OUT)
def main(args: argparse.Namespace) -> int:
    result = run_check(device=args.device, shape=args.shape, quantize=args.quantize, max_tokens=args.max_tokens,
                       streams=[int(s) for s in args.streams.split(",")], rounds=args.rounds, threads=args.threads,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    doc = {**report.document("gpu-llamacpp", "fleet.bench", args.argv), **result}
    path = report.save(doc, args.out, "gpu-llamacpp")
    print(f"results: {path}", file=sys.stderr)
    rates = ", ".join(f"{k} {v['output_tokens_per_s']}" for k, v in result["rates"].items())
    print(f"gpu-llamacpp {args.device}: offloaded={result['offloaded']} parity={all(result['parity']['same'])} "
          f"output tokens/s: {rates}")
    wrong = not all(result["parity"]["same"]) or (args.device.startswith("cuda") and not result["offloaded"])
    return 1 if wrong else 0
