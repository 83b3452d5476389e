"""Batches survive what a box lives through (real `fleetctl serve` processes, real
workers, real MiniLM, kill -9 by PID, at the shipped settings):

1. kill -9 of the daemon mid-batch, then of every fleet process at once (the
   daemon's session: daemon, workers, resource tracker) mid-resume; each time
   the daemon starts again on the same FLEET_HOME and the batch goes on: every
   custom_id is answered exactly once, every line of the result files is whole.
2. A disk that fills up (a small tmpfs under FLEET_HOME/batches, mounted here as
   root) pauses the batch with a `disk_full` error, the output stays whole lines;
   once space is freed the batch goes on by itself and completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon

pytestmark = pytest.mark.slow

FINAL = ("completed", "failed", "expired", "cancelled")


def embed_lines(n: int) -> str:
    return "".join(json.dumps({"custom_id": f"k{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": DEFAULT_MODEL, "input": f"line {i} of a batch that survives",
                                        "encoding_format": "float"}}) + "\n" for i in range(n))


def client_of(d: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=2)


def submit(d: DaemonProc, path: Path, text: str) -> str:
    path.write_text(text)
    c = client_of(d)
    f = c.files.create(file=path.open("rb"), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id


def wait_for(d: DaemonProc, batch_id: str, done, timeout_s: float = 300.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        b = client_of(d).batches.retrieve(batch_id)
        if done(b):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id}: still {b.status} {b.request_counts} after {timeout_s} s")


def answers(d: DaemonProc, b) -> Counter:
    """custom_id -> times answered, over the output and error files (each line must parse)."""
    c = client_of(d)
    seen: Counter = Counter()
    for file_id in (b.output_file_id, b.error_file_id):
        if file_id:
            for raw in c.files.content(file_id).text.splitlines():
                seen[json.loads(raw)["custom_id"]] += 1
    return seen


def killed(d: DaemonProc, *, whole_session: bool) -> None:
    """kill -9 of the daemon (its workers then exit by themselves), or of every process
    of its session at once; reaped, its log closed."""
    if whole_session:
        os.killpg(d.proc.pid, signal.SIGKILL)
    else:
        d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=30)
    d.stop()


def test_kill_9_mid_batch_then_every_process_at_once_and_every_line_is_answered_once(tmp_path):
    n = 3000
    home = tmp_path / "home"
    d = start_daemon(home)
    batch_id = submit(d, tmp_path / "in.jsonl", embed_lines(n))
    b = wait_for(d, batch_id, lambda b: b.request_counts.completed >= n // 5)
    at_first_kill = b.request_counts.completed
    killed(d, whole_session=False)
    d = start_daemon(home)
    try:
        b = client_of(d).batches.retrieve(batch_id)
        assert b.status == "in_progress" and b.request_counts.completed >= at_first_kill
        b = wait_for(d, batch_id, lambda b: b.request_counts.completed >= n // 2)
        at_second_kill = b.request_counts.completed
        killed(d, whole_session=True)
        d = start_daemon(home)
        b = wait_for(d, batch_id, lambda b: b.status in FINAL)
        seen = answers(d, b)
    finally:
        d.stop()
    twice = sum(1 for v in seen.values() if v > 1)
    missing = n - len(seen)
    print(f"kill -9: {n} lines; killed at {at_first_kill} (daemon) and {at_second_kill} (every process) "
          f"answered; in the end {len(seen)} answered, {twice} twice, {missing} missing")
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    assert (len(seen), twice, missing) == (n, 0, 0)


@pytest.fixture
def small_disk(tmp_path: Path):
    """FLEET_HOME/batches on a 24 MiB tmpfs, unmounted after the test."""
    home = tmp_path / "home"
    where = home / "batches"
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield home, where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_pauses_the_batch_and_it_goes_on_once_space_is_freed(tmp_path, small_disk):
    home, where = small_disk
    n = 2000  # ~8 KB of output a line: ~16 MiB in all
    ballast = where / "ballast"
    d = start_daemon(home)
    try:
        batch_id = submit(d, tmp_path / "in.jsonl", embed_lines(n))
        with ballast.open("wb") as f:  # leaves room for about half of the output
            f.write(b"\0" * (15 << 20))
        b = wait_for(d, batch_id, lambda b: b.errors is not None and b.errors.data[0].code == "disk_full",
                     timeout_s=120)
        assert b.status == "in_progress" and 0 < b.request_counts.completed < n
        paused_at = b.request_counts.completed
        time.sleep(2)
        assert client_of(d).batches.retrieve(batch_id).request_counts.completed <= paused_at + 512  # held, not lost
        ballast.unlink()
        b = wait_for(d, batch_id, lambda b: b.status in FINAL, timeout_s=120)
        seen = answers(d, b)
    finally:
        d.stop()
    print(f"full disk: paused at {paused_at} of {n} lines; after freeing space {len(seen)} answered")
    assert b.status == "completed" and b.errors is None and b.request_counts.completed == n
    assert len(seen) == n and max(seen.values()) == 1
