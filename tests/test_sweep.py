"""Stale shared-memory entries of dead queue owners (local_queue.sweep): the policy
over a table of names, then real queues in /dev/shm owned by a live and a dead process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleet.local_queue import LocalQueue
from fleet.local_queue.sweep import SHM_DIR, find_stale, owner_of, pid_alive, queue_name, sweep_stale

DEAD, LIVE = 4001, 4002


@pytest.mark.parametrize("entry, owner", [
    ("fleet-4001", ("fleet-4001", 4001)),
    ("fleet-4001.lock", ("fleet-4001", 4001)),
    ("sem.fleet-4001.work", ("fleet-4001", 4001)),
    ("sem.fleet-4001.results", ("fleet-4001", 4001)),  # queues of earlier versions
    ("fleet-4001.wake", ("fleet-4001", 4001)),
    ("fleet-4001.work", None),           # a semaphore name only under sem.
    ("sem.fleet-4001", None),            # a segment never under sem.
    ("sem.fleet-4001.lock", None),
    ("fleet-q-3fa2b1c0d4e5", None),      # a queue not named after a pid
    ("fleet-0", None),
    ("fleet-4001.tmp", None),
    ("fleetx-4001", None),               # another prefix
    ("other-4001", None),
    ("sem.mp-80uqaqv7", None),           # multiprocessing's own semaphores
    ("fleet-4001-extra", None),
])
def test_which_entries_belong_to_a_pid_named_queue(entry, owner):
    assert owner_of(entry, "fleet") == owner


def test_only_the_dead_owners_entries_are_stale():
    entries = [f"{e}" for pid in (DEAD, LIVE) for e in (
        f"fleet-{pid}", f"fleet-{pid}.lock", f"sem.fleet-{pid}.work", f"sem.fleet-{pid}.results")]
    entries += ["sem.mp-80uqaqv7", "fleet-q-abc", "notes.txt"]
    asked: list[int] = []

    def alive(pid: int) -> bool:
        asked.append(pid)
        return pid == LIVE

    assert find_stale(entries, "fleet", alive) == sorted(
        [f"fleet-{DEAD}", f"fleet-{DEAD}.lock", f"sem.fleet-{DEAD}.results", f"sem.fleet-{DEAD}.work"])
    assert sorted(asked) == [DEAD, LIVE]  # one question per queue, not per entry


def test_sweep_removes_files_of_dead_owners_only(tmp_path):
    for pid in (DEAD, LIVE):
        for e in (f"fleet-{pid}", f"fleet-{pid}.lock", f"sem.fleet-{pid}.work", f"sem.fleet-{pid}.results"):
            (tmp_path / e).write_bytes(b"x")
    (tmp_path / "fleet-q-abc").write_bytes(b"x")
    removed = sweep_stale("fleet", shm_dir=tmp_path, alive=lambda pid: pid == LIVE)
    assert len(removed) == 4 and all(str(DEAD) in e for e in removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["fleet-q-abc", f"fleet-{LIVE}", f"fleet-{LIVE}.lock", f"sem.fleet-{LIVE}.results", f"sem.fleet-{LIVE}.work"])
    assert sweep_stale("fleet", shm_dir=tmp_path / "missing") == []


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def shm_entries(name: str) -> set[str]:
    return {e for e in os.listdir(SHM_DIR) if e in (name, f"{name}.lock", f"{name}.wake")}


def test_entries_named_after_the_sweeper_itself_are_stale(tmp_path):
    """The sweeper has not created its queue yet: one already named after its pid
    is a dead process's (a reused pid) and would make its own create fail."""
    me = os.getpid()
    for e in (f"fleet-{me}", f"fleet-{me}.lock", f"fleet-{LIVE}"):
        (tmp_path / e).write_bytes(b"x")
    assert sorted(sweep_stale("fleet", shm_dir=tmp_path, alive=lambda pid: True)) == [f"fleet-{me}", f"fleet-{me}.lock"]
    assert [p.name for p in tmp_path.iterdir()] == [f"fleet-{LIVE}"]


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
def test_real_queue_of_a_dead_pid_is_swept_and_a_live_ones_is_kept():
    """Real segments, locks and wake FIFOs in /dev/shm: one queue named after a
    process that has exited, one after a process that runs. Only the prefix of
    this test is swept, so no other queue on the box is touched."""
    prefix = f"fleetsweeptest{os.getpid()}"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = LocalQueue.create(queue_name(prefix, dead_pid()), slots=16, slab_bytes=1 << 16)
    live = LocalQueue.create(queue_name(prefix, owner.pid), slots=16, slab_bytes=1 << 16)
    dead.close()  # the owner died: nobody holds it any more
    try:
        assert len(shm_entries(dead.name)) == 3 and len(shm_entries(live.name)) == 3
        removed = sweep_stale(prefix)
        assert sorted(removed) == sorted(
            [dead.name, f"{dead.name}.lock", f"{dead.name}.wake"])
        assert shm_entries(dead.name) == set()
        assert len(shm_entries(live.name)) == 3
        with pytest.raises(FileNotFoundError):
            LocalQueue.attach(dead.name)
        LocalQueue.attach(live.name).close()  # the live one still works
    finally:
        owner.kill()
        owner.wait()
        live.close()
        live.unlink()
        dead.unlink()


def test_entries_this_user_may_not_remove_are_skipped(tmp_path, monkeypatch):
    """/dev/shm is sticky: another user's stale entries cannot be removed (EPERM),
    and a start must not fail on them. The refusal is injected: tests run as root here."""
    for e in (f"fleet-{DEAD}", f"fleet-{DEAD}.lock", f"fleet-{DEAD + 1}"):
        (tmp_path / e).write_bytes(b"x")
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if str(DEAD) in str(path) and str(DEAD + 1) not in str(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr("fleet.local_queue.sweep.os.unlink", unlink)
    assert sweep_stale("fleet", shm_dir=tmp_path, alive=lambda pid: False) == [f"fleet-{DEAD + 1}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"fleet-{DEAD}", f"fleet-{DEAD}.lock"]
