"""A paused box is not a hung worker (issue 25, deliverable 6).

A real daemon at the shipped settings, busy with embed requests, is paused whole
(SIGSTOP of the daemon and every process it started, as a VM stall or a cgroup
freeze does) for 20 s, then resumed. Before: the supervisor killed its healthy
worker right after SIGCONT ("no progress for 20.9 s") and every model was loaded
again. Now: the same worker keeps serving, nothing is reloaded, and every request
in flight is answered, once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon

PAUSE_S = 20.0
#: A batch of this size runs long enough (~0.1-1 s on CPU) that the pause likely
#: catches one mid-forward; the lease (10 s) and the batch bound (5 s floor) are
#: both shorter than the pause.
TEXTS = ["the box was paused while this batch ran " * 12] * 32
CLIENTS = 3


@pytest.fixture()
def shipped(tmp_path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "home")
    yield d
    d.stop()


def state(d: DaemonProc) -> tuple[int, int, float]:
    """(worker pid, its slot's restarts, when the default model was loaded on it)."""
    ps = httpx.get(d.url + "/v1/ps", timeout=60).json()
    worker = ps["workers"][0]
    return worker["pid"], ps["slots"][0]["restarts"], worker["models"][DEFAULT_MODEL]["loaded_at"]


def test_a_paused_box_keeps_its_worker_and_answers_every_request_once(shipped: DaemonProc) -> None:
    d = shipped
    for _ in range(4):  # the worker's cost model is fitted: its batch bound is the 5 s floor, not warm-up's 30 s
        assert httpx.post(d.url + "/v1/embed", json={"inputs": TEXTS}, timeout=120).status_code == 200
    before = state(d)

    stop = threading.Event()
    answers: list[tuple[float, float, int]] = []  # (sent, answered, status), monotonic s

    def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = httpx.post(d.url + "/v1/embed", json={"inputs": TEXTS}, timeout=120).status_code
            except httpx.HTTPError as exc:
                status = -1
                print(f"client error: {exc!r}")
            answers.append((sent, time.monotonic(), status))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    # Only processes this test started: the daemon and its descendants (workers, resource tracker).
    procs = [psutil.Process(d.proc.pid), *psutil.Process(d.proc.pid).children(recursive=True)]
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(PAUSE_S)
    resumed_at = time.monotonic()
    for p in procs:
        os.kill(p.pid, signal.SIGCONT)
    # Past a whole lease (10 s) after the resume: a worker judged hung would be dead by now.
    time.sleep(15.0)
    stop.set()
    for t in threads:
        t.join(timeout=180)

    assert answers and all(status == 200 for _, _, status in answers), answers
    spanning = [a for a in answers if a[0] < paused_at and a[1] > resumed_at]
    assert spanning, "no request was in flight across the pause"
    assert state(d) == before  # same worker pid, no restart, the model not loaded again
    log = d.log()
    assert "fresh lease" in log  # the supervisor saw its own pause
    assert "has not made progress" not in log and "items returned to their lanes" not in log
    assert "lost their lease" not in log  # no claim expired: nothing ran twice
    assert "poison" not in log.lower()


# ---- the worker's side: a pause is no batch's time (runtimes.policy.paused_ns) -----------------

S = 1_000_000_000


@pytest.mark.parametrize(("gap", "cpu", "period", "paused"), [
    (1 * S, 0, 1 * S, 0),                 # on time
    (int(1.9 * S), 0, 1 * S, 0),          # late within the slack: a busy box, not a pause
    (21 * S, S // 10, 1 * S, 20 * S),     # stopped 20 s, idle before
    (21 * S, 2 * S, 1 * S, 20 * S),       # stopped mid-batch: two threads computed 1 s before the stop
    (21 * S, 20 * S, 1 * S, 0),           # the process computed all along (a call held the GIL): not a pause
])
def test_a_heartbeat_gap_is_a_pause_only_when_the_process_did_not_run(gap: int, cpu: int, period: int,
                                                                       paused: int) -> None:
    from fleet.runtimes.policy import paused_ns

    assert paused_ns(gap, cpu, period) == paused


def test_a_batch_resumed_after_a_pause_is_within_its_bound() -> None:
    from fleet.runtimes.state import Progress

    progress = Progress()
    with progress.running("a batch", bound_ms=5_000):
        start = progress.busy[1]
        progress.excuse(20 * S)  # the heartbeat thread saw the box paused 20 s
        assert progress.overdue(start + 21 * S) is None  # 1 s of its own time
        what, ran_ms = progress.overdue(start + 26 * S)  # 6 s of its own: past the 5 s bound
        assert what == "a batch" and ran_ms == pytest.approx(6_000)
    assert progress.overdue(start + 60 * S) is None
