"""Images, sparse and multi-vector embeddings through one daemon, in one run.

Measured over HTTP/MessagePack against a `fleetctl serve` this script starts
(free loopback port, throwaway FLEET_HOME, one worker; stopped by PID at the end):
  - dense and per-token (`output: "tokens"`) vectors from all-MiniLM-L6-v2,
  - sparse (`output: "sparse"`) from a SPLADE built on the same encoder: the
    MiniLM weights loaded as `BertForMaskedLM` (the MLM head's transform and
    bias are untrained, the decoder is tied to the word embeddings), so dense
    vs sparse compares the same 6-layer encoder with and without the 30522-term
    head;
  - images/s from a CLIP with random weights built from a config (`--clip`:
    `small` = ViT-S/32-like vision tower at 224 px, 6 layers, width 384; `tiny` =
    2 layers, width 32, 32 px), fed 640x480 JPEGs made with Pillow (decoding and
    preprocessing in the worker are part of what is measured).
Each kind runs closed-loop for `--duration` seconds with `--clients` concurrent
clients, kinds interleaved over `--rounds` rounds; tokens/s is the server's
`usage.input_tokens` per second, the median over rounds is reported.

Usage (the measured rounds take /tmp/fleet-bench.lock themselves, see --lock):
  python -m fleet.bench embed-kinds [--rounds 3] [--duration 8] [--clients 4]
      [--clip small|tiny] [--out bench/results/embed-kinds.json]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import io
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
import numpy as np

from fleet.bench.corpus import CORPUS_PATH
from fleet.bench.daemon import LocalDaemon
from fleet.bench.tokens import package_model_dir
from fleet.bench.cli import CLIENTS, DURATION, LOCK, OUT, ROUNDS, bench, option

MSGPACK = "application/msgpack"
DENSE = "all-minilm-l6-v2"
SPLADE = "splade-minilm"
CLIP = "clip-bench"
TEXTS_PER_REQUEST = 32
IMAGES_PER_REQUEST = 8


def build_splade(folder: Path) -> Path:
    from transformers import AutoTokenizer, BertForMaskedLM

    src = package_model_dir()
    BertForMaskedLM.from_pretrained(src).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return folder


def build_clip(folder: Path, size: str) -> Path:
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = AutoTokenizer.from_pretrained(package_model_dir())
    if size == "small":
        vision = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                      image_size=224, patch_size=32)
        text = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6)
        pixels, projection = 224, 256
    else:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=32, patch_size=8)
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        pixels, projection = 32, 16
    torch.manual_seed(0)
    text_config = dict(vocab_size=tok.vocab_size, max_position_embeddings=77, bos_token_id=tok.cls_token_id,
                       eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id, **text)
    cfg = CLIPConfig(text_config=text_config, vision_config=vision, projection_dim=projection)
    CLIPModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": pixels}, crop_size={"height": pixels, "width": pixels})
    processor.save_pretrained(folder)
    return folder


def make_jpegs(n: int) -> list[bytes]:
    """640x480 photo-like JPEGs: smooth colour fields plus mild noise (seeded)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:480, 0:640].astype(np.float32)
    out = []
    for k in range(n):
        base = np.stack([128 + 100 * np.sin(x / (40 + 7 * k)), 128 + 100 * np.cos(y / (30 + 5 * k)),
                         (x + y + 31 * k) % 256], axis=-1)
        img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def pull(home: str, folder: Path, name: str, runtime: str) -> None:
    env = {**os.environ, "FLEET_HOME": home, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", name,
                           "--task", "embed", "--runtime", runtime], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr)


async def closed_loop(url: str, bodies: list[bytes], clients: int, duration_s: float, per_request: int) -> dict:
    """`clients` callers, each sending the next body as soon as its last answer came."""
    done = {"requests": 0, "errors": 0, "tokens": 0, "items": 0}
    decode = msgspec.msgpack.Decoder()
    stop_at = time.perf_counter() + duration_s

    async def caller(http: httpx.AsyncClient, k: int) -> None:
        while time.perf_counter() < stop_at:
            resp = await http.post("/v1/embed", content=bodies[k % len(bodies)], headers={"Content-Type": MSGPACK})
            k += clients
            if resp.status_code != 200:
                done["errors"] += 1
                continue
            done["requests"] += 1
            done["items"] += per_request
            done["tokens"] += decode.decode(resp.content)["usage"]["input_tokens"]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(caller(http, k) for k in range(clients)))
    elapsed = time.perf_counter() - t0
    return {**done, "elapsed_s": elapsed, "items_per_s": done["items"] / elapsed,
            "tokens_per_s": done["tokens"] / elapsed}


@bench("embed-kinds", ROUNDS, DURATION, CLIENTS.but(default=4), option("--clip", choices=("small", "tiny"),
                                                                     default="small"), OUT, LOCK)
def main(args: argparse.Namespace) -> int:

    work = Path(tempfile.mkdtemp(prefix="fleet-bench-kinds-"))
    home = str(work / "home")
    Path(home).mkdir()
    pull(home, build_splade(work / "splade"), SPLADE, "splade")
    pull(home, build_clip(work / "clip", args.clip), CLIP, "clip")
    texts = [t for t in CORPUS_PATH.read_text().splitlines() if t]
    jpegs = make_jpegs(16)
    enc = msgspec.msgpack.encode

    def text_bodies(model: str, output: str) -> list[bytes]:
        return [enc({"model": model, "inputs": texts[i : i + TEXTS_PER_REQUEST], "output": output})
                for i in range(0, len(texts) - TEXTS_PER_REQUEST, TEXTS_PER_REQUEST)]

    kinds = {
        "dense (MiniLM)": (text_bodies(DENSE, "dense"), TEXTS_PER_REQUEST),
        "tokens (MiniLM)": (text_bodies(DENSE, "tokens"), TEXTS_PER_REQUEST),
        "sparse (MiniLM SPLADE)": (text_bodies(SPLADE, "sparse"), TEXTS_PER_REQUEST),
        f"images (CLIP {args.clip}, 640x480 JPEG)": (
            [enc({"model": CLIP, "inputs": [{"image": jpegs[(i + j) % len(jpegs)]} for j in range(IMAGES_PER_REQUEST)]})
             for i in range(len(jpegs))], IMAGES_PER_REQUEST),
    }
    daemon = LocalDaemon(home, args=("--workers", "1"))
    try:
        for kind, (bodies, _) in kinds.items():  # warm-up: loads every model, pays first shapes
            for body in bodies[:2]:
                resp = httpx.post(daemon.url + "/v1/embed", content=body, headers={"Content-Type": MSGPACK},
                                  timeout=600)
                if resp.status_code != 200:
                    raise RuntimeError(f"warm-up of {kind} failed: {resp.status_code} {resp.content[:300]!r}")
        ps = httpx.get(daemon.url + "/v1/ps", timeout=10).json()
        dtypes = {name: m["dtype"] for w in ps["workers"] for name, m in w["models"].items()}
        rounds: dict[str, list[dict]] = {k: [] for k in kinds}
        lock = open(args.lock, "a") if args.lock else None
        if lock is not None:
            print(f"waiting for {args.lock} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the process exits
        for r in range(args.rounds):
            for kind, (bodies, per) in kinds.items():
                res = asyncio.run(closed_loop(daemon.url, bodies, args.clients, args.duration, per))
                rounds[kind].append(res)
                print(f"round {r + 1} {kind}: {res['items_per_s']:.1f} items/s, {res['tokens_per_s']:.0f} tokens/s, "
                      f"{res['errors']} errors", flush=True)
    finally:
        daemon.stop()
    summary = {k: {"items_per_s": statistics.median(x["items_per_s"] for x in v),
                   "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                   "errors": sum(x["errors"] for x in v)} for k, v in rounds.items()}
    print("\n| kind | items/s | tokens/s | errors |\n| --- | --- | --- | --- |")
    for k, s in summary.items():
        print(f"| {k} | {s['items_per_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['errors']} |")
    print(f"served dtypes: {dtypes}; load average {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "dtypes": dtypes,
                                        "summary": summary, "rounds": rounds, "loadavg": os.getloadavg()}, indent=2))
    return 0
