"""A killed daemon leaves nothing; one daemon per FLEET_HOME (real `fleetctl serve`
processes, real workers, real /dev/shm, kill -9 by PID, at the shipped settings).

Scenario, in order (one home):
1. Daemon A serves. A second `fleetctl serve` on the same home exits 1 at once with
   one line naming A's pid and URL, and starts nothing.
2. `kill -9` of A's process while clients keep its worker busy: every client's
   request in flight is cut with the connection (nothing else: no hang); the worker
   and the multiprocessing resource tracker exit by themselves within a second
   (measured and printed; asserted with room for a loaded box). A's queue entries
   stay in /dev/shm (nothing ran to remove them).
3. Daemon B starts on the same home (the kernel dropped A's lock): at start it
   removes A's segment, lock and wake FIFO, and not those of a live owner.
4. B stops on SIGTERM and removes its own entries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fleet.local_queue import LocalQueue
from fleet.local_queue.sweep import SHM_DIR
from tests.conftest import DEFAULT_MODEL, DaemonProc, free_port, start_daemon

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")]

#: What the issue asks for: the orphans are gone within a second of the kill.
EXIT_TARGET_S = 1.0
#: The assertion's bound: the target plus room for a loaded shared box (the measured
#: time is printed; it is what the closing note reports).
EXIT_BOUND_S = 5.0
#: Clients keeping the worker busy when the daemon is killed.
CLIENTS = 4


def queue_entries(pid: int) -> set[str]:
    name = f"fleet-{pid}"
    wanted = {name, f"{name}.lock", f"{name}.wake"}
    return wanted & set(os.listdir(SHM_DIR))


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = process_stat(int(entry))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                out.append(int(entry))
    return out


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of `pid`, or None when it no longer exists."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for init to reap it."""
    stat = process_stat(pid)
    return stat is None or stat[0] in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def client_loop(url: str, stop: threading.Event, out: list[str]) -> None:
    """Embed requests back to back until the daemon is gone: "200" per answer, then
    "cut" once the connection fails (the process that held it died)."""
    body = {"model": DEFAULT_MODEL, "inputs": [f"{i} the killed daemon's last batch" for i in range(16)]}
    with httpx.Client(timeout=60) as client:
        while True:
            try:
                r = client.post(url + "/v1/embed", json=body)
            except httpx.TransportError:
                out.append("cut")
                return
            out.append(str(r.status_code))
            if stop.is_set() or r.status_code != 200:
                return


def test_killed_daemon_leaves_nothing_and_one_daemon_per_home(tmp_path):
    home = tmp_path / "home"
    a = start_daemon(home)
    b: DaemonProc | None = None
    live_queue: LocalQueue | None = None
    try:
        # 1. A second daemon on the same home: refused, one line naming the first.
        env = {**os.environ, "FLEET_HOME": str(home), "FLEET_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"}
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "fleetctl", "serve"], env=env, capture_output=True,
                                text=True, timeout=120, stdin=subprocess.DEVNULL)
        refused_s = time.monotonic() - t0
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 1, second.stderr
        assert len(errors) == 1, second.stderr
        assert f"pid {a.proc.pid}, {a.url}" in errors[0] and str(home) in errors[0], errors
        assert httpx.get(a.url + "/readyz", timeout=10).status_code == 200  # the first one is untouched

        # 2. kill -9 of A's process only: its children go by themselves.
        ps = httpx.get(a.url + "/v1/ps", timeout=10).json()
        workers = [w["pid"] for w in ps["workers"]]
        children = children_of(a.proc.pid)
        trackers = [pid for pid in children if "resource_tracker" in cmdline(pid)]
        assert workers and set(workers) <= set(children), (workers, children)
        assert len(trackers) == 1, [cmdline(p) for p in children]
        assert len(queue_entries(a.proc.pid)) == 3
        # Under load: the worker is mid-batch when its daemon dies.
        stop = threading.Event()
        outcomes: list[str] = []
        clients = [threading.Thread(target=client_loop, args=(a.url, stop, outcomes)) for _ in range(CLIENTS)]
        for t in clients:
            t.start()
        while outcomes.count("200") < CLIENTS and all(t.is_alive() for t in clients):
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(timeout=10)
        stop.set()
        for t in clients:
            t.join(timeout=60)
        exit_s: dict[int, float] = {}
        while len(exit_s) < len(children) and time.monotonic() - killed_at < 30:
            for pid in children:
                if pid not in exit_s and gone(pid):
                    exit_s[pid] = time.monotonic() - killed_at
            time.sleep(0.01)
        counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
        print(f"after kill -9 of the daemon under load: worker(s) {[round(exit_s.get(p, -1), 3) for p in workers]} s, "
              f"resource tracker {round(exit_s.get(trackers[0], -1), 3)} s (target {EXIT_TARGET_S} s); "
              f"client outcomes {counts}; a second daemon on the home was refused in {refused_s:.2f} s")
        # Every client ended: answered, or cut off with the process (no hang, no other answer).
        assert not any(t.is_alive() for t in clients)
        assert set(outcomes) <= {"200", "cut"} and outcomes.count("cut") == CLIENTS, counts
        assert set(exit_s) == set(children), f"still running 30 s after the kill: {set(children) - set(exit_s)}"
        assert max(exit_s.values()) < EXIT_BOUND_S, exit_s
        # Nothing ran to remove A's queue: its entries are still there.
        assert len(queue_entries(a.proc.pid)) == 3

        # 3. B on the same home: A's lock died with A; A's entries go, a live owner's stay.
        live_queue = LocalQueue.create(f"fleet-{os.getpid()}", slots=16, slab_bytes=1 << 16)
        b = start_daemon(home)
        assert queue_entries(a.proc.pid) == set()
        assert len(queue_entries(os.getpid())) == 3
        assert len(queue_entries(b.proc.pid)) == 3
        log = b.log()
        assert log.count("shared-memory entries of dead daemons") == 1 and f"fleet-{a.proc.pid}.lock" in log
        r = httpx.post(b.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["after the kill"]}, timeout=120)
        assert r.status_code == 200 and r.json()["shape"] == [1, 384]

        # 4. A clean stop removes B's own entries.
        b_pid = b.proc.pid
        b_workers = [w["pid"] for w in httpx.get(b.url + "/v1/ps", timeout=10).json()["workers"]]
        assert b.stop() in (0, -signal.SIGTERM)
        assert queue_entries(b_pid) == set()
        assert all(gone(pid) for pid in b_workers)
    finally:
        for d in (a, b):
            if d is not None:
                d.stop()
        if live_queue is not None:
            live_queue.close()
            live_queue.unlink()
