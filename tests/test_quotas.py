"""Quotas per owner (issue 39, item 5): `[owners.NAME]` in config.toml bounds the models,
adapters and resident bytes of the models whose names are the owner's.

- In the store (every way a model is added ends in `Store.commit`): the owner's next
  model or adapter past its bound is refused `quota_exceeded` naming the owner, the bound
  and its setting; other owners' and unclaimed models are not bounded by it.
- On a real daemon at the shipped settings (tests/alias_models.py), the owners set by
  SIGHUP: an Ollama copy past `models` is refused 507 and stores nothing; a request that
  would load a model past `resident_bytes` is refused 507 naming the setting, the models
  resident stay, and once one is unloaded the same request loads and answers.

Before: the only bounds were the box's (`store_max_models`, memory); any team could fill them.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from fleet.errors import QuotaExceeded
from fleet.quotas import OwnerQuota, check_add, check_load, owner_of
from fleet.store import Manifest, Store, utc_now

OWNERS = {"ml-team": OwnerQuota(models_match=["tone-*", "team-*"], models=2, adapters=1, resident_bytes=1000),
          "search": OwnerQuota(models_match=["search-*"])}


class Stored:
    def __init__(self, name: str, base: str | None = None) -> None:
        self.name, self.base = name, base


def test_owners_and_bounds_as_a_table() -> None:
    assert owner_of(OWNERS, "tone-v1") == "ml-team" and owner_of(OWNERS, "search-a") == "search"
    assert owner_of(OWNERS, "other") is None
    stored = [Stored("tone-v1"), Stored("tone-v2"), Stored("tone-lora", base="tone-v1"), Stored("search-a")]
    with pytest.raises(QuotaExceeded, match=r"owners\.ml-team\.models = 2"):
        check_add(OWNERS, "team-new", False, stored)
    with pytest.raises(QuotaExceeded, match=r"owners\.ml-team\.adapters = 1"):
        check_add(OWNERS, "tone-lora-2", True, stored)
    check_add(OWNERS, "tone-v2", False, stored)  # replacing one of its own: no more models than before
    check_add(OWNERS, "search-b", False, stored)  # no bound for search
    check_add(OWNERS, "other", False, stored)  # nobody's
    with pytest.raises(QuotaExceeded, match=r"owners\.ml-team\.resident_bytes = 1000"):
        check_load(OWNERS, "tone-v2", 400, {"tone-v1": 700, "search-a": 10_000})
    check_load(OWNERS, "tone-v2", 300, {"tone-v1": 700, "search-a": 10_000})
    check_load(OWNERS, "tone-v1", 10_000, {"tone-v1": 700})  # resident already: no load


def commit(store: Store, name: str, tmp: Path, base: str | None = None) -> None:
    src = tmp / "config.json"
    src.write_text("{}")
    with store.lock(name), store.staging(name) as staging:
        staging.copy_in(src, "config.json")
        store.commit(staging, Manifest(name=name, source=f"path:{tmp}", task="embed", runtime="sentence-transformers",
                                       base=base, files=list(staging.files), created_at=utc_now()))


def test_the_store_refuses_an_owners_model_past_its_bound(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('[owners.ml-team]\nmodels_match = ["team-*"]\nmodels = 1\n')
    store = Store(home / "models")
    commit(store, "team-a", tmp_path)
    commit(store, "someone-else", tmp_path)
    with pytest.raises(QuotaExceeded, match=r"ml-team stores 1 models \(team-a\), its quota \(owners\.ml-team\.models"):
        commit(store, "team-b", tmp_path)
    assert store.names() == ["someone-else", "team-a"]
    commit(store, "team-a", tmp_path)  # pulled again: still one


def reload_with(d, config: str) -> None:
    (d.home / "config.toml").write_text(config)
    d.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)  # the reload runs on the loop at once; readiness says nothing about it


def resident(d) -> dict[str, int]:
    workers = httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"]
    return {n: m["bytes"] for w in workers for n, m in w["models"].items()}


def test_a_daemon_refuses_a_copy_and_a_load_past_an_owners_quota(tone_box) -> None:
    d = tone_box
    for name in [n for n in resident(d) if n.startswith("tone-")]:
        assert httpx.post(f"{d.url}/v1/models/{name}/unload", headers=d.admin, timeout=60).status_code == 200
    one = httpx.post(d.url + "/v1/classify", json={"model": "tone-v1", "inputs": ["hi"]}, timeout=60)
    assert one.status_code == 200
    held = resident(d)["tone-v1"]
    # tone-v2 is sized by its files (the load check's estimate): it fits alone, not beside tone-v1.
    files = json.loads((d.home / "models" / "tone-v2" / "manifest.json").read_text())["files"]
    bound = sum(f["size"] for f in files) + held // 2
    tone_models = [n for n in httpx.get(d.url + "/api/tags", timeout=30).json()["models"]
                   if n["name"].split(":")[0].startswith("tone-")]
    try:
        reload_with(d, f'[owners.ml-team]\nmodels_match = ["tone-*"]\nmodels = {len(tone_models)}\n'
                       f'resident_bytes = {bound}\n')
        r = httpx.post(d.url + "/api/copy", json={"source": "tone-v1", "destination": "tone-extra"}, headers=d.admin,
                       timeout=60)
        assert r.status_code == 507 and f"owners.ml-team.models = {len(tone_models)}" in r.text, r.text
        assert not (d.home / "models" / "tone-extra").exists()
        time.sleep(0.6)  # past the daemon's view of what is resident (daemon.quotas.REFRESH_S)
        r = httpx.post(d.url + "/v1/classify", json={"model": "tone-v2", "inputs": ["hi"]}, timeout=60)
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "quota_exceeded" and f"owners.ml-team.resident_bytes = {bound}" in \
            error["message"] and "tone-v1" in error["message"]
        assert "tone-v2" not in resident(d) and "tone-v1" in resident(d)
        # Room made: the same request loads and answers.
        assert httpx.post(f"{d.url}/v1/models/tone-v1/unload", headers=d.admin, timeout=60).status_code == 200
        deadline = time.monotonic() + 10
        while "tone-v1" in resident(d):  # the worker's info blob follows its unload
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.6)
        r = httpx.post(d.url + "/v1/classify", json={"model": "tone-v2", "inputs": ["hi"]}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        reload_with(d, "")
