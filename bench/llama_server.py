"""llama.cpp's own server as a peer of the generation bench: `python -m llama_cpp.server`.

It is the `server` extra of the same llama-cpp-python build the `llama.cpp` runtime
uses (.venv/llamacpp, scripts/setup_llamacpp.sh); its FastAPI requirements live in their
own folder, .venv/llamacpp-server (scripts/setup_llamacpp_server.sh), so that they never
shadow the daemon's packages: only this child process sees them. It serves the GGUF
through one `Llama` object, one request at a time (its requests wait on a lock), with
llama.cpp's prompt-prefix reuse between consecutive requests: the bench alternates
prompts so a TTFT is a real prefill. By default a new request interrupts the one being
streamed (it ends early, short of its max_tokens); the bench turns that off
(`--interrupt_requests false`) so that every request is answered whole and waits its turn.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fleet.bench.daemon import Child, free_port

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / ".venv" / "llamacpp"
SERVER_DEPS = ROOT / ".venv" / "llamacpp-server"
SETUP = "scripts/setup_llamacpp_server.sh"


def missing() -> str | None:
    """Why the server cannot start here (None: it can)."""
    if not (BUILD / "llama_cpp" / "server").is_dir():
        return "llama.cpp is not built (./scripts/setup_llamacpp.sh)"
    if not (SERVER_DEPS / "fastapi").is_dir():
        return f"its Python requirements are not installed ({SETUP})"
    return None


class LlamaServer(Child):
    """`python -m llama_cpp.server` on `gguf`, on a free loopback port, stopped by PID."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int = 4096, start_timeout_s: float = 120.0) -> None:
        why = missing()
        if why:
            raise FileNotFoundError(why)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log = tempfile.mkstemp(prefix="fleet-bench-llama-server-", suffix=".log")
        os.close(fd)
        # Threads as the runtime runs them (runtimes/adapters/llamacpp.py): OpenMP waits passively.
        env = {**os.environ, "PYTHONPATH": f"{SERVER_DEPS}:{BUILD}", "OMP_WAIT_POLICY": "PASSIVE"}
        # Flash attention as the runtime's context runs it on this CPU (llama.cpp's "auto").
        super().__init__(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "gguf",
             "--host", "127.0.0.1", "--port", str(self.port), "--n_threads", str(threads),
             "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--n_batch", "512",
             "--flash_attn", "true", "--interrupt_requests", "false"],
            env, Path(log),
        )
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama_cpp.server not ready after {timeout_s:g} s:\n{self.tail()}")
