"""A web page must not drive a loopback daemon (issue 16, deliverable 1).

Probes as a browser would send them, over real HTTP to a real `fleetctl serve`:
a foreign Host (DNS rebinding), a foreign Origin, and bodies a page can post with
no CORS preflight (text/plain, form, multipart). Each is refused in the contract's
error shape and changes nothing (no pin, no load); allowed origins get correct
CORS answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from fleet.daemon.guard import allowed_host, allowed_origin
from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon

APP_ORIGIN = "https://app.example.com"
EMBED = json.dumps({"model": DEFAULT_MODEL, "inputs": ["hi"]}).encode()


@pytest.fixture(scope="module")
def cors_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A daemon at the shipped defaults plus one browser app's origin on cors_origins."""
    d = start_daemon(tmp_path_factory.mktemp("fleet-cors"), extra_env={"FLEET_CORS_ORIGINS": APP_ORIGIN})
    yield d
    d.stop()


def pinned(url: str) -> list[str]:
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return [m["id"] for m in models if m.get("pinned")]


# ---- DNS rebinding: a foreign Host ----------------------------------------------

def test_foreign_host_is_refused(daemon):
    port = daemon.url.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "evil.example", f"rebind.attacker.test:{port}"):
        resp = httpx.post(daemon.url + "/v1/embed", content=EMBED,
                          headers={"Host": host, "Content-Type": "application/json"}, timeout=30)
        assert resp.status_code == 403, (host, resp.text)
        assert resp.json()["error"]["code"] == "forbidden"
        got = httpx.get(daemon.url + "/v1/models", headers={"Host": host}, timeout=30)
        assert got.status_code == 403  # a rebinding page cannot read replies either


def test_loopback_hosts_are_served(daemon):
    port = daemon.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        resp = httpx.post(daemon.url + "/v1/embed", content=EMBED,
                          headers={"Host": host, "Content-Type": "application/json"}, timeout=60)
        assert resp.status_code == 200, (host, resp.text)


@pytest.mark.parametrize("header,bind,names,ok", [
    ("127.0.0.1:7744", "127.0.0.1", [], True),
    ("localhost:7744", "127.0.0.1", [], True),
    ("[::1]:7744", "::1", [], True),
    ("evil.example:7744", "127.0.0.1", [], False),
    ("127.0.0.1.nip.io:7744", "127.0.0.1", [], False),
    ("fleet.lan:7744", "127.0.0.1", ["fleet.lan"], True),
    ("10.0.0.5:7744", "10.0.0.5", [], True),
    ("10.0.0.6:7744", "10.0.0.5", [], False),
    ("anything:7744", "0.0.0.0", [], True),
    ("anything:7744", "0.0.0.0", ["fleet.lan"], False),
    ("FLEET.LAN", "0.0.0.0", ["fleet.lan"], True),
])
def test_allowed_host_table(header, bind, names, ok):
    assert allowed_host(header, bind, names) is ok


# ---- Origin / CORS ----------------------------------------------------------------

def test_foreign_origin_is_refused_and_changes_nothing(daemon):
    evil = {"Origin": "https://evil.example", "Content-Type": "application/json"}
    before = pinned(daemon.url)
    for path in ("/v1/embed", f"/v1/models/{DEFAULT_MODEL}/pin", f"/v1/models/{DEFAULT_MODEL}/unload"):
        resp = httpx.post(daemon.url + path, content=EMBED if path == "/v1/embed" else b"", headers=evil,
                          timeout=60)
        assert resp.status_code == 403, (path, resp.text)
        assert resp.json()["error"]["code"] == "forbidden"
        assert "access-control-allow-origin" not in resp.headers
    pre = httpx.options(daemon.url + "/v1/embed", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"}, timeout=30)
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    assert pinned(daemon.url) == before
    assert httpx.post(daemon.url + "/v1/embed", content=EMBED, headers={"Content-Type": "application/json"},
                      timeout=60).status_code == 200


def test_loopback_origin_is_allowed_with_cors_headers(daemon):
    resp = httpx.post(daemon.url + "/v1/embed", content=EMBED, timeout=60,
                      headers={"Origin": "http://localhost:3000", "Content-Type": "application/json"})
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-served-by" in resp.headers["access-control-expose-headers"]


def test_listed_origin_gets_preflight_and_reply(cors_daemon):
    pre = httpx.options(cors_daemon.url + "/v1/embed", headers={
        "Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"}, timeout=30)
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"content-type", "authorization"} <= allowed
    assert "Origin" in pre.headers["vary"]
    resp = httpx.post(cors_daemon.url + "/v1/embed", content=EMBED, timeout=60,
                      headers={"Origin": APP_ORIGIN, "Content-Type": "application/json"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == APP_ORIGIN
    # Another origin stays refused on the same daemon.
    other = httpx.post(cors_daemon.url + "/v1/embed", content=EMBED, timeout=60,
                       headers={"Origin": "https://app.example.com.evil.example", "Content-Type": "application/json"})
    assert other.status_code == 403


@pytest.mark.parametrize("origin,host,patterns,ok", [
    ("http://localhost:3000", "127.0.0.1:7744", [], True),
    ("https://127.0.0.1", "127.0.0.1:7744", [], True),
    ("http://[::1]:8080", "127.0.0.1:7744", [], True),
    ("http://box.lan:7744", "box.lan:7744", [], True),  # the daemon's own /docs page
    ("https://evil.example", "127.0.0.1:7744", [], False),
    ("null", "127.0.0.1:7744", [], False),
    ("null", "127.0.0.1:7744", ["null"], True),
    ("https://a.example.com", "127.0.0.1:7744", ["https://*.example.com"], True),
    ("https://a.example.org", "127.0.0.1:7744", ["https://*.example.com"], False),
    ("chrome-extension://abc", "127.0.0.1:7744", [], False),
])
def test_allowed_origin_table(origin, host, patterns, ok):
    assert allowed_origin(origin, host, patterns) is ok


# ---- bodies a page can post without a preflight --------------------------------------

SIMPLE_BODIES = [
    ("text/plain", EMBED),
    ("text/plain;charset=UTF-8", EMBED),
    ("application/x-www-form-urlencoded", EMBED),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n' + EMBED + b"\r\n--x--\r\n"),
    ("", EMBED),
]


@pytest.mark.parametrize("ctype,body", SIMPLE_BODIES, ids=[c or "none" for c, _ in SIMPLE_BODIES])
def test_non_json_bodies_are_415(daemon, ctype, body):
    headers = {"Content-Type": ctype} if ctype else {}
    before = pinned(daemon.url)
    for path in ("/v1/embed", "/v1/embeddings", "/v1/chat/completions", f"/v1/models/{DEFAULT_MODEL}/pin"):
        resp = httpx.post(daemon.url + path, content=body, headers=headers, timeout=60)
        assert resp.status_code == 415, (path, ctype, resp.status_code, resp.text)
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    assert pinned(daemon.url) == before
    resp = httpx.post(daemon.url + "/v1/embed", content=msgspec.msgpack.encode({"model": DEFAULT_MODEL,
                      "inputs": ["hi"]}), headers={"Content-Type": "application/msgpack"}, timeout=60)
    assert resp.status_code == 200


def test_admin_without_body_still_works(daemon):
    resp = httpx.post(daemon.url + f"/v1/models/{DEFAULT_MODEL}/load", headers=daemon.admin, timeout=120)
    assert resp.status_code == 200, resp.text
