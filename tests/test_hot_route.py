"""`POST /v1/embed` in plain ASGI (daemon.hot) answers exactly as the Litestar route does.

`fleetctl serve` puts `HotRoutes` in front of the Litestar app, so every
/v1/embed request of the other tests (values, errors, limits, timelines,
schemathesis) goes through it. Here both are called side by side, in process,
on the same app and daemon, with requests that fail at each step before the
queue (a daemon that was never started holds no queue; what follows the
queue is the same `embed_exchange` for both): status, content type, body and
headers must be identical, in JSON and in MessagePack. Plus the hot route's
own parts: a body over the limit by its Content-Length or by what arrives,
a client gone before its body, and routes it must leave to Litestar.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from fleet.daemon.app import create_app
from fleet.daemon.core import Daemon
from fleet.daemon.controllers.embed import embed_exchange
from fleet.daemon.hot import HotRoutes
from fleet.config import Settings

LIMIT = 4096

MP, JS = "application/msgpack", "application/json"


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-home")
    daemon = Daemon(Settings(home=str(home), max_body_bytes=LIMIT))
    litestar = create_app(daemon)
    return litestar, HotRoutes(litestar, daemon, embed_exchange)


def call(app, body: bytes, *, content_type: str, accept: str | None = None, path: str = "/v1/embed",
         method: str = "POST", chunks: int = 1, declared: bool = True, disconnect: bool = False) -> dict:
    headers = [(b"host", b"127.0.0.1:7744"), (b"content-type", content_type.encode())]
    if accept:
        headers.append((b"accept", accept.encode()))
    if declared:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 7744), "state": {}}
    step = max(1, -(-len(body) // chunks))
    parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    if disconnect:
        messages = messages[:1] + [{"type": "http.disconnect"}]
        messages[0]["more_body"] = True
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    if not sent:
        return {}
    start = sent[0]
    return {"status": start["status"], "headers": dict(start["headers"]),
            "body": b"".join(m.get("body", b"") for m in sent[1:])}


CASES = [
    ("empty body", b"", JS),
    ("malformed JSON", b"{", JS),
    ("malformed MessagePack", b"\xc1", MP),
    ("inputs of the wrong type", b'{"model": "m", "inputs": 3}', JS),
    ("an unknown output", b'{"model": "m", "inputs": ["a"], "output": "nope"}', JS),
    ("no model and none stored", b'{"inputs": ["a"]}', JS),
    ("empty inputs", msgspec.msgpack.encode({"model": "m", "inputs": []}), MP),
    ("an integer past 64 bits", b'{"model": "m", "inputs": ["a"], "timeout_ms": 1' + b"0" * 30 + b"}", JS),
    ("top_k without sparse", b'{"model": "m", "inputs": ["a"], "top_k": 3}', JS),
    ("a model not stored", b'{"model": "no-such-model", "inputs": ["a"]}', JS),
    ("an invalid model name", b'{"model": "../etc", "inputs": ["a"]}', JS),
    ("a bad base64 image", b'{"model": "m", "inputs": [{"image": "***"}]}', JS),
    ("a body over the limit", b'{"model": "m", "inputs": ["' + b"x" * LIMIT + b'"]}', JS),
]


@pytest.mark.parametrize("accept", [None, MP, JS])
@pytest.mark.parametrize("name,body,content_type", CASES, ids=[c[0] for c in CASES])
def test_the_hot_route_answers_like_the_litestar_route(apps, name, body, content_type, accept):
    litestar, hot = apps
    want = call(litestar, body, content_type=content_type, accept=accept)
    got = call(hot, body, content_type=content_type, accept=accept)
    assert want["status"] >= 400, want  # every case fails before the queue
    assert got == want


def test_a_body_over_the_limit_is_refused_by_what_arrives_too(apps):
    litestar, hot = apps
    body = b'{"model": "m", "inputs": ["' + b"x" * LIMIT + b'"]}'
    got = call(hot, body, content_type=JS, chunks=7, declared=False)
    assert got["status"] == 413
    assert msgspec.json.decode(got["body"])["error"] == {
        "code": "payload_too_large", "message": f"request body is over the limit of {LIMIT} bytes (max_body_bytes)"}
    assert got == call(litestar, body, content_type=JS, chunks=7, declared=False)
    # A body in many pieces within the limit is read whole.
    small = b'{"model": "no-such-model", "inputs": ["' + b"y" * 100 + b'"]}'
    assert call(hot, small, content_type=JS, chunks=9) == call(litestar, small, content_type=JS)


def test_a_client_gone_before_its_body_gets_no_answer(apps):
    _, hot = apps
    assert call(hot, b'{"model": "m", "inputs": ["a"]}', content_type=JS, chunks=2, disconnect=True) == {}


@pytest.mark.parametrize("method,path", [("GET", "/v1/embed"), ("POST", "/v1/embeddings"),
                                         ("POST", "/v1/embed/"), ("POST", "/v1/rerank")])
def test_other_routes_are_the_litestar_apps(apps, method, path):
    litestar, hot = apps
    body = b'{"model": "no-such-model", "inputs": ["a"], "input": "a", "query": "q", "documents": ["d"]}'
    assert call(hot, body, content_type=JS, method=method, path=path) == \
        call(litestar, body, content_type=JS, method=method, path=path)
