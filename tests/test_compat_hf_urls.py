"""TEI's and TGI's clients configured with a URL, unchanged: huggingface_hub's
InferenceClient at per-model base URLs (`/models/<name>`) and at the root, TGI's
`/generate` and `/generate_stream`, TEI's `/similarity` and `/decode`, HF's
token-classification shape, and `?model=` on a POST route.

One daemon serves all-MiniLM-L6-v2 (embed), a tiny reranker, classifier and
tagger (BERTs with the MiniLM tokenizer) and a tiny Llama; each client answer
is checked against fleet's native answer for the same input.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, start_daemon, default_model_dir
from tests.gen_models import build_llama, pull

TEXT = "Alice met Bob in Paris"
PROMPT = "the capital of france is"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertForTokenClassification

    root = tmp_path_factory.mktemp("hf-urls")
    home = root / "home"
    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def bert(cls, name: str, **kw) -> Path:
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, **kw)
        folder = root / name
        cls(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    tags = {"id2label": {0: "O", 1: "B-PER", 2: "I-PER"}, "label2id": {"O": 0, "B-PER": 1, "I-PER": 2}}
    pull(home, bert(BertForSequenceClassification, "reranker", num_labels=1), "tiny-reranker")
    pull(home, bert(BertForTokenClassification, "tagger", num_labels=3, **tags), "tiny-tagger")
    pull(home, build_llama(root / "llama"), "tiny-llama")
    daemon = start_daemon(home)
    yield daemon
    daemon.stop()


@pytest.fixture()
def hf(monkeypatch: pytest.MonkeyPatch):
    from huggingface_hub import InferenceClient, constants

    # CI exports HF_HUB_OFFLINE=1 so nothing reaches the hub; the library then refuses
    # every URL, loopback too. Only loopback is called here.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient


def ok(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    return resp.json()


def post(d, path: str, body: dict) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120)


def native_vectors(d, texts: list[str]) -> np.ndarray:
    out = ok(post(d, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": texts}))
    return np.asarray(out["embeddings"], dtype=np.float32)


def native_text(d, prompt: str | None, max_tokens: int, **kw) -> dict:
    body = {"model": "tiny-llama", "max_tokens": max_tokens, "temperature": 0, **kw}
    return ok(post(d, "/v1/generate", {**body, "prompt": prompt} if prompt is not None else body))


# ---- huggingface_hub, unchanged --------------------------------------------------------------

def test_feature_extraction_at_a_model_url(d, hf) -> None:
    got = hf(model=f"{d.url}/models/{DEFAULT_MODEL}").feature_extraction(TEXT)
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got, native_vectors(d, [TEXT]), atol=1e-6)


def test_sentence_similarity_at_a_model_url(d, hf) -> None:
    sentences = ["Bob and Alice were in France", "the stock market fell"]
    got = hf(model=f"{d.url}/models/{DEFAULT_MODEL}").sentence_similarity(TEXT, sentences)
    v = native_vectors(d, [TEXT, *sentences])
    np.testing.assert_allclose(got, v[1:] @ v[0], atol=1e-5)


def test_text_generation_at_a_model_url(d, hf) -> None:
    client = hf(model=f"{d.url}/models/tiny-llama")
    want = native_text(d, PROMPT, 8)
    assert client.text_generation(PROMPT, max_new_tokens=8) == want["text"]
    details = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=False)
    assert details.generated_text == want["text"]
    assert details.details.generated_tokens == want["usage"]["output_tokens"]
    assert details.details.finish_reason in ("length", "eos_token")
    assert "".join(t.text for t in details.details.tokens) == want["text"]
    assert all(t.id >= 0 and t.logprob <= 0 for t in details.details.tokens)
    # Streamed token by token (TGI's SSE events): the tokens spell the same text.
    assert "".join(client.text_generation(PROMPT, max_new_tokens=8, stream=True)) == want["text"]
    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events[-1].generated_text == want["text"] and events[-1].details.generated_tokens == len(events)


def test_a_streamed_line_survives_the_clients_line_splitter(d, hf) -> None:
    """The client reads SSE with httpx's `iter_lines`, which splits at U+2028, U+2029 and
    U+0085 too (`str.splitlines`). JSON leaves those raw, so fleet escapes them: the
    echoed prompt comes back whole, not as a cut event the client cannot parse."""
    prompt = f"line one\u2028line two\u2029three\x85{PROMPT}"
    want = native_text(d, prompt, 4)["text"]
    client = hf(model=f"{d.url}/models/tiny-llama")  # held: its session closes the stream when collected
    events = list(client.text_generation(prompt, max_new_tokens=4, stream=True, details=True, return_full_text=True))
    assert events[-1].generated_text == prompt + want


def test_token_classification_at_a_model_url(d, hf) -> None:
    got = hf(model=f"{d.url}/models/tiny-tagger").token_classification(TEXT)
    native = ok(post(d, "/v1/extract", {"model": "tiny-tagger", "inputs": [TEXT]}))["results"][0]
    assert [(e.entity_group, e.word, e.start, e.end) for e in got] == \
        [(e["entity"], e["text"], e["start"], e["end"]) for e in native]
    assert [e.score for e in got] == pytest.approx([e["score"] for e in native])


def test_chat_completion_with_a_schema_at_a_model_url(d, hf) -> None:
    """huggingface_hub sends `{"type": "json_object", "value": schema}` and `model: "dummy"`."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    client = hf(model=f"{d.url}/models/tiny-llama")
    out = client.chat_completion([{"role": "user", "content": "where?"}], max_tokens=40, temperature=0,
                                 response_format={"type": "json_schema",
                                                  "json_schema": {"name": "place", "schema": schema}})
    text = out.choices[0].message.content
    native = native_text(d, None, 40, messages=[{"role": "user", "content": "where?"}], format=schema)
    assert text == native["text"]
    if out.choices[0].finish_reason == "stop":
        assert set(json.loads(text)) == {"city"}


def test_feature_extraction_at_the_root(d, hf) -> None:
    """At the daemon's own root a body that names no model is refused when it could be for several."""
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as err:
        hf(model=d.url).feature_extraction(TEXT)
    assert err.value.response.status_code == 400 and "/models/" in err.value.response.text
    got = ok(post(d, "/", {"inputs": TEXT, "model": DEFAULT_MODEL}))
    np.testing.assert_allclose(got, native_vectors(d, [TEXT]), atol=1e-6)


# ---- the routes and rules themselves ------------------------------------------------------

def test_root_dispatches_by_the_model(d) -> None:
    docs = ["Paris is in France", "a cat sat"]
    ranked = ok(post(d, "/", {"query": "france", "texts": docs}))  # one reranker stored: its default
    native = ok(post(d, "/v1/rerank", {"model": "tiny-reranker", "query": "france", "documents": docs}))
    assert [(r["index"], pytest.approx(r["score"])) for r in ranked] == \
        [(r["index"], r["score"]) for r in native["results"]]
    # TGI's root: a one-item list, or the stream with `stream: true`.
    want = native_text(d, PROMPT, 6)
    assert ok(post(d, "/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})) == [
        {"generated_text": want["text"]}]
    assert ok(post(d, "/models/tiny-llama/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})) == {
        "generated_text": want["text"]}


def test_model_url_ignores_and_names_a_placeholder_model(d) -> None:
    resp = post(d, f"/models/{DEFAULT_MODEL}/v1/embeddings", {"model": "tgi", "input": TEXT})
    assert np.allclose(ok(resp)["data"][0]["embedding"], native_vectors(d, [TEXT])[0], atol=1e-6)
    assert resp.headers["x-fleet-ignored-fields"] == "model"
    assert "x-fleet-ignored-fields" not in post(d, f"/models/{DEFAULT_MODEL}/v1/embeddings",
                                                {"model": DEFAULT_MODEL, "input": TEXT}).headers
    listed = ok(httpx.get(f"{d.url}/models/tiny-llama/v1/models"))["data"]
    assert [m["id"] for m in listed] == ["tiny-llama"]
    assert ok(httpx.get(f"{d.url}/models/{DEFAULT_MODEL}/info"))["model_id"] == DEFAULT_MODEL
    assert httpx.get(f"{d.url}/models/tiny-llama/api/tags").status_code == 404
    missing = post(d, "/models/no-such-model/embed", {"inputs": TEXT})
    assert missing.status_code == 404 and missing.json()["error_type"] == "model_not_found"  # TEI's error shape


def test_query_model_is_applied(d) -> None:
    resp = post(d, "/predict?model=tiny-reranker", {"inputs": TEXT})
    assert resp.status_code == 400  # applied: a reranker does not classify (it would have run the default)
    got = ok(post(d, f"/embed?model={DEFAULT_MODEL}", {"inputs": TEXT, "model": "tiny-llama"}))
    np.testing.assert_allclose(got, native_vectors(d, [TEXT]), atol=1e-6)


def test_decode_and_tokenize_round_trip(d) -> None:
    tokens = ok(post(d, "/tokenize", {"inputs": [TEXT]}))[0]
    ids = [t["id"] for t in tokens]
    assert ok(post(d, "/decode", {"ids": ids})) == [TEXT.lower()]
    assert ok(post(d, "/decode", {"ids": [ids, ids[:3]], "skip_special_tokens": False}))[0].startswith("[CLS]")


def test_tgi_grammar_is_enforced(d) -> None:
    out = ok(post(d, "/models/tiny-llama/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "grammar": {"type": "regex", "value": "(yes|no)"}}}))
    assert out["generated_text"] in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = ok(post(d, "/models/tiny-llama/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 30, "grammar": {"type": "json", "value": schema}}}))
    native = native_text(d, PROMPT, 30, format=schema)
    assert out["generated_text"] == native["text"]
    resp = post(d, "/models/tiny-llama/generate", {"inputs": PROMPT, "parameters": {"top_k": 5, "max_new_tokens": 2}})
    assert resp.headers["x-fleet-ignored-fields"] == "parameters.top_k"


def test_model_not_found_says_what_to_do(d) -> None:
    resp = post(d, "/v1/embed", {"model": "bge-small-en-v1.5", "inputs": [TEXT]})  # in the catalog, not pulled
    assert resp.status_code == 404 and "`fleetctl pull bge-small-en-v1.5`" in resp.json()["error"]["message"]
    resp = post(d, "/v1/embeddings", {"model": "all-minilm-l6-v3", "input": TEXT})
    assert resp.status_code == 404 and "did you mean 'all-minilm-l6-v2'" in resp.json()["error"]["message"]


def test_haystack_hugging_face_api_components(d, hf) -> None:
    """haystack's TEI embedder and TGI chat generator, configured with the model's URL."""
    from haystack.dataclasses import ChatMessage
    from haystack_integrations.components.embedders.huggingface_api import HuggingFaceAPITextEmbedder
    from haystack_integrations.components.generators.huggingface_api import HuggingFaceAPIChatGenerator

    embedder = HuggingFaceAPITextEmbedder(api_type="text_embeddings_inference",
                                          api_params={"url": f"{d.url}/models/{DEFAULT_MODEL}"})
    got = embedder.run(TEXT)["embedding"]  # haystack's default: normalize=False, truncate=True
    native = ok(post(d, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": [TEXT], "normalize": False}))
    np.testing.assert_allclose(got, native["embeddings"][0], atol=1e-5)
    chat = HuggingFaceAPIChatGenerator(api_type="text_generation_inference",
                                       api_params={"url": f"{d.url}/models/tiny-llama"},
                                       generation_kwargs={"max_tokens": 8, "temperature": 0})
    reply = chat.run([ChatMessage.from_user("hi there")])["replies"][0]
    assert reply.text == native_text(d, None, 8, messages=[{"role": "user", "content": "hi there"}])["text"]

# ---- OpenAI's Responses API (the openai client, unchanged) ---------------------------------

def test_openai_responses(d) -> None:
    import openai

    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused")
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    native = native_text(d, None, 8, messages=turns)
    out = client.responses.create(model="tiny-llama", input="hi there", instructions="be brief", max_output_tokens=8,
                                  temperature=0)
    assert out.output_text == native["text"]
    assert out.usage.output_tokens == native["usage"]["output_tokens"]
    assert out.status == ("incomplete" if native["finish_reason"] == "length" else "completed")
    items = client.responses.create(model="tiny-llama", input=[{"role": "user", "content": "hi there"}],
                                    instructions="be brief", max_output_tokens=8, temperature=0)
    assert items.output_text == native["text"]
    events = list(client.responses.create(model="tiny-llama", input="hi there", instructions="be brief",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{out.status}" and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == native["text"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    structured = client.responses.create(model="tiny-llama", input="a number", max_output_tokens=20, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert structured.output_text == native_text(d, None, 20, messages=[{"role": "user", "content": "a number"}],
                                                 format=schema)["text"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny-llama", input="more", previous_response_id="resp_1")
    assert "keeps no responses" in str(err.value)
