"""The service wiring end to end, with this test playing systemd.

A real process serves a Litestar app over uvicorn with the pieces wired the way
the daemon wires them (JSON logs, request ids, bearer auth, /metrics, READY only
when serving and "pinned models" are loaded, watchdog, STOPPING on SIGTERM).
The test listens on an abstract NOTIFY_SOCKET, as systemd does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "wiring-test-key-0123456789abcdef"

APP = r'''
import asyncio, logging, socket
from contextlib import asynccontextmanager
from litestar import Litestar, get
from litestar.exceptions import HTTPException
import uvicorn
from daemon.auth import bearer_auth, check_bind
from daemon.logs import RequestIdMiddleware, setup_logging
from daemon.metrics import Metrics, metrics_route
from daemon.notify import SystemdServer, announce_ready, watchdog_loop

log = logging.getLogger("fleet.daemon")
setup_logging("info")
HOST, KEY = "127.0.0.1", __import__("os").environ["FLEET_API_KEY"]
check_bind(HOST, KEY)
metrics = Metrics()
pinned_loaded = asyncio.Event()

@get("/healthz", sync_to_thread=False)
def healthz() -> dict:
    return {"status": "ok"}

@get("/readyz", sync_to_thread=False)
def readyz() -> dict:
    if not pinned_loaded.is_set():
        raise HTTPException(status_code=503, detail="loading")
    return {"status": "ready"}

@get("/v1/ps", sync_to_thread=False)
def ps() -> list:
    log.info("ps asked")
    metrics.observe_request("", "ps", "ok", 0.001)
    return []

async def load_pinned() -> None:
    await asyncio.sleep(0.5)  # stands in for the workers loading pinned models
    metrics.model_loaded("all-minilm-l6-v2")
    pinned_loaded.set()

@asynccontextmanager
async def lifespan(app):
    tasks = [
        asyncio.create_task(load_pinned()),
        asyncio.create_task(announce_ready(lambda: server.started, pinned_loaded.wait(), status=f"serving on {HOST}:{port}")),
        asyncio.create_task(watchdog_loop(lambda: pinned_loaded.is_set())),
    ]
    yield
    for t in tasks:
        t.cancel()
    log.info("drained")

sock = socket.socket()
sock.bind((HOST, 0))
port = sock.getsockname()[1]
app = RequestIdMiddleware(bearer_auth(KEY)(Litestar([healthz, readyz, ps, metrics_route(metrics)],
                                                    lifespan=[lifespan], logging_config=None)))
server = SystemdServer(uvicorn.Config(app, log_config=None, lifespan="on"))
server.run(sockets=[sock])
'''


def recv(sock: socket.socket, timeout: float = 30.0) -> dict[str, str]:
    sock.settimeout(timeout)
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())


def test_ready_watchdog_auth_logs_and_stop_as_systemd_sees_them(tmp_path):
    script = tmp_path / "fleetd_wiring.py"
    script.write_text(APP)
    name = f"@fleet-wiring-{uuid.uuid4().hex}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(b"\0" + name[1:].encode())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000",
           "FLEET_API_KEY": KEY}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        # 1. READY arrives only when the API answers and the pinned models are in.
        msg = recv(notify)
        while "READY" not in msg:
            msg = recv(notify)
        assert time.monotonic() - started >= 0.5
        url = "http://" + msg["STATUS"].removeprefix("serving on ")
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/readyz", headers=auth, timeout=5).json() == {"status": "ready"}

        # 2. The watchdog is fed at half the timeout while healthy.
        pings = [recv(notify, 2) for _ in range(3)]
        assert pings == [{"WATCHDOG": "1"}] * 3

        # 3. Auth guards everything but /healthz; request ids follow the request.
        refused = httpx.get(f"{url}/v1/ps", timeout=5)
        assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 16
        r = httpx.get(f"{url}/v1/ps", headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-42"}, timeout=5)
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
        generated = httpx.get(f"{url}/v1/ps", headers={"Authorization": f"Bearer {KEY}",
                                                       "X-Request-Id": "bad id\twith spaces"}, timeout=5)
        assert len(generated.headers["x-request-id"]) == 16
        scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
        assert 'fleet_model_loads_total{model="all-minilm-l6-v2"} 1.0' in scraped
        assert 'fleet_requests_total{model="-",status="ok",task="ps"} 2.0' in scraped

        # 4. SIGTERM: STOPPING=1 at once, then a clean exit.
        proc.send_signal(signal.SIGTERM)
        msg = recv(notify, 10)
        while "STOPPING" not in msg:
            msg = recv(notify, 10)
        assert msg["STATUS"] == "stopping on SIGTERM"
        assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
    records = [json.loads(line) for line in proc.stderr.read().splitlines()]
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own lines, as JSON
    ps_lines = [r for r in records if r["msg"] == "ps asked"]
    assert [r["request_id"] for r in ps_lines][0] == "req-42"
    assert ps_lines[1]["request_id"] == generated.headers["x-request-id"]
    assert "drained" in [r["msg"] for r in records]  # the lifespan shutdown ran
