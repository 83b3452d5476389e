"""Bind rule and bearer auth, over real HTTP to a Litestar app served by uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import uvicorn
from litestar import Litestar, get, post
from litestar.params import JSONBody
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from daemon.auth import MIN_KEY_CHARS, BearerAuthMiddleware, bearer_auth, check_bind, is_loopback
from daemon.metrics import Metrics, metrics_route
from fleet.errors import Unauthorized

KEY = "k3y-for-tests-0123456789abcdef"


class EmbedIn(msgspec.Struct):
    model: str
    inputs: list[str]


def make_app(metrics: Metrics, calls: list[str]) -> Litestar:
    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @post("/v1/embed", sync_to_thread=False)
    def embed(data: JSONBody[EmbedIn]) -> dict[str, object]:
        calls.append(data.model)
        metrics.observe_request(data.model, "embed", "ok", 0.004, queue_ms=1.0, inference_ms=2.5)
        return {"model": data.model, "n": len(data.inputs)}

    return Litestar([healthz, embed, metrics_route(metrics)])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[str]]]:
    calls: list[str] = []
    metrics = Metrics()
    app = bearer_auth(KEY)(make_app(metrics, calls))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", calls
    srv.should_exit = True
    thread.join(10)
    sock.close()


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


def test_healthz_is_open(server):
    url, _ = server
    r = httpx.get(f"{url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_missing_token_gets_401_json_and_handler_never_runs(server):
    url, calls = server
    before = len(calls)
    r = httpx.post(f"{url}/v1/embed", json={"model": "m", "inputs": ["a"]})
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/json"
    assert r.headers["www-authenticate"] == 'Bearer realm="fleet"'
    assert r.json()["error"]["code"] == "unauthorized"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    assert len(calls) == before


def test_wrong_key_gets_invalid_token(server):
    url, calls = server
    before = len(calls)
    for token in (KEY[:-1] + "X", KEY + "X", "x", KEY.upper()):
        r = httpx.post(f"{url}/v1/embed", json={"model": "m", "inputs": ["a"]},
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401
        assert "invalid_token" in r.headers["www-authenticate"]
    r = httpx.post(f"{url}/v1/embed", json={"model": "m", "inputs": ["a"]}, headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401
    assert len(calls) == before


def test_right_key_passes_any_scheme_case(server):
    url, calls = server
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(f"{url}/v1/embed", json={"model": "all-minilm-l6-v2", "inputs": ["a", "b"]},
                       headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 201, r.text
        assert r.json() == {"model": "all-minilm-l6-v2", "n": 2}
    assert calls[-3:] == ["all-minilm-l6-v2"] * 3


@pytest.mark.parametrize(
    "headers",
    [
        {"Accept": "application/msgpack"},
        {"Accept": "application/x-msgpack"},
        {"Content-Type": "application/msgpack"},
    ],
)
def test_refusal_speaks_msgpack_when_asked(server, headers):
    url, _ = server
    r = httpx.post(f"{url}/v1/embed", content=msgspec.msgpack.encode({"model": "m", "inputs": []}), headers=headers)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["error"]["code"] == "unauthorized"


def test_accept_json_wins_over_msgpack_body(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/embed", content=b"\x80",
                   headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_unknown_paths_are_guarded_too(server):
    # Wrapped around the whole app: no 404 leaks which paths exist.
    url, _ = server
    assert httpx.get(f"{url}/v1/nope").status_code == 401
    assert httpx.get(f"{url}/v1/nope", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_metrics_are_guarded_and_scrapable(server):
    url, _ = server
    assert httpx.get(f"{url}/metrics").status_code == 401
    httpx.post(f"{url}/v1/embed", json={"model": "scraped", "inputs": ["a"]}, headers={"Authorization": f"Bearer {KEY}"})
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    counts = {(s.labels["model"], s.labels["status"]): s.value for s in families["fleet_requests"].samples}
    assert counts[("scraped", "ok")] == 1.0
    om = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}", "Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")


def test_no_key_means_no_guard():
    app = Litestar([])
    assert bearer_auth("")(app) is app
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
