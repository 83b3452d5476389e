"""Embeddings end to end: real daemon, real HTTP, real weights, checked against
sentence-transformers run directly on the same model."""

from __future__ import annotations

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL

MSGPACK = "application/msgpack"

TEXTS = [
    "The cat sat on the mat.",
    "Quarterly revenue grew 12% year over year, driven by strong demand for cloud services in Europe.",
    "¿Cuál es la capital de Francia?",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "a",
    "Emergency rooms reported a sharp increase in respiratory infections during the first week of January, "
    "prompting hospitals to postpone elective surgeries and open additional wards.",
    "東京は日本の首都です。",
    "Reset your password from the account settings page, then sign in again on every device.",
]


def post_msgpack(url: str, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(url + path, content=msgspec.msgpack.encode(body),
                      headers={"Content-Type": MSGPACK, **kw.pop("headers", {})}, timeout=60, **kw)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def served_dtype(url: str) -> str:
    ps = httpx.get(url + "/v1/ps", timeout=10).json()
    return next(w["models"][DEFAULT_MODEL]["dtype"] for w in ps["workers"] if DEFAULT_MODEL in w["models"])


def reference(st_model, dtype: str, texts: list[str]) -> np.ndarray:
    import copy

    import torch

    model = st_model if dtype == "float32" else copy.deepcopy(st_model).to(getattr(torch, dtype))
    return model.encode(texts, convert_to_numpy=True).astype(np.float32)


def test_msgpack_embed_matches_sentence_transformers(daemon, st_model):
    resp = post_msgpack(daemon.url, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": TEXTS})
    assert resp.status_code == 200, resp.content
    assert resp.headers["content-type"].startswith(MSGPACK)
    reply = msgspec.msgpack.decode(resp.content)
    # Tensors travel as raw float32 bytes plus shape, never as lists of floats.
    assert isinstance(reply["embeddings"], bytes)
    assert reply["shape"] == [len(TEXTS), 384] and reply["dtype"] == "float32"
    got = np.frombuffer(reply["embeddings"], dtype="<f4").reshape(reply["shape"])
    # Same model, same dtype as fleet chose at load: the same vectors.
    dtype = served_dtype(daemon.url)
    assert cosine_rows(got, reference(st_model, dtype, TEXTS)).min() >= 0.9999
    # And against full precision, whatever dtype the device check picked.
    assert cosine_rows(got, reference(st_model, "float32", TEXTS)).min() >= 0.999
    expected_tokens = sum(len(ids) for ids in st_model.tokenizer(TEXTS, truncation=True, max_length=256)["input_ids"])
    assert reply["usage"]["input_tokens"] == expected_tokens
    assert float(resp.headers["X-Queue-Ms"]) >= 0 and float(resp.headers["X-Inference-Ms"]) > 0
    assert "/" in resp.headers["X-Served-By"]


def test_json_and_msgpack_give_the_same_vectors(daemon):
    body = {"model": DEFAULT_MODEL, "inputs": TEXTS[:3]}
    mp = msgspec.msgpack.decode(post_msgpack(daemon.url, "/v1/embed", body).content)
    resp = httpx.post(daemon.url + "/v1/embed", json=body, timeout=60)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    js = resp.json()
    assert js["shape"] == [3, 384] and isinstance(js["embeddings"][0][0], float)
    np.testing.assert_allclose(np.array(js["embeddings"], dtype=np.float32),
                               np.frombuffer(mp["embeddings"], dtype="<f4").reshape(3, 384), atol=1e-6)
    assert js["usage"] == mp["usage"]


def test_accept_header_picks_the_reply_format(daemon):
    body = {"model": DEFAULT_MODEL, "inputs": ["x"]}
    resp = httpx.post(daemon.url + "/v1/embed", json=body, headers={"Accept": "application/x-msgpack"}, timeout=60)
    assert resp.headers["content-type"].startswith(MSGPACK)
    assert isinstance(msgspec.msgpack.decode(resp.content)["embeddings"], bytes)
    resp = post_msgpack(daemon.url, "/v1/embed", body, headers={"Accept": "application/json"})
    assert resp.headers["content-type"].startswith("application/json")
    # Litestar's name for MessagePack is accepted on the way in too.
    resp = httpx.post(daemon.url + "/v1/embed", content=msgspec.msgpack.encode(body),
                      headers={"Content-Type": "application/x-msgpack"}, timeout=60)
    assert resp.status_code == 200 and isinstance(msgspec.msgpack.decode(resp.content)["embeddings"], bytes)


def test_normalize_false_is_the_models_own_output(daemon, st_model):
    """all-MiniLM-L6-v2 ends in a Normalize module: sentence-transformers' encode gives
    unit vectors with normalize_embeddings=False, and so does `normalize: false`."""
    body = {"model": DEFAULT_MODEL, "inputs": TEXTS[:2]}
    raw = msgspec.msgpack.decode(post_msgpack(daemon.url, "/v1/embed", {**body, "normalize": False}).content)
    r = np.frombuffer(raw["embeddings"], dtype="<f4").reshape(2, 384)
    np.testing.assert_allclose(np.linalg.norm(r, axis=1), 1.0, atol=1e-5)
    assert cosine_rows(r, reference(st_model, served_dtype(daemon.url), TEXTS[:2])).min() > 0.9999


def test_openai_client(daemon, st_model):
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused-on-loopback")
    out = client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[:4])
    assert [d.index for d in out.data] == [0, 1, 2, 3]
    got = np.array([d.embedding for d in out.data], dtype=np.float32)
    assert got.shape == (4, 384)
    assert cosine_rows(got, reference(st_model, served_dtype(daemon.url), TEXTS[:4])).min() >= 0.9999
    assert out.usage.prompt_tokens > 0
    single = client.embeddings.create(model=DEFAULT_MODEL, input="just one", encoding_format="float")
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384
    short = client.embeddings.create(model=DEFAULT_MODEL, input="cut", dimensions=64)
    assert len(short.data[0].embedding) == 64
    assert abs(np.linalg.norm(short.data[0].embedding) - 1.0) < 1e-4


def test_models_health_ready(daemon):
    models = httpx.get(daemon.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list"
    card = next(m for m in models["data"] if m["id"] == DEFAULT_MODEL)
    assert card["task"] == "embed" and card["loaded"] is True
    assert httpx.get(daemon.url + "/healthz", timeout=10).json() == {"status": "ok"}
    ready = httpx.get(daemon.url + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_many_concurrent_requests_each_answered_once(daemon):
    """Requests from many clients batch together; each gets its own rows back."""
    import asyncio

    texts = [f"request number {i} about topic {i % 7}" for i in range(48)]

    async def one(client: httpx.AsyncClient, text: str) -> np.ndarray:
        resp = await client.post("/v1/embed", content=msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": [text]}),
                                 headers={"Content-Type": MSGPACK})
        assert resp.status_code == 200
        reply = msgspec.msgpack.decode(resp.content)
        return np.frombuffer(reply["embeddings"], dtype="<f4").reshape(reply["shape"])[0]

    async def main() -> list[np.ndarray]:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, t) for t in texts))

    got = np.stack(asyncio.run(main()))
    together = msgspec.msgpack.decode(post_msgpack(daemon.url, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": texts}).content)
    want = np.frombuffer(together["embeddings"], dtype="<f4").reshape(len(texts), 384)
    assert cosine_rows(got, want).min() > 0.999
