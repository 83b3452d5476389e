"""Profiles visible and live: `/v1/models/{id}`, `/v1/ps` and TEI `/info` show the
profile a worker serves a model with and where each setting came from; a tuned profile
written while the daemon serves (what `fleetctl tune --write` writes) applies on SIGHUP,
to the resident model, from its next batch.

`profile_sources` is checked on tables of cases (in-process); the rest on a real daemon.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time
from pathlib import Path

import httpx
import pytest

from fleet.catalog import Profile, TunedInfo, profile_sources, write_tuned_profile
from tests.conftest import DEFAULT_MODEL, start_daemon

SHIPPED = """
[models."m"]
source = "hf:org/m"
task = "embed"
runtime = "sentence-transformers"
[models."m".profile]
max_batch_items = 32
linger_ms = 1.0
[models."m".profiles."cpu-x"]
max_batch_tokens = 4096
"""


@pytest.mark.parametrize("user, klass, expected", [
    # Shipped only: the default profile's keys are "shipped", the rest the built-in defaults.
    ("", "cpu-y", {"max_batch_items": "shipped", "linger_ms": "shipped", "max_batch_tokens": "default",
                   "dtype": "default", "engine": "default"}),
    # A shipped tuned class sets its keys; the rest come from `profile`.
    ("", "cpu-x", {"max_batch_tokens": "tuned", "max_batch_items": "shipped", "linger_ms": "shipped",
                   "dtype": "default", "engine": "default"}),
    # The user's `profile` keys win over the shipped tuned class.
    ('[models."m".profile]\nmax_batch_tokens = 1000\ndtype = "float32"\n', "cpu-x",
     {"max_batch_tokens": "config", "dtype": "config", "max_batch_items": "shipped", "linger_ms": "shipped",
      "engine": "default"}),
    # The user's own tuned class (fleetctl tune --write) wins over everything.
    ('[models."m".profile]\ndtype = "float32"\n[models."m".profiles."cpu-x"]\ndtype = "bfloat16"\n'
     'max_batch_items = 8\n', "cpu-x",
     {"dtype": "tuned", "max_batch_items": "tuned", "max_batch_tokens": "default", "linger_ms": "shipped",
      "engine": "default"}),
])
def test_profile_sources(tmp_path: Path, user: str, klass: str, expected: dict) -> None:
    shipped = tmp_path / "shipped.toml"
    shipped.write_text(SHIPPED)
    if user:
        (tmp_path / "models.toml").write_text(user)
    assert profile_sources(tmp_path, "m", klass, shipped=shipped) == expected


def test_profile_sources_without_an_entry(tmp_path: Path) -> None:
    shipped = tmp_path / "shipped.toml"
    shipped.write_text(SHIPPED)
    assert set(profile_sources(tmp_path, "pulled-from-a-folder", "cpu-x", shipped=shipped).values()) == {"manifest"}


def detail(url: str) -> dict:
    r = httpx.get(f"{url}/v1/models/{DEFAULT_MODEL}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_tuned_profile_applies_on_sighup(tmp_path: Path) -> None:
    from fleet.runtimes.device import device_class

    klass = device_class("cpu")
    home = tmp_path / "home"
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    try:
        before = detail(d.url)["profiles"]
        assert len(before) == 1 and before[0]["device"] == "cpu"
        assert set(before[0]["sources"].values()) <= {"shipped", "tuned", "default"}  # no models.toml of ours yet
        assert before[0]["settings"]["max_batch_items"] > 2
        info = httpx.get(d.url + "/info", timeout=10).json()
        assert info["max_batch_tokens"] == before[0]["settings"]["max_batch_tokens"]

        # What `fleetctl tune --write` writes, while the daemon serves.
        tuned = Profile(max_batch_items=2, max_batch_tokens=512, dtype=before[0]["settings"]["dtype"], linger_ms=0.0,
                        engine="torch")
        write_tuned_profile(home, DEFAULT_MODEL, klass, tuned, TunedInfo(tuned_at="2026-12-04T00:00:00Z",
                                                                         knee_tokens_per_s=1.0, knee_p95_ms=1.0))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while (after := detail(d.url)["profiles"])[0]["settings"]["max_batch_items"] != 2:
            assert time.monotonic() < deadline, after
            time.sleep(0.2)
        assert after[0]["name"] == klass
        assert after[0]["sources"] == dict.fromkeys(["max_batch_items", "max_batch_tokens", "dtype", "engine",
                                                     "linger_ms"], "tuned")
        assert after[0]["settings"]["max_batch_tokens"] == 512
        info = httpx.get(d.url + "/info", timeout=10).json()
        assert (info["max_batch_tokens"], info["max_batch_requests"]) == (512, 2)
        ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
        model = ps["workers"][0]["models"][DEFAULT_MODEL]
        assert model["profile"] == klass and model["settings"]["max_batch_items"] == 2
        assert f"{DEFAULT_MODEL}: profile {klass}: max_batch_items" in d.log()
        assert "(engine at the next load)" in d.log()  # the weights stay on the engine they loaded on

        # The resident model's next batches keep to it: at most 2 items each.
        def one(i: int) -> httpx.Response:
            return httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [f"text {i}"]}, timeout=60)

        with cf.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(one, range(24)))
        assert all(r.status_code == 200 for r in got)
        assert max(int(r.headers["x-batch-items"]) for r in got) <= 2
    finally:
        d.stop()
