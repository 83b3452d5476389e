"""LoRA adapters on encoders, in-process: each runtime's adapter (runtimes/) with
two peft LoRAs attached serves one batch mixing base rows and both adapters on
one copy of the base, and every row equals the merged adapter model run
through its reference library (tests.lora_models.References): sentence-
transformers `encode`, `CrossEncoder.predict`, transformers, the
token-classification pipeline. fp32 throughout, so the tolerances are fp32's
(the merged weights round differently from base + B @ A: ~1e-7).

The end-to-end path (pull checks, the daemon's `adapter` field, compatibility
routes, memory in ps) is tests/test_lora_encoders_api.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleet.messages import WorkError
from fleet.protocol import ClassifyRequest, EmbedRequest, ExtractRequest, RerankRequest
from fleet.runtimes.base import ModelSpec, Profile
from tests.lora_models import (
    CLASSIFY_LABELS, NER_OWN_LABELS, TOPIC_LABELS, References, build_bases, build_loras,
)

TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible service, never again.",
    "The package arrived on Tuesday.",
    "ok",
    "Das Essen war ausgezeichnet und der Kellner sehr freundlich.",
    "Angela Merkel met Emmanuel Macron in Berlin.",
]
QUERY = "how do cats behave at home"
DOCS = ["Cats sleep for most of the day.", "The stock market closed higher.", "a",
        "Domestic cats groom themselves and mark territory.", "Kittens play to practise hunting."]
#: Micro-batches of 3: every micro-batch mixes rows of different adapters.
PROFILE = Profile(dtype="float32", micro_batch_items=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-encoders")
    bases = build_bases(root)
    return bases, build_loras(root / "loras", bases)


@pytest.fixture(scope="module")
def ref(models) -> References:
    return References(*models)


def served(models, key: str, task: str, runtime: str, loras: list[str], profile: Profile = PROFILE):
    """The runtime adapter of base `key` (store name "base"), loaded, with `loras` attached."""
    from fleet.runtimes.registry import adapter_class

    bases, folders = models
    adapter = adapter_class(task, runtime)(ModelSpec("base", bases[key], task, runtime, profile), "cpu")
    adapter.load()
    for name in loras:
        adapter.attach_lora(ModelSpec(name, folders[name], task, "peft", extra={"base": "base"}))
    return adapter


def lora_of(req) -> str | None:
    return req.adapter or (req.model if req.model != "base" else None)


def test_embedder_rows_equal_the_merged_model_in_sentence_transformers(models, ref) -> None:
    adapter = served(models, "embedder", "embed", "sentence-transformers", ["emb-a", "emb-b"])
    reqs = [EmbedRequest(model="base", inputs=TEXTS), EmbedRequest(model="emb-a", inputs=TEXTS[::-1]),
            EmbedRequest(model="base", inputs=TEXTS[1:4], adapter="emb-b"),
            EmbedRequest(model="emb-b", inputs=TEXTS[:2], normalize=False)]
    worst = 0.0
    for req, res in zip(reqs, adapter.run_batch(reqs)):
        got = np.frombuffer(res.data, "<f4").reshape(res.shape)
        want = ref.embed(lora_of(req), req.inputs)
        if not req.normalize:  # the model's Normalize module is applied per request
            got = got / np.linalg.norm(got, axis=1, keepdims=True)
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst < 1e-5, worst
    # The adapters really change the vectors (a silent base answer would fail here).
    assert np.abs(ref.embed("emb-a", TEXTS) - ref.embed(None, TEXTS)).max() > 0.05
    assert np.abs(ref.embed("emb-b", TEXTS) - ref.embed(None, TEXTS)).max() > 0.05


@pytest.mark.parametrize("runtime, key, loras", [
    ("transformers", "reranker", ["rr-head", "rr-body"]),
    ("sentence-transformers", "cross-encoder", ["ce-head", "ce-body"]),
])
def test_reranker_rows_equal_the_merged_model(models, ref, runtime: str, key: str, loras: list[str]) -> None:
    adapter = served(models, key, "rerank", runtime, loras)
    reqs = [RerankRequest(model=loras[0], query=QUERY, documents=DOCS), RerankRequest(model="base", query=QUERY,
                                                                                       documents=DOCS[:3]),
            RerankRequest(model="base", query="stock prices", documents=DOCS, adapter=loras[1], raw_scores=True),
            RerankRequest(model="base", query="kittens", documents=DOCS[2:], raw_scores=True)]
    for req, res in zip(reqs, adapter.run_batch(reqs)):
        index = np.frombuffer(res.index, "<i4")
        got = np.empty(len(index), dtype=np.float32)
        got[index] = np.frombuffer(res.scores, "<f4")
        pairs = [(req.query, d) for d in req.docs]
        if runtime == "transformers":
            want = ref.rerank_logits(lora_of(req), pairs)
            if not req.raw_scores:
                want = 1 / (1 + np.exp(-want))
        else:
            want = ref.cross_encoder(lora_of(req), pairs)  # sigmoid as CrossEncoder applies it
            if req.raw_scores:
                want = np.log(want / (1 - want))
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
        assert list(index) == list(np.argsort(-got, kind="stable"))
    pairs = [(QUERY, d) for d in DOCS]
    base = ref.rerank_logits(None, pairs) if runtime == "transformers" else ref.cross_encoder(None, pairs)
    for lora in loras:
        other = ref.rerank_logits(lora, pairs) if runtime == "transformers" else ref.cross_encoder(lora, pairs)
        assert np.abs(other - base).max() > 0.01, lora


def classified(res) -> tuple[list[str], np.ndarray]:
    """(labels, scores per label in label order) of a ClassifyResult with every label."""
    top = np.frombuffer(res.top, "<i4").reshape(res.shape)
    scores = np.frombuffer(res.scores, "<f4").reshape(res.shape)
    out = np.empty(res.shape, dtype=np.float32)
    np.put_along_axis(out, top, scores, axis=1)
    return res.labels, out


def test_classifier_rows_use_their_own_head_and_labels(models, ref) -> None:
    adapter = served(models, "classifier", "classify", "transformers", ["cls-head", "cls-topics"])
    reqs = [ClassifyRequest(model="base", inputs=TEXTS), ClassifyRequest(model="cls-topics", inputs=TEXTS[::-1]),
            ClassifyRequest(model="base", inputs=TEXTS[2:], adapter="cls-head"),
            ClassifyRequest(model="cls-topics", inputs=TEXTS[:2], top_k=2)]
    results = adapter.run_batch(reqs)
    for req, res in zip(reqs[:3], results):
        labels, got = classified(res)
        want_labels, want = ref.classify(lora_of(req), req.inputs)
        assert labels == want_labels
        np.testing.assert_allclose(got, want, atol=5e-6)
    assert results[1].labels == TOPIC_LABELS and results[0].labels == CLASSIFY_LABELS
    # top_k cuts within the adapter's own labels, best first.
    _, want = ref.classify("cls-topics", TEXTS[:2])
    assert results[3].shape == (2, 2)
    assert np.frombuffer(results[3].top, "<i4").reshape(2, 2).tolist() == np.argsort(-want, axis=1)[:, :2].tolist()
    assert np.abs(ref.classify("cls-head", TEXTS)[1] - ref.classify(None, TEXTS)[1]).max() > 0.05


def test_tagger_rows_tag_with_their_own_labels(models, ref) -> None:
    adapter = served(models, "tagger", "extract", "transformers", ["ner-own", "ner-body"])
    reqs = [ExtractRequest(model="base", inputs=TEXTS), ExtractRequest(model="ner-own", inputs=TEXTS[::-1]),
            ExtractRequest(model="base", inputs=TEXTS[1:], adapter="ner-body")]
    seen: set[str] = set()
    for req, res in zip(reqs, adapter.run_batch(reqs)):
        want = ref.extract(lora_of(req), req.inputs)
        got = [[(s.entity, s.start, s.end, s.score) for s in row] for row in res.spans]
        assert [[x[:3] for x in row] for row in got] == [[x[:3] for x in row] for row in want], lora_of(req)
        np.testing.assert_allclose([x[3] for row in got for x in row], [x[3] for row in want for x in row],
                                   atol=5e-6)
        seen |= {x[0] for row in got for x in row}
        if lora_of(req) == "ner-own":
            assert {x[0] for row in got for x in row} <= {lab.split("-")[-1] for lab in NER_OWN_LABELS}
    assert {"DRUG", "DOSE"} & seen and {"PER", "LOC"} & seen


def test_eviction_keeps_the_batch_and_frees_the_heads(models) -> None:
    bases, folders = models
    from fleet.runtimes.adapters.classify import SequenceClassifier

    adapter = SequenceClassifier(ModelSpec("base", bases["classifier"], "classify", "transformers",
                                           Profile(dtype="float32", max_loras=1)), "cpu")
    adapter.load()
    alone = adapter.footprint_bytes()
    spec = {n: ModelSpec(n, folders[n], "classify", "peft", extra={"base": "base"}) for n in ("cls-head", "cls-topics")}
    adapter.attach_lora(spec["cls-topics"])
    topics = adapter.footprint_bytes() - alone
    # Both named by the batch about to run: past max_loras, neither is detached.
    adapter.attach_lora(spec["cls-head"], keep={"cls-head", "cls-topics"})
    assert adapter.attached_loras() == ["cls-topics", "cls-head"]
    res = adapter.run_batch([ClassifyRequest(model="cls-head", inputs=TEXTS[:1]),
                             ClassifyRequest(model="cls-topics", inputs=TEXTS[:1])])
    assert [r.labels for r in res] == [CLASSIFY_LABELS, TOPIC_LABELS]
    # Once idle, the least recently used one leaves, and its weights and head with it.
    adapter.loras.detach_idle()
    assert adapter.attached_loras() == ["cls-topics"]
    assert adapter.footprint_bytes() - alone == topics
    with pytest.raises(Exception, match="is for base model 'other'"):
        adapter.attach_lora(ModelSpec("x", folders["cls-head"], "classify", "peft", extra={"base": "other"}))


def test_an_adapter_of_another_size_is_refused_and_leaves_nothing(models, tmp_path: Path) -> None:
    from fleet.errors import ModelLoadFailed
    from transformers import BertModel

    from tests.lora_models import bert_config, build_lora, tokenizer

    _, folders = models
    wide = build_lora(BertModel(bert_config(tokenizer()).__class__(**{**bert_config(tokenizer()).to_dict(),
                                                                      "hidden_size": 48})),
                      tmp_path / "wide", seed=11, task_type="FEATURE_EXTRACTION")
    adapter = served(models, "classifier", "classify", "transformers", ["cls-head"])
    before = adapter.footprint_bytes()
    with pytest.raises(ModelLoadFailed, match="'wide'"):
        adapter.attach_lora(ModelSpec("wide", wide, "classify", "peft", extra={"base": "base"}))
    assert adapter.attached_loras() == ["cls-head"] and adapter.footprint_bytes() == before
    assert not isinstance(adapter.run_batch([ClassifyRequest(model="cls-head", inputs=TEXTS[:2])])[0], WorkError)
    # A LoRA of the encoder alone (trained on BertModel) fits the classifier's encoder: its
    # weights are matched to the layers whose paths end the same way, and change the answers.
    adapter.attach_lora(ModelSpec("emb-a", folders["emb-a"], "classify", "peft", extra={"base": "base"}))
    plain, body = adapter.run_batch([ClassifyRequest(model="base", inputs=TEXTS), ClassifyRequest(model="emb-a",
                                                                                                   inputs=TEXTS)])
    assert np.abs(classified(plain)[1] - classified(body)[1]).max() > 0.01


# ---- the traced CPU forward (runtimes/adapters/traced.py) beside LoRA rows ------------------

def answers_of(adapter, reqs) -> list[tuple[tuple, np.ndarray]]:
    """Each result as (what must be equal, scores in input order): rerank (-, per
    document), classify (labels, per label), extract (spans' entity and offsets, their
    scores)."""
    out = []
    for res in adapter.run_batch(reqs):
        assert not isinstance(res, WorkError), res
        if hasattr(res, "spans"):
            spans = [s for row in res.spans for s in row]
            out.append((tuple((s.entity, s.start, s.end) for s in spans), np.array([s.score for s in spans])))
        elif hasattr(res, "labels"):
            out.append((tuple(res.labels), classified(res)[1]))
        else:
            got = np.empty(len(np.frombuffer(res.index, "<i4")), dtype=np.float32)
            got[np.frombuffer(res.index, "<i4")] = np.frombuffer(res.scores, "<f4")
            out.append(((), got))
    return out


@pytest.mark.parametrize("task, runtime, key, loras", [
    ("rerank", "transformers", "reranker", ["rr-head", "rr-body"]),
    ("rerank", "sentence-transformers", "cross-encoder", ["ce-head", "ce-body"]),
    ("classify", "transformers", "classifier", ["cls-head", "cls-topics"]),
    ("extract", "transformers", "tagger", ["ner-own", "ner-body"]),
])
def test_base_rows_replay_the_traced_forward_and_adapter_rows_run_eagerly(models, monkeypatch, task, runtime, key,
                                                                         loras) -> None:
    """Rerankers, classifiers and taggers trace their CPU forward at load, as the
    embedder does: micro-batches of base rows replay the graph, with the eager
    forward's answers; a
    micro-batch with any adapter row runs eagerly (the adapters' hooks are Python a
    graph does not call), with its adapter's answers. MIN_SPEEDUP 0: whether the graph
    is faster is timing, measured in bench/; here it is kept whatever it measured."""
    from fleet.runtimes.adapters import traced
    from fleet.runtimes.info import engine_info

    monkeypatch.setattr(traced, "MIN_SPEEDUP", 0.0)
    # engine torch: where OpenVINO is installed and measured faster it would serve instead (no trace).
    adapter = served(models, key, task, runtime, loras, Profile(dtype="float32", engine="torch", micro_batch_items=3))
    assert adapter.compiled is not None, adapter.traced_why
    assert engine_info(adapter)["forward"]["traced"] is True
    if task == "rerank":
        base = [RerankRequest(model="base", query=QUERY, documents=DOCS), RerankRequest(model="base", query="kittens",
                                                                                         documents=DOCS[2:])]
        tuned = [RerankRequest(model=loras[0], query=QUERY, documents=DOCS),
                 RerankRequest(model="base", query="kittens", documents=DOCS[2:], adapter=loras[1])]
    else:
        kind = ClassifyRequest if task == "classify" else ExtractRequest
        base = [kind(model="base", inputs=TEXTS), kind(model="base", inputs=TEXTS[2:])]
        tuned = [kind(model=loras[0], inputs=TEXTS), kind(model=loras[1], inputs=TEXTS[2:])]
    graph, calls = adapter.compiled._graph, [0]
    adapter.compiled._graph = lambda *a: (calls.__setitem__(0, calls[0] + 1), graph(*a))[1]
    replayed, replayed_tuned = answers_of(adapter, base), answers_of(adapter, tuned)
    assert calls[0] >= 2  # base micro-batches (of 3 rows) ran the graph...
    in_base = calls[0]
    mixed = answers_of(adapter, [base[0], tuned[0]])
    # ... none with an adapter row: the mixed batch pairs each base row with the same input's
    # adapter row (equal lengths keep input order), so every micro-batch of 3 has one.
    assert calls[0] == in_base
    adapter.compiled = None
    eager, eager_tuned = answers_of(adapter, base), answers_of(adapter, tuned)
    for got, want in zip([*replayed, *replayed_tuned, *mixed], [*eager, *eager_tuned, eager[0], eager_tuned[0]]):
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=2e-6)
    # The adapter rows really are the adapter's.
    (base_keys, base_scores), (tuned_keys, tuned_scores) = eager[0], eager_tuned[0]
    assert base_keys != tuned_keys or np.abs(tuned_scores - base_scores).max() > 0.01
