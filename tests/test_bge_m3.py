"""BGE-M3 (task `embed`, runtime `bge-m3`) end to end: a tiny random
`XLMRobertaModel` with an XLM-R-style Unigram tokenizer (trained here) and
random `sparse_linear.pt` / `colbert_linear.pt` heads, in bge-m3's folder
layout (its sentence-transformers files included), pulled with no flags
(detected by its head files), served by a real daemon.

Reference: FlagEmbedding's formulas, copied below from
FlagOpen/FlagEmbedding@7ed43d67 (`finetune/embedder/encoder_only/m3/modeling.py`:
`_dense_embedding` (cls), `_sparse_embedding` (token weights), `_colbert_embedding`,
the normalisation of `EncoderOnlyEmbedderM3ModelForInference.forward`;
`inference/embedder/encoder_only/m3.py`: `_process_token_weights`,
`_process_colbert_vecs`; `runner.py`: the heads' loading). The package itself
pulls in `datasets` and `ir-datasets` on import, which this project does not carry.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import start_daemon
from tests.gen_models import pull

NAME = "tiny-bge-m3"
MSGPACK = "application/msgpack"
HIDDEN = 32
MAX_TOKENS = 128
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hybrid search uses dense, sparse and multi-vector retrieval",
    "¿dónde está la biblioteca? está al lado del museo",
    "東京は日本の首都です",
    "invoices must be paid within thirty days of receipt",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?",
]
TEXTS = [
    "hello world hello",  # a repeated term: its weight is the larger of the two
    "Sparse vectors make hybrid search cheap: an inverted index plus a dense index.",
    "a",
    "¿Dónde está la biblioteca? 東京は日本の首都です",
    "the lazy dog the lazy fox the quick dog",
]
LONG = " ".join(["word"] * 300)


def build_tokenizer(folder: Path):
    """XLMRobertaTokenizer over a Unigram model trained on a few sentences (<s> <pad> </s>
    <unk> first, <mask> last, as XLM-R has them); tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import XLMRobertaTokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>")
    tok.train_from_iterator(CORPUS * 8, trainer)
    vocab = [(piece, score) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    xlmr = XLMRobertaTokenizer(vocab=[*vocab, ("<mask>", 0.0)], model_max_length=MAX_TOKENS)
    xlmr.save_pretrained(folder)
    return xlmr


def build_bge_m3(folder: Path, seed: int = 0) -> Path:
    """bge-m3's layout: config.json, model.safetensors, the tokenizer, the two heads as
    torch pickles (float16, as FlagEmbedding saves a half-precision model), and the
    sentence-transformers files (CLS pooling, then Normalize)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=MAX_TOKENS + 2, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, initializer_range=0.3)
    XLMRobertaModel(cfg).eval().save_pretrained(folder)
    torch.save({k: v.half() for k, v in torch.nn.Linear(HIDDEN, HIDDEN).state_dict().items()},
               folder / "colbert_linear.pt")
    torch.save({k: v.half() for k, v in torch.nn.Linear(HIDDEN, 1).state_dict().items()}, folder / "sparse_linear.pt")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_TOKENS,
                                                                  "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {},
                                                                          "default_prompt_name": None}))
    return folder


class FlagM3:
    """FlagEmbedding's M3 inference on the same folder (formulas from the files named above)."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()
        hidden = self.model.config.hidden_size
        # runner.py get_model: Linear heads, state dicts read with weights_only=True.
        self.colbert_linear = torch.nn.Linear(in_features=hidden, out_features=hidden)
        self.sparse_linear = torch.nn.Linear(in_features=hidden, out_features=1)
        self.colbert_linear.load_state_dict(torch.load(folder / "colbert_linear.pt", map_location="cpu",
                                                       weights_only=True))
        self.sparse_linear.load_state_dict(torch.load(folder / "sparse_linear.pt", map_location="cpu",
                                                      weights_only=True))

    def encode(self, sentences: list[str], normalize_embeddings: bool = True, max_length: int = MAX_TOKENS):
        torch, tokenizer = self.torch, self.tokenizer
        inputs = tokenizer(sentences, truncation=True, max_length=max_length)
        inputs = tokenizer.pad([{k: inputs[k][i] for k in inputs.keys()} for i in range(len(sentences))],
                               padding=True, return_tensors="pt")
        with torch.no_grad():
            last_hidden_state = self.model(**inputs, return_dict=True).last_hidden_state
            dense_vecs = last_hidden_state[:, 0]  # _dense_embedding, pooling "cls"
            # _sparse_embedding(return_embedding=False): the token weights.
            token_weights = torch.relu(self.sparse_linear(last_hidden_state))
            colbert_vecs = self.colbert_linear(last_hidden_state[:, 1:])  # _colbert_embedding
            colbert_vecs = colbert_vecs * inputs["attention_mask"][:, 1:][:, :, None].float()
            if normalize_embeddings:
                dense_vecs = torch.nn.functional.normalize(dense_vecs, dim=-1)
                colbert_vecs = torch.nn.functional.normalize(colbert_vecs, dim=-1)

        def _process_token_weights(token_weights: np.ndarray, input_ids: list):
            result = defaultdict(int)
            unused_tokens = set()
            for _token in ['cls_token', 'eos_token', 'pad_token', 'unk_token']:
                if _token in tokenizer.special_tokens_map:
                    _token_id = tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[_token])
                    unused_tokens.add(_token_id)
            for w, idx in zip(token_weights, input_ids):
                if idx not in unused_tokens and w > 0:
                    idx = str(idx)
                    if w > result[idx]:
                        result[idx] = w
            return result

        def _process_colbert_vecs(colbert_vecs: np.ndarray, attention_mask: list):
            tokens_num = np.sum(attention_mask)
            return colbert_vecs[:tokens_num - 1]

        lexical = list(map(_process_token_weights, token_weights.squeeze(-1).numpy(),
                           inputs["input_ids"].numpy().tolist()))
        colbert = list(map(_process_colbert_vecs, colbert_vecs.numpy(), inputs["attention_mask"].numpy()))
        return {"dense_vecs": dense_vecs.numpy(), "lexical_weights": lexical, "colbert_vecs": colbert}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "model")


@pytest.fixture(scope="module")
def flag(folder: Path) -> FlagM3:
    return FlagM3(folder)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folder: Path):
    home = tmp_path_factory.mktemp("fleet-bge-m3")
    # Profile dtype float32 so answers compare to 1e-5 (the overlay names the profile only).
    (home / "models.toml").write_text(
        f'[models."{NAME}"]\nsource = "path:{folder.resolve()}"\ntask = "embed"\nruntime = "bge-m3"\n'
        f'[models."{NAME}".profile]\ndtype = "float32"\n')
    pull(home, folder, NAME)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": NAME})
    yield d
    d.stop()


def post(d, body: dict, *, msgpack: bool) -> dict:
    if msgpack:
        resp = httpx.post(d.url + "/v1/embed", content=msgspec.msgpack.encode({"model": NAME, **body}),
                          headers={"Content-Type": MSGPACK}, timeout=60)
        assert resp.status_code == 200, resp.content
        return msgspec.msgpack.decode(resp.content)
    resp = httpx.post(d.url + "/v1/embed", json={"model": NAME, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_pull_detects_bge_m3_by_its_heads(tmp_path, folder):
    """No --task, no --runtime: the head files beside an XLM-R config say bge-m3 (before
    modules.json would say sentence-transformers), and both heads are stored."""
    from fleet.store import Store

    home = tmp_path / "home"
    pull(home, folder, "detected")
    manifest = Store(home / "models").get("detected")
    assert (manifest.task, manifest.runtime) == ("embed", "bge-m3")
    assert {"sparse_linear.pt", "colbert_linear.pt"} <= {f.path for f in manifest.files}


def test_dense_is_flagembeddings_cls_vector(fleet, flag, folder):
    from sentence_transformers import SentenceTransformer

    want = flag.encode(TEXTS)["dense_vecs"]
    reply = post(fleet, {"inputs": TEXTS}, msgpack=True)
    got = np.frombuffer(reply["embeddings"], "<f4").reshape(reply["shape"])
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The folder's own sentence-transformers modules (CLS pooling, Normalize) agree.
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(TEXTS)
    np.testing.assert_allclose(got, st, atol=1e-5)
    raw = post(fleet, {"inputs": TEXTS, "normalize": False}, msgpack=False)
    np.testing.assert_allclose(raw["embeddings"], flag.encode(TEXTS, normalize_embeddings=False)["dense_vecs"],
                               atol=1e-5)
    print(f"bge-m3 dense: min cosine {float(np.min(np.sum(got * want, axis=1))):.7f}, "
          f"max abs {float(np.abs(got - want).max()):.2e}")


def test_dense_controls_and_prompts(fleet, flag):
    """`dimensions` cuts then re-normalises, `output_dtype` converts (as for every dense
    embedder); a `prompt` goes before each text for every output, as FlagEmbedding's
    query instruction does; bge-m3 has no named prompts."""
    want = flag.encode(TEXTS)["dense_vecs"]
    cut = post(fleet, {"inputs": TEXTS, "dimensions": 8, "output_dtype": "float16"}, msgpack=True)
    assert cut["dtype"] == "float16" and cut["shape"] == [len(TEXTS), 8]
    short = want[:, :8] / np.linalg.norm(want[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(np.frombuffer(cut["embeddings"], "<f2").reshape(cut["shape"]), short, atol=1e-3)
    prompted = flag.encode(["Represent this for search: " + t for t in TEXTS])
    dense = post(fleet, {"inputs": TEXTS, "prompt": "Represent this for search: "}, msgpack=False)
    np.testing.assert_allclose(dense["embeddings"], prompted["dense_vecs"], atol=1e-5)
    sparse = post(fleet, {"inputs": TEXTS, "prompt": "Represent this for search: ", "output": "sparse"},
                  msgpack=False)
    assert [v["indices"] for v in sparse["embeddings"]] == [sorted(map(int, r)) for r in prompted["lexical_weights"]]
    resp = httpx.post(fleet.url + "/v1/embed", json={"model": NAME, "inputs": ["a"], "prompt_name": "query"},
                      timeout=60)
    assert resp.status_code == 400 and "prompt_name" in resp.json()["error"]["message"]
    resp = httpx.post(fleet.url + "/v1/embed", json={"model": NAME, "inputs": ["a"], "dimensions": HIDDEN + 1},
                      timeout=60)
    assert resp.status_code == 400 and "dimensions" in resp.json()["error"]["message"]


def test_sparse_is_flagembeddings_lexical_weights(fleet, flag):
    want = flag.encode(TEXTS)["lexical_weights"]
    reply = post(fleet, {"inputs": TEXTS, "output": "sparse"}, msgpack=True)
    assert reply["dimension"] == len(flag.tokenizer)
    worst = 0.0
    for vec, ref in zip(reply["embeddings"], want):
        indices = np.frombuffer(vec["indices"], "<i4")
        values = np.frombuffer(vec["values"], "<f4")
        assert indices.tolist() == sorted(int(k) for k in ref)  # the same terms, ids ascending
        expect = np.array([ref[str(i)] for i in indices], dtype=np.float32)
        np.testing.assert_allclose(values, expect, atol=1e-5)
        worst = max(worst, float(np.abs(values - expect).max(initial=0.0)))
    assert sum(len(ref) for ref in want) > 2 * len(TEXTS)  # terms were really compared
    repeated = flag.tokenizer("hello world hello", add_special_tokens=False)["input_ids"]
    assert len(set(repeated)) < len(repeated)  # the max-merge was exercised
    print(f"bge-m3 sparse: max abs {worst:.2e}")


def test_sparse_top_k_keeps_the_largest_terms(fleet, flag):
    want = flag.encode(TEXTS)["lexical_weights"]
    reply = post(fleet, {"inputs": TEXTS, "output": "sparse", "top_k": 3}, msgpack=False)
    for vec, ref in zip(reply["embeddings"], want):
        top = sorted(sorted(ref, key=lambda k: -ref[k])[:3], key=int)
        assert vec["indices"] == [int(k) for k in top]


def test_tokens_are_flagembeddings_colbert_vectors(fleet, flag):
    for normalize in (True, False):
        want = flag.encode(TEXTS, normalize_embeddings=normalize)["colbert_vecs"]
        reply = post(fleet, {"inputs": TEXTS, "output": "tokens", "normalize": normalize}, msgpack=True)
        worst = 0.0
        for block, shape, ref in zip(reply["embeddings"], reply["shapes"], want):
            got = np.frombuffer(block, "<f4").reshape(shape)
            assert got.shape == ref.shape  # every token after CLS, EOS included
            np.testing.assert_allclose(got, ref, atol=1e-5)
            worst = max(worst, float(np.abs(got - ref).max()))
        print(f"bge-m3 colbert (normalize={normalize}): max abs {worst:.2e}")


def test_tei_embed_sparse_serves_the_lexical_weights(fleet, flag):
    want = flag.encode(TEXTS[:2])["lexical_weights"]
    resp = httpx.post(fleet.url + "/embed_sparse", json={"model": NAME, "inputs": TEXTS[:2]}, timeout=60)
    assert resp.status_code == 200, resp.text
    for pairs, ref in zip(resp.json(), want):
        assert [p["index"] for p in pairs] == sorted(int(k) for k in ref)


@pytest.mark.parametrize("body, status, code, needle", [
    ({"inputs": [LONG], "truncate": False}, 422, "input_too_long", str(MAX_TOKENS)),
    ({"inputs": [{"image": "iVBORw0KGgo="}]}, 400, "bad_request", "text only"),
    ({"inputs": ["a"], "top_k": 2}, 400, "bad_request", "top_k"),
])
def test_bad_requests(fleet, body, status, code, needle):
    resp = httpx.post(fleet.url + "/v1/embed", json={"model": NAME, **body}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and needle in err["message"]


def test_long_input_is_truncated_by_default(fleet, flag):
    reply = post(fleet, {"inputs": [LONG], "output": "tokens"}, msgpack=False)
    assert reply["usage"]["input_tokens"] == MAX_TOKENS and reply["shapes"] == [[MAX_TOKENS - 1, HIDDEN]]


def test_one_batch_of_mixed_outputs_equals_each_alone(folder):
    """The worker's call: dense, sparse (with and without top_k) and tokens requests,
    and one it refuses, in one run_batch, micro-batches of 2; each answer equals the
    request run alone."""
    from fleet.messages import WorkError
    from fleet.protocol import EmbedRequest
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.registry import adapter_class

    spec = ModelSpec(name=NAME, path=folder, task="embed", runtime="bge-m3",
                     profile=Profile(dtype="float32", micro_batch_items=2))
    a = adapter_class("embed", "bge-m3")(spec, "cpu")
    a.load()
    batch = [
        EmbedRequest(NAME, TEXTS),
        EmbedRequest(NAME, TEXTS[::-1], output="sparse"),
        EmbedRequest(NAME, [LONG], truncate=False),
        EmbedRequest(NAME, TEXTS[1:], output="tokens", normalize=False),
        EmbedRequest(NAME, TEXTS, output="sparse", top_k=2),
        EmbedRequest(NAME, TEXTS[:2], normalize=False),
        EmbedRequest(NAME, TEXTS[2:], prompt="query: ", dimensions=8, output_dtype="int8"),
        EmbedRequest(NAME, TEXTS[2:], prompt="query: ", output="tokens"),
    ]
    together = a.run_batch(batch)
    assert isinstance(together[2], WorkError) and together[2].code == "input_too_long"
    for req, got in zip(batch, together):
        if isinstance(got, WorkError):
            continue
        (alone,) = a.run_batch([req])
        assert type(got) is type(alone) and got.input_tokens == alone.input_tokens
        if req.output == "sparse":
            for g, w in zip(got.vectors, alone.vectors):
                assert g.indices == w.indices
                np.testing.assert_allclose(np.frombuffer(g.values, "<f4"), np.frombuffer(w.values, "<f4"), atol=1e-5)
        elif req.output == "tokens":
            assert got.shapes == alone.shapes
            for g, w in zip(got.data, alone.data):
                np.testing.assert_allclose(np.frombuffer(g, "<f4"), np.frombuffer(w, "<f4"), atol=1e-5)
        elif req.output_dtype == "int8":
            assert got.dtype == "int8" and got.shape == alone.shape == (len(req.inputs), 8)
            assert np.abs(np.frombuffer(got.data, "i1").astype(int) - np.frombuffer(alone.data, "i1")).max() <= 1
        else:
            np.testing.assert_allclose(np.frombuffer(got.data, "<f4"), np.frombuffer(alone.data, "<f4"), atol=1e-5)


class _RunsCode:
    """A pickle that would create `marker` when unpickled by a full unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_head_that_is_not_plain_tensors_is_refused_unrun(tmp_path, folder):
    """The heads are read with torch's weights-only unpickler: a pickle naming any
    other callable fails the load (naming the model and the file, not a path) and
    the callable never runs."""
    import shutil

    import torch

    from fleet.errors import ModelLoadFailed
    from fleet.runtimes.base import ModelSpec
    from fleet.runtimes.registry import adapter_class

    bad = Path(shutil.copytree(folder, tmp_path / "bad"))
    marker = tmp_path / "ran"
    torch.save({"weight": _RunsCode(marker), "bias": torch.zeros(1)}, bad / "sparse_linear.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(bad / "sparse_linear.pt", weights_only=True)
    a = adapter_class("embed", "bge-m3")(ModelSpec(name="bad-m3", path=bad, task="embed", runtime="bge-m3"), "cpu")
    with pytest.raises(ModelLoadFailed) as err:
        a.load()
    assert "bad-m3" in str(err.value) and "sparse_linear.pt" in str(err.value) and str(tmp_path) not in str(err.value)
    assert not marker.exists()
    torch.save({"weight": torch.zeros(2, HIDDEN), "bias": torch.zeros(2)}, bad / "sparse_linear.pt")
    with pytest.raises(ModelLoadFailed, match="linear head"):
        a.load()


def test_pull_keeps_the_heads_and_no_other_pickle(tmp_path, folder):
    """The two head files are taken beside safetensors (they are read weights-only);
    any other pickle follows the usual rule: skipped beside safetensors, refused alone."""
    from fleet.errors import BadRequest
    from fleet.pull_files import select_files

    heads = ["colbert_linear.pt", "sparse_linear.pt"]
    keep, skipped = select_files(["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", *heads],
                                 allow_pickle=False, origin="test")
    assert set(heads) <= set(keep) and skipped == ["pytorch_model.bin"]
    with pytest.raises(BadRequest, match="pickle"):
        select_files(["config.json", "pytorch_model.bin", "tokenizer.json", *heads], allow_pickle=False, origin="test")
    with pytest.raises(BadRequest, match="pickle"):
        select_files(["config.json", "model.pt", "tokenizer.json"], allow_pickle=False, origin="test")
