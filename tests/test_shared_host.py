"""Loopback is a shared host (issue 42, item 8): every user of the box reaches a loopback
daemon, so what changes the daemon is the operator's, and what clients may fill is bounded.

At the shipped settings:
- every route that changes the daemon (pin, unpin, load, unload, Ollama's pull, delete,
  copy, create, push and blobs; a per-model URL too) refuses a plain loopback client
  401 and one with another key 403, in the route's error shape, and changes nothing;
  the operator's `fleetctl`, run by the user who owns FLEET_HOME, works with no extra
  step (it reads `FLEET_HOME/admin.key`, 0600, and sends it only to that daemon);
- inference stays open (a stored model loads on first use), but a client's Ollama
  `keep_alive` neither pins nor unloads: named as not applied;
- `/api/copy` shares the original's files (hard links) and keeps its source: no record of
  a deleted temporary folder, and `/api/pull` names models, never paths;
- copies stop at `store_max_models` (507), batch uploads at `batch_files_max_bytes`
  (by default a quarter of the disk holding FLEET_HOME: a small tmpfs here, as
  tests/test_full_disk.py mounts it; skipped without root).

Before: each route answered the plain client and acted; `fleetctl` had no key to read;
`keep_alive: -1` pinned; a copy was a full copy recorded as `path:<home>/tmpXXXX` and
`/api/pull` of it answered that path; copies and uploads went on until the disk was full.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from fleet.bench.daemon import LocalDaemon
from fleet.pins import PinStore
from fleet.pull import pull_model
from fleet.store import Manifest, Store
from tests.conftest import (
    DEFAULT_MODEL, START_TIMEOUT_S, ollama_operator, start_daemon,
)

SPARE = "spare"
BLOB = b"a blob another user would upload"
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    """A daemon at the shipped settings; the catalog's MiniLM (preloaded) and a spare copy stored."""
    home = tmp_path_factory.mktemp("shared-home")
    store = Store(home / "models")
    store.clone(pull_model(store, DEFAULT_MODEL).manifest, SPARE)
    d = start_daemon(home)
    yield d
    d.stop()


def state(d: LocalDaemon) -> dict:
    """What a refused request must leave as it was."""
    workers = httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"]
    return {
        "stored": sorted(m["name"] for m in httpx.get(d.url + "/api/tags", timeout=30).json()["models"]),
        "resident": sorted((n, bool(m.get("pinned"))) for w in workers for n, m in w["models"].items()),
        "pins": sorted(PinStore(d.home).load()),
        "blob": httpx.head(f"{d.url}/api/blobs/{DIGEST}", headers=d.admin, timeout=30).status_code,
    }


#: (method, path, body): every route that changes the daemon, with a body that would act.
CHANGING = [
    ("POST", f"/v1/models/{SPARE}/pin", None),
    ("DELETE", f"/v1/models/{DEFAULT_MODEL}/pin", None),
    ("POST", f"/v1/models/{SPARE}/load", None),
    ("POST", f"/v1/models/{DEFAULT_MODEL}/unload", None),
    ("POST", f"/models/{SPARE}/v1/models/{SPARE}/load", None),
    ("POST", "/api/pull", {"model": DEFAULT_MODEL, "stream": False}),
    ("DELETE", "/api/delete", {"model": SPARE}),
    ("POST", "/api/copy", {"source": SPARE, "destination": "taken"}),
    ("POST", "/api/create", {"model": "made", "from": SPARE, "adapters": {"adapter_config.json": DIGEST},
                             "stream": False}),
    ("POST", f"/api/blobs/{DIGEST}", BLOB),
    ("HEAD", f"/api/blobs/{DIGEST}", None),
    ("POST", "/api/push", {"model": SPARE}),
    ("POST", "/v1/store/pull", {"source": DEFAULT_MODEL, "force": True}),
    ("DELETE", f"/v1/models/{SPARE}", None),
]


def call(d: LocalDaemon, method: str, path: str, body, headers: dict[str, str]) -> httpx.Response:
    content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    return httpx.request(method, d.url + path, content=content, timeout=120,
                         headers={**headers, **({"Content-Type": "application/json"} if body is not None else {})})


def refusal(resp: httpx.Response, path: str) -> str:
    """The refusal's message, checked to be in the route's shape (Ollama's on /api)."""
    if resp.request.method == "HEAD":
        return ""
    err = resp.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(err, str), resp.text
        return err
    assert err["code"] == {401: "unauthorized", 403: "forbidden"}[resp.status_code], resp.text
    return err["message"]


def test_routes_that_change_the_daemon_refuse_a_plain_loopback_client(shared: LocalDaemon) -> None:
    before = state(shared)
    for method, path, body in CHANGING:
        plain = call(shared, method, path, body, {})
        assert plain.status_code == 401, (method, path, plain.status_code, plain.text)
        assert method == "HEAD" or "admin key" in refusal(plain, path)
        # OpenAI's clients send a placeholder key on loopback; an API key is not the admin key either.
        other = call(shared, method, path, body, {"Authorization": "Bearer unused-on-loopback"})
        assert other.status_code == 403, (method, path, other.status_code, other.text)
        assert str(shared.home) not in refusal(other, path)
    assert state(shared) == before
    # The operator's key opens them.
    assert call(shared, "POST", f"/v1/models/{SPARE}/pin", None, shared.admin).status_code == 200
    assert call(shared, "DELETE", f"/v1/models/{SPARE}/pin", None, shared.admin).status_code == 200
    assert call(shared, "POST", f"/v1/models/{SPARE}/unload", None, shared.admin).status_code == 200
    assert state(shared) == before


def test_fleetctl_of_the_user_owning_fleet_home_needs_no_extra_step(shared: LocalDaemon) -> None:
    key = shared.home / "admin.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600  # other users cannot read it
    # The daemon is found through its lock file (no FLEET_URL), the key through FLEET_HOME.
    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_URL", "FLEET_ADMIN_KEY", "FLEET_API_KEY")}
    env["FLEET_HOME"] = str(shared.home)
    for verb in ("pin", "unpin"):
        out = subprocess.run([sys.executable, "-m", "fleetctl", verb, SPARE], env=env, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
    assert f"{verb}ned {SPARE}" in out.stdout
    # The key goes only to the daemon it belongs to: not to another URL this client is pointed at.
    from fleetctl.client import Client

    with pytest.MonkeyPatch.context() as mp:
        for name in ("FLEET_ADMIN_KEY", "FLEET_API_KEY", "FLEET_API_KEY_FILE"):
            mp.delenv(name, raising=False)
        mp.setenv("FLEET_HOME", str(shared.home))
        with Client(shared.url) as own, Client(f"http://127.0.0.1:{shared.port + 1}") as other:
            assert own.headers["Authorization"] == shared.admin["Authorization"]
            assert "Authorization" not in other.headers


def ignored(resp: httpx.Response) -> list[str]:
    return [f.strip() for f in resp.headers.get("x-fleet-ignored-fields", "").split(",")]


def resident(d: LocalDaemon) -> dict[str, dict]:
    return {n: m for w in httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"] for n, m in w["models"].items()}


def test_inference_stays_open_but_a_clients_keep_alive_neither_pins_nor_unloads(shared: LocalDaemon) -> None:
    call(shared, "POST", f"/v1/models/{SPARE}/unload", None, shared.admin)
    # A stored model that is not resident loads on first use: loads are the memory policy's.
    r = httpx.post(shared.url + "/api/embed", json={"model": SPARE, "input": "a", "keep_alive": -1}, timeout=120)
    assert r.status_code == 200, r.text
    assert "keep_alive" in ignored(r)
    assert resident(shared)[SPARE]["pinned"] is False
    r = httpx.post(shared.url + "/api/embed", json={"model": SPARE, "input": "a", "keep_alive": 0}, timeout=120)
    assert r.status_code == 200 and "keep_alive" in ignored(r)
    assert SPARE in resident(shared)  # not unloaded on a client's word
    # The operator's keep_alive is applied, as Ollama applies it.
    operator = ollama_operator(shared, timeout=120)
    operator.embed(model=SPARE, input="a", keep_alive=-1)
    assert resident(shared)[SPARE]["pinned"] is True
    operator.embed(model=SPARE, input="a", keep_alive=0)
    assert SPARE not in resident(shared)


def test_a_copy_shares_its_files_keeps_its_source_and_pull_names_no_path(shared: LocalDaemon) -> None:
    store = Store(shared.home / "models")
    r = call(shared, "POST", "/api/copy", {"source": SPARE, "destination": "spare-copy"}, shared.admin)
    assert r.status_code == 200, r.text
    original, copy = store.get(SPARE), store.get("spare-copy")
    assert copy.source == original.source and copy.files == original.files
    for f in copy.files:  # the same inode: a copy takes no room on the disk
        assert (store.path("spare-copy") / f.path).stat().st_ino == (store.path(SPARE) / f.path).stat().st_ino
    pulled = call(shared, "POST", "/api/pull", {"model": "spare-copy", "stream": False}, shared.admin)
    assert pulled.status_code == 200 and pulled.json() == {"status": "success"}, pulled.text

    # A model recorded with a folder that is gone, as copies made before were (a temporary
    # folder in FLEET_HOME): its pull is refused naming the model, never the folder.
    store.clone(original, "orphan")
    with store.lock("orphan"):
        store.rewrite_manifest(msgspec.structs.replace(store.get("orphan"),
                                                       source=f"path:{shared.home}/tmpk2x9_q4m"))
    for stream in (False, True):
        r = call(shared, "POST", "/api/pull", {"model": "orphan", "stream": stream}, shared.admin)
        assert r.status_code == 502, r.text
        assert "orphan" in r.json()["error"] and str(shared.home) not in r.text and "tmpk2x9" not in r.text
    for name in ("spare-copy", "orphan"):
        assert call(shared, "DELETE", "/api/delete", {"model": name}, shared.admin).status_code == 200


def fake_model(store: Store, name: str) -> None:
    """A stored model as far as counting goes: a folder with a manifest (never served)."""
    folder = store.root / name
    folder.mkdir()
    (folder / "manifest.json").write_bytes(msgspec.json.encode(Manifest(
        name=name, source="path:/nonexistent", task="embed", runtime="sentence-transformers", files=[],
        created_at="2026-01-01T00:00:00Z")))


def test_copies_stop_at_store_max_models(shared: LocalDaemon) -> None:
    store = Store(shared.home / "models")
    limit = 1000  # the shipped store_max_models
    fakes = [f"filler-{i:04d}" for i in range(limit - 1 - len(store.names()))]
    try:
        for name in fakes:
            fake_model(store, name)
        assert call(shared, "POST", "/api/copy", {"source": SPARE, "destination": "last-copy"},
                    shared.admin).status_code == 200  # the 1000th
        refused = call(shared, "POST", "/api/copy", {"source": SPARE, "destination": "one-too-many"}, shared.admin)
        assert refused.status_code == 507, refused.text
        assert "store_max_models" in refused.json()["error"] and not store.exists("one-too-many")
        assert [p.name for p in store.root.iterdir() if p.name.startswith(".tmp-")] == []
        # The daemon keeps serving.
        assert httpx.post(shared.url + "/v1/embed", json={"model": SPARE, "inputs": ["x"]},
                          timeout=120).status_code == 200
    finally:
        for name in fakes:
            shutil.rmtree(store.root / name)
        if store.exists("last-copy"):
            store.remove("last-copy")


def jsonl(n_bytes: int) -> bytes:
    """A valid batch input file of about `n_bytes`."""
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embed",
                       "body": {"model": DEFAULT_MODEL, "inputs": ["a" * 900]}}).encode() + b"\n"
    return b"".join(line.replace(b'"x"', f'"{i}"'.encode()) for i in range(n_bytes // len(line) + 1))


def upload(d: LocalDaemon, body: bytes) -> httpx.Response:
    return httpx.post(d.url + "/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}, timeout=120)


def test_the_batch_quota_is_read_from_config_toml(shared: LocalDaemon) -> None:
    """`batch_files_max_bytes` in config.toml, applied on SIGHUP (the shipped quota, a quarter of
    the disk, is what the tmpfs test below meets)."""
    cfg = shared.home / "config.toml"
    cfg.write_text("batch_files_max_bytes = 1048576\n")
    try:
        os.kill(shared.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "batch_files_max_bytes" not in shared.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = upload(shared, jsonl(2 << 20))
        assert refused.status_code == 507, refused.text
        err = refused.json()["error"]
        assert err["code"] == "insufficient_storage" and "batch_files_max_bytes" in err["message"]
        assert upload(shared, jsonl(100_000)).status_code == 200
    finally:
        cfg.unlink()
        os.kill(shared.proc.pid, signal.SIGHUP)


@pytest.fixture()
def daemon_on_small_disk(tmp_path: Path, shared: LocalDaemon) -> Iterator[LocalDaemon]:
    """A daemon at the shipped settings whose FLEET_HOME is a 64 MiB tmpfs (its store, hundreds
    of MB, is a link to the other daemon's, on the big disk); needs root to mount."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {out.stderr.strip()}")
    try:
        home = disk / "home"
        home.mkdir()
        (home / "models").symlink_to(shared.home / "models")
        d = LocalDaemon(home, env={"FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2")},
                        timeout_s=START_TIMEOUT_S, log=tmp_path / "daemon.log")
        yield d
        d.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_batch_uploads_stop_at_a_quarter_of_the_disk_by_default(daemon_on_small_disk: LocalDaemon) -> None:
    d = daemon_on_small_disk
    files = d.home / "batches" / "files"
    refused = upload(d, jsonl(20 << 20))  # fits on the 64 MiB disk, not in its quarter
    assert refused.status_code == 507, refused.text
    assert refused.json()["error"]["code"] == "insufficient_storage"
    assert [p.name for p in files.iterdir()] == []  # nothing kept of it
    kept = upload(d, jsonl(8 << 20))
    assert kept.status_code == 200, kept.text
    assert upload(d, jsonl(10 << 20)).status_code == 507  # 8 + 10 MiB: past the quarter, counting what is kept
    assert httpx.delete(f"{d.url}/v1/files/{kept.json()['id']}", timeout=30).status_code == 200
    assert upload(d, jsonl(10 << 20)).status_code == 200  # room again
