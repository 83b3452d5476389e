"""Batch work below interactive work (issue 23, deliverable 2), measured in one run.

    flock /tmp/fleet-bench.lock python -m fleet.bench batch-priority --start [--batch 32] [--min-requests 60]
    python -m fleet.bench batch-priority --url http://127.0.0.1:7744

On the same inputs (the bench corpus, requests of `--batch` inputs to /v1/embed,
the same windows of texts as `fleetctl bench` sends):

1. the knee of interactive requests: bench.runner's open-loop ramp, as `fleetctl bench`;
2. a batch alone: the same requests as the lines of a /v1/embed batch; its
   throughput is lines/s from its creation to its final status (polled every
   0.1 s), against the knee's requests/s. Goal: >= 0.9;
3. interactive requests at half the knee's rate for `--duration` s (long enough for
   `--min-requests` requests: a p95 of 14 requests is their second largest), without a batch,
   then with a batch running that keeps the workers busy throughout (it holds more
   lines than the step can finish; cancelled after it), `--rounds` times. The p95
   of each step, the ratio with/without per round, and the median ratio. Goal: <= 1.25.

Results: bench/results/<time>-batch-priority.json (command, machine, versions,
every step, the ratios). `--start` runs `fleetctl serve` on a free port with a
throwaway FLEET_HOME and stops it (by PID) at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from fleet.bench import corpus, report
from fleet.bench.daemon import daemon_from_args
from fleet.bench.knee import OPEN
from fleet.bench.runner import Plan, StepRecord, TargetSpec, open_run, run_step
from fleet.bench.runner import bench as bench_targets
from fleet.bench.sampler import Sampler
from fleet.bench.targets import request_windows
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import DAEMON, DURATION, OUT, ROUNDS, bench, option

MODEL = "all-minilm-l6-v2"
GOAL_BATCH_VS_KNEE = 0.9
GOAL_P95_RATIO = 1.25
FINAL = ("completed", "failed", "expired", "cancelled")


def batch_file(texts: list[str], batch: int, lines: int, path: Path) -> Path:
    """`lines` /v1/embed requests of `batch` inputs each, windows of the corpus as the load generator takes them."""
    windows = request_windows(len(texts), batch)
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": MODEL, "inputs": [texts[j] for j in windows[i % len(windows)]]}
            f.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/embed", "body": body}) + "\n")
    return path


class Batches:
    """The Batches API over plain HTTP (bench imports no client of the project's)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=600)

    def start(self, path: Path) -> str:
        with path.open("rb") as f:
            r = self.http.post("/v1/files", files={"file": (path.name, f, "application/jsonl")},
                               data={"purpose": "batch"})
        r.raise_for_status()
        r = self.http.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/embed",
                                                "completion_window": "24h"})
        r.raise_for_status()
        return r.json()["id"]

    def get(self, batch_id: str) -> dict:
        r = self.http.get(f"/v1/batches/{batch_id}")
        r.raise_for_status()
        return r.json()

    def wait(self, batch_id: str, done, poll_s: float = 0.1, timeout_s: float = 3600.0) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            b = self.get(batch_id)
            if done(b):
                return b
            time.sleep(poll_s)
        raise RuntimeError(f"batch {batch_id} did not get there in {timeout_s} s: {b['status']}")

    def cancel(self, batch_id: str) -> dict:
        """Cancel it unless it is final already (then it did not saturate the whole step)."""
        if self.get(batch_id)["status"] not in FINAL:
            self.http.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
        return self.wait(batch_id, lambda b: b["status"] in FINAL)


def step_doc(rec: StepRecord) -> dict:
    r, num = rec.result, report._num  # NaN (a step with no answer) -> null
    return {"offered_rps": r.offered, "throughput_rps": r.throughput_rps, "tokens_per_s": r.tokens_per_s,
            "p50_ms": num(r.p50_ms), "p95_ms": num(r.p95_ms), "p99_ms": num(r.p99_ms), "sent": r.sent, "ok": r.ok,
            "errors": r.errors, "error_codes": {str(k): v for k, v in rec.error_codes.items()},
            "lag_p99_ms": rec.lag_p99_ms, "generator_bound": rec.generator_bound,
            "server_queue_p50_ms": rec.server_queue_p50_ms, "server_inference_p50_ms": rec.server_inference_p50_ms,
            "box": rec.box}


@bench("batch-priority", DAEMON, option("--batch", type=int, default=32, help="inputs per request (and per batch line)"),
       DURATION.but(default=20.0, help="seconds per half-knee step, at least"),
       option("--min-requests", type=int, default=60, help="requests per half-knee step, at least"),
       ROUNDS.but(help="half-knee steps without, then with, a batch"),
       option("--alone-s", type=float, default=30.0, help="about how long the batch alone runs"),
       option("--step-s", type=float, default=10.0, help="seconds per step of the knee's ramp"), OUT)
def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)
    err = Console(stderr=True)

    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    work = Path(tempfile.mkdtemp(prefix="batch-priority-"))
    daemon, url = daemon_from_args(args, work / "home")
    pid = daemon.proc.pid if daemon else None
    plan = Plan(model=MODEL, batch=args.batch, duration_s=args.step_s, encoding="base64")
    spec = TargetSpec("fleet", "fleet", url, pids=[pid] if pid else [])
    jobs = Batches(url)
    rounds: list[dict] = []
    try:
        with Sampler() as sampler:
            # 1. The knee of interactive requests of this shape.
            err.print(f"1. the knee of interactive requests ({args.batch} inputs each) at {url}")
            [knee_run] = bench_targets([spec], plan, texts, lengths, sampler=sampler)
            knee = knee_run.knee(plan.criteria)
            if knee.knee is None:
                raise RuntimeError("no knee: the server failed even at the lowest load")
            knee_rps = knee.capacity_rps
            err.print(f"   knee {knee_rps:.2f} requests/s ({knee.capacity_tokens_per_s:,.0f} tokens/s), "
                      f"p95 {knee.knee.p95_ms:.0f} ms")
            # 2. The same requests as a batch, alone.
            n_alone = max(200, int(knee_rps * args.alone_s))
            err.print(f"2. a batch of {n_alone} lines alone")
            path = batch_file(texts, args.batch, n_alone, work / "alone.jsonl")
            t0 = time.monotonic()
            alone_id = jobs.start(path)
            alone = jobs.wait(alone_id, lambda b: b["status"] in FINAL)
            alone_s = time.monotonic() - t0
            if alone["status"] != "completed" or alone["request_counts"]["completed"] != n_alone:
                raise RuntimeError(f"the batch alone ended {alone['status']}: {alone['request_counts']}")
            batch_rps = n_alone / alone_s
            err.print(f"   {batch_rps:.2f} lines/s = {batch_rps / knee_rps:.2f} x the knee")
            # 3. Half the knee, without then with a saturating batch.
            half = knee_rps / 2
            duration = max(args.duration, args.min_requests / half)
            # More lines than the step can finish at the batch's own rate alone, twice over.
            n_sat = max(400, int(max(knee_rps, batch_rps) * (duration + 60) * 2))
            sat_path = batch_file(texts, args.batch, n_sat, work / "saturating.jsonl")
            gen = open_run(spec, plan, texts, lengths, None)
            try:
                for r in range(args.rounds):
                    err.print(f"3. round {r + 1}/{args.rounds}: {half:.2f} requests/s for {duration:.0f} s, "
                              "without a batch, then with one")
                    without = run_step(gen, plan, half, 2 * r, sampler, mode=OPEN, duration_s=duration)
                    sat_id = jobs.start(sat_path)
                    running = jobs.wait(sat_id, lambda b: b["request_counts"]["completed"] >= 20)
                    before = running["request_counts"]["completed"]
                    with_batch = run_step(gen, plan, half, 2 * r + 1, sampler, mode=OPEN, duration_s=duration)
                    after = jobs.get(sat_id)
                    during = after["request_counts"]["completed"] - before
                    cancelled = jobs.cancel(sat_id)
                    time.sleep(2.0)
                    ratio = with_batch.result.p95_ms / without.result.p95_ms
                    err.print(f"   p95 {without.result.p95_ms:.1f} ms without, {with_batch.result.p95_ms:.1f} ms with "
                              f"({ratio:.2f} x); the batch answered {during} lines meanwhile")
                    rounds.append({"without": step_doc(without), "with_batch": step_doc(with_batch),
                                   "p95_ratio": ratio, "batch_lines_during_step": during,
                                   "batch_lines_per_s_during_step": during / duration,
                                   "batch_running_at_step_end": after["status"] == "in_progress",
                                   "batch_status_after_cancel": cancelled["status"]})
            finally:
                gen.driver.close()
    finally:
        if daemon:
            daemon.stop()

    p95_ratio = statistics.median(r["p95_ratio"] for r in rounds)
    summary = {
        "knee_rps": knee_rps, "knee_tokens_per_s": knee.capacity_tokens_per_s, "knee_p95_ms": knee.knee.p95_ms,
        "batch_alone_lines": n_alone, "batch_alone_s": alone_s, "batch_alone_lines_per_s": batch_rps,
        "batch_alone_vs_knee": batch_rps / knee_rps,
        "half_knee_rps": half,
        "p95_without_ms": statistics.median(r["without"]["p95_ms"] for r in rounds),
        "p95_with_batch_ms": statistics.median(r["with_batch"]["p95_ms"] for r in rounds),
        "p95_ratio_median": p95_ratio, "p95_ratios": [r["p95_ratio"] for r in rounds],
        # Where the difference is: the server's own X-Queue-Ms (p50 per step, median of rounds).
        "queue_p50_without_ms": statistics.median(r["without"]["server_queue_p50_ms"] or 0.0 for r in rounds),
        "queue_p50_with_batch_ms": statistics.median(r["with_batch"]["server_queue_p50_ms"] or 0.0 for r in rounds),
        "goals": {"batch_alone_ge_0.9x_knee": batch_rps / knee_rps >= GOAL_BATCH_VS_KNEE,
                  "p95_ratio_le_1.25": p95_ratio <= GOAL_P95_RATIO},
    }
    doc = {
        **report.document("batch_priority", "fleet.bench", args.argv),
        "corpus": report.corpus_doc(corpus.CORPUS_PATH, lengths),
        "settings": {"url": url, "started_daemon": bool(daemon), "batch": args.batch, "duration_s": duration,
                     "min_requests": args.min_requests,
                     "rounds": args.rounds, "model": MODEL},
        "summary": summary,
        "knee_steps": [step_doc(s) for s in knee_run.steps],
        "rounds": rounds,
    }
    out = report.save(doc, args.out, "batch-priority")

    t = Table(title=f"batch work below interactive work ({args.batch} inputs/request)", title_justify="left")
    for col in ("measure", "value", "goal"):
        t.add_column(col, justify="left" if col == "measure" else "right")
    t.add_row("interactive knee, requests/s", f"{knee_rps:.2f}", "")
    t.add_row("batch alone, lines/s", f"{batch_rps:.2f}", "")
    t.add_row("batch alone / knee", f"{batch_rps / knee_rps:.2f}", f">= {GOAL_BATCH_VS_KNEE}")
    t.add_row(f"p95 at {half:.2f} req/s without a batch, ms", f"{summary['p95_without_ms']:.1f}", "")
    t.add_row("p95 with a saturating batch, ms", f"{summary['p95_with_batch_ms']:.1f}", "")
    t.add_row("p95 with / without (median of rounds)", f"{p95_ratio:.2f}", f"<= {GOAL_P95_RATIO}")
    console.print(t)
    err.print(f"results: {out}")
    return 0 if all(summary["goals"].values()) else 1
