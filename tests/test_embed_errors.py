"""Bad input gets the contract's error shape, the right status, in the
negotiated format, and the daemon keeps serving afterwards."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from tests.conftest import DEFAULT_MODEL

MSGPACK = "application/msgpack"


def still_serving(url: str) -> None:
    resp = httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["still here"]}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["shape"] == [1, 384]


def error_of(resp: httpx.Response) -> dict:
    if resp.headers["content-type"].startswith(MSGPACK):
        return msgspec.msgpack.decode(resp.content)["error"]
    return resp.json()["error"]


def send(url: str, content: bytes, content_type: str, path: str = "/v1/embed") -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"Content-Type": content_type}, timeout=60)


# (case, content-type, body, status, code)
CASES = [
    ("malformed msgpack", MSGPACK, b"\xc1\xff\x00", 400, "bad_request"),
    ("truncated msgpack", MSGPACK, msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": ["a"]})[:-3], 400, "bad_request"),
    ("malformed json", "application/json", b'{"model": "x", "inputs": [', 400, "bad_request"),
    ("empty body", "application/json", b"", 400, "bad_request"),
    ("inputs not a list", "application/json", b'{"model": "all-minilm-l6-v2", "inputs": "text"}', 400, "bad_request"),
    ("input not a string", MSGPACK, msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": [1, 2]}), 400, "bad_request"),
    ("normalize not a bool", "application/json", b'{"model": "all-minilm-l6-v2", "inputs": ["a"], "normalize": "yes"}', 400, "bad_request"),
    ("model not a string", "application/json", b'{"model": 5, "inputs": ["a"]}', 400, "bad_request"),
    ("empty inputs", "application/json", b'{"model": "all-minilm-l6-v2", "inputs": []}', 400, "bad_request"),
    ("unknown model", "application/json", b'{"model": "no-such-model", "inputs": ["a"]}', 404, "model_not_found"),
    ("model name is a path", "application/json", b'{"model": "../../etc", "inputs": ["a"]}', 404, "model_not_found"),
    ("non-utf8 json", "application/json", b'{"model": "all-minilm-l6-v2", "inputs": ["\xff\xfe"]}', 400, "bad_request"),
    # msgpack str 0xa2 + two bytes that are not UTF-8
    ("non-utf8 msgpack", MSGPACK,
     b"\x82\xa5model" + msgspec.msgpack.encode(DEFAULT_MODEL) + b"\xa6inputs\x91\xa2\xff\xfe", 400, "bad_request"),
    ("bad timeout", "application/json", b'{"model": "all-minilm-l6-v2", "inputs": ["a"], "timeout_ms": -5}', 400, "bad_request"),
]


@pytest.mark.parametrize("case,ctype,body,status,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(daemon, case, ctype, body, status, code):
    resp = send(daemon.url, body, ctype)
    assert resp.status_code == status, (case, resp.status_code, resp.content[:300])
    # The reply is in the request's format.
    assert resp.headers["content-type"].startswith(MSGPACK if ctype == MSGPACK else "application/json")
    err = error_of(resp)
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    still_serving(daemon.url)


def test_body_over_the_limit_is_413(daemon):
    # The session daemon runs with FLEET_MAX_BODY_BYTES = 4 MiB.
    big = msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": ["x" * (5 << 20)]})
    resp = send(daemon.url, big, MSGPACK)
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "payload_too_large"
    still_serving(daemon.url)


def test_too_many_inputs(daemon):
    resp = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a"] * 2049}, timeout=60)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["code"] == "bad_request" and "2048" in err["message"]
    still_serving(daemon.url)


def test_input_too_long_without_truncation_is_422(daemon):
    long_text = "word " * 600  # > 256 tokens, all-MiniLM-L6-v2's limit
    resp = httpx.post(daemon.url + "/v1/embed",
                      json={"model": DEFAULT_MODEL, "inputs": ["short", long_text], "truncate": False}, timeout=60)
    assert resp.status_code == 422
    err = error_of(resp)
    assert err["code"] == "input_too_long" and "input 1" in err["message"] and "256" in err["message"]
    # With truncation (the default) the same input is fine.
    ok = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [long_text]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["input_tokens"] == 256
    still_serving(daemon.url)


def test_msgpack_errors_come_back_in_msgpack(daemon):
    resp = httpx.post(daemon.url + "/v1/embed", content=msgspec.msgpack.encode({"model": "nope", "inputs": ["a"]}),
                      headers={"Content-Type": MSGPACK}, timeout=60)
    assert resp.status_code == 404 and resp.headers["content-type"].startswith(MSGPACK)
    assert msgspec.msgpack.decode(resp.content) == {"error": {"code": "model_not_found",
                                                              "message": error_of(resp)["message"]}}


def test_unknown_route_and_method_use_the_error_shape(daemon):
    resp = httpx.get(daemon.url + "/v1/nothing-here", timeout=10)
    assert resp.status_code == 404 and "code" in resp.json()["error"]
    resp = httpx.get(daemon.url + "/v1/embed", timeout=10)
    assert resp.status_code == 405 and "code" in resp.json()["error"]


def test_openai_bad_input(daemon):
    # Token ids are read in the model's vocabulary: one past its end is refused.
    resp = httpx.post(daemon.url + "/v1/embeddings", json={"model": DEFAULT_MODEL, "input": [[1, 30522]]}, timeout=60)
    assert resp.status_code == 400 and error_of(resp)["code"] == "bad_request"
    resp = httpx.post(daemon.url + "/v1/embeddings",
                      json={"model": DEFAULT_MODEL, "input": "a", "dimensions": 4096}, timeout=60)
    assert resp.status_code == 400 and "dimensions" in error_of(resp)["message"]
    still_serving(daemon.url)
