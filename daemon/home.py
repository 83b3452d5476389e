"""One daemon per FLEET_HOME: an flock held for the daemon's whole life.

Two daemons on one home would share its pins and store under two queues: a
pin through one leaves the other waiting for a model its workers never load.
`claim_home` takes `FLEET_HOME/run/daemon.lock` (non-blocking) before anything
starts and writes `{pid, url}` into it; the kernel drops the lock when the
process dies, even by SIGKILL, so a stale file never blocks the next start.
The fd is close-on-exec and never passed to workers: it dies with the daemon.
"""

from __future__ import annotations

import fcntl
import os
import time

import msgspec

from fleet.config import Settings
from fleet.errors import Unavailable

LOCK_FILE = "daemon.lock"

#: How long a refused start waits for the holder's {pid, url} (it writes them
#: right after taking the lock).
HOLDER_WAIT_S = 1.0


class Holder(msgspec.Struct, frozen=True):
    pid: int
    url: str


def claim_home(settings: Settings) -> int:
    """Take the home's lock for this process; returns its fd (keep it open).
    Raises Unavailable naming the daemon that holds it."""
    run = settings.home_path / "run"
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(fd)
        os.close(fd)
        who = f"pid {holder.pid}, {holder.url}" if holder else "pid unknown"
        raise Unavailable(f"another fleet daemon ({who}) already serves FLEET_HOME {settings.home_path}; "
                          "stop it first or set another FLEET_HOME") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, msgspec.json.encode(Holder(os.getpid(), settings.url)), 0)
    return fd


def read_holder(fd: int, wait_s: float = HOLDER_WAIT_S) -> Holder | None:
    """The lock holder's {pid, url}, waiting up to `wait_s` for it to be written."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return msgspec.json.decode(os.pread(fd, 4096, 0), type=Holder)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
