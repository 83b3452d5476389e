"""Blobs uploaded for `ollama create` (`POST /api/blobs/sha256:...`) do not pile up
under FLEET_HOME/blobs: a blob no stored model holds goes `blob_keep_ms` after its
last use (swept by the daemon), and a model's blobs go with it when it is removed
(`/api/delete`, `fleetctl rm`) unless another stored model holds them (fleet.blobs).

The policy on a folder with fake times first; then a real daemon with the real
`ollama` client, a tiny Llama and a peft LoRA of it in their hub layouts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleet import blobs
from fleet.store import Store
from tests.conftest import ollama_operator, start_daemon
from tests.gen_models import build_llama, build_lora, pull

#: The daemon's keep time in these tests (the shipped one is an hour): sweeps every 1.5 s.
KEEP_MS = 3_000


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_sweep_removes_only_unused_blobs_past_their_keep_time(tmp_path: Path) -> None:
    """Held by a stored model: kept however old. Unheld: kept while fresh, removed once
    older than the keep time. Half-written uploads likewise; other files are not ours."""
    home = tmp_path / "home"
    llama = build_llama(tmp_path / "llama")
    pull(home, llama, "tiny-llama")
    store = Store(home / "models")
    held_hex = store.get("tiny-llama").files[0].sha256
    folder = blobs.blobs_dir(home)
    folder.mkdir()
    now = time.time()
    files = {
        "held": folder / f"sha256-{held_hex}",
        "stale": folder / f"sha256-{digest_of(b'stale')}",
        "fresh": folder / f"sha256-{digest_of(b'fresh')}",
        "stale part": folder / f".sha256-{digest_of(b'cut')}.140234.part",
        "fresh part": folder / f".sha256-{digest_of(b'going')}.140235.part",
        "not ours": folder / "README",
    }
    for name, path in files.items():
        path.write_bytes(name.encode())
        age = 0 if name.startswith("fresh") else 7200
        os.utime(path, (now - age, now - age))
    removed = blobs.sweep(home, store, keep_s=3600, now=now)
    assert sorted(removed) == sorted([files["stale"].name, files["stale part"].name])
    assert {name for name, path in files.items() if path.exists()} == {"held", "fresh", "fresh part", "not ours"}
    # A touch (HEAD, a create) starts the keep time again.
    os.utime(files["fresh"], (now - 7200, now - 7200))
    blobs.touch(files["fresh"])
    assert blobs.sweep(home, store, keep_s=3600) == []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ollama-blobs")
    home = root / "home"
    llama = build_llama(root / "llama")
    pull(home, llama, "tiny-llama")
    lora = build_lora(llama, root / "tone", seed=3)
    d = start_daemon(home, extra_env={"FLEET_BLOB_KEEP_MS": str(KEEP_MS)})
    yield d, lora
    d.stop()


def blob_files(home: Path) -> set[str]:
    folder = blobs.blobs_dir(home)
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def wait_for(check, what: str, within_s: float = 30.0) -> None:
    """Poll `check` until it holds; the bound is generous (sweeps every KEEP_MS / 2)."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def held_by(home: Path, model: str) -> set[str]:
    """The blob file names of a stored model's files."""
    return {f"sha256-{f.sha256}" for f in Store(home / "models").get(model).files}


def upload_adapter(client, lora: Path) -> dict[str, str]:
    return {f.name: client.create_blob(f) for f in sorted(lora.iterdir()) if f.is_file()}


def test_unused_uploads_are_swept_and_a_models_blobs_go_with_it(served) -> None:
    d, lora = served
    client = ollama_operator(d)
    stray = f"sha256:{digest_of(b'never used by a create')}"
    assert httpx.post(d.url + f"/api/blobs/{stray}", content=b"never used by a create", headers=d.admin,
                      timeout=30).status_code == 201
    adapters = upload_adapter(client, lora)
    assert client.create(model="tone", from_="tiny-llama", adapters=adapters).status == "success"
    uploaded = {digest.replace(":", "-") for digest in adapters.values()}
    # The model's own files; the folder's README.md is not one (a pull skips it): its blob is unused too.
    adapter_files = held_by(d.home, "tone")
    readme = adapters["README.md"].replace(":", "-")
    assert adapter_files == uploaded - {readme}
    stray_file = stray.replace(":", "-")
    assert uploaded | {stray_file} <= blob_files(d.home)

    # The unused uploads go after their keep time; the adapter's blobs stay, held by "tone".
    wait_for(lambda: not {stray_file, readme} & blob_files(d.home), "the unused blobs were never swept")
    assert httpx.head(d.url + f"/api/blobs/{stray}", headers=d.admin, timeout=10).status_code == 404
    time.sleep(2 * KEEP_MS / 1000)  # past the keep time of the adapter's blobs too, and a sweep more
    assert adapter_files <= blob_files(d.home)
    for name in adapter_files:
        assert httpx.head(d.url + f"/api/blobs/{name.replace('-', ':')}", headers=d.admin,
                          timeout=10).status_code == 200

    # Deleting the model releases its blobs at once.
    client.delete("tone")
    assert not adapter_files & blob_files(d.home)
    gone = httpx.head(d.url + f"/api/blobs/{adapters['adapter_model.safetensors']}", headers=d.admin, timeout=10)
    assert gone.status_code == 404


def test_fleetctl_rm_releases_blobs_no_other_model_holds(served) -> None:
    d, lora = served
    client = ollama_operator(d)
    pull(d.home, lora, "tone-pulled", "--base", "tiny-llama")  # the same files, pulled from the folder
    adapters = upload_adapter(client, lora)
    for name in ("tone-a", "tone-b"):
        assert client.create(model=name, from_="tiny-llama", adapters=adapters).status == "success"
    adapter_files = held_by(d.home, "tone-a")
    assert adapter_files == held_by(d.home, "tone-pulled")

    def rm(name: str) -> None:
        out = subprocess.run([sys.executable, "-m", "fleetctl", "rm", name, "--yes"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "FLEET_HOME": str(d.home)},
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr

    rm("tone-a")  # tone-b and tone-pulled hold the same files
    assert adapter_files <= blob_files(d.home)
    client.delete("tone-b")  # tone-pulled still does
    assert adapter_files <= blob_files(d.home)
    rm("tone-pulled")
    assert not adapter_files & blob_files(d.home)
