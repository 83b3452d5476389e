"""Where the time goes at saturation: per-stage timeline, padding and CPU of fleet under closed-loop load.

`--clients` blocking clients (threads, one keep-alive connection each) send
`--batch`-text embed requests back to back for `--duration` seconds, MessagePack
both ways, each with `X-Fleet-Timeline: 1` (the daemon's and the worker's
CLOCK_MONOTONIC stamps per stage; bench/timeline.py). The texts are the request
windows every `fleetctl bench` target sends (`bench.targets.request_windows`).

Requests that share the worker's `claimed` stamp ran in one batch: grouping by it
gives each batch's requests, so its texts and their token counts. From those:
- the worker's own time per stage (summed over batches, as a share of the wall
  time) and what is left idle;
- the forward's padding: the batch's texts sorted by length and cut into
  micro-batches as the worker cuts them (at most `--micro-batch`, the profile's
  `micro_batch_items`, where padding costs more than the worker's `fixed_tokens`
  of a forward: runtimes/adapters/batching.padding_cuts), each padded to its longest, against
  the same texts in unsorted request windows (a per-request caller) and
  length-sorted batches of `--batch` over the whole corpus (the offline limit);
- tokens/s of the forward alone (real tokens / forward + pool time);
- CPU over the window: the API process, its workers (every descendant), the
  clients (this process), and the box's idle cores (/proc/stat).
Printed with the load average before and after; JSON under bench/results/.

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench saturation [--url URL | --start] [--clients 8]
      [--batch 32] [--duration 20] [--out bench/results/saturation-<time>.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

import httpx
import msgspec
import numpy as np
import psutil
from rich.console import Console

from fleet.bench import corpus, report
from fleet.bench.daemon import daemon_from_args
from fleet.bench.httpclient import BlockingConn, Endpoint, build_request
from fleet.bench.targets import request_windows
from fleet.bench.timeline import HEADER, MODEL, parse_stamps
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import CLIENTS, DAEMON, DURATION, OUT, bench, option
from fleet.runtimes.adapters.batching import padding_cuts
from fleet.runtimes.base import ROW_MULTIPLES

WARMUP_S = 3.0
#: The worker's stages, one span per batch (fleet.messages.WORKER_STAGES).
#: The adapter stamps `tokenized` and `forward` for its batch's last micro-batch
#: (runtimes/adapters/sentence_transformer.py `marks`): with one micro-batch they split tokenize
#: from forward; with several, decoded -> tokenized also holds the earlier micro-batches'
#: forwards. So the model's span is decoded -> host, and the last micro-batch is shown apart.
WORKER_SPANS = (("woke", "claimed", "lane choice + claim"), ("claimed", "lingered", "linger"),
                ("lingered", "decoded", "overpull return + decode"),
                ("decoded", "host", "tokenize + forward + pool, all micro-batches"),
                ("host", "ran", "normalise, split, results"))
LAST_MICRO = (("decoded", "tokenized", "first tokenize .. last micro-batch tokenized"),
              ("tokenized", "forward", "last micro-batch: forward + pool"))
#: Per request, API side and queue.
REQUEST_SPANS = (("sent", "handler", "client -> handler"), ("handler", "put", "decode, check, queue put"),
                 ("put", "claimed", "queued (put -> claimed)"), ("ran", "collected", "result back to the API"),
                 ("collected", "encoded", "resume + reply encode"), ("encoded", "received", "reply send, client read"))


def cpu_s(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of `pid` (its threads included), or of its
    descendants with `children` (a daemon's workers); 0 for what is gone."""
    try:
        procs = psutil.Process(pid).children(recursive=True) if children else [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def box_idle() -> tuple[float, float]:
    """(idle + iowait, total) CPU seconds of the whole box (the first eight /proc/stat fields)."""
    t = psutil.cpu_times()
    return t.idle + t.iowait, float(sum(t[:8]))


def padded(lengths: list[int], size: int, *, sort: bool, fixed: float = 0.0, rows: int = 1) -> int:
    """Tokens a forward pays for `lengths` cut into chunks of `size`, each padded to its
    longest; sorted with `fixed` (the worker's `fixed_tokens`) and `rows` (its engine's
    row multiple), cut as the worker cuts (runtimes/adapters/batching.padding_cuts)."""
    xs = sorted(lengths) if sort else list(lengths)
    if sort and fixed > 0 and len(xs) > 1:
        bounds = padding_cuts(np.asarray(xs), size, fixed, rows)
        return sum(xs[hi - 1] * (hi - lo) for lo, hi in zip(bounds, bounds[1:]))
    return sum(max(xs[i:i + size]) * len(xs[i:i + size]) for i in range(0, len(xs), size))


def warm(url: str, request: bytes) -> None:
    """One request, answered 200, before anything is measured (the model is loaded)."""
    conn = BlockingConn(Endpoint(url), timeout_s=300)
    try:
        status, _, body = conn.exchange(request)
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"the warm-up request was answered {status}: {bytes(body[:200])!r}")


def load(url: str, prepared: list[bytes], clients: int, duration_s: float) -> tuple[list[dict], float, float]:
    """Closed loop: (rows of stamps with the window index, t0, t1 of the measured window in monotonic ns)."""
    ep = Endpoint(url)
    turn = itertools.count()
    rows: list[dict] = []
    errors: list[str] = []
    start = time.monotonic_ns()
    t0, t1 = start + int(WARMUP_S * 1e9), start + int((WARMUP_S + duration_s) * 1e9)

    def client() -> None:
        conn = BlockingConn(ep, timeout_s=120)
        try:
            while (sent := time.monotonic_ns()) < t1:
                k = next(turn) % len(prepared)
                status, headers, _ = conn.exchange(prepared[k])
                received = time.monotonic_ns()
                if status != 200:
                    errors.append(f"{status}")
                    continue
                if sent >= t0:
                    rows.append({"sent": sent, **parse_stamps(headers[HEADER.lower().encode()].decode()),
                                 "received": received, "window": k})
        except Exception as exc:  # noqa: BLE001 - reported, the run fails
            errors.append(repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, e.g. {errors[0]}")
    return rows, t0, t1


def union_s(spans: list[tuple[int, int]]) -> float:
    """Seconds covered by (start, end) spans in ns, overlaps counted once."""
    total, reach = 0, None
    for a, b in sorted(spans):
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total / 1e9


def analyse(rows: list[dict], windows: list[list[int]], lengths: list[int], batch: int, micro: int,
            wall_s: float, fixed: float = 0.0, row_multiple: int = 1) -> dict:
    batches: dict[int, list[dict]] = {}
    for r in rows:
        batches.setdefault(r["claimed"], []).append(r)
    firsts = [b[0] for b in batches.values()]
    worker = {}
    for a, b, label in WORKER_SPANS + LAST_MICRO:
        total = sum((r[b] - r[a]) / 1e9 for r in firsts if a in r and b in r)
        worker[label] = {"total_s": total, "share_of_wall": total / wall_s,
                         "per_batch_ms": 1e3 * total / max(len(firsts), 1)}
    # A batch run between two micro-batches of another (runtimes.flows, an interjection)
    # lies inside that batch's span: the worker's busy time is the spans' union.
    busy = union_s([(r["woke"], r["ran"]) for r in firsts])
    model = union_s([(r["decoded"], r["host"]) for r in firsts])
    real = [lengths[i] for r in rows for i in windows[r["window"]]]
    worker_label = (f"worker (batch sorted, cut at {fixed:.0f} tokens of fixed cost, at most {micro}"
                    f"{f', rows in multiples of {row_multiple}' if row_multiple > 1 else ''})" if fixed
                    else f"worker (batch sorted, micro-batches of {micro})")
    pads = {worker_label: 0, "request windows unsorted (per request)": 0}
    for group in batches.values():
        lens = [lengths[i] for r in group for i in windows[r["window"]]]
        pads[worker_label] += padded(lens, micro, sort=True, fixed=fixed, rows=row_multiple)
    for r in rows:
        pads["request windows unsorted (per request)"] += padded([lengths[i] for i in windows[r["window"]]], batch,
                                                                 sort=False)
    pads[f"corpus length-sorted, batches of {batch} (offline limit)"] = round(
        padded(lengths, batch, sort=True) * len(real) / len(lengths))
    requests = {label: {f"p{q}_ms": float(np.percentile([(r[b] - r[a]) / 1e6 for r in rows], q)) for q in (50, 90)}
                for a, b, label in REQUEST_SPANS}
    sizes = np.array([len(g) for g in batches.values()])
    return {
        "requests": len(rows), "batches": len(batches), "wall_s": wall_s,
        "requests_per_batch": {"mean": float(sizes.mean()), "min": int(sizes.min()), "max": int(sizes.max())},
        "tokens_per_s": sum(real) / wall_s,
        "worker_busy_share": busy / wall_s,
        "worker_stages": worker,
        "model_tokens_per_s": sum(real) / model if model else None,
        "padding_fraction": {k: 1 - sum(real) / v for k, v in pads.items()},
        "request_stages": requests,
        "round_trip_p50_ms": float(np.median([(r["received"] - r["sent"]) / 1e6 for r in rows])),
    }


@bench("saturation", DAEMON, CLIENTS, option("--batch", type=int, default=32, help="texts per request"),
       option("--micro-batch", type=int, default=64, help="the served profile's micro_batch_items"),
       DURATION.but(default=20.0), OUT)
def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)

    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    windows = request_windows(len(texts), args.batch)
    load_before = os.getloadavg()
    daemon, url = daemon_from_args(args)
    ep = Endpoint(url)
    prepared = [build_request(ep, "/v1/embed", msgspec.msgpack.encode({"model": MODEL, "inputs": [texts[i] for i in w]}),
                              "application/msgpack", "application/msgpack").replace(
                                  b"\r\n\r\n", f"\r\n{HEADER}: 1\r\n\r\n".encode(), 1) for w in windows]
    try:
        api = int(httpx.get(url + "/v1/ps", timeout=10).json()["pid"])
        # The model loads at its first request (seconds on a CPU: tracing, the thread
        # check): longer than the warm-up, it would fall inside the measured window.
        warm(url, prepared[0])
        samples = (lambda: cpu_s(api), lambda: cpu_s(api, children=True), time.process_time)
        cpu = {k: [f()] for k, f in zip(("api", "workers", "clients"), samples)}
        idle0 = box_idle()
        rows, t0, t1 = load(url, prepared, args.clients, args.duration)
        # The counters span the warm-up too: a second sample bounds the window.
        idle1 = box_idle()
        for k, f in zip(cpu, samples):
            cpu[k].append(f())
        # What served the run, read after it (the model loads at its first request, so
        # before the run /v1/ps may list none), while the daemon is up (`--start` stops it):
        # the engine and its settings, and the worker's fitted batch cost (ms = a + b x
        # tokens; runtimes/policy.CostModel).
        workers = httpx.get(url + "/v1/ps", timeout=10).json().get("workers", [])
        served = {str(w.get("pid")): {name: {k: m.get(k) for k in ("dtype", "engine", "choice", "settings", "threads",
                                                                   "fixed_tokens")}
                                         for name, m in w.get("models", {}).items()} for w in workers}
        worker_cost = {str(w.get("pid")): {n: m.get("cost") for n, m in w.get("models", {}).items()} for w in workers}
    finally:
        if daemon:
            daemon.stop()
    load_after = os.getloadavg()
    span = WARMUP_S + args.duration
    # Where the worker cuts micro-batches (runtimes/base.Adapter.fixed_tokens; absent: by count).
    fixed = next((float(m["fixed_tokens"]) for w in served.values() for n, m in w.items()
                  if n == MODEL and m.get("fixed_tokens")), 0.0)
    # ... and in what multiples of rows (runtimes/base.ROW_MULTIPLES of the engine that served).
    engine = next(((m.get("engine") or {}).get("engine") for w in served.values() for n, m in w.items()
                   if n == MODEL), None)
    res = analyse(rows, windows, lengths, args.batch, args.micro_batch, (t1 - t0) / 1e9, fixed,
                  ROW_MULTIPLES.get(engine or "torch", 1))
    res["worker_cost"] = worker_cost
    cores = os.cpu_count() or 1
    res["cpu_cores_used"] = {k: (v[1] - v[0]) / span for k, v in cpu.items()}
    res["idle_cores"] = cores * (idle1[0] - idle0[0]) / max(idle1[1] - idle0[1], 1.0)

    console.print(f"[bold]{args.clients} clients x {args.batch} texts, {res['requests']} requests in "
                  f"{res['wall_s']:.1f} s: {res['tokens_per_s']:,.0f} tokens/s[/] (round trip p50 "
                  f"{res['round_trip_p50_ms']:.1f} ms; {res['batches']} batches, "
                  f"{res['requests_per_batch']['mean']:.2f} requests each)")
    console.print(f"worker busy {100 * res['worker_busy_share']:.0f} % of the wall; the model alone (tokenize .. "
                  f"vectors on the host) {res['model_tokens_per_s'] or 0:,.0f} tokens/s of real tokens")
    for label, v in res["worker_stages"].items():
        console.print(f"  {label:46s} {100 * v['share_of_wall']:5.1f} % of wall  {v['per_batch_ms']:8.2f} ms/batch")
    for label, v in res["padding_fraction"].items():
        console.print(f"padding {label}: {100 * v:.1f} %")
    for label, v in res["request_stages"].items():
        console.print(f"  {label:28s} p50 {v['p50_ms']:8.2f} ms  p90 {v['p90_ms']:8.2f} ms")
    console.print("cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in res["cpu_cores_used"].items())
                  + f"; idle cores {res['idle_cores']:.2f} of {cores}")
    console.print(f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}, "
                  f"after {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}")

    doc = report.document("saturation", "fleet.bench", args.argv) | {
        "settings": {"url": url, "started_daemon": bool(daemon), "clients": args.clients, "batch": args.batch,
                     "micro_batch": args.micro_batch, "duration_s": args.duration, "warmup_s": WARMUP_S},
        "served": served, "load_before": load_before, "load_after": load_after, **res,
        "rows": rows,  # every request's stamps (ns) and window: the analysis can be redone
    }
    out = report.save(doc, args.out, "saturation")
    Console(stderr=True).print(f"results: {out}")
    return 0
