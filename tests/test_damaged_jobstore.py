"""A damaged batch store is set aside; a start that fails exits 1 (issue 42, item 4).

Before: with `batches/jobs.db` damaged (bytes overwritten, or truncated) the app's
start failed ("database disk image is malformed") and `fleetctl serve` neither
exited nor listened, its workers still up: interactive inference was down with
the batch store. Now the damaged store (database and the files it names) is
renamed `batches.damaged-<UTC time>`, logged once, named by `fleetctl doctor`,
and the daemon starts with an empty one; a start that fails for any other reason
stops what it started and exits 1 with one line.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from fleet.daemon.jobstore import DAMAGED_PREFIX, JobStore, new_file_id
from fleet.batches import FileObject
from tests.conftest import DEFAULT_MODEL, free_port, start_daemon

#: What a crash, a bad disk or a hand edit leaves of the database.
DAMAGE = {
    # One page's bytes overwritten: sqlite reads it at open ("database disk image is malformed").
    "overwritten": lambda raw: raw[:4096] + b"\xa5" * 4096 + raw[8192:],
    # The last page overwritten: opening never reads it, sqlite's quick_check does.
    "overwritten at the end": lambda raw: raw[:-4000] + b"\xff" * 4000,
    "truncated": lambda raw: raw[: len(raw) // 2 + 100],
}


def damaged_store(home: Path, how: str) -> str:
    """A store with files (rows and bytes) written through JobStore, then damaged; the id of one file."""
    store = JobStore(home)
    ids = []
    for i in range(200):
        f = FileObject(id=new_file_id(), bytes=3, created_at=1, filename=f"input-{i:03}.jsonl", purpose="batch")
        store.add_file(f, lines=1, span=1)
        store.path(f.id).write_bytes(b"{}\n")
        ids.append(f.id)
    store.close()  # the last connection: the journal is folded into jobs.db
    db = home / "batches" / "jobs.db"
    assert not (home / "batches" / "jobs.db-wal").exists()
    db.write_bytes(DAMAGE[how](db.read_bytes()))
    return ids[0]


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_store_is_set_aside_whole_and_an_empty_one_opens(tmp_path: Path, how: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "home"
    kept = damaged_store(home, how)
    with caplog.at_level(logging.ERROR, logger="fleet.batches"):
        store = JobStore(home)
        assert store.list_files(after=None, limit=10, order="desc", purpose=None) == ([], False)
        f = FileObject(id=new_file_id(), bytes=3, created_at=1, filename="new.jsonl", purpose="batch")
        store.add_file(f)
        assert store.get_file(f.id).file == f
        store.close()
        JobStore(home).close()  # the fresh store is whole: nothing more is set aside
    aside = sorted(p.name for p in home.iterdir() if p.name.startswith(DAMAGED_PREFIX))
    assert len(aside) == 1
    # The damaged database and the files it names, together, for the operator to repair.
    assert (home / aside[0] / "jobs.db").is_file() and (home / aside[0] / "files" / kept).read_bytes() == b"{}\n"
    logged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(logged) == 1 and aside[0] in logged[0]


def test_serve_with_a_damaged_store_serves_and_doctor_names_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    damaged_store(home, "overwritten")
    d = start_daemon(home)
    try:
        embedded = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a text"]}, timeout=60)
        assert embedded.status_code == 200, embedded.text
        listed = httpx.get(d.url + "/v1/files", timeout=30)
        assert listed.status_code == 200 and listed.json()["data"] == []
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                           "body": {"model": DEFAULT_MODEL, "input": "x"}}) + "\n"
        uploaded = httpx.post(d.url + "/v1/files", files={"file": ("in.jsonl", line.encode())},
                              data={"purpose": "batch"}, timeout=30)
        assert uploaded.status_code == 200, uploaded.text
        assert d.log().count("jobs.db is damaged") == 1
        env = {**os.environ, "FLEET_HOME": str(home), "FLEET_URL": d.url}
        doctor = subprocess.run([sys.executable, "-m", "fleetctl", "doctor", "--json"], env=env,
                                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        d.stop()
    aside = [p for p in home.iterdir() if p.name.startswith(DAMAGED_PREFIX)]
    assert len(aside) == 1
    findings = [f for f in json.loads(doctor.stdout) if f["check"] == "damaged"]
    assert [f["level"] for f in findings] == ["warn"], doctor.stdout
    assert str(aside[0]) in findings[0]["detail"] and "batch store" in findings[0]["detail"]


def test_serve_exits_1_when_its_start_fails_and_leaves_no_process(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "batches").write_text("a file where the batch store's folder goes")
    port = free_port()
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_PORT": str(port), "HF_HUB_OFFLINE": "1",
           "FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2")}
    env.pop("FLEET_URL", None)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fleetctl", "serve"], env=env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "did not start" in errors[0] and "Not a directory" in errors[0], out.stderr[-3000:]
    assert time.monotonic() - t0 < 110
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens
    # Its worker went with it.
    left = []
    for p in psutil.process_iter(["environ"]):
        if (p.info["environ"] or {}).get("FLEET_HOME") == str(home):
            left.append(p.pid)
    assert left == []
    # Not damage: nothing was set aside.
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(DAMAGED_PREFIX)) == []
