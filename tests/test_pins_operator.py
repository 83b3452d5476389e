"""Pins belong to the operator (issue 25, deliverable 5).

Persisted pins come only from the admin routes and the CLI. An Ollama client's
`keep_alive` keeps a model resident for the life of the daemon process at most:
before, `keep_alive: "-99999999999999h"` from a loopback client pinned a model
persistently, and when it could never fit the budget `/readyz` stayed 503 across
restarts. A pin that can never be served is named by `/readyz`, `/v1/ps` and
`fleetctl doctor`, and the daemon is ready for the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.pins import PinStore
from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir, start_daemon
from tests.test_damaged_files import damage

COPY = "minilm-copy"
FOREVER = "-99999999999999h"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FLEET_HOME with the default model and a copy of it under another name."""
    home = tmp_path_factory.mktemp("fleet-pins") / "home"
    store = Store(home / "models")
    pull_model(store, DEFAULT_MODEL)
    pull_model(store, f"path:{default_model_dir()}", name=COPY)
    # Both in float32, so that `budget_for_one` holds one and not two on any CPU: where
    # bfloat16 passes the load's dtype check (an Intel Xeon with AMX: min cosine
    # 0.999933), each would take half and both would fit.
    (home / "models.toml").write_text(
        f'[models."{DEFAULT_MODEL}".profile]\ndtype = "float32"\n\n'
        f'[models."{COPY}"]\nsource = "path:{default_model_dir()}"\ntask = "embed"\n'
        f'runtime = "sentence-transformers"\n[models."{COPY}".profile]\ndtype = "float32"\n')
    return home


@pytest.fixture()
def home(two_models: Path) -> Iterator[Path]:
    yield two_models
    (two_models / "pins.json").unlink(missing_ok=True)


def resident(d: DaemonProc) -> dict[str, dict]:
    return {name: m for w in httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"]
            for name, m in w["models"].items()}


def test_keep_alive_keeps_a_model_for_the_life_of_the_daemon_only(home: Path) -> None:
    d = start_daemon(home)
    try:
        # The operator's keep (a client without the admin key keeps nothing: test_shared_host).
        kept = httpx.post(d.url + "/api/embed", json={"model": COPY, "input": "a text", "keep_alive": FOREVER},
                          headers=d.admin, timeout=120)
        assert kept.status_code == 200, kept.text
        assert resident(d)[COPY]["pinned"] is True
        assert COPY not in PinStore(home).load()  # nothing persisted
        # keep_alive 0 cannot release what the operator keeps (the preload), and says so.
        refused = httpx.post(d.url + "/api/embed", json={"model": DEFAULT_MODEL, "input": "a", "keep_alive": 0},
                             headers=d.admin, timeout=60)
        assert refused.status_code == 400 and "fleetctl unpin" in refused.json()["error"]
        assert DEFAULT_MODEL in resident(d)
    finally:
        d.stop()
    again = start_daemon(home)
    try:
        assert httpx.get(again.url + "/readyz", timeout=30).json() == {"ready": True, "status": "ready"}
        assert COPY not in resident(again)
    finally:
        again.stop()


def budget_for_one() -> int:
    """A CPU budget the default model fits in, but not two of its size."""
    from fleet.runtimes.footprint import estimate_footprint

    fp = estimate_footprint(default_model_dir(), "sentence-transformers", dtype="float32")
    return fp.activation_bytes + int(1.5 * fp.weights_bytes)


def doctor_pins(d: DaemonProc, home: Path) -> list[dict]:
    env = {**os.environ, "FLEET_URL": d.url, "FLEET_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "doctor", "--json"], env=env, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    return [f for f in json.loads(out.stdout) if f["check"] == "pins"]


def test_a_pin_that_can_never_fit_is_named_and_does_not_hold_readiness(home: Path) -> None:
    PinStore(home).add(COPY, "cpu")  # the operator's, from an earlier run with room for it
    # Ready at all is the point: before, the start never became ready.
    d = start_daemon(home, extra_env={"FLEET_CPU_BUDGET_BYTES": str(budget_for_one()), "FLEET_DEVICE": "cpu"})
    try:
        ready = httpx.get(d.url + "/readyz", timeout=30).json()
        assert ready["ready"] is True
        assert ready["unservable"][COPY].startswith("model_too_large: ")
        assert COPY in ready["status"] and "cannot be served" in ready["status"]
        assert str(home) not in json.dumps(ready)  # names models, never paths
        ps = httpx.get(d.url + "/v1/ps", timeout=30).json()
        assert set(ps["unservable"]) == {COPY}
        found = doctor_pins(d, home)
        assert [f["level"] for f in found] == ["warn"]
        assert COPY in found[0]["detail"] and f"fleetctl unpin {COPY}" in found[0]["fix"]
        served = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a text"]}, timeout=60)
        assert served.status_code == 200, served.text
    finally:
        d.stop()


def test_a_damaged_preload_is_named_and_every_other_model_serves(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store(home / "models")
    pull_model(store, DEFAULT_MODEL)
    pull_model(store, f"path:{default_model_dir()}", name=COPY)
    damage(store, COPY, "truncated")
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": f"{DEFAULT_MODEL},{COPY}"})
    try:
        ready = httpx.get(d.url + "/readyz", timeout=30).json()
        assert ready["ready"] is True and ready["unservable"][COPY].startswith("integrity_error: ")
        served = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a text"]}, timeout=60)
        assert served.status_code == 200, served.text
    finally:
        d.stop()
