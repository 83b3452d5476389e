"""The API process's memory while a large batch file is uploaded and run (issue 23).

    flock /tmp/fleet-bench.lock python -m fleet.bench batch-memory [--gib 1] [--line-kib 1024] [--inflight-mib 64]

Writes a JSONL file of `--gib` GiB (lines of /v1/embeddings requests, each one
text of about `--line-kib` KiB: the worker reads the first 32 characters per token
of it, so the run costs little model time and the bytes are what is measured),
starts `fleetctl serve` on a throwaway FLEET_HOME, uploads the file through the
Files API (multipart, streamed), runs it as a batch to the end, and samples the
API process every 0.1 s (/proc/<pid>/status: VmRSS and its parts; the shared
part is the queue's slab, shared memory the workers map too). Prints and writes
bench/results/<time>-batch-memory.json: the peaks during the upload and during
the run, the times, and the batch's counts. `--inflight-mib` sets the daemon's
`batch_inflight_bytes` (request bytes of lines in flight; default: the shipped 64 MiB),
which bounds what the run holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fleet.bench import report
from fleet.bench.daemon import LocalDaemon
from fleet.bench.cli import OUT, bench, option

MODEL = "all-minilm-l6-v2"
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0])
    return out


class Peaks:
    """Samples a process every `interval_s`; the peak of each field per phase."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.phase = "idle"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = status_kib(self.pid)
            except (FileNotFoundError, ProcessLookupError):
                return
            peak = self.peaks.setdefault(self.phase, {})
            for k, v in sample.items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def write_file(path: Path, total_bytes: int, line_bytes: int) -> int:
    """Request lines until `total_bytes`; returns how many."""
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
    text = " ".join(words[i % len(words)] for i in range(line_bytes // 6))[:line_bytes]
    n = written = 0
    with path.open("w") as f:
        while written < total_bytes:
            line = json.dumps({"custom_id": f"m{n}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": MODEL, "input": f"{n} {text}"}}) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return n


@bench("batch-memory", option("--gib", type=float, default=1.0, help="input file size, GiB"),
       option("--line-kib", type=int, default=1024, help="bytes of text per line, KiB"),
       option("--inflight-mib", type=int, default=None, help="batch_inflight_bytes, MiB (default: shipped)"), OUT)
def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="batch-memory-"))
    path = work / "big.jsonl"
    lines = write_file(path, int(args.gib * (1 << 30)), args.line_kib << 10)
    size = path.stat().st_size
    print(f"input: {lines} lines, {size / (1 << 30):.2f} GiB", file=sys.stderr)
    env = {"FLEET_BATCH_MAX_FILE_BYTES": str(size + (1 << 20))}
    if args.inflight_mib is not None:
        env["FLEET_BATCH_INFLIGHT_BYTES"] = str(args.inflight_mib << 20)
    daemon = LocalDaemon(work / "home", env=env)
    peaks = Peaks(daemon.proc.pid)
    try:
        http = httpx.Client(base_url=daemon.url, timeout=None)
        time.sleep(1.0)
        peaks.phase = "upload"
        t0 = time.monotonic()
        with path.open("rb") as f:
            r = http.post("/v1/files", files={"file": (path.name, f, "application/jsonl")}, data={"purpose": "batch"})
        r.raise_for_status()
        upload_s = time.monotonic() - t0
        peaks.phase = "run"
        t1 = time.monotonic()
        batch = http.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/embeddings",
                                               "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        run_s = time.monotonic() - t1
        peaks.phase = "after"
        time.sleep(1.0)
    finally:
        peaks.stop()
        daemon.stop()
    mib = {phase: {k: round(v / 1024, 1) for k, v in p.items()} for phase, p in peaks.peaks.items()}
    doc = {
        **report.document("batch_memory", "fleet.bench", args.argv),
        "input": {"lines": lines, "bytes": size, "line_text_bytes": args.line_kib << 10},
        "settings": env,
        "upload_s": upload_s, "run_s": run_s, "batch": {"status": batch["status"],
                                                        "request_counts": batch["request_counts"]},
        "api_process_peak_mib": mib,
        "note": "VmRSS = RssAnon (the process's own memory) + RssFile + RssShmem (the queue's slab, "
                "shared memory the workers map too: pages the API process wrote payloads into)",
    }
    out = report.save(doc, args.out, "batch-memory")
    print(json.dumps({"upload_s": round(upload_s, 1), "run_s": round(run_s, 1), "batch": doc["batch"],
                      "api_process_peak_mib": mib}, indent=1))
    print(f"results: {out}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1
