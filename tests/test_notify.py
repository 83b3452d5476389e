"""sd_notify against a real NOTIFY_SOCKET the test listens on (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleet.daemon.notify import notify, watchdog_interval_s, watchdog_loop

ROOT = Path(__file__).resolve().parents[1]


def parse(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    else:
        name = f"@fleet-test-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name[1:].encode())
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    yield sock
    sock.close()


def test_ready_and_status_arrive_as_one_datagram(notify_socket):
    assert notify(READY=1, STATUS="serving on 127.0.0.1:7744") is True
    msg = parse(notify_socket.recv(4096))
    assert msg == {"READY": "1", "STATUS": "serving on 127.0.0.1:7744"}


def test_reloading_carries_monotonic_usec(notify_socket):
    before = time.monotonic_ns() // 1000
    notify(RELOADING=1)
    after = time.monotonic_ns() // 1000
    msg = parse(notify_socket.recv(4096))
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after


def test_stopping_from_another_process(notify_socket):
    # The variable is read at call time, in whatever process calls it.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", "from fleet.daemon.notify import notify; notify(STOPPING=1, STATUS='draining')"],
        env=env, check=True, timeout=60,
    )
    assert parse(notify_socket.recv(4096)) == {"STOPPING": "1", "STATUS": "draining"}


def test_no_socket_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify(READY=1) is False


def test_unreachable_socket_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert notify(READY=1) is False


def test_multiline_value_is_refused(notify_socket):
    with pytest.raises(ValueError, match="one line"):
        notify(STATUS="a\nREADY=1")


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("30000000", "1", None),  # meant for another process (we inherited it)
        ("0", None, None),
        ("junk", None, None),
    ],
)
def test_watchdog_interval(monkeypatch, usec, pid, expected):
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert watchdog_interval_s() == expected


def test_watchdog_pings_only_while_healthy(notify_socket, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s timeout: pings every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notify_socket.setblocking(False)
    healthy = True

    def drain() -> int:
        count = 0
        while True:
            try:
                assert parse(notify_socket.recv(4096)) == {"WATCHDOG": "1"}
            except BlockingIOError:
                return count
            count += 1

    async def scenario() -> tuple[int, int, int]:
        nonlocal healthy
        task = asyncio.create_task(watchdog_loop(lambda: healthy))
        await asyncio.sleep(0.55)
        first = drain()
        healthy = False
        await asyncio.sleep(0.1)  # let a ping already decided on arrive
        drain()
        await asyncio.sleep(0.5)
        second = drain()
        healthy = True
        await asyncio.sleep(0.35)
        third = drain()
        task.cancel()
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert 4 <= first <= 7
    assert second == 0
    assert third >= 2


def test_watchdog_loop_returns_without_watchdog(notify_socket, monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    notify_socket.setblocking(False)
    checks = []

    def healthy() -> bool:
        checks.append(1)
        return True

    async def scenario() -> tuple[bool, object]:
        task = asyncio.create_task(watchdog_loop(healthy))
        await asyncio.sleep(0.2)  # a loop that ran would have checked and pinged at once
        return task.done(), task.result() if task.done() else None

    assert asyncio.run(scenario()) == (True, None)
    assert checks == []  # it returned before checking health even once
    with pytest.raises(BlockingIOError):
        notify_socket.recv(4096)  # and sent nothing


def test_raising_health_check_stops_pings(notify_socket):
    notify_socket.setblocking(False)

    def broken() -> bool:
        raise RuntimeError("supervisor gone")

    async def scenario() -> None:
        task = asyncio.create_task(watchdog_loop(broken, interval_s=0.1))
        await asyncio.sleep(0.3)
        assert not task.done()  # keeps checking; recovers if the check recovers
        task.cancel()

    asyncio.run(scenario())
    with pytest.raises(BlockingIOError):
        notify_socket.recv(4096)
