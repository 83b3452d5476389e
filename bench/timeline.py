"""Where one short request's time goes: a per-stage timeline, measured on the real daemon.

Sends `--requests` single-text embed requests (the shortest corpus texts, in turn),
one at a time over one keep-alive connection (a blocking client), MessagePack both ways, each with
`X-Fleet-Timeline: 1`. The daemon answers with a CLOCK_MONOTONIC stamp per stage
(daemon/timeline.py; the worker's ride in its result envelope); this client
runs on the same box and reads the same clock, so it adds its own send and
receive stamps. Printed: p50 / p90 / p99 of each stage, the round trip, the
model's own time (tokenize to vectors on the host) and what serving adds around
it, with the machine's load average before and after.

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench timeline [--url URL | --start] [--requests 300]
      [--out bench/results/timeline-<time>.json]
`--start` runs `fleetctl serve` on a free loopback port with a temporary FLEET_HOME
(the shipped defaults) and stops it (by PID) at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from fleet.bench import corpus, report
from fleet.bench.daemon import daemon_from_args
from fleet.bench.httpclient import BlockingConn, Endpoint, build_request
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import DAEMON, OUT, REQUESTS, bench

MODEL = "all-minilm-l6-v2"
HEADER = "X-Fleet-Timeline"
WARMUP = 20
SHORT_TEXTS = 32

#: (from stamp, to stamp, what happens in between), in the request's order.
#: `sent` and `received` are this client's; the rest come from the daemon.
STAGES = (
    ("sent", "handler", "HTTP send, parse, route (client -> handler)"),
    ("handler", "checked", "body read, decode, model check"),
    ("checked", "put", "queue put"),
    ("put", "woke", "worker wake-up"),
    ("woke", "claimed", "lane choice + claim"),
    ("claimed", "lingered", "linger for more"),
    ("lingered", "decoded", "return overpull, worker decode"),
    ("decoded", "tokenized", "tokenize"),
    ("tokenized", "forward", "forward + pool"),
    ("forward", "host", "vectors to host"),
    ("host", "ran", "normalise, split, result Structs"),
    ("ran", "collected", "result encode, ack, event loop wake-up + collect"),
    ("collected", "resumed", "future resolved, request resumes"),
    ("resumed", "encoded", "reply build + encode"),
    ("encoded", "received", "reply send, client read"),
)
#: The model's own time: what an in-process call of the adapter pays as well.
MODEL_SPAN = ("decoded", "host")


def parse_stamps(value: str) -> dict[str, int]:
    """The daemon's header as {stage: ns}."""
    return {stage: int(ns) for stage, _, ns in (part.partition("=") for part in value.split(","))}


def stage_table(rows: list[dict[str, int]]) -> list[dict]:
    """Per stage: p50 / p90 / p99 in ms over the requests that have both stamps."""
    table = []
    for a, b, label in STAGES:
        ms = np.array([(r[b] - r[a]) / 1e6 for r in rows if a in r and b in r], dtype=np.float64)
        table.append({"from": a, "to": b, "stage": label, "n": int(ms.size),
                      **({f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)} if ms.size else {})})
    return table


def spans(rows: list[dict[str, int]]) -> dict[str, np.ndarray]:
    rtt = np.array([(r["received"] - r["sent"]) / 1e6 for r in rows])
    model = np.array([(r[MODEL_SPAN[1]] - r[MODEL_SPAN[0]]) / 1e6 if MODEL_SPAN[1] in r else np.nan for r in rows])
    return {"round trip": rtt, "model (tokenize .. on host)": model, "added around the model": rtt - model}


def measure(url: str, texts: list[str], requests: int) -> list[dict[str, int]]:
    """Sequential requests on one keep-alive connection, a blocking client (a lone
    agent: no client-side event loop in the round trip)."""
    ep = Endpoint(url)
    prepared = [build_request(ep, "/v1/embed", msgspec.msgpack.encode({"model": MODEL, "inputs": [t]}),
                              "application/msgpack", "application/msgpack").replace(
                                  b"\r\n\r\n", f"\r\n{HEADER}: 1\r\n\r\n".encode(), 1) for t in texts]
    conn = BlockingConn(ep)
    rows = []
    try:
        for i in range(WARMUP + requests):
            sent = time.monotonic_ns()
            status, headers, _ = conn.exchange(prepared[i % len(prepared)])
            received = time.monotonic_ns()
            if status != 200:
                raise RuntimeError(f"request {i} answered {status}")
            if i >= WARMUP:
                rows.append({"sent": sent, **parse_stamps(headers[HEADER.lower().encode()].decode()),
                             "received": received})
    finally:
        conn.close()
    return rows


@bench("timeline", DAEMON, REQUESTS.but(default=300, help="sequential requests, after the warm-up"), OUT)
def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)

    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    short = [texts[i] for i in sorted(range(len(texts)), key=lambda i: lengths[i])[:SHORT_TEXTS]]
    load_before = os.getloadavg()
    daemon, url = daemon_from_args(args)
    try:
        rows = measure(url, short, args.requests)
    finally:
        if daemon:
            daemon.stop()
    load_after = os.getloadavg()

    table = stage_table(rows)
    totals = {name: {f"p{q}_ms": float(np.nanpercentile(v, q)) for q in (50, 90, 99)} for name, v in spans(rows).items()}
    t = Table(title=f"one short request, {len(rows)} sequential (msgpack, keep-alive), per stage", title_justify="left")
    for col in ("stage", "p50 ms", "p90 ms", "p99 ms"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for s in table:
        if s["n"]:
            t.add_row(s["stage"], f"{s['p50_ms']:.3f}", f"{s['p90_ms']:.3f}", f"{s['p99_ms']:.3f}")
        else:
            t.add_row(s["stage"], "-", "-", "-")
    t.add_section()
    for name, v in totals.items():
        t.add_row(name, f"{v['p50_ms']:.3f}", f"{v['p90_ms']:.3f}", f"{v['p99_ms']:.3f}")
    console.print(t)
    console.print("stage percentiles are per stage: they do not add up to the round trip's. "
                  f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}, "
                  f"after {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} ({os.cpu_count()} CPUs)")

    doc = report.document("timeline", "fleet.bench", args.argv) | {
        "settings": {"url": url, "started_daemon": bool(daemon), "requests": len(rows), "warmup": WARMUP},
        "load_before": load_before, "load_after": load_after,
        "stages": table, "totals": totals,
    }
    out = report.save(doc, args.out, "timeline")
    Console(stderr=True).print(f"results: {out}")
    return 0
