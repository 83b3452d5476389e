"""Rerank and TEI clients against a real daemon, unchanged: the Cohere SDK (v2
and v1 clients), Jina-shaped requests, huggingface_hub's InferenceClient and
TEI's own routes; the default-model rule; bad input on the new routes.

The daemon serves all-MiniLM-L6-v2 (embed), two tiny rerankers and one tiny
classifier (BERTs with the MiniLM tokenizer, saved with `save_pretrained` and
pulled with `fleetctl pull path:`). Every score is checked against the native
`/v1/rerank` or `/v1/classify` answer; every vector against `/v1/embed`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet.daemon.codec import is_hf_path
from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir, start_daemon
from tests.gen_models import pull

QUERY = "how do cats behave at home"
DOCS = [
    "Cats sleep for most of the day and are most active at dawn and dusk.",
    "The stock market closed higher on Friday.",
    "Domestic cats groom themselves and mark territory by rubbing against furniture.",
    "Dogs need daily walks.",
    "Kittens play to practise hunting.",
]
TEXTS = ["I love this product, it works perfectly.", "Terrible service, never again.", "ok"]
LABELS = {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
          "label2id": {"negative": 0, "neutral": 1, "positive": 2}}


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("compat-models")
    home = root / "home"
    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def bert(name: str, **kw) -> Path:
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, **kw)
        folder = root / name
        BertForSequenceClassification(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    reranker = bert("reranker", num_labels=1)
    pull(home, reranker, "tiny-reranker")
    pull(home, Path(shutil.copytree(reranker, root / "reranker-b")), "tiny-reranker-b")
    pull(home, bert("classifier", num_labels=3, **LABELS), "tiny-classifier")
    d = start_daemon(home)
    yield d
    d.stop()


def post(d: DaemonProc, path: str, body: dict) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=60)


def ok(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    return resp.json()


def native_rerank(d: DaemonProc, model: str = "tiny-reranker") -> dict[int, float]:
    results = ok(post(d, "/v1/rerank", {"model": model, "query": QUERY, "documents": DOCS}))["results"]
    return {r["index"]: r["score"] for r in results}


def check_sorted(scores: list[float]) -> None:
    assert scores == sorted(scores, reverse=True)


def test_cohere_v2_client_reranks_like_the_native_route(compat):
    import cohere

    want = native_rerank(compat)
    with cohere.ClientV2(api_key="unused", base_url=compat.url) as co:
        got = co.rerank(model="tiny-reranker", query=QUERY, documents=DOCS, top_n=3)
    assert len(got.results) == 3 and got.id
    check_sorted([r.relevance_score for r in got.results])
    assert [r.index for r in got.results] == sorted(want, key=want.get, reverse=True)[:3]
    np.testing.assert_allclose([r.relevance_score for r in got.results], [want[r.index] for r in got.results],
                               rtol=1e-6)


def test_cohere_v1_client_reads_relevance_score_and_documents(compat):
    import cohere

    want = native_rerank(compat)
    co = cohere.Client(api_key="unused", base_url=compat.url)
    got = co.rerank(model="tiny-reranker", query=QUERY, documents=[{"text": d} for d in DOCS],
                    return_documents=True)
    assert len(got.results) == len(DOCS)
    check_sorted([r.relevance_score for r in got.results])
    assert [r.document.text for r in got.results] == [DOCS[r.index] for r in got.results]
    np.testing.assert_allclose([r.relevance_score for r in got.results], [want[r.index] for r in got.results],
                               rtol=1e-6)


#: Cohere v1 documents as objects: `text` and fields beyond it (strings).
RECORDS = [{"text": d, "title": f"Note {i}", "source": "notes"} for i, d in enumerate(DOCS)]


def test_cohere_v1_client_sends_documents_with_more_fields_than_text(compat):
    """Cohere ranks on `text` and keeps every field of a document: so does fleet. The
    fields that neither ranked nor came back are named in X-Fleet-Ignored-Fields."""
    import cohere

    want = native_rerank(compat)
    co = cohere.Client(api_key="unused", base_url=compat.url)
    got = co.rerank(model="tiny-reranker", query=QUERY, documents=RECORDS, return_documents=True, top_n=3)
    assert [r.index for r in got.results] == sorted(want, key=want.get, reverse=True)[:3]
    np.testing.assert_allclose([r.relevance_score for r in got.results], [want[r.index] for r in got.results],
                               rtol=1e-6)
    for r in got.results:  # the documents as sent, every field (the SDK keeps extra ones)
        assert r.document.text == DOCS[r.index]
        assert r.document.model_dump() == RECORDS[r.index]
    raw = post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": RECORDS})
    assert [r["index"] for r in ok(raw)["results"]] == sorted(want, key=want.get, reverse=True)
    assert raw.headers["X-Fleet-Ignored-Fields"] == "documents[].title,documents[].source"
    back = post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": RECORDS,
                                       "return_documents": True})
    assert "X-Fleet-Ignored-Fields" not in back.headers
    assert [r["document"] for r in ok(back)["results"]] == [RECORDS[r["index"]] for r in ok(back)["results"]]


def test_cohere_v1_rank_fields_rank_on_those_fields_in_their_order(compat):
    """`rank_fields` [title, text]: each document is ranked on `title: ...` and `text: ...`
    lines, which is what the native route answers for those texts."""
    import cohere

    texts = [f"title: {r['title']}\ntext: {r['text']}" for r in RECORDS]
    native = ok(post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": texts}))
    want = {r["index"]: r["score"] for r in native["results"]}
    assert want != native_rerank(compat)  # the titles change the scores
    co = cohere.Client(api_key="unused", base_url=compat.url)
    got = co.rerank(model="tiny-reranker", query=QUERY, documents=RECORDS, rank_fields=["title", "text"])
    assert [r.index for r in got.results] == [r["index"] for r in native["results"]]
    np.testing.assert_allclose([r.relevance_score for r in got.results], [want[r.index] for r in got.results],
                               rtol=1e-6)
    raw = post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": RECORDS,
                                      "rank_fields": ["title", "text"]})
    assert raw.headers["X-Fleet-Ignored-Fields"] == "documents[].source"
    one = ok(post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": RECORDS,
                                         "rank_fields": ["title"]}))
    titles = ok(post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY,
                                            "documents": [r["title"] for r in RECORDS]}))
    assert [(r["index"], r["score"]) for r in one["results"]] == [(r["index"], r["score"]) for r in titles["results"]]


def test_jina_shaped_request_gets_relevance_score_and_document_objects(compat):
    want = native_rerank(compat)
    got = ok(post(compat, "/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "top_n": 2,
                                         "return_documents": True, "documents": [{"text": d} for d in DOCS]}))
    results = got["results"]
    assert len(results) == 2
    check_sorted([r["relevance_score"] for r in results])
    for r in results:
        assert r["relevance_score"] == r["score"]
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(want[r["index"]], rel=1e-6)


def test_huggingface_hub_feature_extraction_through_tei_embed(compat, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # CI exports HF_HUB_OFFLINE=1 so nothing reaches the hub; the library then refuses
    # every request, a loopback daemon's too. A user pointing the client at fleet runs
    # without it: so does this test (the client's own switch, read per request).
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    # A text alone against the native answer for it alone: in bfloat16 a padded batch
    # rounds differently from one unpadded row, by up to ~1e-3 (whether a CPU runs a
    # batch's texts padded together depends on its measured fixed cost).
    want = [np.asarray(ok(post(compat, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": [t]}))["embeddings"][0],
                       dtype=np.float32) for t in TEXTS[:2]]
    client = InferenceClient(model=compat.url + "/embed")
    one = client.feature_extraction(TEXTS[0])
    assert one.shape == (1, 384)
    np.testing.assert_allclose(one[0], want[0], atol=1e-6)
    # all-MiniLM-L6-v2 ends in a Normalize module: normalize=False answers its own (unit)
    # output, as sentence-transformers' encode(normalize_embeddings=False) does ...
    raw = client.feature_extraction(TEXTS[1], normalize=False)
    np.testing.assert_allclose(raw[0], want[1], atol=1e-5)
    # ... and the hub's `parameters` are read: one fleet does not do is refused by name.
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError, match="truncation_direction"):
        client.feature_extraction(TEXTS[1], truncation_direction="Left")


def test_tei_embed_routes_answer_bare_lists(compat):
    want = np.asarray(ok(post(compat, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": TEXTS}))["embeddings"])
    batch = ok(post(compat, "/embed", {"inputs": TEXTS}))
    np.testing.assert_allclose(np.asarray(batch), want, atol=1e-6)
    ids = [t.ids for t in _tokenizer().encode_batch(TEXTS[:2], add_special_tokens=False)]
    by_ids = ok(post(compat, "/embed", {"inputs": [TEXTS[2], *ids]}))
    np.testing.assert_allclose(np.asarray(by_ids), want[[2, 0, 1]], atol=1e-5)
    cut = ok(post(compat, "/embed", {"inputs": TEXTS[0], "dimensions": 64}))
    assert np.asarray(cut).shape == (1, 64)
    # /embed_all: each token's vector as the model gives it (TEI does not normalise them).
    native_tokens = ok(post(compat, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": TEXTS[:2],
                                                  "output": "tokens", "normalize": False}))["embeddings"]
    every = ok(post(compat, "/embed_all", {"inputs": TEXTS[:2]}))
    assert [np.asarray(b).shape for b in every] == [np.asarray(b).shape for b in native_tokens]
    np.testing.assert_allclose(np.asarray(every[0]), np.asarray(native_tokens[0]), atol=1e-6)


def _tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def test_tei_rerank_predict_tokenize_and_info(compat):
    want = native_rerank(compat)
    ranks = ok(post(compat, "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": DOCS,
                                        "return_text": True}))
    assert isinstance(ranks, list) and len(ranks) == len(DOCS)
    check_sorted([r["score"] for r in ranks])
    assert all(r["text"] == DOCS[r["index"]] and r["score"] == pytest.approx(want[r["index"]], rel=1e-6)
               for r in ranks)
    assert "text" not in ok(post(compat, "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": DOCS}))[0]

    native = ok(post(compat, "/v1/classify", {"model": "tiny-classifier", "inputs": TEXTS}))["results"]
    single = ok(post(compat, "/predict", {"inputs": TEXTS[0]}))  # the only classifier: no model needed
    assert [p["label"] for p in single] == [p["label"] for p in native[0]]
    check_sorted([p["score"] for p in single])
    batch = ok(post(compat, "/predict", {"inputs": [[t] for t in TEXTS]}))
    assert [[p["label"] for p in row] for row in batch] == [[p["label"] for p in row] for row in native]

    text = "Hello, naïve world"
    tokens = ok(post(compat, "/tokenize", {"inputs": text}))
    enc = _tokenizer().encode(text)
    assert [t["id"] for t in tokens[0]] == enc.ids
    assert tokens[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    raw = text.encode()
    assert all(raw[t["start"]:t["stop"]].decode() == t["text"] for t in tokens[0] if not t["special"])
    assert [t["text"] for t in tokens[0][1:-1]] == ["Hello", ",", "naïve", "world"]

    info = ok(httpx.get(compat.url + "/info", timeout=10))
    assert info["model_id"] == DEFAULT_MODEL and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] > 0 and info["max_client_batch_size"] > 0
    classifier = ok(httpx.get(compat.url + "/info", params={"model": "tiny-classifier"}, timeout=10))
    assert classifier["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}


def test_model_left_out_with_two_rerankers_lists_the_candidates(compat):
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/v2/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/rerank", {"query": QUERY, "texts": DOCS})):
        resp = post(compat, path, body)
        assert resp.status_code == 400, (path, resp.text)
        err = resp.json()["error"]
        if path == "/rerank":  # TEI's error shape: {"error": message, "error_type": code}
            err = {"code": resp.json()["error_type"], "message": err}
        assert err["code"] == "bad_request"
        assert "tiny-reranker" in err["message"] and "tiny-reranker-b" in err["message"]
        assert "default_models" in err["message"]
    # The only classifier and the only embedder are found without a name.
    assert ok(post(compat, "/v1/classify", {"inputs": TEXTS}))["model"] == "tiny-classifier"
    assert ok(post(compat, "/v1/embed", {"inputs": TEXTS}))["model"] == DEFAULT_MODEL


@pytest.mark.parametrize("path,body,status,code", [
    ("/v2/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": []}, 400, "bad_request"),
    ("/v2/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": [{"txt": "x"}]}, 400, "bad_request"),
    ("/v1/rerank", {"model": "tiny-reranker", "query": "", "documents": DOCS}, 400, "bad_request"),
    ("/v1/rerank", {"model": "no-such-model", "query": QUERY, "documents": DOCS}, 404, "model_not_found"),
    # A string document is Cohere's {"text": ...}: it has no `title` to rank on.
    ("/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": DOCS, "rank_fields": ["title"]}, 400,
     "bad_request"),
    ("/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": [{"text": "a", "year": 1999}]}, 400,
     "bad_request"),
    ("/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": [{"title": "b"}]}, 400, "bad_request"),
    ("/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": [{"text": "a", "title": "b"}],
                    "rank_fields": "title"}, 400, "bad_request"),
    ("/v1/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": [{"text": "a", "title": "b"}],
                    "top_m": 1}, 400, "bad_request"),
    ("/v2/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": DOCS, "rank_fields": ["title"]}, 400,
     "unsupported"),
    ("/v2/rerank", {"model": "tiny-reranker", "query": QUERY, "documents": DOCS,
                    "relevant_spans": {"mode": "enabled"}}, 400, "unsupported"),
    ("/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": DOCS, "documents": DOCS}, 400, "bad_request"),
    ("/embed", {"inputs": []}, 400, "bad_request"),
    ("/embed", {"inputs": [1, "a"]}, 400, "bad_request"),
    ("/embed", {"inputs": [[101, 40_000]]}, 400, "bad_request"),
    ("/embed", {"inputs": "a", "prompt_name": "querry"}, 400, "bad_request"),
    ("/embed", {"inputs": "a", "truncation_direction": "left"}, 400, "unsupported"),
    ("/embed", {"inputs": "a", "dimensions": 0}, 400, "bad_request"),
    ("/embed", {"inputs": "a", "parameters": {"dimensions": 0}}, 400, "bad_request"),
    ("/embed", {"inputs": "a", "model": "tiny-reranker"}, 400, "bad_request"),
    ("/embed_sparse", {"inputs": "a"}, 400, "bad_request"),
    ("/predict", {"inputs": ["a", "b"]}, 400, "unsupported"),
    ("/predict", {"inputs": [["a", "b"]]}, 400, "unsupported"),
    ("/predict", {"inputs": ["a", ["b"]]}, 400, "bad_request"),
    ("/predict", {"inputs": 5}, 400, "bad_request"),
    ("/tokenize", {"inputs": []}, 400, "bad_request"),
    ("/tokenize", {"inputs": "a", "model": "../etc"}, 400, "bad_request"),
    ("/tokenize", {"inputs": "a", "model": "no-such-model"}, 404, "model_not_found"),
    ("/info?model=no-such-model", None, 404, "model_not_found"),
])
def test_bad_input_on_the_new_routes_is_a_clean_4xx_and_the_daemon_keeps_serving(compat, path, body, status,
                                                                                  code):
    resp = httpx.get(compat.url + path, timeout=10) if body is None else post(compat, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    if is_hf_path(path.partition("?")[0]):  # TEI's shape: the message as the string `error`, the code as `error_type`
        assert isinstance(err, str)
        err = {"code": resp.json()["error_type"], "message": err}
    assert err["code"] == code and err["message"]
    assert str(compat.home) not in err["message"]  # messages name models, never paths
    assert ok(post(compat, "/embed", {"inputs": "still serving"}))


def test_default_models_from_config_toml_apply_on_sighup(compat):
    """Last in this module: it changes the daemon's config. `default_models` is a live
    setting (SIGHUP, no restart): the rerank default then answers where the request
    named no model and two rerankers are stored."""
    import os
    import signal
    import time

    assert post(compat, "/v2/rerank", {"query": QUERY, "documents": DOCS}).status_code == 400
    (compat.home / "config.toml").write_text('[default_models]\nrerank = "tiny-reranker-b"\n')
    os.kill(compat.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while (resp := post(compat, "/v2/rerank", {"query": QUERY, "documents": DOCS})).status_code == 400:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)
    got = ok(resp)
    assert got["model"] == "tiny-reranker-b"
    want = native_rerank(compat, "tiny-reranker-b")
    assert [r["relevance_score"] for r in got["results"]] == pytest.approx([want[r["index"]] for r in got["results"]],
                                                                          rel=1e-6)
