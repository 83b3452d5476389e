"""A full disk under the store: `/api/copy` answers 507 (issue 42, item 9).

FLEET_HOME, store included, on a 128 MiB tmpfs (the default model takes 88 MB of
it) that the test fills. Before: `/api/copy` answered 500 ("internal error:
OSError", or a pull error naming the store's path). Now: 507 in Ollama's error
shape naming the model, nothing left in the store, the daemon serving, and the
same copy succeeds once there is room. Needs root to mount; skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.bench.daemon import LocalDaemon
from tests.conftest import DEFAULT_MODEL, START_TIMEOUT_S
from tests.test_full_disk import fill

COPY = "minilm-copy"


@pytest.fixture()
def daemon_on_a_small_disk(tmp_path: Path) -> Iterator[tuple[LocalDaemon, Path]]:
    """A daemon at the shipped settings whose whole FLEET_HOME (store too) is on a 128 MiB tmpfs."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {out.stderr.strip()}")
    try:
        env = {"FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2")}
        d = LocalDaemon(mnt / "home", env=env, timeout_s=START_TIMEOUT_S, log=tmp_path / "daemon.log")
        try:
            yield d, mnt
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def stored(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir() if p.name != ".locks")


def test_a_copy_on_a_full_disk_is_507_and_leaves_nothing(daemon_on_a_small_disk: tuple[LocalDaemon, Path]) -> None:
    d, disk = daemon_on_a_small_disk
    admin = d.admin  # read before the disk is full (the key lives on it)
    home = disk / "home"
    filler = fill(disk)
    body = {"source": DEFAULT_MODEL, "destination": COPY}

    refused = httpx.post(d.url + "/api/copy", json=body, headers=admin, timeout=120)
    assert refused.status_code == 507, refused.text
    message = refused.json()["error"]
    assert COPY in message and "no space left" in message and str(disk) not in message
    assert stored(home) == [DEFAULT_MODEL]  # no half copy, no staging folder
    embedded = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["still serving"]}, timeout=60)
    assert embedded.status_code == 200, embedded.text

    filler.unlink()
    (disk / "filler-tail").unlink()
    copied = httpx.post(d.url + "/api/copy", json=body, headers=admin, timeout=120)
    assert copied.status_code == 200, copied.text
    assert stored(home) == sorted([DEFAULT_MODEL, COPY])
    tags = httpx.get(d.url + "/api/tags", timeout=30).json()["models"]
    assert {m["name"] for m in tags} == {f"{DEFAULT_MODEL}:latest", f"{COPY}:latest"}
