"""Peers the bench starts itself: infinity-emb on loopback, from its own virtual environment.

infinity-emb 0.0.78 needs transformers<5, so it cannot share fleet's venv; it
lives in `bench/.venv-infinity` (built by `bench/setup_infinity.sh`). It is
started on 127.0.0.1 with the very model folder fleet serves, under the same
model name, and stopped by its PID when the bench ends.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx

from fleet.bench.daemon import Child, free_port

INFINITY_VENV = Path(__file__).with_name(".venv-infinity")


class Infinity(Child):
    def __init__(self, model_dir: Path, model_name: str, *, device: str = "cpu", batch_size: int = 32,
                 dtype: str = "auto", venv: Path = INFINITY_VENV, start_timeout_s: float = 300.0) -> None:
        exe = venv / "bin" / "infinity_emb"
        if not exe.is_file():
            raise FileNotFoundError(f"{exe} not found; build it with bench/setup_infinity.sh")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log = tempfile.mkstemp(prefix="fleet-bench-infinity-", suffix=".log")
        os.close(fd)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
        # Its venv's python must not see fleet's packages.
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        super().__init__(
            [str(exe), "v2", "--model-id", str(model_dir), "--served-model-name", model_name,
             "--host", "127.0.0.1", "--port", str(self.port), "--engine", "torch", "--device", device,
             "--batch-size", str(batch_size), "--dtype", dtype, "--no-bettertransformer", "--log-level", "warning"],
            env, Path(log),
        )
        self.version = _venv_version(venv, "infinity_emb")
        self.dtype = dtype
        self._wait_ready(start_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"infinity-emb exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"infinity-emb not ready after {timeout_s:g} s:\n{self.tail()}")


def _venv_version(venv: Path, dist: str) -> str:
    for meta in (venv / "lib").glob(f"python*/site-packages/{dist}-*.dist-info/METADATA"):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"
