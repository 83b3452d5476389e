"""Where a worker's threads spend a measured step: py-spy samples of running processes.

A GPU at 5-15 % busy with 14 of 16 cores idle (bench/README, the H200 runs) left one
question the counters cannot answer: what the model's worker does with its time, on
which thread. `record` attaches py-spy to processes for a few seconds (`--nonblocking`:
the process is read, never paused, so the step it samples runs as the others did)
and keeps each one's collapsed stacks (`--format raw`, one line per distinct stack:
`thread (TID): NAME;frame;frame COUNT`); `summarise` turns them into what a reader
needs first: each thread's busy share of the window and the frames it spent most on.

Only samples where a thread ran count (py-spy drops idle threads by default), so a
thread's share is the fraction of the window it was on a CPU or holding work, not the
fraction of the GIL it held. Without py-spy on PATH (the bench extra installs it) the
check says why and is skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

RATE = 100  # samples a second
TOP = 12  # frames kept per thread
#: `thread (TID): NAME` (NAME absent where the process never imported threading).
_THREAD = re.compile(r"^thread \((\d+)\)(?:: ([^;]*))?")


def binary() -> str | None:
    """py-spy on PATH, else beside this interpreter (a venv's bin/, not on PATH when the
    venv is not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def available() -> str | None:
    """Why py-spy cannot run here, or None."""
    return None if binary() else "py-spy is not installed (pip install py-spy; the bench extra has it)"


def start(pids: dict[int, str], seconds: float, out_dir: Path, stem: str) -> list[tuple[int, str, Path,
                                                                                        subprocess.Popen]]:
    """One `py-spy record` per process, running for `seconds`: (pid, label, raw file, process)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for pid, label in pids.items():
        raw = out_dir / f"{stem}-pyspy-{label}-{pid}.txt"
        proc = subprocess.Popen([binary() or "py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                                 "--rate", str(RATE), "--threads", "--nonblocking", "--format", "raw",
                                 "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        running.append((pid, label, raw, proc))
    return running


def finish(running: list[tuple[int, str, Path, subprocess.Popen]], seconds: float) -> dict[str, dict]:
    """Wait for the recorders; each process's summary (or its error), by `label/pid`."""
    out = {}
    for pid, label, raw, proc in running:
        try:
            _, err = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        key = f"{label}/{pid}"
        if proc.returncode != 0 or not raw.exists():
            out[key] = {"error": f"py-spy exited {proc.returncode}: {(err or '').strip()[-400:]}"}
            continue
        out[key] = {"file": raw.name, **summarise(raw.read_text(), seconds)}
    return out


def summarise(raw: str, seconds: float, rate: int = RATE) -> dict:
    """Per thread: its busy share of the window (samples / (seconds x rate)), and the
    frames it was in most, by self samples (the innermost frame) and by total samples
    (any frame of the stack), as shares of that thread's samples."""
    samples: Counter[str] = Counter()
    own: dict[str, Counter[str]] = defaultdict(Counter)
    total: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        m = _THREAD.match(stack)
        if not m or not count.isdigit():
            continue
        thread = f"{m.group(2) or 'thread'} ({m.group(1)})"
        n = int(count)
        frames = stack.split(";")[1:]
        samples[thread] += n
        if frames:
            own[thread][frames[-1]] += n
            for frame in set(frames):
                total[thread][frame] += n
    window = max(seconds * rate, 1)
    return {"threads": {t: {"busy": round(n / window, 3), "samples": n,
                            "self": [[f, round(c / n, 3)] for f, c in own[t].most_common(TOP)],
                            "total": [[f, round(c / n, 3)] for f, c in total[t].most_common(TOP)]}
                        for t, n in samples.most_common()}}
