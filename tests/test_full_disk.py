"""A full disk on pin, unpin and config writes (issue 25, deliverable 7).

FLEET_HOME on a small tmpfs that the test fills. Before: a pin answered 500
"internal error: OSError" and left `.pins.json.<pid>.tmp`. Now: 507
`insufficient_storage` naming the model, no temporary file left, the old file as
it was, and the same request succeeds once there is room. Needs root to mount;
skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.bench.daemon import LocalDaemon
from fleet.catalog import Profile, TunedInfo, write_tuned_profile
from fleet.errors import InsufficientStorage
from fleet.pins import PinStore
from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import DEFAULT_MODEL, START_TIMEOUT_S, default_model_dir

COPY = "minilm-copy"


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted in a temp dir (unmounted after the test)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the disk has no room left; returns it (delete it to make room)."""
    filler = disk / "filler"
    for name, size in (("filler", 64 << 10), ("filler-tail", 512)):  # the tail: what is left of a page
        with open(disk / name, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


def leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in home.iterdir() if p.name.endswith(".tmp"))


def test_a_pin_on_a_full_disk_is_insufficient_storage_and_leaves_nothing(small_disk: Path) -> None:
    home = small_disk / "home"
    pins = PinStore(home)
    pins.add("first", "cpu")
    before = (home / "pins.json").read_bytes()
    filler = fill(small_disk)
    for change in (lambda: pins.add("second", "cpu"), lambda: pins.remove("first")):
        with pytest.raises(InsufficientStorage, match="no space left to save the .*pin of '(second|first)'"):
            change()
        assert leftovers(home) == []
        assert (home / "pins.json").read_bytes() == before
    filler.unlink()
    (small_disk / "filler-tail").unlink()
    pins.add("second", "cpu")
    assert set(pins.load()) == {"first", "second"} and leftovers(home) == []


def test_a_tuned_profile_on_a_full_disk_leaves_models_toml_as_it_was(small_disk: Path) -> None:
    home = small_disk / "home"
    home.mkdir()
    (home / "models.toml").write_text(f'[models."{DEFAULT_MODEL}"]\nprofile = {{ max_batch_items = 8 }}\n')
    before = (home / "models.toml").read_bytes()
    fill(small_disk)
    info = TunedInfo(tuned_at="2026-12-04T00:00:00Z", knee_tokens_per_s=1000.0, knee_p95_ms=50.0)
    with pytest.raises(InsufficientStorage, match=f"tuned profile of '{DEFAULT_MODEL}'"):
        write_tuned_profile(home, DEFAULT_MODEL, "cpu-test", Profile(), info)
    assert (home / "models.toml").read_bytes() == before
    assert [p.name for p in home.iterdir() if p.name.startswith(".")] == []


@pytest.fixture()
def daemon_on_small_disk(small_disk: Path, tmp_path: Path) -> Iterator[tuple[LocalDaemon, Path]]:
    """A daemon at the shipped settings whose FLEET_HOME is on the small disk; the store
    (hundreds of MB) is a link to a folder on the big one."""
    models = tmp_path / "models"
    store = Store(models)
    pull_model(store, DEFAULT_MODEL)
    pull_model(store, f"path:{default_model_dir()}", name=COPY)
    home = small_disk / "home"
    home.mkdir()
    (home / "models").symlink_to(models)
    env = {"FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2")}
    d = LocalDaemon(home, env=env, timeout_s=START_TIMEOUT_S, log=tmp_path / "daemon.log")
    yield d, home
    d.stop()


def test_pin_and_unpin_on_a_full_disk_answer_507(daemon_on_small_disk: tuple[LocalDaemon, Path]) -> None:
    d, home = daemon_on_small_disk
    pin = f"{d.url}/v1/models/{COPY}/pin"
    admin = d.admin  # read before the disk is full (the key lives on it)
    assert httpx.post(pin, headers=admin, timeout=120).status_code == 200  # room: persisted
    unpinned_default = f"{d.url}/v1/models/{DEFAULT_MODEL}/pin"
    before = (home / "pins.json").read_bytes()
    filler = fill(home.parent)

    refused = httpx.delete(pin, headers=admin, timeout=60)
    assert refused.status_code == 507, refused.text
    err = refused.json()["error"]
    assert err["code"] == "insufficient_storage" and COPY in err["message"] and str(home) not in err["message"]
    refused = httpx.post(unpinned_default, headers=admin, timeout=120)
    assert refused.status_code == 507, refused.text
    assert leftovers(home) == [] and (home / "pins.json").read_bytes() == before
    assert set(PinStore(home).load()) == {COPY}

    filler.unlink()
    (home.parent / "filler-tail").unlink()
    assert httpx.delete(pin, headers=admin, timeout=60).status_code == 200
    assert httpx.post(unpinned_default, headers=admin, timeout=120).status_code == 200
    assert set(PinStore(home).load()) == {DEFAULT_MODEL} and leftovers(home) == []

    # A pin that cannot be saved is not made: the worker lets go of it again.
    fill(home.parent)
    refused = httpx.post(pin, headers=admin, timeout=120)
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "insufficient_storage"
    held = {n: m for w in httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"] for n, m in w["models"].items()}
    assert held[COPY]["pinned"] is False and held[DEFAULT_MODEL]["pinned"] is True
    assert leftovers(home) == [] and set(PinStore(home).load()) == {DEFAULT_MODEL}
