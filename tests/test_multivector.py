"""Per-token vectors (`output: "tokens"`, ColBERT-style) end to end: the real
daemon with all-MiniLM-L6-v2, checked against sentence-transformers'
`encode(output_value="token_embeddings")` on the same weights (padding left out)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL
from tests.test_embed_api import TEXTS, post_msgpack, served_dtype

MSGPACK = "application/msgpack"


@pytest.fixture(scope="module")
def token_reference(daemon, st_model):
    """sentence-transformers' token vectors, in the dtype fleet chose at load."""
    import copy

    import torch

    dtype = served_dtype(daemon.url)
    model = st_model if dtype == "float32" else copy.deepcopy(st_model).to(getattr(torch, dtype))
    blocks = model.encode(TEXTS, output_value="token_embeddings", convert_to_numpy=False)
    return [b.float().cpu().numpy() for b in blocks], dtype


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    assert got.shape == want.shape
    # Every token keeps its direction; fp32 also keeps its values (batch shapes
    # differ between fleet and the reference, so bf16 rounding differs a little).
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() > (0.9999 if dtype == "float32" else 0.995), cos.min()
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_msgpack_tokens_are_one_float32_block_per_input(daemon, token_reference):
    want, dtype = token_reference
    resp = post_msgpack(daemon.url, "/v1/embed",
                        {"model": DEFAULT_MODEL, "inputs": TEXTS, "output": "tokens", "normalize": False})
    assert resp.status_code == 200, resp.content
    reply = msgspec.msgpack.decode(resp.content)
    assert reply["dtype"] == "float32"
    assert all(isinstance(b, bytes) for b in reply["embeddings"])
    assert reply["shapes"] == [list(w.shape) for w in want]
    for block, shape, w in zip(reply["embeddings"], reply["shapes"], want):
        assert_close(np.frombuffer(block, dtype="<f4").reshape(shape), w, dtype)
    # Every real token is counted once (special tokens included).
    assert reply["usage"]["input_tokens"] == sum(w.shape[0] for w in want)


def test_json_tokens_are_nested_lists_and_normalised_by_default(daemon, token_reference):
    want, dtype = token_reference
    resp = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": TEXTS[:3], "output": "tokens"},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["shapes"] == [list(w.shape) for w in want[:3]]
    for rows, w in zip(reply["embeddings"], want[:3]):
        got = np.asarray(rows, dtype=np.float32)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert_close(got, w / np.linalg.norm(w, axis=1, keepdims=True), dtype)


def test_tokens_and_dense_requests_batched_together_each_get_their_kind(daemon, token_reference):
    """Concurrent requests of both kinds land in shared batches; each gets its own output."""
    want, dtype = token_reference

    def one(k: int):
        text = TEXTS[k % len(TEXTS)]
        output = "tokens" if k % 2 else "dense"
        resp = post_msgpack(daemon.url, "/v1/embed",
                            {"model": DEFAULT_MODEL, "inputs": [text], "output": output, "normalize": False})
        assert resp.status_code == 200, resp.content
        return k, output, msgspec.msgpack.decode(resp.content)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(24)))
    for k, output, reply in answers:
        if output == "tokens":
            (shape,) = reply["shapes"]
            assert_close(np.frombuffer(reply["embeddings"][0], dtype="<f4").reshape(shape), want[k % len(TEXTS)], dtype)
        else:
            assert reply["shape"] == [1, 384]


@pytest.mark.parametrize("body, needle", [
    ({"output": "tokens", "top_k": 4}, "top_k"),
    ({"output": "colbert"}, "output"),
    ({"output": "sparse"}, "SPLADE"),
])
def test_bad_output_requests(daemon, body, needle):
    resp = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a"], **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "bad_request" and needle in err["message"]
