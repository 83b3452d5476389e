"""Peers the bench starts itself on loopback: infinity-emb, TEI and Ollama.

Each peer is set up by a script beside this file, which says what it installs and
where; the bench never installs anything. `skip_reason(name)` says why a peer
cannot start on this box (its program is missing, with the script that sets it
up), so `fleetctl bench --compare` reports it as skipped, in its tables and its
JSON, instead of leaving it out.

  infinity  infinity-emb 0.0.78 in `bench/.venv-infinity` (bench/setup_infinity.sh):
            it needs transformers<5, so it cannot share fleet's venv.
  tei       text-embeddings-inference's router, `text-embeddings-router`, from
            `bench/.tei/bin` or PATH (bench/setup_tei.sh builds it with cargo: TEI
            ships as container images and Rust source, in no PyPI, npm or Debian
            package).
  ollama    `ollama` from `bench/.ollama/bin` or PATH (bench/setup_ollama.sh unpacks
            Ollama's Linux release archive; no PyPI, npm or Debian package carries
            the server). The model is imported from the same folder fleet serves
            (`ollama create` converts its safetensors), into a temporary store.

Every peer gets the very model folder fleet serves, under the same model name, is
bound to 127.0.0.1 on a free port, and is stopped by its PID when the bench ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from fleet.bench.daemon import Child, free_port

HERE = Path(__file__).parent
INFINITY_VENV = HERE / ".venv-infinity"
TEI_ROOT = HERE / ".tei"
OLLAMA_ROOT = HERE / ".ollama"
#: The peers the bench can start, and the script that sets each up (`--targets` names).
SETUP = {"infinity": "bench/setup_infinity.sh", "tei": "bench/setup_tei.sh", "ollama": "bench/setup_ollama.sh"}


def program(name: str) -> Path | None:
    """The peer's executable: the one its setup script installed under bench/, else PATH's."""
    if name == "infinity":
        exe = INFINITY_VENV / "bin" / "infinity_emb"
        return exe if exe.is_file() else None
    exe_name, root = {"tei": ("text-embeddings-router", TEI_ROOT), "ollama": ("ollama", OLLAMA_ROOT)}[name]
    local = root / "bin" / exe_name
    if local.is_file():
        return local
    found = shutil.which(exe_name)
    return Path(found) if found else None


def skip_reason(name: str) -> str | None:
    """Why the peer `name` cannot start here (the line the bench reports), or None."""
    if name not in SETUP or program(name) is not None:
        return None
    what = {"infinity": "the infinity-emb peer is not built",
            "tei": "text-embeddings-router (TEI) is not installed",
            "ollama": "ollama is not installed"}[name]
    return f"{what}: run {SETUP[name]}"


class _Peer(Child):
    """A peer server: started by the subclass, ready once `health` answers 200."""

    label = "peer"
    health = "/health"

    def __init__(self, argv: list[str], env: dict[str, str], start_timeout_s: float) -> None:
        fd, log = tempfile.mkstemp(prefix=f"fleet-bench-{self.label}-", suffix=".log")
        os.close(fd)
        super().__init__(argv, env, Path(log))
        self._wait_ready(start_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.label} not ready after {timeout_s:g} s:\n{self.tail()}")


def _peer_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", **extra}
    # A peer's own python (infinity's venv) must not see fleet's packages.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


class Infinity(_Peer):
    label = "infinity-emb"

    def __init__(self, model_dir: Path, model_name: str, *, device: str = "cpu", batch_size: int = 32,
                 dtype: str = "auto", venv: Path = INFINITY_VENV, start_timeout_s: float = 300.0) -> None:
        exe = venv / "bin" / "infinity_emb"
        if not exe.is_file():
            raise FileNotFoundError(f"{exe} not found; build it with {SETUP['infinity']}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = _venv_version(venv, "infinity_emb")
        self.dtype = dtype
        super().__init__(
            [str(exe), "v2", "--model-id", str(model_dir), "--served-model-name", model_name,
             "--host", "127.0.0.1", "--port", str(self.port), "--engine", "torch", "--device", device,
             "--batch-size", str(batch_size), "--dtype", dtype, "--no-bettertransformer", "--log-level", "warning"],
            _peer_env(INFINITY_ANONYMOUS_USAGE_STATS="0"), start_timeout_s,
        )


class TEI(_Peer):
    """text-embeddings-inference's router on the model folder (it reads config.json,
    tokenizer.json, the safetensors and sentence-transformers' pooling config there)."""

    label = "text-embeddings-router"

    def __init__(self, model_dir: Path, model_name: str, *, batch_size: int = 32, start_timeout_s: float = 300.0) -> None:
        exe = program("tei")
        if exe is None:
            raise FileNotFoundError(skip_reason("tei"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = _version_of([str(exe), "--version"])
        super().__init__(
            [str(exe), "--model-id", str(model_dir), "--served-model-name", model_name,
             "--hostname", "127.0.0.1", "--port", str(self.port), "--max-client-batch-size", str(max(batch_size, 32))],
            _peer_env(), start_timeout_s,
        )


class Ollama(_Peer):
    """`ollama serve` with a store of its own in a temporary folder, and the model
    imported there from fleet's folder (`ollama create`, FROM <folder>) before the run."""

    label = "ollama"
    health = "/api/version"

    def __init__(self, model_dir: Path, model_name: str, *, start_timeout_s: float = 300.0) -> None:
        exe = program("ollama")
        if exe is None:
            raise FileNotFoundError(skip_reason("ollama"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._store = tempfile.mkdtemp(prefix="fleet-bench-ollama-")
        env = _peer_env(OLLAMA_HOST=f"127.0.0.1:{self.port}", OLLAMA_MODELS=self._store, OLLAMA_NOHISTORY="1")
        self.version = _version_of([str(exe), "--version"])
        super().__init__([str(exe), "serve"], env, start_timeout_s)
        modelfile = Path(self._store) / "Modelfile"
        modelfile.write_text(f"FROM {model_dir}\n")
        made = subprocess.run([str(exe), "create", model_name, "-f", str(modelfile)], env=env, capture_output=True,
                              text=True, timeout=start_timeout_s)
        if made.returncode != 0:
            self.stop()
            raise RuntimeError(f"ollama could not import {model_name} from its folder:\n{made.stderr[-2000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        code = super().stop(timeout_s)
        shutil.rmtree(self._store, ignore_errors=True)
        return code


def _version_of(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr).strip() else "unknown"


def _venv_version(venv: Path, dist: str) -> str:
    for meta in (venv / "lib").glob(f"python*/site-packages/{dist}-*.dist-info/METADATA"):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"
