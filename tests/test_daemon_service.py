"""The daemon as a service: metrics, auth, bind rule (real daemon, real HTTP)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DEFAULT_MODEL, free_port, start_daemon


def test_metrics_parse_and_count_requests(daemon):
    ok = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["count me"]}, timeout=60)
    assert ok.status_code == 200
    bad = httpx.post(daemon.url + "/v1/embed", json={"model": "no-such-model", "inputs": ["x"]}, timeout=60)
    assert bad.status_code == 404
    resp = httpx.get(daemon.url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    requests = {(s.labels["model"], s.labels["status"]): s.value for s in families["fleet_requests"].samples
                if s.name == "fleet_requests_total"}
    assert requests[(DEFAULT_MODEL, "ok")] >= 1
    assert any(status == "model_not_found" and value >= 1 for (_, status), value in requests.items())
    assert "fleet_request_duration_seconds" in families


def test_api_key_guards_everything_but_healthz(tmp_path):
    key = "k" * 32
    d = start_daemon(tmp_path / "home", extra_env={"FLEET_API_KEY": key, "FLEET_CPU_THREADS": "1"},
                     wait_ready=False)
    try:
        # Readiness polling itself needs the key now.
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(d.url + "/readyz", headers={"Authorization": f"Bearer {key}"}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert d.proc.poll() is None, d.log()[-3000:]
            time.sleep(0.3)
        assert httpx.get(d.url + "/healthz", timeout=5).status_code == 200
        body = {"model": DEFAULT_MODEL, "inputs": ["secret"]}
        missing = httpx.post(d.url + "/v1/embed", json=body, timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = httpx.post(d.url + "/v1/embed", json=body, headers={"Authorization": "Bearer " + "x" * 32}, timeout=30)
        assert wrong.status_code == 401
        assert httpx.get(d.url + "/v1/nothing", timeout=5).status_code == 401  # routes are not revealed
        good = httpx.post(d.url + "/v1/embed", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert good.status_code == 200 and good.json()["shape"] == [1, 384]
    finally:
        d.stop()


def test_non_loopback_bind_without_key_is_refused(tmp_path):
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home"), "FLEET_PORT": str(free_port())}
    env.pop("FLEET_API_KEY", None)
    out = subprocess.run([sys.executable, "-m", "fleetctl", "serve", "--host", "0.0.0.0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "API key" in out.stderr and "Traceback" not in out.stderr
