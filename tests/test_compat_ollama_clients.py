"""Ollama clients as they are: litellm's `ollama/` and `ollama_chat/` (JSON bodies
with no Content-Type), `infinity/` rerank and `huggingface/` at a per-model URL,
the `ollama` client's create (blobs + `from` + `adapters`), copy and push, and
Ollama's string error shape. Each answer is compared with fleet's own answer for
the same request; the browser guard still refuses untyped posts that carry an Origin.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_dir, ollama_operator, start_daemon
from tests.gen_models import build_llama, build_lora, pull

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list on import otherwise

PROMPT = "the capital of france is"
DOCS = ["Paris is the capital of France", "a cat sat on the mat", "France borders Spain"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("ollama-clients")
    home = root / "home"
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, num_labels=1)
    BertForSequenceClassification(cfg).eval().save_pretrained(root / "reranker")
    tok.save_pretrained(root / "reranker")
    pull(home, root / "reranker", "tiny-reranker")
    llama = build_llama(root / "llama")
    pull(home, llama, "tiny-llama")
    lora = build_lora(llama, root / "tone", seed=3)
    pull(home, lora, "tone-pulled", "--base", "tiny-llama")
    d = start_daemon(home)
    yield d, lora
    d.stop()


@pytest.fixture()
def d(env):
    return env[0]


def ok(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    return resp.json()


def native_generate(d, model: str, prompt: str, n: int) -> str:
    return ok(httpx.post(d.url + "/api/generate", json={"model": model, "prompt": prompt, "stream": False, "raw": True,
                                                       "options": {"num_predict": n, "temperature": 0}},
                         timeout=120))["response"]


# ---- litellm -----------------------------------------------------------------------------------

def test_litellm_ollama_and_ollama_chat(d) -> None:
    import litellm

    messages = [{"role": "user", "content": "hi there"}]
    chat = litellm.completion(model="ollama_chat/tiny-llama", messages=messages, api_base=d.url, max_tokens=6,
                              temperature=0)
    native = ok(httpx.post(d.url + "/api/chat", json={"model": "tiny-llama", "messages": messages, "stream": False,
                                                      "options": {"num_predict": 6, "temperature": 0}}, timeout=120))
    assert chat.choices[0].message.content == native["message"]["content"]
    gen = litellm.completion(model="ollama/tiny-llama", messages=messages, api_base=d.url, max_tokens=6,
                             temperature=0)
    # litellm renders the prompt itself ("### User:\nhi there\n\n") and fleet's chat template wraps it.
    native = ok(httpx.post(d.url + "/api/generate", json={"model": "tiny-llama", "prompt": "### User:\nhi there\n\n",
                                                          "stream": False,
                                                          "options": {"num_predict": 6, "temperature": 0}},
                           timeout=120))
    assert gen.choices[0].message.content == native["response"]


def test_litellm_infinity_rerank(d) -> None:
    import litellm

    got = litellm.rerank(model="infinity/tiny-reranker", query="france", documents=DOCS, api_base=d.url)
    native = ok(httpx.post(d.url + "/v1/rerank", json={"model": "tiny-reranker", "query": "france",
                                                       "documents": DOCS}, timeout=60))["results"]
    assert [r["index"] for r in got.results] == [r["index"] for r in native]
    assert [r["relevance_score"] for r in got.results] == pytest.approx([r["score"] for r in native])
    assert [r["document"]["text"] for r in got.results] == [DOCS[r["index"]] for r in native]
    # Infinity's own body answers Infinity's shape; TEI's body TEI's bare list.
    raw = ok(httpx.post(d.url + "/rerank", json={"query": "france", "documents": DOCS, "return_documents": True},
                        timeout=60))
    assert raw["results"][0]["document"] == DOCS[native[0]["index"]] and "object" in raw
    tei = ok(httpx.post(d.url + "/rerank", json={"query": "france", "texts": DOCS}, timeout=60))
    assert isinstance(tei, list) and tei[0]["index"] == native[0]["index"]


def test_litellm_huggingface_at_a_model_url(d) -> None:
    import litellm

    # `input_type` spares litellm a hub call that asks the model's pipeline tag (no network here).
    emb = litellm.embedding(model=f"huggingface/{DEFAULT_MODEL}", input=["hello world"],
                            api_base=f"{d.url}/models/{DEFAULT_MODEL}", input_type="feature-extraction")
    native = ok(httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["hello world"]}))
    np.testing.assert_allclose(emb.data[0]["embedding"], native["embeddings"][0], atol=1e-6)
    messages = [{"role": "user", "content": "hi"}]
    out = litellm.completion(model="huggingface/tgi", messages=messages, api_base=f"{d.url}/models/tiny-llama",
                             max_tokens=6, temperature=0)
    native = ok(httpx.post(d.url + "/v1/chat/completions", json={"model": "tiny-llama", "messages": messages,
                                                                 "max_tokens": 6, "temperature": 0}, timeout=120))
    assert out.choices[0].message.content == native["choices"][0]["message"]["content"]


# ---- the ollama client -------------------------------------------------------------------------

def test_create_a_lora_model_from_blobs(env) -> None:
    import ollama

    d, lora = env
    client = ollama_operator(d)  # create, copy and push are the operator's
    adapters = {f.name: client.create_blob(f) for f in sorted(Path(lora).iterdir()) if f.is_file()}
    assert client.create(model="tone", from_="tiny-llama", adapters=adapters).status == "success"
    assert native_generate(d, "tone", PROMPT, 8) == native_generate(d, "tone-pulled", PROMPT, 8)
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="tone", from_="tiny-llama", adapters=adapters)
    assert err.value.status_code == 400 and "already exists" in err.value.error
    client.copy("tiny-llama", "llama-copy")
    assert native_generate(d, "llama-copy", PROMPT, 8) == native_generate(d, "tiny-llama", PROMPT, 8)
    with pytest.raises(ollama.ResponseError) as err:
        client.push("tiny-llama")
    assert err.value.status_code == 400 and "does not push" in err.value.error


def test_errors_are_ollama_strings(d) -> None:
    import ollama

    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=d.url).show("no-such-model")
    assert err.value.status_code == 404 and isinstance(err.value.error, str) and "no-such-model" in err.value.error
    for resp in (httpx.post(d.url + "/api/nope", json={}), httpx.get(d.url + "/api/generate")):
        assert isinstance(resp.json()["error"], str), resp.text
    ps = ok(httpx.get(d.url + "/api/ps"))["models"]
    assert ps and all("size_vram" in m and m["expires_at"] for m in ps)


def test_untyped_bodies_on_api_only_without_a_browser_origin(d) -> None:
    body = b'{"model": "tiny-llama", "prompt": "hi", "stream": false, "options": {"num_predict": 2}}'
    form = httpx.post(d.url + "/api/generate", content=body,
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=120)
    assert form.status_code == 200 and ok(form)["done"]
    for origin, status in (("https://evil.example", 403), (d.url, 415)):
        resp = httpx.post(d.url + "/api/generate", content=body, headers={"Origin": origin}, timeout=30)
        assert resp.status_code == status, resp.text
        assert isinstance(resp.json()["error"], str)
    assert httpx.post(d.url + "/v1/embed", content=b'{"inputs": ["x"]}').status_code == 415
