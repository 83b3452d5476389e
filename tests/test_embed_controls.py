"""Instructions, Matryoshka dimensions and compact vectors (issue 22, items 2-4), end to end.

Real daemon, real HTTP, real worker: the real all-MiniLM-L6-v2 with prompts set
by a catalog override (FLEET_HOME/models.toml), a tiny random Qwen3 last-token
embedder laid out like Qwen3-Embedding (its prompts in
config_sentence_transformers.json) and a tiny INSTRUCTOR-like model whose
pooling leaves the prompt out. Every answer is checked against
sentence-transformers run in-process on the same folders: `encode(prompt_name=
..., prompt=..., truncate_dim=..., normalize_embeddings=True)`, and
`quantize_embeddings(..., ranges=fleet.vectors.scalar_ranges(d))` for the dtypes.
The models serve in float32 (the overlay says so), so vectors agree to ~1e-6.
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

from fleet.vectors import OUTPUT_DTYPES, WIRE_DTYPES, quantize, scalar_ranges
from tests.conftest import DaemonProc, default_model_dir, start_daemon
from tests.gen_embedders import QWEN3_QUERY, build_instructor_embedder, build_qwen3_embedder

MSGPACK = "application/msgpack"
MINILM = "all-minilm-l6-v2"
QWEN = "tiny-qwen3-emb"
INSTRUCTOR = "tiny-instructor"
#: The catalog override of the real all-MiniLM (it ships with no prompts).
MINILM_PROMPTS = {"query": "query: ", "passage": "passage: ", "classification": "classify this: ",
                  "retrieval.query": "Represent the query for retrieval: "}
MINILM_DIMS = [384, 256, 128, 64]
TEXTS = [
    "what is the capital of france",
    "Paris is the capital and largest city of France, on the Seine.",
    "a",
    "¿Dónde está la biblioteca? Está al lado del museo de historia natural.",
    "GPU memory is managed per device: pinned models stay resident, others are evicted LRU.",
]
#: Cosine / absolute agreement with sentence-transformers (float32 on both sides; batch shapes differ).
ATOL = 2e-5


# ---- the served models and their references ------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed-controls")
    return {QWEN: build_qwen3_embedder(root / "qwen3-emb"),
            INSTRUCTOR: build_instructor_embedder(root / "instructor", default_model_dir())}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    home = tmp_path_factory.mktemp("fleet-embed-controls")
    prompts = ", ".join(f"{msgspec.json.encode(k).decode()} = {msgspec.json.encode(v).decode()}"
                        for k, v in MINILM_PROMPTS.items())
    lines = [f'[models."{MINILM}"]', f"prompts = {{ {prompts} }}", f"matryoshka_dims = {MINILM_DIMS}",
             f'[models."{MINILM}".profile]', 'dtype = "float32"', ""]
    for name, folder in folders.items():
        lines += [f'[models."{name}"]', f'source = "path:{folder.resolve()}"', 'task = "embed"',
                  'runtime = "sentence-transformers"', f'[models."{name}".profile]', 'dtype = "float32"', ""]
    (home / "models.toml").write_text("\n".join(lines))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name in (MINILM, *folders):
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join((MINILM, *folders)), "FLEET_CPU_THREADS": "1",
                                      "FLEET_DEFAULT_MODELS": f"embed={MINILM}"})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]):
    """sentence-transformers on the same folders (MiniLM with the override's prompts, as the constructor takes them)."""
    from sentence_transformers import SentenceTransformer

    return {MINILM: SentenceTransformer(str(default_model_dir()), device="cpu", prompts=MINILM_PROMPTS),
            **{name: SentenceTransformer(str(f), device="cpu", local_files_only=True) for name, f in folders.items()}}


def post(d: DaemonProc, path: str, body: dict, *, msgpack: bool = False, **kw) -> httpx.Response:
    if msgpack:
        return httpx.post(d.url + path, content=msgspec.msgpack.encode(body), headers={"Content-Type": MSGPACK},
                          timeout=60, **kw)
    return httpx.post(d.url + path, json=body, timeout=60, **kw)


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.content[:500]
    if resp.headers["content-type"].startswith(MSGPACK):
        return msgspec.msgpack.decode(resp.content)
    return resp.json()


def dense(reply: dict) -> np.ndarray:
    """A native dense reply as its array (raw bytes in MessagePack, lists in JSON)."""
    if isinstance(reply["embeddings"], bytes):
        return np.frombuffer(reply["embeddings"], dtype=WIRE_DTYPES[reply["dtype"]]).reshape(reply["shape"])
    return np.asarray(reply["embeddings"], dtype=WIRE_DTYPES[reply.get("dtype", "float32")])


def error(resp: httpx.Response, status: int = 400) -> str:
    assert resp.status_code == status, resp.content[:500]
    return resp.json()["error"]["message"]


def tokens_of(ref, texts: list[str], prompt: str = "") -> int:
    """What sentence-transformers feeds the model: prompt + text, tokenized together, cut at its limit."""
    features = ref.preprocess([prompt + t for t in texts])
    return int(features["attention_mask"].sum())


# ---- instructions ------------------------------------------------------------------------

@pytest.mark.parametrize("model", [MINILM, QWEN, INSTRUCTOR])
@pytest.mark.parametrize("msgpack", [False, True])
def test_prompt_name_gives_sentence_transformers_vectors_and_counts_its_tokens(fleet, references, model, msgpack):
    ref = references[model]
    for name in ("query", "document", *(["passage"] if model == MINILM else [])):
        reply = ok(post(fleet, "/v1/embed", {"model": model, "inputs": TEXTS, "prompt_name": name}, msgpack=msgpack))
        want = ref.encode(TEXTS, prompt_name=name, normalize_embeddings=True)
        np.testing.assert_allclose(dense(reply), want, atol=ATOL, err_msg=f"{model} {name}")
        assert reply["usage"]["input_tokens"] == tokens_of(ref, TEXTS, ref.prompts[name])
    # The query prompt changes the vectors (else the test above proves nothing).
    plain = dense(ok(post(fleet, "/v1/embed", {"model": model, "inputs": TEXTS})))
    np.testing.assert_allclose(plain, ref.encode(TEXTS, normalize_embeddings=True), atol=ATOL)
    query = ref.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    assert np.min(np.sum(plain * query, axis=1)) < 0.99


@pytest.mark.parametrize("model", [MINILM, QWEN, INSTRUCTOR])
def test_a_raw_prompt_is_prepended_as_sentence_transformers_does(fleet, references, model):
    ref, prompt = references[model], "Summarize: "
    reply = ok(post(fleet, "/v1/embed", {"model": model, "inputs": TEXTS, "prompt": prompt}))
    np.testing.assert_allclose(dense(reply), ref.encode(TEXTS, prompt=prompt, normalize_embeddings=True), atol=ATOL)
    assert reply["usage"]["input_tokens"] == tokens_of(ref, TEXTS, prompt)


def test_prompt_wins_over_prompt_name_and_the_reply_says_so(fleet, references):
    resp = post(fleet, "/v1/embed", {"model": QWEN, "inputs": TEXTS, "prompt": "", "prompt_name": "query"})
    np.testing.assert_allclose(dense(ok(resp)), references[QWEN].encode(TEXTS, prompt="", normalize_embeddings=True),
                               atol=ATOL)
    assert resp.headers["x-fleet-ignored-fields"] == "prompt_name"
    assert "x-fleet-ignored-fields" not in post(fleet, "/v1/embed", {"model": QWEN, "inputs": TEXTS}).headers


def test_an_unknown_prompt_name_is_refused_listing_the_models_names(fleet):
    msg = error(post(fleet, "/v1/embed", {"model": MINILM, "inputs": ["x"], "prompt_name": "querry"}))
    assert "'querry'" in msg and all(f"'{n}'" in msg for n in ("query", "document", "passage", "classification"))
    msg = error(post(fleet, "/v1/embed", {"model": QWEN, "inputs": ["x"], "prompt_name": "passage"}))
    assert "'passage'" in msg and "'query'" in msg


# ---- dimensions ----------------------------------------------------------------------------

@pytest.mark.parametrize("model,dims", [(MINILM, 64), (MINILM, 100), (QWEN, 16)])
def test_dimensions_cut_then_normalise_like_truncate_dim(fleet, references, model, dims):
    reply = ok(post(fleet, "/v1/embed", {"model": model, "inputs": TEXTS, "dimensions": dims,
                                         "prompt_name": "query"}, msgpack=True))
    want = references[model].encode(TEXTS, prompt_name="query", truncate_dim=dims, normalize_embeddings=True)
    assert reply["shape"] == [len(TEXTS), dims] and reply["dimensions"] == dims
    np.testing.assert_allclose(dense(reply), want, atol=ATOL)


def test_dimensions_above_the_width_are_refused_naming_it(fleet):
    assert "384" in error(post(fleet, "/v1/embed", {"model": MINILM, "inputs": ["x"], "dimensions": 385}))
    assert "dimensions" in error(post(fleet, "/v1/embed", {"model": MINILM, "inputs": ["x"], "dimensions": 0}))


# ---- output dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", OUTPUT_DTYPES)
def test_output_dtypes_are_quantize_embeddings_with_the_fixed_ranges(fleet, references, dtype):
    from sentence_transformers.util.quantization import quantize_embeddings

    body = {"model": QWEN, "inputs": TEXTS, "output_dtype": dtype, "dimensions": 60, "prompt_name": "query"}
    packed = ok(post(fleet, "/v1/embed", body, msgpack=True))
    listed = ok(post(fleet, "/v1/embed", body))
    got = dense(packed)
    width = (60 + 7) // 8 if dtype.endswith("binary") else 60
    assert packed["dtype"] == listed["dtype"] == dtype and packed["dimensions"] == listed["dimensions"] == 60
    assert packed["shape"] == listed["shape"] == [len(TEXTS), width] and len(packed["embeddings"]) == got.nbytes
    assert all(isinstance(x, int if dtype not in ("float32", "float16") else float) for x in listed["embeddings"][0])
    np.testing.assert_array_equal(np.asarray(listed["embeddings"], dtype=got.dtype), got)
    # Against sentence-transformers: its float vectors, quantized with the same ranges.
    floats = references[QWEN].encode(TEXTS, prompt_name="query", truncate_dim=60, normalize_embeddings=True)
    want = floats.astype(np.float16) if dtype == "float16" else quantize_embeddings(
        floats, precision=dtype, ranges=scalar_ranges(60)) if dtype != "float32" else floats
    assert want.dtype == got.dtype and want.shape == got.shape
    diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
    if dtype.endswith("int8"):
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # a value on a bucket's edge may land one off
    elif dtype.endswith("binary"):
        # A bit flips only for a component within float noise of 0.
        assert (np.unpackbits(want.view(np.uint8)) != np.unpackbits(got.view(np.uint8))).mean() < 0.01
    else:
        assert diff.max() <= (1e-3 if dtype == "float16" else ATOL)


def test_int8_needs_unit_vectors_and_dtypes_need_dense_output(fleet):
    assert "normalize" in error(post(fleet, "/v1/embed", {"inputs": ["x"], "output_dtype": "int8", "normalize": False}))
    assert "output_dtype" in error(post(fleet, "/v1/embed", {"inputs": ["x"], "output_dtype": "int4"}))
    assert "tokens" in error(post(fleet, "/v1/embed", {"inputs": ["x"], "output": "tokens", "dimensions": 8}))
    ok(post(fleet, "/v1/embed", {"inputs": ["x"], "output_dtype": "ubinary", "normalize": False}))


# ---- the compatibility routes ------------------------------------------------------------

def test_openai_sdk_extra_body_prompt_name_dimensions_and_jina_task(fleet, references):
    from openai import OpenAI

    client = OpenAI(base_url=fleet.url + "/v1", api_key="unused")
    ref = references[MINILM]
    got = client.embeddings.create(model=MINILM, input=TEXTS, dimensions=128, extra_body={"prompt_name": "query"})
    np.testing.assert_allclose([e.embedding for e in got.data],
                               ref.encode(TEXTS, prompt_name="query", truncate_dim=128, normalize_embeddings=True),
                               atol=ATOL)
    assert got.usage.prompt_tokens == tokens_of(ref, TEXTS, "query: ")
    # Jina's `task` picks the model's prompt of that name, else the names it means.
    for task, name in [("retrieval.query", "retrieval.query"), ("retrieval.passage", "passage"),
                       ("classification", "classification")]:
        got = client.embeddings.create(model=MINILM, input=TEXTS, extra_body={"task": task})
        np.testing.assert_allclose([e.embedding for e in got.data],
                                   ref.encode(TEXTS, prompt_name=name, normalize_embeddings=True), atol=ATOL)
    raw = client.embeddings.with_raw_response.create(model=MINILM, input="x", extra_body={"task": "separation"})
    assert raw.headers["x-fleet-ignored-fields"] == "task"  # MiniLM has no prompt for it
    ints = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float",
                                    extra_body={"output_dtype": "int8"})
    np.testing.assert_array_equal(np.array([e.embedding for e in ints.data]),
                                  quantize(ref.encode(TEXTS, normalize_embeddings=True), "int8"))


def test_openai_base64_with_a_compact_dtype_is_refused(fleet):
    # base64 is what the openai SDK asks unless told otherwise, and it reads it as float32.
    resp = post(fleet, "/v1/embeddings", {"input": "x", "output_dtype": "int8", "encoding_format": "base64"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "output_dtype"


def test_ollama_embed_takes_prompt_name_dimensions_and_output_dtype(fleet, references):
    ref = references[QWEN]
    got = ok(post(fleet, "/api/embed", {"model": QWEN, "input": TEXTS, "prompt_name": "query", "dimensions": 32}))
    np.testing.assert_allclose(got["embeddings"], ref.encode(TEXTS, prompt_name="query", truncate_dim=32,
                                                             normalize_embeddings=True), atol=ATOL)
    assert got["prompt_eval_count"] == tokens_of(ref, TEXTS, QWEN3_QUERY)
    packed = ok(post(fleet, "/api/embed", {"model": QWEN, "input": TEXTS, "output_dtype": "ubinary"}))
    assert np.asarray(packed["embeddings"]).shape == (len(TEXTS), 8)
    legacy = ok(post(fleet, "/api/embeddings", {"model": QWEN, "prompt": TEXTS[0], "prompt_name": "query"}))
    # The legacy route answers the pooled vector unnormalised (before the model's Normalize module).
    got = np.asarray(legacy["embedding"])
    np.testing.assert_allclose([got / np.linalg.norm(got)], ref.encode(TEXTS[:1], prompt_name="query"), atol=ATOL)


def test_tei_embed_takes_its_prompt_name(fleet, references):
    ref = references[INSTRUCTOR]
    for body in ({"inputs": TEXTS, "model": INSTRUCTOR, "prompt_name": "query"},
                 {"inputs": TEXTS, "model": INSTRUCTOR, "parameters": {"prompt_name": "query"}}):
        np.testing.assert_allclose(ok(post(fleet, "/embed", body)),
                                   ref.encode(TEXTS, prompt_name="query", normalize_embeddings=True), atol=ATOL)


def test_cohere_v2_sdk_input_type_embedding_types_and_output_dimension(fleet, references):
    import cohere

    ref = references[QWEN]
    co = cohere.ClientV2(api_key="unused", base_url=fleet.url)
    got = co.embed(model=QWEN, texts=TEXTS, input_type="search_query", output_dimension=48,
                   embedding_types=["float", "int8", "uint8", "binary", "ubinary"])
    floats = ref.encode(TEXTS, prompt_name="query", truncate_dim=48, normalize_embeddings=True)
    np.testing.assert_allclose(got.embeddings.float_, floats, atol=ATOL)
    mine = np.asarray(got.embeddings.float_, dtype=np.float32)
    for dtype in ("int8", "uint8", "binary", "ubinary"):
        np.testing.assert_array_equal(getattr(got.embeddings, dtype), quantize(mine, dtype))
    assert got.texts == TEXTS and got.meta.billed_units.input_tokens == tokens_of(ref, TEXTS, QWEN3_QUERY)
    docs = co.embed(model=QWEN, texts=TEXTS, input_type="search_document", embedding_types=["int8"])
    np.testing.assert_array_equal(docs.embeddings.int8, quantize(ref.encode(TEXTS, normalize_embeddings=True),
                                                                 "int8"))


def test_cohere_v1_sdk_on_the_native_route(fleet, references):
    import cohere

    ref = references[MINILM]
    co = cohere.Client(api_key="unused", base_url=fleet.url)
    got = co.embed(model=MINILM, texts=TEXTS, input_type="search_query")
    assert got.response_type == "embeddings_floats"
    np.testing.assert_allclose(got.embeddings, ref.encode(TEXTS, prompt_name="query", normalize_embeddings=True),
                               atol=ATOL)
    typed = co.embed(model=MINILM, texts=TEXTS, input_type="clustering", embedding_types=["ubinary"])
    assert typed.response_type == "embeddings_by_type"
    np.testing.assert_array_equal(typed.embeddings.ubinary, quantize(ref.encode(TEXTS, normalize_embeddings=True),
                                                                     "ubinary"))


def test_cohere_refuses_what_it_cannot_apply(fleet):
    for body, field in [({"texts": ["x"], "input_type": "search_query", "truncate": "START"}, "truncate"),
                        ({"texts": ["x"], "input_type": "search_query", "max_tokens": 5}, "max_tokens"),
                        ({"texts": ["x"], "input_type": "search_query", "embedding_types": ["int4"]},
                         "embedding_types"),
                        ({"texts": ["x"], "input_type": "searching"}, "input_type")]:
        assert field in error(post(fleet, "/v2/embed", body))
    resp = post(fleet, "/v2/embed", {"texts": ["x"], "input_type": "search_query", "priority": 3})
    assert resp.status_code == 200 and resp.headers["x-fleet-ignored-fields"] == "priority"


# ---- one batch, many requests (the worker's call, in-process) -----------------------------

def adapter(folder: Path, name: str, prompts: dict[str, str] | None = None):
    from fleet.prompts import merged_prompts
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    table, default = merged_prompts(folder, prompts, None)
    spec = ModelSpec(name=name, path=folder, task="embed", runtime="sentence-transformers",
                     profile=Profile(dtype="float32", micro_batch_items=4),
                     extra={"prompts": table, "default_prompt_name": default})
    a = SentenceTransformerEmbedder(spec, "cpu")
    a.load()
    return a


@pytest.mark.parametrize("key", [QWEN, INSTRUCTOR])
def test_a_batch_of_mixed_requests_answers_each_as_if_alone(folders, references, key):
    """Requests with other prompts, dimensions and dtypes share micro-batches
    (4 inputs each, length-sorted across requests); each answer equals the
    request run alone and sentence-transformers' (a row never depends on its
    batch neighbours: int8 ranges are fixed, prompt tokens are left out per row)."""
    from fleet.messages import EmbedResult, WorkError
    from fleet.protocol import EmbedRequest

    a, ref = adapter(folders[key], key), references[key]
    batch = [EmbedRequest(model=key, inputs=TEXTS, prompt_name="query"),
             EmbedRequest(model=key, inputs=TEXTS[::-1], output_dtype="int8", dimensions=24),
             EmbedRequest(model=key, inputs=TEXTS[1:3], prompt="Title: ", output_dtype="ubinary"),
             EmbedRequest(model=key, inputs=["x"], prompt_name="nope"),
             EmbedRequest(model=key, inputs=TEXTS[:2], prompt_name="document", normalize=False, dimensions=10)]
    together = a.run_batch(batch)
    assert isinstance(together[3], WorkError) and together[3].code == "bad_request"
    for req, got in zip(batch, together):
        if isinstance(got, WorkError):
            continue
        alone = a.run_batch([req])[0]
        assert isinstance(got, EmbedResult) and got.shape == alone.shape and got.input_tokens == alone.input_tokens
        mine, solo = (np.frombuffer(r.data, WIRE_DTYPES[r.dtype]).astype(np.float64) for r in (got, alone))
        assert np.abs(mine - solo).max() <= (1 if req.output_dtype == "int8" else ATOL)
    q = np.frombuffer(together[0].data, "<f4").reshape(together[0].shape)
    np.testing.assert_allclose(q, ref.encode(TEXTS, prompt_name="query", normalize_embeddings=True), atol=ATOL)
    # normalize=false: the model's output (its Normalize module applied, as the reference's
    # normalize_embeddings=False), cut to 10 and not made unit length again.
    np.testing.assert_allclose(np.frombuffer(together[4].data, "<f4").reshape(together[4].shape),
                               ref.encode(TEXTS[:2], prompt_name="document", truncate_dim=10), atol=ATOL)
    a.unload()


def test_pull_records_the_folders_prompts_and_the_catalogs(tmp_path, folders):
    from fleet.catalog import load_catalog
    from fleet.pull import pull_model
    from fleet.store import Store

    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(
        f'[models."q"]\nsource = "path:{folders[QWEN]}"\ntask = "embed"\nruntime = "sentence-transformers"\n'
        'prompts = { passage = "passage: " }\ndefault_prompt_name = "query"\nmatryoshka_dims = [64, 32, 16]\n')
    store = Store(home / "models")
    m = pull_model(store, "q", catalog=load_catalog(home)).manifest
    assert m.prompts == {"query": QWEN3_QUERY, "document": "", "passage": "passage: "}
    assert m.default_prompt_name == "query" and m.matryoshka_dims == [64, 32, 16]
    (home / "models.toml").write_text((home / "models.toml").read_text().replace('"query"\n', '"instruct"\n'))
    with pytest.raises(Exception, match="default_prompt_name 'instruct'"):
        pull_model(store, "q", catalog=load_catalog(home))


# ---- the conversions alone ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "uint8", "binary", "ubinary"])
def test_quantize_is_quantize_embeddings_with_the_fixed_ranges_row_by_row(dtype):
    """Exactly the reference's arithmetic (odd widths, the range's ends, values on a
    bucket's edge), and a row's bytes do not depend on the rows quantized with it."""
    from sentence_transformers.util.quantization import quantize_embeddings

    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 37)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x[0, :4] = [1.0, -1.0, 0.0, np.float32(-1.0) + np.float32(2.0) / 255 * 7]
    got = quantize(x, dtype)
    np.testing.assert_array_equal(got, quantize_embeddings(x, precision=dtype, ranges=scalar_ranges(37)))
    np.testing.assert_array_equal(np.concatenate([quantize(x[i:i + 1], dtype) for i in range(len(x))]), got)


def test_float16_is_numpys_rounding_on_both_paths():
    from fleet.runtimes.adapters.dense import TORCH_FLOAT16_FROM, to_float16

    rng = np.random.default_rng(4)
    for rows in (1, TORCH_FLOAT16_FROM // 100 + 1):  # numpy's cast, then torch's
        x = (rng.normal(size=(rows, 100)) * 3).astype(np.float32)
        x[0, :4] = [65504.0, 1e-8, -0.0, np.float32(2.0 ** -24 * 1.5)]
        np.testing.assert_array_equal(to_float16(x).view(np.uint16), x.astype("<f2").view(np.uint16))
