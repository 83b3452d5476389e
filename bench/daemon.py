"""Processes the bench starts itself: a throwaway `fleetctl serve`, and any child with a log.

The one way to start a daemon for a test or a bench: every bench script that runs
its own daemon (embed_compare --start, generate_compare, embed_kinds,
nats_compare, tune's candidates) and the test suite (tests/conftest.py) use
`LocalDaemon`; peers (infinity-emb, nats-server) run as a `Child`.

Every child runs in its own session and is stopped by its PID (SIGTERM, then
SIGKILL after 30 s), never by name.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

#: How much of a child's log an error message carries (characters, from the end).
TAIL_CHARS = 3000


def free_port() -> int:
    """A loopback port free right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A child process in its own session, stdout and stderr to `log`, stopped by PID."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.log_path = Path(log)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(list(argv), env=dict(env), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        return self.log()[-TAIL_CHARS:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, `timeout_s` to exit, then SIGKILL; safe to call more than once. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


#: The daemons this process started, by URL: their admin keys are at hand (`admin_headers`).
_STARTED: dict[str, LocalDaemon] = {}


def admin_headers(url: str) -> dict[str, str]:
    """What the routes that change a daemon (load, pin, ...) take: the admin key of a daemon
    this process started, else the one `fleetctl` would send (fleet.admin.client_key:
    `FLEET_ADMIN_KEY`, or the key of the daemon serving FLEET_HOME); none when neither."""
    started = _STARTED.get(url.rstrip("/"))
    if started is not None:
        return started.admin
    from fleet.admin import client_key
    from fleet.config import default_home

    key = client_key(default_home(), url)
    return {"Authorization": f"Bearer {key}"} if key else {}


class LocalDaemon(Child):
    """`fleetctl serve [args]` on a free loopback port with FLEET_HOME = `home`.

    The environment is this process's (without its FLEET_* variables when
    `inherit_fleet` is false), plus FLEET_HOME, FLEET_PORT, HF_HUB_OFFLINE=1 and
    `env` (which wins), minus FLEET_URL (so the daemon never mistakes itself for a
    client of another one). The log goes to `log` (default `home/daemon.log`).
    With `wait` (the default) the constructor returns once /readyz answers 200,
    and raises RuntimeError with the log's tail if the daemon exits or is not
    ready within `timeout_s` (it is stopped first); with `wait=False` call
    `wait_ready()` yourself, e.g. after starting several. `module`: what runs
    `serve` (`python -m MODULE serve`; bench.stand_in for a stand-in forward).
    """

    def __init__(self, home: str | Path, *, env: Mapping[str, str] | None = None, args: Sequence[str] = (),
                 timeout_s: float = 300.0, wait: bool = True, inherit_fleet: bool = True,
                 log: Path | None = None, module: str = "fleetctl") -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if inherit_fleet or not k.startswith("FLEET_")}
        full = {**base, "FLEET_HOME": str(self.home), "FLEET_PORT": str(self.port), "HF_HUB_OFFLINE": "1",
                **(env or {})}
        full.pop("FLEET_URL", None)
        self.env = full
        super().__init__([sys.executable, "-m", module, "serve", *args], full, log or self.home / "daemon.log")
        _STARTED[self.url] = self
        if wait:
            self.wait_ready(timeout_s)

    @property
    def admin(self) -> dict[str, str]:
        """Headers carrying the operator's admin key (fleet.admin), as `fleetctl` sends
        it: what the routes that change the daemon (pin, load, pull, ...) take."""
        from fleet.admin import key_path, read_key

        return {"Authorization": f"Bearer {read_key(key_path(self.home, self.env.get('FLEET_ADMIN_KEY_FILE', '')))}"}

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # closes the log; the process is already gone
                raise RuntimeError(f"fleetctl serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"fleetctl serve not ready after {timeout_s:g} s:\n{self.tail()}")


def daemon_from_args(args: argparse.Namespace, home: Path | str | None = None) -> tuple[LocalDaemon | None, str]:
    """(the daemon started for the run, or None; the URL to measure) from the options
    `bench.cli.DAEMON` declares (`--url URL | --start`): with `--start` a LocalDaemon on
    `home` (a new temp directory by default)."""
    if args.start:
        daemon = LocalDaemon(home if home is not None else tempfile.mkdtemp(prefix="fleet-bench-home-"))
        return daemon, daemon.url
    return None, (args.url or os.environ.get("FLEET_URL") or "http://127.0.0.1:7744").rstrip("/")
