"""systemd readiness and watchdog (the sd_notify protocol), without libsystemd.

The service manager passes `$NOTIFY_SOCKET`: a datagram socket path, or an
abstract one written with a leading `@`. Each message is one datagram of
`KEY=VALUE` lines. Without the variable (not under systemd) every call is a
no-op, so the daemon calls these unconditionally.

Order the daemon follows: `READY=1` only once the API socket is serving and the
pinned models are loaded (`announce_ready`); `WATCHDOG=1` from `watchdog_loop`
while healthy; `STOPPING=1` as the stop signal arrives (`SystemdServer`). `RELOADING=1` must carry `MONOTONIC_USEC`
(CLOCK_MONOTONIC, µs), added here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger("fleet.notify")


def _address(raw: str) -> str | bytes:
    # "@name" is Linux's abstract namespace: the kernel name starts with a NUL byte.
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    return raw


def notify(**fields: object) -> bool:
    """Send one sd_notify datagram, e.g. `notify(READY=1, STATUS="serving")`.

    Returns True when a message was sent, False when there is no `$NOTIFY_SOCKET`.
    A socket that is set but unreachable is logged, not raised: readiness
    reporting must never take the daemon down.
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw or not fields:
        return False
    if fields.get("RELOADING") and "MONOTONIC_USEC" not in fields:
        fields["MONOTONIC_USEC"] = time.monotonic_ns() // 1000
    lines = []
    for key, value in fields.items():
        text = str(value)
        if "\n" in text:
            raise ValueError(f"sd_notify field {key} must be one line: {text!r}")
        lines.append(f"{key}={text}")
    payload = ("\n".join(lines) + "\n").encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(payload, _address(raw))
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", raw, exc)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """The watchdog timeout systemd expects us to beat, in seconds, or None.

    `WATCHDOG_PID` names the process the timeout is meant for; a child that
    inherited the variables (a worker) must not feed it.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


async def watchdog_loop(is_healthy: Callable[[], bool], interval_s: float | None = None) -> None:
    """Ping `WATCHDOG=1` every half timeout while `is_healthy()` is true.

    Run it as a task on the daemon's event loop: a blocked loop stops the pings
    too, which is the point. When unhealthy, pings stop and systemd restarts the
    service after the timeout (`Restart=on-failure`). Returns at once when no
    watchdog is configured.
    """
    timeout_s = interval_s if interval_s is not None else watchdog_interval_s()
    if not timeout_s:
        return
    period_s = timeout_s / 2
    was_healthy = True
    while True:
        try:
            healthy = bool(is_healthy())
        except Exception:  # a broken health check counts as unhealthy, loudly
            log.exception("health check raised")
            healthy = False
        if healthy:
            notify(WATCHDOG=1)
        elif was_healthy:
            log.error("unhealthy: withholding watchdog pings; systemd restarts the service in %.0f s", timeout_s)
        was_healthy = healthy
        await asyncio.sleep(period_s)


async def announce_ready(serving: Callable[[], Awaitable[bool]], *waits: Awaitable[object],
                         status: str = "serving") -> None:
    """Send READY=1 once every `waits` finished and `await serving()` is true.

    `serving` checks e.g. `server.started` for a uvicorn.Server: uvicorn runs the
    app's lifespan startup *before* it listens, so READY sent from the lifespan
    would come too early. It is awaited so that it may read the queue the way
    the event loop must (daemon.broker.Broker.call). Await the pinned-model loads
    in `waits`.
    """
    for waited in waits:
        await waited
    while not await serving():
        await asyncio.sleep(0.05)
    notify(READY=1, STATUS=status)


class SystemdServer(uvicorn.Server):
    """uvicorn.Server that tells systemd STOPPING=1 as soon as a stop signal arrives.

    uvicorn then stops accepting, finishes open requests and runs the lifespan
    shutdown; systemd shows "deactivating" meanwhile instead of a hung service.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            notify(STOPPING=1, STATUS=f"stopping on {signal.Signals(sig).name}")
        super().handle_exit(sig, frame)
