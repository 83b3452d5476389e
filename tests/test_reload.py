"""SIGHUP on a real daemon: config.toml's live settings apply without a restart or a
dropped request, the others are logged as needing a restart, and systemd's reload
protocol (RELOADING=1 with MONOTONIC_USEC, then READY=1) reaches a real NOTIFY_SOCKET."""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, start_daemon

KEY = "reload-test-key-0123456789abcdef"


def notify_until(sock: socket.socket, key: str, timeout_s: float = 30.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        msg = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
        if key in msg:
            return msg


def embed(url: str, n: int, **extra) -> httpx.Response:
    body = {"model": DEFAULT_MODEL, "inputs": [f"reload {i}" for i in range(n)], **extra}
    return httpx.post(url + "/v1/embed", json=body, timeout=120)


@pytest.mark.slow
def test_sighup_applies_live_settings_and_keeps_requests(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config = home / "config.toml"
    config.write_text("timeout_ms = 30000\nmax_inputs = 64\n")
    name = f"@fleet-reload-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name[1:].encode())
    d = start_daemon(home, extra_env={"NOTIFY_SOCKET": name, "FLEET_CPU_THREADS": "1"})
    stop = threading.Event()
    results: list[tuple[int, str]] = []

    def load() -> None:
        # Requests in flight across the reload: each names its own timeout, so the
        # reload's tiny default does not apply to them; each sends 4 inputs (< any limit here).
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                try:
                    r = client.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "timeout_ms": 60_000,
                                                               "inputs": ["in flight"] * 4})
                    results.append((r.status_code, r.text[:200]))
                except httpx.HTTPError as exc:
                    results.append((0, f"{type(exc).__name__}: {exc}"))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    try:
        notify_until(sock, "READY")
        assert embed(d.url, 10).status_code == 200  # 10 <= 64 before the reload
        for t in threads:
            t.start()
        time.sleep(1.0)
        # 1. Live: max_inputs, the default timeout, the body limit. Needs a restart: queue_slots.
        config.write_text("timeout_ms = 1\nmax_inputs = 5\nmax_body_bytes = 4000\nqueue_slots = 4096\n"
                          "max_token_vector_bytes = 1000\n")
        d.proc.send_signal(signal.SIGHUP)
        reloading = notify_until(sock, "RELOADING")
        assert int(reloading["MONOTONIC_USEC"]) > 0
        ready = notify_until(sock, "READY")
        assert "queue_slots" in ready["STATUS"]
        time.sleep(1.0)  # more requests in flight after the reload
        stop.set()
        for t in threads:
            t.join(timeout=130)

        too_many = embed(d.url, 10, timeout_ms=60_000)
        assert too_many.status_code == 400 and "limit of 5" in too_many.json()["error"]["message"]
        assert embed(d.url, 5, timeout_ms=60_000).status_code == 200
        timed_out = embed(d.url, 2)  # no timeout_ms: the new default of 1 ms applies
        assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "timeout", timed_out.text
        big = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["x" * 5000],
                                                     "timeout_ms": 60_000}, timeout=60)
        assert big.status_code == 413, big.text
        vectors = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a b c"],
                                                         "output": "tokens", "timeout_ms": 60_000}, timeout=60)
        assert vectors.status_code == 413 and "max_token_vector_bytes = 1000" in vectors.text, vectors.text

        # 2. The API key can be set live (loopback: a key is optional, and now required).
        config.write_text(f'timeout_ms = 30000\napi_key = "{KEY}"\n')
        d.proc.send_signal(signal.SIGHUP)
        notify_until(sock, "RELOADING")
        notify_until(sock, "READY")
        assert embed(d.url, 1).status_code == 401
        authed = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["ok"]},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert authed.status_code == 200 and authed.json()["shape"] == [1, 384]
        assert httpx.get(d.url + "/healthz", timeout=5).status_code == 200
    finally:
        stop.set()
        d.stop()
        sock.close()
    # Every request in flight across the reload completed.
    assert len(results) >= 4 and all(code == 200 for code, _ in results), [r for r in results if r[0] != 200]
    log = d.log()
    reloads = [line for line in log.splitlines() if "reloaded models.toml and config.toml" in line]
    assert len(reloads) == 2
    assert "applied timeout_ms, max_inputs, max_body_bytes" in reloads[0]
    assert "api_key" in reloads[1]
    assert "need a restart (not applied): queue_slots" in log
    assert KEY not in log  # the key is a secret: named, never printed
