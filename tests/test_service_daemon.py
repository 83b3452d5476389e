"""The real daemon as systemd sees it: `fleetctl serve` (real uvicorn, real worker,
real weights), with this test playing the service manager on an abstract
NOTIFY_SOCKET and with WATCHDOG_USEC and an API key set, as the unit sets them.

Readiness tells the truth: READY=1 only once the API serves and every pinned
model is resident; a damaged pins.json (at start or while serving) is set aside
and logged once, never an error; unpinning the preloaded model means readiness
no longer waits for it. Then the watchdog, auth, request ids in JSON logs,
metrics, and STOPPING=1 with a clean exit on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import queue
import socket
import threading
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet.local_queue.sweep import SHM_DIR
from tests.conftest import DEFAULT_MODEL, START_TIMEOUT_S, DaemonProc, start_daemon

KEY = "wiring-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: A hand edit gone wrong: the device where a {device, at} record belongs.
DAMAGED = b'{"format": 1, "pins": {"all-minilm-l6-v2": "cpu"}}'


class Systemd:
    """The service manager's side of NOTIFY_SOCKET: it reads every datagram as it
    comes (as PID 1 does; a reader that stopped would fill the socket's buffer)."""

    def __init__(self) -> None:
        self.name = f"fleet-service-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name.encode())
        self.messages: queue.Queue[dict[str, str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                raw = self.sock.recv(4096)
            except OSError:  # closed
                return
            self.messages.put(dict(line.split("=", 1) for line in raw.decode().splitlines()))

    def next(self, timeout: float) -> dict[str, str]:
        return self.messages.get(timeout=timeout)

    def until(self, key: str, timeout: float, d: DaemonProc) -> dict[str, str]:
        """The next message carrying `key` (WATCHDOG=1 pings come in between); fails
        at once, with the daemon's log, if the daemon exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.next(1.0)
            except queue.Empty:
                assert d.proc.poll() is None, f"daemon exited with {d.proc.returncode}:\n{d.log()[-3000:]}"
                continue
            if key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout} s:\n{d.log()[-3000:]}")

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def get(url: str, path: str, request_id: str | None = None) -> httpx.Response:
    headers = {**AUTH, **({"X-Request-Id": request_id} if request_id else {})}
    return httpx.get(url + path, headers=headers, timeout=30)


def resident(url: str) -> dict[str, dict]:
    return {name: m for w in get(url, "/v1/ps").json()["workers"] for name, m in w["models"].items()}


def card(url: str, name: str) -> tuple[bool, bool]:
    """(loaded, pinned) of `name` in `/v1/models`."""
    c = next(c for c in get(url, "/v1/models").json()["data"] if c["id"] == name)
    return c.get("loaded", False), c.get("pinned", False)


def counter(url: str, family: str, **labels: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(get(url, "/metrics").text)}
    return sum(s.value for s in families[family].samples
               if s.name == family + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_real_daemon_as_systemd_sees_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "pins.json").write_bytes(DAMAGED)
    systemd = Systemd()
    d = start_daemon(home, wait_ready=False, extra_env={
        "NOTIFY_SOCKET": "@" + systemd.name, "WATCHDOG_USEC": "400000", "FLEET_API_KEY": KEY})
    try:
        # 1. READY arrives despite the damaged pins file, and only once the preloaded
        #    model is resident (readiness is "every pinned model resident").
        msg = systemd.until("READY", START_TIMEOUT_S, d)
        assert msg["STATUS"] == f"serving on {d.url}"
        assert get(d.url, "/readyz").json() == {"ready": True, "status": "ready"}
        assert resident(d.url)[DEFAULT_MODEL]["pinned"] is True
        (aside,) = home.glob("pins.json.damaged-*")
        assert aside.read_bytes() == DAMAGED and not (home / "pins.json").exists()

        # 2. The watchdog is fed at half its timeout while healthy.
        pings = [systemd.next(2) for _ in range(3)]
        assert pings == [{"WATCHDOG": "1"}] * 3

        # 3. Auth guards everything but /healthz; request ids follow the request.
        assert httpx.get(d.url + "/healthz", timeout=10).status_code == 200
        refused = httpx.get(d.url + "/v1/ps", timeout=10)
        assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 16
        r = get(d.url, "/v1/ps", "req-42")
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
        assert len(get(d.url, "/v1/ps", "bad id\twith spaces").headers["x-request-id"]) == 16

        # 4. The pins file damaged while serving: the admin (with the operator's admin key,
        #    which the daemon takes in place of the API key) and readiness endpoints
        #    still answer 200 (a server-side problem is never a 4xx); the first reader
        #    sets the file aside, in its request's log context.
        (home / "pins.json").write_bytes(b"\0garbage")
        for path in ("/v1/ps", "/v1/models", "/readyz"):
            r = get(d.url, path, "req-43")
            assert r.status_code == 200, (path, r.text)
        assert get(d.url, "/v1/ps").json()["ready"] is True
        assert len(list(home.glob("pins.json.damaged-*"))) == 2
        r = httpx.delete(d.url + f"/v1/models/{DEFAULT_MODEL}/pin", headers=d.admin, timeout=60)
        assert r.status_code == 200 and r.json()["was_pinned"] is True  # the preload's pin

        # 5. Unpinned, then unloaded: readiness no longer waits for the preloaded model.
        r = httpx.post(d.url + f"/v1/models/{DEFAULT_MODEL}/unload", headers=d.admin, timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["loaded"] is False
        assert DEFAULT_MODEL not in resident(d.url)
        assert get(d.url, "/readyz").json() == {"ready": True, "status": "ready"}
        assert card(d.url, DEFAULT_MODEL) == (False, False)
        # A worker restarted now (killed) does not pin it again either.
        (old,) = get(d.url, "/v1/ps").json()["workers"]
        os.kill(old["pid"], signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not [w for w in get(d.url, "/v1/ps").json()["workers"] if w["pid"] != old["pid"] and w["up"]]:
            assert time.monotonic() < deadline, d.log()[-3000:]
            time.sleep(0.2)
        assert get(d.url, "/readyz").json() == {"ready": True, "status": "ready"}
        # Pinned again: loaded now (by the pin: the restart did not preload it), persisted,
        # and readiness waits for it again.
        r = httpx.post(d.url + f"/v1/models/{DEFAULT_MODEL}/pin", headers=d.admin, timeout=120)
        assert r.status_code == 200 and r.json()["results"][0]["pinned"] is True
        assert not r.json()["results"][0].get("already") and d.log().count(f"loaded {DEFAULT_MODEL} on cpu") == 2
        assert card(d.url, DEFAULT_MODEL) == (True, True)
        assert DEFAULT_MODEL in json.loads((home / "pins.json").read_bytes())["pins"]
        assert get(d.url, "/readyz").status_code == 200

        # 6. Metrics count the request and both loads (the preload, the pin after the unload).
        r = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["count me"]}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["shape"] == [1, 384]
        assert counter(d.url, "fleet_requests", model=DEFAULT_MODEL, task="embed", status="ok") == 1.0
        assert counter(d.url, "fleet_model_loads", model=DEFAULT_MODEL) == 2.0

        # 7. SIGTERM: STOPPING=1 at once, then a clean exit that removed the queue.
        d.proc.send_signal(signal.SIGTERM)
        msg = systemd.until("STOPPING", 10, d)
        assert msg["STATUS"] == "stopping on SIGTERM"
        assert d.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert not [e for e in os.listdir(SHM_DIR) if f"fleet-{d.proc.pid}" in e]
    finally:
        d.stop()
        systemd.close()
    # The daemon's own lines are JSON (not a TTY); each damaged file was logged once,
    # the second one with the id of the request that found it.
    records = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert any(r["logger"] == "fleet.daemon" and r["msg"].startswith("serving on") for r in records)
    damaged = [r for r in records if r["logger"] == "fleet.pins"]
    assert len(damaged) == 2 and all("set aside as pins.json.damaged-" in r["msg"] for r in damaged), damaged
    assert "request_id" not in damaged[0] and damaged[1]["request_id"] == "req-43"
