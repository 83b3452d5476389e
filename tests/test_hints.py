"""Errors that say what to do: a model not pulled names `fleetctl pull NAME`, a typo
the closest name, a model too large the setting that sizes the budget; the CLI
finds the daemon through FLEET_URL, FLEET_HOME's config, then the running
daemon's lock file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.config import client_url_source
from fleet.errors import ModelNotFound
from fleet.store import Store
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import too_large_reason

from tests.conftest import copy_default_model
from tests.gen_models import pull


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("FLEET_HOME", str(h))
    for var in ("FLEET_URL", "FLEET_HOST", "FLEET_PORT"):
        monkeypatch.delenv(var, raising=False)
    return h


def test_model_not_found_says_what_to_do(home: Path, tmp_path: Path) -> None:
    store = Store(home / "models")
    with pytest.raises(ModelNotFound) as err:
        store.get("bge-small-en-v1.5")  # in the catalog, not pulled
    assert "`fleetctl pull bge-small-en-v1.5`" in err.value.message
    with pytest.raises(ModelNotFound) as err:
        store.get("bge-smal-en-v1.5")  # a typo of a catalog name
    assert "did you mean 'bge-small-en-v1.5'" in err.value.message
    pull(home, copy_default_model(tmp_path / "m"), "my-embedder")
    with pytest.raises(ModelNotFound) as err:
        store.remove("my-embeder")  # a typo of a stored name
    assert "did you mean 'my-embedder'" in err.value.message
    with pytest.raises(ModelNotFound) as err:
        store.get("zzzz")
    assert "nor in fleet's catalog" in err.value.message
    out = subprocess.run([sys.executable, "-m", "fleetctl", "rm", "my-embeder"], capture_output=True, text=True,
                         timeout=60, env=os.environ.copy())
    assert out.returncode == 1 and "did you mean 'my-embedder'" in out.stderr


def test_model_too_large_names_the_setting() -> None:
    big = Footprint(weights_bytes=900 << 20, activation_bytes=100 << 20)
    cpu = too_large_reason("big", big, [], device="cpu", budget_bytes=512 << 20, free_now_bytes=4 << 30)
    assert "budget of 512.0 MiB" in cpu and "cpu_budget_bytes" in cpu and "FLEET_CPU_BUDGET_BYTES" in cpu
    gpu = too_large_reason("big", big, [], device="cuda:0", budget_bytes=512 << 20, free_now_bytes=4 << 30)
    assert "gpu_reserve_bytes" in gpu


def test_the_cli_finds_the_daemon(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client_url_source() == ("http://127.0.0.1:7744", "default")
    (home / "run").mkdir()
    (home / "run" / "daemon.lock").write_text(json.dumps({"pid": os.getpid(), "url": "http://127.0.0.1:7999"}))
    assert client_url_source() == ("http://127.0.0.1:7999", "lock file")
    (home / "config.toml").write_text("port = 7851\n")
    assert client_url_source() == ("http://127.0.0.1:7851", "config")
    monkeypatch.setenv("FLEET_URL", "http://10.9.9.9:1")
    assert client_url_source() == ("http://10.9.9.9:1", "env")
    monkeypatch.delenv("FLEET_URL")
    (home / "config.toml").unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (home / "run" / "daemon.lock").write_text(json.dumps({"pid": int(dead.stdout), "url": "http://127.0.0.1:7999"}))
    assert client_url_source() == ("http://127.0.0.1:7744", "default")  # a lock file outlives its daemon
    (home / "config.toml").write_text("port = 7851\n")
    out = subprocess.run([sys.executable, "-m", "fleetctl", "ps"], capture_output=True, text=True, timeout=60,
                         env=os.environ.copy())
    assert out.returncode == 1 and "http://127.0.0.1:7851" in out.stderr
    (home / "config.toml").write_text("port = [\n")
    out = subprocess.run([sys.executable, "-m", "fleetctl", "ps"], capture_output=True, text=True, timeout=60,
                         env=os.environ.copy())
    assert out.returncode == 1 and "config.toml" in out.stderr and "Traceback" not in out.stderr
