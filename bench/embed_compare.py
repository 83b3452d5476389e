"""Embeddings end to end: fleet over HTTP/MessagePack against sentence-transformers in-process.

Measured in one run, on the same inputs (the bench corpus, requests of 32
inputs, the same windows for every side), interleaved in rounds so drifts of
the box fall on every side alike:
  (a) sentence-transformers `encode` in-process, default settings, fp32;
  (b) the same with bf16 weights;
  (c) fleet over HTTP/MessagePack, closed loop, with clients doubled until
      throughput stops growing (the most tokens/s any client count reached);
and the latency one short single-input request adds over encoding it
in-process (p50, p95, p99; `bench.inference_compare.alternate`: one fleet
request then one `encode` of the same text in this process, fp32 with the
workers' OpenMP policy, in turn, so the box's drifts fall on both alike), with
the machine's load average (os.getloadavg) at the start and end of every round.
Goals: (c) >= 2.0 x (a), (c) >= 0.9 x (b), added p50 <= 1 ms, added p99 <= 3 ms.
Ratios and the added latency are taken within each round, then their median
across rounds.

Tokens are counted with the model's tokenizer up front (bench/tokens.py).

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench embed-compare [--url URL | --start] [--rounds 3]
      [--duration 8] [--latency-requests 300] [--out bench/results/embed-compare-<time>.json]
`--start` runs `fleetctl serve` itself on a free loopback port with a temporary
FLEET_HOME and stops it (by PID) at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from fleet.bench import corpus, inference_compare, report
from fleet.bench.daemon import daemon_from_args
from fleet.bench.knee import CLOSED
from fleet.bench.loadgen import Generator, Merged, Setup, StepPlan
from fleet.bench.sampler import Sampler
from fleet.bench.st_local import LocalST, STSetup
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import DAEMON, DEVICE, DURATION, OUT, ROUNDS, bench, option

MODEL = "all-minilm-l6-v2"
BATCH = 32
GOAL_VS_FP32 = 2.0
GOAL_VS_BF16 = 0.9
GOAL_ADDED_P50_MS = 1.0
GOAL_ADDED_P99_MS = 3.0
#: Short-request latency: the shortest corpus texts, one per request.
SHORT_TEXTS = 32


def fleet_state(url: str) -> tuple[int | None, str]:
    """The daemon's PID and the dtype its workers hold the model in (from /v1/ps)."""
    ps = httpx.get(url + "/v1/ps", timeout=10).json()
    dtype = "unknown"
    for w in ps.get("workers", []):
        m = w.get("models", {}).get(MODEL)
        if m:
            dtype = m.get("dtype", dtype)
    return ps.get("pid"), dtype


def stats(m: Merged) -> dict:
    lat = m.latencies_ms
    return {
        "requests": m.ok, "errors": m.errors, "elapsed_s": m.elapsed_s,
        "rps": m.ok / m.elapsed_s, "tokens_per_s": m.tokens_ok / m.elapsed_s,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p95_ms": float(np.percentile(lat, 95)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "server_tokens": m.server_tokens, "tokens": m.tokens_ok, "generator_cpu_s": m.cpu_s,
    }


def saturate(gen: Generator, duration_s: float, index: int, max_clients: int = 32) -> tuple[dict, list[dict]]:
    """Double the clients until tokens/s grows by less than 5 %; the best step wins."""
    steps: list[dict] = []
    clients = 1
    while clients <= max_clients:
        s = stats(gen.run(StepPlan(index=index, mode=CLOSED, offered=clients, duration_s=duration_s)))
        s["clients"] = clients
        steps.append(s)
        if len(steps) >= 2 and s["tokens_per_s"] < 1.05 * steps[-2]["tokens_per_s"]:
            break
        clients *= 2
    return max(steps, key=lambda s: s["tokens_per_s"]), steps


@bench("embed-compare", DAEMON, ROUNDS, DURATION, OUT, DEVICE,
       option("--latency-requests", type=int, default=300,
              help="alternating pairs (fleet request, in-process encode) per round for the added latency"))
def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)
    err = Console(stderr=True)

    model_dir = package_model_dir()
    texts = corpus.load()
    counter = TokenCounter(model_dir)
    lengths = counter.count(texts)
    short_idx = sorted(range(len(texts)), key=lambda i: lengths[i])[:SHORT_TEXTS]
    short_texts = [texts[i] for i in short_idx]
    short_lengths = [lengths[i] for i in short_idx]

    daemon, url = daemon_from_args(args)
    opened: list = []
    try:
        pid, fleet_dtype = fleet_state(url)
        err.print(f"fleet at {url} (pid {pid}) serves {MODEL} as {fleet_dtype}")
        st_fp32 = LocalST(STSetup(str(model_dir), "fp32", args.device, texts, lengths, BATCH))
        opened.append(st_fp32)
        st_bf16 = LocalST(STSetup(str(model_dir), "bf16", args.device, texts, lengths, BATCH))
        opened.append(st_bf16)
        # The short-request baseline: the model in this process as a user gets it, the
        # faster dtype on this CPU with torch's defaults (bench.inference_compare).
        short_dtype = inference_compare.fast_dtype()
        st_short = inference_compare.load_local(short_dtype)
        gen = Generator(Setup(kind="fleet", task="embed", url=url, model=MODEL, texts=texts, lengths=lengths,
                              batch=BATCH))
        opened.append(gen)

        rounds = []
        with Sampler() as sampler:
            sampler.track("fleet", [pid] if pid else [])
            sampler.track("st", [st_fp32.proc.pid, st_bf16.proc.pid])
            sampler.track("generator", gen.pids)
            one = StepPlan(index=0, mode=CLOSED, offered=1, duration_s=args.duration)
            # Warm every side once (first requests build caches), untimed.
            for side in (st_fp32, st_bf16, gen):
                side.run(StepPlan(index=0, mode=CLOSED, offered=1, duration_s=1.0))
            for r in range(args.rounds):
                err.print(f"round {r + 1}/{args.rounds}")
                t0, load_start = time.time(), os.getloadavg()
                a = stats(st_fp32.run(one))
                b = stats(st_bf16.run(one))
                c, c_steps = saturate(gen, args.duration, r)
                pairs = inference_compare.summarize(
                    inference_compare.alternate(url, st_short, short_texts, args.latency_requests, warmup=10))
                short_fleet = {f"p{q}_ms": pairs[f"rtt_p{q}_ms"] for q in (50, 95, 99)}
                short_local = {f"p{q}_ms": pairs[f"local_p{q}_ms"] for q in (50, 95, 99)}
                rounds.append({"a_st_fp32": a, "b_st_bf16": b, "c_fleet": c, "c_steps": c_steps,
                               "short_fleet": short_fleet, "short_local": short_local, "short_pairs": pairs,
                               "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                               "box": sampler.window(t0, time.time())})
    finally:
        for side in opened:
            side.close()
        if daemon:
            daemon.stop()

    def med(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in rounds)

    a_tps, b_tps, c_tps = med("a_st_fp32", "tokens_per_s"), med("b_st_bf16", "tokens_per_s"), med("c_fleet", "tokens_per_s")
    # Ratios are taken within each round (the sides of one round share the box's
    # state at that time), then their median: on a shared box this is steadier
    # than the ratio of medians.
    c_over_a = statistics.median(r["c_fleet"]["tokens_per_s"] / r["a_st_fp32"]["tokens_per_s"] for r in rounds)
    c_over_b = statistics.median(r["c_fleet"]["tokens_per_s"] / r["b_st_bf16"]["tokens_per_s"] for r in rounds)
    added_p50 = statistics.median(r["short_fleet"]["p50_ms"] - r["short_local"]["p50_ms"] for r in rounds)
    added_p95 = statistics.median(r["short_fleet"]["p95_ms"] - r["short_local"]["p95_ms"] for r in rounds)
    added_p99 = statistics.median(r["short_fleet"]["p99_ms"] - r["short_local"]["p99_ms"] for r in rounds)
    path_p50 = statistics.median(r["short_pairs"]["path_p50_ms"] for r in rounds)
    path_p99 = statistics.median(r["short_pairs"]["path_p99_ms"] for r in rounds)
    loads = [x for r in rounds for x in (r["load_avg_start"][0], r["load_avg_end"][0])]
    summary = {
        "a_st_fp32_tokens_per_s": a_tps, "b_st_bf16_tokens_per_s": b_tps, "c_fleet_tokens_per_s": c_tps,
        "c_over_a": c_over_a, "c_over_b": c_over_b,
        "c_clients": statistics.median(r["c_fleet"]["clients"] for r in rounds),
        "fleet_dtype": fleet_dtype, "short_baseline_dtype": short_dtype,
        "short_fleet_p50_ms": med("short_fleet", "p50_ms"), "short_fleet_p95_ms": med("short_fleet", "p95_ms"),
        "short_local_p50_ms": med("short_local", "p50_ms"), "short_local_p95_ms": med("short_local", "p95_ms"),
        "short_fleet_p99_ms": med("short_fleet", "p99_ms"), "short_local_p99_ms": med("short_local", "p99_ms"),
        "added_p50_ms": added_p50, "added_p95_ms": added_p95, "added_p99_ms": added_p99,
        "path_p50_ms": path_p50, "path_p99_ms": path_p99,
        "load_avg_1m_min": min(loads), "load_avg_1m_max": max(loads),
        "goals": {
            "c_ge_2x_a": c_over_a >= GOAL_VS_FP32,
            "c_ge_0.9x_b": c_over_b >= GOAL_VS_BF16,
            "added_p50_le_1ms": added_p50 <= GOAL_ADDED_P50_MS,
            "added_p99_le_3ms": added_p99 <= GOAL_ADDED_P99_MS,
        },
    }
    doc = {
        **report.document("embed_compare", "fleet.bench", args.argv),
        "corpus": report.corpus_doc(corpus.CORPUS_PATH, lengths),
        "tokens": "counted up front with the model's tokenizer.json (special tokens included)",
        "settings": {"url": url, "started_daemon": bool(daemon), "rounds": args.rounds, "duration_s": args.duration,
                     "batch": BATCH, "short_texts": SHORT_TEXTS, "device": args.device},
        "summary": summary, "rounds": rounds,
    }
    out = report.save(doc, args.out, "embed-compare")

    t = Table(title=f"embeddings end to end ({args.rounds} rounds x {args.duration:g} s, median), {BATCH} inputs/request",
              title_justify="left")
    for col in ("side", "tokens/s", "req/s", "p50 ms", "vs (a), per round", "note"):
        t.add_column(col, justify="left" if col in ("side", "note") else "right")
    for key, label, note in (("a_st_fp32", "(a) sentence-transformers fp32", "in-process encode, defaults"),
                             ("b_st_bf16", "(b) sentence-transformers bf16", "in-process encode"),
                             ("c_fleet", "(c) fleet HTTP/msgpack", f"{summary['c_clients']:.0f} clients, served as {fleet_dtype}")):
        vs_a = statistics.median(r[key]["tokens_per_s"] / r["a_st_fp32"]["tokens_per_s"] for r in rounds)
        t.add_row(label, f"{med(key, 'tokens_per_s'):,.0f}", f"{med(key, 'rps'):.2f}", f"{med(key, 'p50_ms'):.1f}",
                  f"{vs_a:.2f}x", note)
    console.print(t)
    lat = Table(title=f"one short request (1 input, {min(short_lengths)}-{max(short_lengths)} tokens), sequential",
                title_justify="left")
    for col in ("", "p50 ms", "p95 ms", "p99 ms"):
        lat.add_column(col, justify="right" if col else "left")
    for label, key in (("fleet HTTP/msgpack", "short_fleet"), (f"in-process encode ({short_dtype})", "short_local")):
        lat.add_row(label, *(f"{summary[f'{key}_p{q}_ms']:.2f}" for q in (50, 95, 99)))
    lat.add_row("added by serving", f"{added_p50:.2f}", f"{added_p95:.2f}", f"{added_p99:.2f}")
    lat.add_row("serving path (round trip - worker inference)", f"{path_p50:.2f}", "",
                f"{path_p99:.2f}")
    console.print(lat)
    console.print(f"load average (1 min) during the rounds: {min(loads):.2f} .. {max(loads):.2f} "
                  f"on {os.cpu_count()} CPUs")
    console.print(f"(c)/(a) per round: {c_over_a:.2f}x (goal >= {GOAL_VS_FP32:g}), "
                  f"(c)/(b) per round: {c_over_b:.2f}x (goal >= {GOAL_VS_BF16:g})")
    for goal, ok in summary["goals"].items():
        console.print(f"goal {goal}: {'[green]met[/]' if ok else '[red]missed[/]'}")
    err.print(f"results: {out}")
    return 0
