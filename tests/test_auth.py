"""Bind rule and bearer auth, over real HTTP: the real app (daemon.app with the hot
route in front) inside the auth wrapper `fleetctl serve` puts around it
(daemon.server.LiveApp), served by uvicorn.

The daemon is not started (no queue, no workers): a request that gets past auth
runs its real route up to the queue, where a model that is not stored answers
404 `model_not_found`. Every request that reaches the queue is counted on
/metrics, so a refused request is seen not to have reached its handler.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import uvicorn
from litestar import Litestar, get
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from fleet.daemon.app import create_app
from fleet.daemon.auth import MIN_KEY_CHARS, BearerAuthMiddleware, bearer_auth, check_bind, is_loopback
from fleet.daemon.core import Daemon
from fleet.daemon.controllers.embed import embed_exchange
from fleet.daemon.hot import HotRoutes
from fleet.daemon.server import LiveApp
from fleet.config import Settings
from fleet.errors import Unauthorized

KEY = "k3y-for-tests-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Not in the store: a request for it that passes auth ends at the queue's door with 404.
BODY = {"model": "no-such-model", "inputs": ["a"]}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    daemon = Daemon(Settings(home=str(tmp_path_factory.mktemp("fleet-home"))))
    app = LiveApp(HotRoutes(create_app(daemon), daemon, embed_exchange), KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # No lifespan: it would start the daemon's queue and workers, which no test here reaches.
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


def requests_counted(url: str) -> dict[tuple[str, str], float]:
    """`fleet_requests_total` per (model, status), from /metrics (with the key)."""
    r = httpx.get(f"{url}/metrics", headers=AUTH)
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    if "fleet_requests" not in families:
        return {}
    return {(s.labels["model"], s.labels["status"]): s.value for s in families["fleet_requests"].samples
            if s.name == "fleet_requests_total"}


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("LOCALHOST", True),
        ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.20", False),
        ("10.0.0.1", False), ("fleet.example", False), ("localhost.evil.example", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_loopback_bind_needs_no_key():
    check_bind("127.0.0.1", "")
    check_bind("::1", "")


def test_exposed_bind_without_key_is_refused_with_a_hint():
    with pytest.raises(Unauthorized, match="refusing to bind 0.0.0.0 without an API key") as info:
        check_bind("0.0.0.0", "")
    assert "FLEET_API_KEY" in info.value.hint


def test_exposed_bind_with_short_key_is_refused():
    with pytest.raises(Unauthorized, match=f"at least {MIN_KEY_CHARS}"):
        check_bind("192.168.1.20", "short")
    check_bind("192.168.1.20", KEY)


@pytest.mark.parametrize("key", [" " * 16, "a" * 16, "a" * 64, "ab" * 16, "abcabcabcabcabcabc", "\t" * 20,
                                 "k3y-for-tests 0123456789abcdef"])
def test_exposed_bind_with_low_entropy_key_is_refused(key):
    with pytest.raises(Unauthorized, match="weak API key"):
        check_bind("192.168.1.20", key)
    check_bind("127.0.0.1", key)  # loopback: any key (or none) is the user's choice


def test_healthz_is_open(url):
    r = httpx.get(f"{url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_missing_token_gets_401_json_and_handler_never_runs(url):
    before = requests_counted(url)
    r = httpx.post(f"{url}/v1/embed", json=BODY)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/json"
    assert r.headers["www-authenticate"] == 'Bearer realm="fleet"'
    assert r.json()["error"]["code"] == "unauthorized"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    assert requests_counted(url) == before


def test_wrong_key_gets_invalid_token(url):
    before = requests_counted(url)
    for token in (KEY[:-1] + "X", KEY + "X", "x", KEY.upper()):
        r = httpx.post(f"{url}/v1/embed", json=BODY, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401
        assert "invalid_token" in r.headers["www-authenticate"]
    r = httpx.post(f"{url}/v1/embed", json=BODY, headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401
    assert requests_counted(url) == before


def test_right_key_passes_any_scheme_case(url):
    before = requests_counted(url).get(("_unknown", "model_not_found"), 0)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(f"{url}/v1/embed", json=BODY, headers={"Authorization": f"{scheme} {KEY}"})
        # Past auth, the real route ran up to the queue: the model is not stored.
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
    # A name the daemon does not store is counted under `_unknown` (daemon.metrics).
    assert requests_counted(url)[("_unknown", "model_not_found")] == before + 3
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert models.status_code == 200 and models.json() == {"data": [], "object": "list"}


@pytest.mark.parametrize(
    "headers",
    [
        {"Accept": "application/msgpack"},
        {"Accept": "application/x-msgpack"},
        {"Content-Type": "application/msgpack"},
    ],
)
def test_refusal_speaks_msgpack_when_asked(url, headers):
    r = httpx.post(f"{url}/v1/embed", content=msgspec.msgpack.encode({"model": "m", "inputs": []}), headers=headers)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["error"]["code"] == "unauthorized"


def test_accept_json_wins_over_msgpack_body(url):
    r = httpx.post(f"{url}/v1/embed", content=b"\x80",
                   headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_unknown_paths_are_guarded_too(url):
    # Wrapped around the whole app: no 404 leaks which paths exist.
    assert httpx.get(f"{url}/v1/nope").status_code == 401
    assert httpx.get(f"{url}/v1/nope", headers=AUTH).status_code == 404


def test_metrics_are_guarded_and_scrapable(url):
    assert httpx.get(f"{url}/metrics").status_code == 401
    r = httpx.get(f"{url}/metrics", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "fleet_request_duration_seconds" in {f.name for f in text_string_to_metric_families(r.text)}
    om = httpx.get(f"{url}/metrics", headers={**AUTH, "Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")


def test_no_key_means_no_guard(tmp_path):
    app = create_app(Daemon(Settings(home=str(tmp_path / "home"))))
    assert bearer_auth("")(app) is app
    assert LiveApp(app, "").app is app
    with pytest.raises(ValueError, match="non-empty api_key"):
        BearerAuthMiddleware(app, "")


def test_as_litestar_middleware_entry():
    @get("/v1/ps", sync_to_thread=False)
    def ps() -> list[str]:
        return []

    @get("/healthz", sync_to_thread=False)
    def healthz() -> str:
        return "ok"

    with TestClient(Litestar([ps, healthz], middleware=[bearer_auth(KEY)])) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/ps").status_code == 401
        assert client.get("/v1/ps", headers={"Authorization": f"Bearer {KEY}"}).json() == []
