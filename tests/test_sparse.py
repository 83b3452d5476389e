"""SPLADE sparse embeddings (`output: "sparse"`, runtime `splade`) end to end: a
tiny `BertForMaskedLM` with the all-MiniLM vocabulary, pulled with
`--runtime splade`, served by a real daemon, checked against the SPLADE formula
computed directly in torch on the same folder:

    w = max_t log(1 + relu(logits[t])) * attention_mask[t]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import default_model_dir, start_daemon

MSGPACK = "application/msgpack"
NAME = "tiny-splade"
TEXTS = [
    "The cat sat on the mat.",
    "Sparse vectors make hybrid search cheap: an inverted index plus a dense index.",
    "a",
    "¿Dónde está la biblioteca?",
    "GPU memory is managed per device; pinned models stay resident and others are evicted LRU.",
]
LONG = " ".join(["word"] * 200)


def build_splade(folder: Path) -> Path:
    """A tiny masked LM whose output bias is set so ~1 % of terms are positive per
    token: term vectors are then really sparse (as trained SPLADE models are)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, initializer_range=0.3)
    model = BertForMaskedLM(cfg).eval()
    with torch.no_grad():
        logits = model(**tok(TEXTS, padding=True, return_tensors="pt")).logits
        model.cls.predictions.bias -= torch.quantile(logits.flatten()[::7], 0.99)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def reference(folder: Path, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**enc).logits
    w = torch.log1p(torch.relu(logits)) * enc["attention_mask"].unsqueeze(-1)
    return w.amax(dim=1).numpy()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_splade(tmp_path_factory.mktemp("splade") / "model")


@pytest.fixture(scope="module")
def want(folder: Path) -> np.ndarray:
    return reference(folder, TEXTS)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folder: Path):
    home = tmp_path_factory.mktemp("fleet-splade")
    # Profile dtype float32 so answers compare to 1e-5 (the overlay names the profile only).
    (home / "models.toml").write_text(
        f'[models."{NAME}"]\nsource = "path:{folder.resolve()}"\ntask = "embed"\nruntime = "splade"\n'
        f'[models."{NAME}".profile]\ndtype = "float32"\n')
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", NAME,
                           "--task", "embed", "--runtime", "splade"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": NAME})
    yield d
    d.stop()


def post(d, body: dict, *, msgpack: bool) -> httpx.Response:
    if msgpack:
        return httpx.post(d.url + "/v1/embed", content=msgspec.msgpack.encode(body),
                          headers={"Content-Type": MSGPACK}, timeout=60)
    return httpx.post(d.url + "/v1/embed", json=body, timeout=60)


def test_msgpack_sparse_vectors_match_the_splade_formula(fleet, want):
    resp = post(fleet, {"model": NAME, "inputs": TEXTS, "output": "sparse"}, msgpack=True)
    assert resp.status_code == 200, resp.content
    reply = msgspec.msgpack.decode(resp.content)
    assert reply["dimension"] == want.shape[1]
    assert len(reply["embeddings"]) == len(TEXTS)
    for vec, row in zip(reply["embeddings"], want):
        indices = np.frombuffer(vec["indices"], dtype="<i4")
        values = np.frombuffer(vec["values"], dtype="<f4")
        # Every non-zero term, ascending ids, its weight as computed directly.
        np.testing.assert_array_equal(indices, np.flatnonzero(row))
        np.testing.assert_allclose(values, row[indices], rtol=1e-5, atol=1e-6)
        assert 0 < len(indices) < want.shape[1] // 4  # really sparse


def test_json_top_k_keeps_the_largest_terms(fleet, want):
    resp = post(fleet, {"model": NAME, "inputs": TEXTS, "output": "sparse", "top_k": 16}, msgpack=False)
    assert resp.status_code == 200, resp.text
    for vec, row in zip(resp.json()["embeddings"], want):
        top = np.sort(np.argsort(-row, kind="stable")[: min(16, np.count_nonzero(row))])
        assert vec["indices"] == top.tolist()
        np.testing.assert_allclose(vec["values"], row[top], rtol=1e-5, atol=1e-6)


def test_tei_embed_sparse_answers_index_value_pairs(fleet, want):
    """TEI's `POST /embed_sparse`: per input, `[{index, value}]` of every non-zero term."""
    resp = httpx.post(fleet.url + "/embed_sparse", json={"model": NAME, "inputs": TEXTS}, timeout=60)
    assert resp.status_code == 200, resp.text
    for pairs, row in zip(resp.json(), want):
        indices = [p["index"] for p in pairs]
        np.testing.assert_array_equal(indices, np.flatnonzero(row))
        np.testing.assert_allclose([p["value"] for p in pairs], row[indices], rtol=1e-5, atol=1e-6)


def test_client_returns_index_and_value_arrays(fleet, want):
    from fleetctl import Client

    with Client(fleet.url) as client:
        (vec,) = client.embed(NAME, [TEXTS[1]], output="sparse", top_k=5)
    assert vec.indices.dtype == np.int32 and vec.values.dtype == np.float32 and len(vec.indices) == 5
    np.testing.assert_allclose(vec.values, want[1][vec.indices], rtol=1e-5)
    assert set(vec.indices.tolist()) == set(np.argsort(-want[1])[:5].tolist())


@pytest.mark.parametrize("body, status, code, needle", [
    ({"inputs": ["a"]}, 400, "bad_request", "output 'sparse'"),
    ({"inputs": ["a"], "output": "tokens"}, 400, "bad_request", "sparse"),
    ({"inputs": ["a"], "output": "sparse", "top_k": 0}, 400, "bad_request", "top_k"),
    ({"inputs": [{"image": "iVBORw0KGgo="}], "output": "sparse"}, 400, "bad_request", "text only"),
    ({"inputs": [LONG], "output": "sparse", "truncate": False}, 422, "input_too_long", "128"),
])
def test_bad_sparse_requests(fleet, body, status, code, needle):
    resp = post(fleet, {"model": NAME, **body}, msgpack=False)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and needle in err["message"]


def test_long_input_is_truncated_by_default(fleet):
    reply = post(fleet, {"model": NAME, "inputs": [LONG], "output": "sparse"}, msgpack=False).json()
    assert reply["usage"]["input_tokens"] == 128


def test_a_masked_lm_is_not_guessed_as_splade(tmp_path, folder):
    """Nothing in the folder says SPLADE: without --runtime the pull refuses and says what to pass."""
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", "guess"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--task" in done.stderr


def test_one_batch_of_mixed_requests_equals_each_alone(folder):
    """The worker's call: requests with different top_k (and one it refuses) in
    one run_batch, micro-batches of 2; each answer equals the request run alone."""
    from fleet.protocol import EmbedRequest
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.messages import SparseEmbedResult, WorkError
    from fleet.runtimes.registry import adapter_class

    spec = ModelSpec(name=NAME, path=folder, task="embed", runtime="splade",
                     profile=Profile(dtype="float32", micro_batch_items=2))
    a = adapter_class("embed", "splade")(spec, "cpu")
    a.load()
    batch = [
        EmbedRequest(NAME, TEXTS, output="sparse"),
        EmbedRequest(NAME, TEXTS[:2], output="sparse", top_k=3),
        EmbedRequest(NAME, ["x"]),
        EmbedRequest(NAME, TEXTS[::-1], output="sparse", top_k=40),
    ]
    together = a.run_batch(batch)
    assert isinstance(together[2], WorkError) and together[2].code == "bad_request"
    for req, got in zip(batch, together):
        if req.output != "sparse":
            continue
        (alone,) = a.run_batch([req])
        assert isinstance(got, SparseEmbedResult) and got.input_tokens == alone.input_tokens
        for g, w in zip(got.vectors, alone.vectors):
            assert g.indices == w.indices
            np.testing.assert_allclose(np.frombuffer(g.values, "<f4"), np.frombuffer(w.values, "<f4"), atol=1e-5)
    assert [len(v.indices) // 4 for v in together[1].vectors] == [3, 3]
