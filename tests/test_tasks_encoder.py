"""Rerank, classify and extract end to end: tiny real models saved with
`save_pretrained`, pulled into a temp store with `fleetctl pull path:`, served
by a real daemon over real HTTP (MessagePack and JSON), and checked against the
same folders run directly through transformers / sentence-transformers.

The served models run in float32 (the catalog overlay says so) so answers can
be compared to 1e-4; one classifier runs with `dtype = "auto"` to exercise the
reduced-precision check at load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DaemonProc, default_model_dir, start_daemon

MSGPACK = "application/msgpack"
MAX_INPUTS = 200

NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
#: Sentences the tiny tagger is trained on (word-level tags; adjacent equal tags form one entity).
NER_TRAIN = [
    ("Angela Merkel met Emmanuel Macron in Berlin on Tuesday .", "PER PER O PER PER O LOC O O O"),
    ("Acme Corp hired John Smith from Paris .", "ORG ORG O PER PER O LOC O"),
    ("José Núñez moved from São Paulo to Zürich .", "PER PER O O LOC LOC O LOC O"),
    ("The United Nations met in New York City today .", "O ORG ORG O O LOC LOC LOC O O"),
    ("nothing to see here", "O O O O"),
]
NER_TEXTS = [s.replace(" .", ".") for s, _ in NER_TRAIN] + [
    "naïve café in São Paulo 🎉 with José Núñez",
    "Macron and Merkel visited Acme Corp in Paris",
    "",
]

QUERY = "how do cats behave at home"
DOCS = [
    "Cats sleep for most of the day and are most active at dawn and dusk.",
    "The stock market closed higher on Friday.",
    "a",
    "Domestic cats groom themselves and mark territory by rubbing against furniture, "
    "doors and the legs of people they trust.",
    "Dogs need daily walks.",
    "¿Los gatos duermen mucho?",
    "Kittens play to practise hunting.",
    "Quarterly revenue grew 12% year over year.",
]
TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible service, never again.",
    "The package arrived on Tuesday.",
    "ok",
    "Das Essen war ausgezeichnet und der Kellner sehr freundlich.",
]


# ---- tiny models -------------------------------------------------------------

def build_models(root: Path) -> dict[str, Path]:
    """Tiny BERTs with the all-MiniLM tokenizer, saved as the hub saves them."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def config(**kw):
        # initializer_range 0.3 (not 0.02): scores spread out, so rankings and top labels mean something.
        return BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, **kw)

    def save(model, name: str) -> Path:
        folder = root / name
        model.eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    torch.manual_seed(0)
    out = {
        "reranker": save(BertForSequenceClassification(config(num_labels=1)), "reranker"),
        "classifier": save(BertForSequenceClassification(config(
            num_labels=3, id2label={0: "negative", 1: "neutral", 2: "positive"},
            label2id={"negative": 0, "neutral": 1, "positive": 2})), "classifier"),
        "multilabel": save(BertForSequenceClassification(config(
            num_labels=4, problem_type="multi_label_classification",
            id2label={0: "billing", 1: "shipping", 2: "quality", 3: "other"},
            label2id={"billing": 0, "shipping": 1, "quality": 2, "other": 3})), "multilabel"),
        "tagger": save(train_tagger(tok, BertConfig(
            vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=128, num_labels=len(NER_LABELS),
            id2label=dict(enumerate(NER_LABELS)), label2id={lab: i for i, lab in enumerate(NER_LABELS)})), "tagger"),
    }
    # A CrossEncoder folder as sentence-transformers saves it, with a saved
    # activation (identity: scores are the logits) that both runtimes must honour.
    ce = CrossEncoder(str(out["reranker"]), device="cpu", activation_fn=torch.nn.Identity())
    ce.save_pretrained(str(root / "cross-encoder"))
    out["cross-encoder"] = root / "cross-encoder"
    # One catalog source per name: the models served twice get their own copy.
    for key in ("cross-encoder", "classifier"):
        out[f"{key}-copy"] = Path(shutil.copytree(out[key], root / f"{key}-copy"))
    return out


def train_tagger(tok, config):
    """A token classifier trained for a few steps on NER_TRAIN, so it finds real
    multi-token entities and leaves most words `O` (random weights tag everything)."""
    import torch
    from transformers import BertForTokenClassification

    torch.manual_seed(0)
    model = BertForTokenClassification(config)
    words = [s.split() for s, _ in NER_TRAIN]
    enc = tok(words, is_split_into_words=True, padding=True, return_tensors="pt")
    targets = torch.full(enc["input_ids"].shape, -100)
    for b, (_, tags) in enumerate(NER_TRAIN):
        tags = tags.split()
        previous = None
        for j, w in enumerate(enc.word_ids(b)):
            if w is not None:
                tag = tags[w]
                begins = w != previous and (w == 0 or tags[w - 1] != tag)
                targets[b, j] = 0 if tag == "O" else NER_LABELS.index(("B-" if begins else "I-") + tag)
            previous = w
    # Frozen word embeddings: 60 Adam steps on the rest take about a second on
    # one thread (and much longer when threads contend for a shared CPU).
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(60):
            loss = model(**enc, labels=targets).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model


#: Store name -> (folder key, task, runtime, dtype).
SERVED = {
    "tiny-rerank": ("reranker", "rerank", "transformers", "float32"),
    "tiny-ce": ("cross-encoder", "rerank", "sentence-transformers", "float32"),
    "tiny-ce-hf": ("cross-encoder-copy", "rerank", "transformers", "float32"),
    "tiny-classify": ("classifier", "classify", "transformers", "float32"),
    "tiny-multilabel": ("multilabel", "classify", "transformers", "float32"),
    "tiny-ner": ("tagger", "extract", "transformers", "float32"),
    "tiny-classify-auto": ("classifier-copy", "classify", "transformers", "auto"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_models(tmp_path_factory.mktemp("tiny-encoders"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    home = tmp_path_factory.mktemp("fleet-encoders")
    # Catalog overlay: each test model's task, runtime and dtype (float32 unless "auto").
    lines = []
    for name, (key, task, runtime, dtype) in SERVED.items():
        lines += [f'[models."{name}"]', f'source = "path:{folders[key].resolve()}"', f'task = "{task}"',
                  f'runtime = "{runtime}"', f'[models."{name}".profile]', f'dtype = "{dtype}"', ""]
    (home / "models.toml").write_text("\n".join(lines))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name, (key, _, _, _) in SERVED.items():
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folders[key]}", "--name", name],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={
        "FLEET_PRELOAD": ",".join(SERVED), "FLEET_CPU_THREADS": "1", "FLEET_MAX_INPUTS": str(MAX_INPUTS),
    })
    yield d
    d.stop()


def post(d: DaemonProc, path: str, body: dict, *, msgpack: bool = False) -> httpx.Response:
    if msgpack:
        return httpx.post(d.url + path, content=msgspec.msgpack.encode(body),
                          headers={"Content-Type": MSGPACK}, timeout=60)
    return httpx.post(d.url + path, json=body, timeout=60)


def decoded(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.content[:500]
    if resp.headers["content-type"].startswith(MSGPACK):
        return msgspec.msgpack.decode(resp.content)
    return resp.json()


def served_dtype(d: DaemonProc, model: str) -> str:
    ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
    return next(w["models"][model]["dtype"] for w in ps["workers"] if model in w["models"])


# ---- references, run directly on the same folders ----------------------------------

def seq_logits(folder: Path, texts, pairs=None) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    enc = tok(texts, pairs, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float().numpy()


def pair_tokens(folder: Path, query: str, docs: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return sum(len(ids) for ids in tok([query] * len(docs), docs, truncation=True, max_length=128)["input_ids"])


def check_ranking(results: list[dict], reference: np.ndarray, n: int) -> None:
    """Best first, every index once (within top_n), scores equal to the reference's."""
    index = [r["index"] for r in results]
    scores = np.array([r["score"] for r in results])
    assert len(index) == n and len(set(index)) == n and all(0 <= i < len(reference) for i in index)
    np.testing.assert_allclose(scores, reference[index], atol=1e-4)
    assert np.all(np.diff(scores) <= 0)
    # Nothing left out scores higher than the last one kept.
    rest = np.delete(reference, index)
    assert not len(rest) or rest.max() <= scores[-1] + 1e-4


# ---- rerank ------------------------------------------------------------------

def test_rerank_matches_cross_encoder_predict(fleet, folders):
    from sentence_transformers import CrossEncoder

    resp = post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS}, msgpack=True)
    reply = decoded(resp)
    assert resp.headers["content-type"].startswith(MSGPACK)
    # The default score is CrossEncoder.predict's: the sigmoid of the one logit.
    reference = CrossEncoder(str(folders["reranker"]), device="cpu").predict([(QUERY, d) for d in DOCS])
    check_ranking(reply["results"], np.asarray(reference, dtype=np.float32), len(DOCS))
    # `relevance_score` is Cohere's and Jina's name for the same number.
    assert all(set(r) == {"index", "relevance_score", "score"} and r["relevance_score"] == r["score"]
               for r in reply["results"])
    assert reply["model"] == "tiny-rerank"
    assert reply["usage"]["input_tokens"] == pair_tokens(folders["reranker"], QUERY, DOCS)
    assert float(resp.headers["X-Inference-Ms"]) > 0 and "/" in resp.headers["X-Served-By"]


def test_rerank_raw_scores_are_the_logits(fleet, folders):
    logits = seq_logits(folders["reranker"], [QUERY] * len(DOCS), DOCS)[:, 0]
    raw = decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS,
                                             "raw_scores": True}))
    check_ranking(raw["results"], logits, len(DOCS))
    sig = decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS}))
    check_ranking(sig["results"], 1 / (1 + np.exp(-logits)), len(DOCS))


def test_rerank_top_n_documents_and_tei_fields(fleet, folders):
    reference = 1 / (1 + np.exp(-seq_logits(folders["reranker"], [QUERY] * len(DOCS), DOCS)[:, 0]))
    top = decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS,
                                             "top_n": 3, "return_documents": True}))
    check_ranking(top["results"], reference, 3)
    assert [r["document"] for r in top["results"]] == [{"text": DOCS[r["index"]]} for r in top["results"]]
    # top_n past the number of documents returns them all.
    assert len(decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS,
                                                  "top_n": 50}))["results"]) == len(DOCS)
    # TEI spelling: `texts`, `return_text` (documents come back as `text`), `raw_scores`.
    tei = decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "texts": DOCS,
                                             "return_text": True}, msgpack=True))
    check_ranking(tei["results"], reference, len(DOCS))
    assert [r["text"] for r in tei["results"]] == [DOCS[r["index"]] for r in tei["results"]]
    assert all("document" not in r for r in tei["results"])


def test_sentence_transformers_cross_encoder_and_its_saved_activation(fleet, folders):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(folders["cross-encoder"]), device="cpu")
    reference = np.asarray(ce.predict([(QUERY, d) for d in DOCS]), dtype=np.float32)
    # The folder saved an identity activation: scores are logits, not probabilities.
    assert reference.min() < 0 or reference.max() > 1
    for model in ("tiny-ce", "tiny-ce-hf"):
        reply = decoded(post(fleet, "/v1/rerank", {"model": model, "query": QUERY, "documents": DOCS}))
        check_ranking(reply["results"], reference, len(DOCS))


def test_rerank_concurrent_requests_batch_and_split_back(fleet, folders):
    """Many documents (more than one micro-batch) and concurrent requests of one
    model: each answer is its own request's, equal to the reference."""
    rng = np.random.default_rng(7)
    words = " ".join(DOCS + TEXTS).split()
    queries = [QUERY, "stock market news", "sleeping kittens", "service was terrible"]
    doc_sets = [[" ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(n)]
                for n in (150, 3, 70, 1)]

    def ask(k: int) -> dict:
        return decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": queries[k],
                                                  "documents": doc_sets[k], "raw_scores": True}, msgpack=k % 2 == 0))

    with ThreadPoolExecutor(len(queries)) as pool:
        replies = list(pool.map(ask, range(len(queries))))
    for k, reply in enumerate(replies):
        logits = seq_logits(folders["reranker"], [queries[k]] * len(doc_sets[k]), doc_sets[k])[:, 0]
        check_ranking(reply["results"], logits, len(doc_sets[k]))
        assert reply["usage"]["input_tokens"] == pair_tokens(folders["reranker"], queries[k], doc_sets[k])


# ---- classify --------------------------------------------------------------------

def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def check_labels(results: list[list[dict]], probs: np.ndarray, labels: list[str], k: int) -> None:
    assert len(results) == len(probs)
    for row, ref in zip(results, probs):
        assert len(row) == k
        got = np.array([e["score"] for e in row])
        np.testing.assert_allclose(got, ref[[labels.index(e["label"]) for e in row]], atol=1e-4)
        assert np.all(np.diff(got) <= 0) and len({e["label"] for e in row}) == k
        np.testing.assert_allclose(got[0], ref.max(), atol=1e-4)


def test_classify_matches_transformers(fleet, folders):
    from transformers import pipeline

    labels = ["negative", "neutral", "positive"]
    probs = softmax(seq_logits(folders["classifier"], TEXTS))
    resp = post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": TEXTS}, msgpack=True)
    reply = decoded(resp)
    check_labels(reply["results"], probs, labels, 3)
    for row in reply["results"]:
        assert abs(sum(e["score"] for e in row) - 1) < 1e-4
    # The transformers pipeline, as a second reference, agrees label by label.
    pipe = pipeline("text-classification", model=str(folders["classifier"]), top_k=None, device="cpu")
    for row, ref in zip(reply["results"], pipe(TEXTS)):
        assert [e["label"] for e in row] == [r["label"] for r in ref]
        np.testing.assert_allclose([e["score"] for e in row], [r["score"] for r in ref], atol=1e-4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["classifier"])
    assert reply["usage"]["input_tokens"] == sum(len(ids) for ids in tok(TEXTS)["input_ids"])
    # JSON gives the same answer.
    js = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": TEXTS}))
    assert js["usage"] == reply["usage"]
    for a, b in zip(js["results"], reply["results"]):
        assert [e["label"] for e in a] == [e["label"] for e in b]
        np.testing.assert_allclose([e["score"] for e in a], [e["score"] for e in b], atol=1e-6)


def test_classify_top_k_multi_label_and_raw(fleet, folders):
    labels = ["negative", "neutral", "positive"]
    logits = seq_logits(folders["classifier"], TEXTS)
    top1 = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": TEXTS, "top_k": 1}))
    check_labels(top1["results"], softmax(logits), labels, 1)
    sig = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": TEXTS, "multi_label": True,
                                               "top_k": 10}))
    check_labels(sig["results"], 1 / (1 + np.exp(-logits)), labels, 3)
    raw = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": TEXTS, "raw_scores": True}))
    check_labels(raw["results"], logits, labels, 3)


def test_multi_label_model_uses_sigmoid_by_default(fleet, folders):
    labels = ["billing", "shipping", "quality", "other"]
    logits = seq_logits(folders["multilabel"], TEXTS)
    reply = decoded(post(fleet, "/v1/classify", {"model": "tiny-multilabel", "inputs": TEXTS}, msgpack=True))
    check_labels(reply["results"], 1 / (1 + np.exp(-logits)), labels, 4)
    # Independent per-label probabilities: they need not sum to one.
    assert any(abs(sum(e["score"] for e in row) - 1) > 0.05 for row in reply["results"])
    single = decoded(post(fleet, "/v1/classify", {"model": "tiny-multilabel", "inputs": TEXTS,
                                                  "multi_label": False, "top_k": 2}))
    check_labels(single["results"], softmax(logits), labels, 2)


def test_auto_dtype_keeps_the_answers(fleet, folders):
    """dtype = "auto": the load-time check keeps a reduced precision only if it
    agrees with fp32 (same top label everywhere, probabilities within 0.01)."""
    dtype = served_dtype(fleet, "tiny-classify-auto")
    assert dtype in ("float32", "bfloat16", "float16")
    probs = softmax(seq_logits(folders["classifier"], TEXTS))
    reply = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify-auto", "inputs": TEXTS}))
    tolerance = 1e-4 if dtype == "float32" else 0.02
    for row, ref in zip(reply["results"], probs):
        got = {e["label"]: e["score"] for e in row}
        np.testing.assert_allclose([got[lab] for lab in ["negative", "neutral", "positive"]], ref, atol=tolerance)


# ---- extract -------------------------------------------------------------------

def test_extract_matches_the_pipeline_simple_aggregation(fleet, folders):
    from transformers import pipeline

    pipe = pipeline("token-classification", model=str(folders["tagger"]), aggregation_strategy="simple",
                    device="cpu")
    resp = post(fleet, "/v1/extract", {"model": "tiny-ner", "inputs": NER_TEXTS}, msgpack=True)
    reply = decoded(resp)
    assert len(reply["results"]) == len(NER_TEXTS)
    for text, got in zip(NER_TEXTS, reply["results"]):
        ref = pipe(text) if text else []
        assert [(e["entity"], e["start"], e["end"]) for e in got] == \
            [(r["entity_group"], r["start"], r["end"]) for r in ref], text
        np.testing.assert_allclose([e["score"] for e in got], [float(r["score"]) for r in ref], atol=1e-4)
        # Offsets are characters into the text as sent: the span's text is that slice.
        assert all(e["text"] == text[e["start"] : e["end"]] for e in got)
    # The trained tagger finds whole multi-token entities and leaves the rest out.
    first = {e["text"]: e["entity"] for e in reply["results"][0]}
    assert first == {"Angela Merkel": "PER", "Emmanuel Macron": "PER", "Berlin": "LOC"}
    accented = {e["text"]: e["entity"] for e in reply["results"][2]}
    assert accented.get("José Núñez") == "PER" and accented.get("São Paulo") == "LOC"
    assert reply["results"][4] == [] and reply["results"][-1] == []
    # JSON gives the same spans.
    js = decoded(post(fleet, "/v1/extract", {"model": "tiny-ner", "inputs": NER_TEXTS}))
    assert [[(e["entity"], e["start"], e["end"]) for e in row] for row in js["results"]] == \
        [[(e["entity"], e["start"], e["end"]) for e in row] for row in reply["results"]]
    assert js["usage"] == reply["usage"] and reply["usage"]["input_tokens"] > len(NER_TEXTS) * 2


# ---- the pure parts: span grouping, dtype agreement, micro-batches ----------------

def spans_of(tags: list[str], rows: list[int] | None = None) -> list[tuple[str, int, int]]:
    from fleet.runtimes.adapters.extract import group_spans, tag_tables

    group, begins, names, outside = tag_tables(NER_LABELS)
    label = np.array([NER_LABELS.index(t) for t in tags], dtype=np.int64)
    rows_np = np.zeros(len(tags), dtype=np.int64) if rows is None else np.array(rows)
    first, last, _ = group_spans(rows_np, label, np.ones(len(tags), dtype=np.float32), group, begins)
    return [(names[label[f]], int(f), int(e)) for f, e in zip(first, last) if not outside[label[f]]]


@pytest.mark.parametrize("tags,rows,spans", [
    (["B-PER", "I-PER", "O", "B-LOC"], None, [("PER", 0, 1), ("LOC", 3, 3)]),
    # B- always starts a new span, even after the same type.
    (["B-PER", "B-PER", "I-PER"], None, [("PER", 0, 0), ("PER", 1, 2)]),
    # I- without a B- still opens a span; a type change closes one.
    (["O", "I-ORG", "I-ORG", "I-LOC"], None, [("ORG", 1, 2), ("LOC", 3, 3)]),
    # A new text (row) always starts a new span.
    (["I-PER", "I-PER", "I-PER"], [0, 0, 1], [("PER", 0, 1), ("PER", 2, 2)]),
    (["O", "O"], None, []),
    ([], None, []),
])
def test_span_grouping_follows_the_simple_strategy(tags, rows, spans):
    assert spans_of(tags, rows) == spans


def test_span_score_is_the_mean_of_its_tokens():
    from fleet.runtimes.adapters.extract import group_spans, tag_tables

    group, begins, _, _ = tag_tables(NER_LABELS)
    label = np.array([1, 2, 0, 5], dtype=np.int64)
    _, _, mean = group_spans(np.zeros(4, dtype=np.int64), label, np.array([0.9, 0.5, 0.99, 0.6], dtype=np.float32),
                             group, begins)
    np.testing.assert_allclose(mean, [0.7, 0.99, 0.6], atol=1e-6)


def test_dtype_agreement_criteria():
    from fleet.runtimes.adapters.hf_common import labels_agree, pair_order_agreement, scores_agree

    ref = np.array([0.9, 0.5, 0.1, 0.3], dtype=np.float32)
    assert scores_agree()(ref, ref + 0.001)[0]
    assert not scores_agree()(ref, ref + np.array([0, 0, 0.05, 0]))[0]  # 6 % of the range
    swapped = np.array([0.9, 0.5, 0.3, 0.1], dtype=np.float32)
    assert pair_order_agreement(ref, swapped) == pytest.approx(5 / 6)
    probs = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    assert labels_agree()(probs, probs + 0.005)[0]
    assert not labels_agree()(probs, np.array([[0.7, 0.2, 0.1], [0.34, 0.41, 0.25]]))[0]  # top label flipped


def test_micro_batches_sort_by_length_and_cover_every_input():
    from fleet.runtimes.adapters.batching import micro_batches

    lengths = np.array([5, 1, 9, 1, 3, 7, 2])
    chunks = list(micro_batches(lengths, 3))
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert sorted(np.concatenate(chunks).tolist()) == list(range(7))
    assert np.concatenate(chunks).tolist() == [1, 3, 6, 4, 0, 5, 2]  # stable: equal lengths keep input order


def padded_cost(lengths: np.ndarray, bounds: list[int], fixed: float) -> float:
    """Predicted time of ascending `lengths` cut at `bounds`: per run, `fixed` + items x longest."""
    return sum(fixed + (hi - lo) * lengths[hi - 1] for lo, hi in zip(bounds, bounds[1:]))


def all_cuts(n: int, step: int):
    """Every way to cut n inputs into runs of at most `step` (as bounds)."""
    for mask in range(1 << (n - 1)):
        bounds = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        if all(hi - lo <= step for lo, hi in zip(bounds, bounds[1:])):
            yield bounds


def test_padding_cuts_are_the_least_predicted_cost():
    """runtimes/adapters/batching.padding_cuts: the cut of sorted lengths whose sum of
    fixed + items x longest is least, runs of at most `step`; exhaustively checked."""
    from fleet.runtimes.adapters.batching import padding_cuts

    rng = np.random.default_rng(5)
    for _ in range(60):
        n, step = int(rng.integers(1, 10)), int(rng.integers(1, 6))
        lengths = np.sort(rng.integers(1, 200, n))
        fixed = float(rng.choice([1.0, 40.0, 400.0]))
        got = padding_cuts(lengths, step, fixed)
        assert got[0] == 0 and got[-1] == n and all(0 < hi - lo <= step for lo, hi in zip(got, got[1:]))
        best = min(padded_cost(lengths, b, fixed) for b in all_cuts(n, step))
        assert padded_cost(lengths, got, fixed) == pytest.approx(best)


def test_padding_cuts_in_multiples_of_rows_are_the_least_cost_of_those_cuts():
    """`rows`: every run but the first (the shortest inputs) holds a multiple of `rows`
    inputs, and of such cuts the one taken is the least predicted cost; a `step` too
    small for one multiple cuts as without it. Exhaustively checked."""
    from fleet.runtimes.adapters.batching import padding_cuts

    rng = np.random.default_rng(11)
    for _ in range(80):
        n, step, rows = int(rng.integers(1, 12)), int(rng.integers(3, 9)), int(rng.integers(2, 4))
        lengths = np.sort(rng.integers(1, 200, n))
        fixed = float(rng.choice([1.0, 40.0, 400.0]))
        got = padding_cuts(lengths, step, fixed, rows)
        runs = [hi - lo for lo, hi in zip(got, got[1:])]
        assert got[0] == 0 and got[-1] == n and all(0 < r <= step for r in runs)
        assert all(r % rows == 0 for r in runs[1:]), (runs, rows)
        allowed = [b for b in all_cuts(n, step) if all((hi - lo) % rows == 0 for lo, hi in zip(b[1:], b[2:]))]
        best = min(padded_cost(lengths, b, fixed) for b in allowed)
        assert padded_cost(lengths, got, fixed) == pytest.approx(best)
    lengths = np.arange(1, 10)
    assert padding_cuts(lengths, 3, 40.0, rows=4) == padding_cuts(lengths, 3, 40.0)


def test_micro_batches_cut_where_padding_costs_more_than_a_forward():
    """Four short texts and two long ones: with a small fixed cost the short ones are
    not padded to the long ones' length; with a large one (or none given: by count)
    they run together; equal lengths are cut by count as before."""
    from fleet.runtimes.adapters.batching import micro_batches

    lengths = np.array([200, 10, 12, 190, 11, 10])
    assert [c.tolist() for c in micro_batches(lengths, 64, fixed=100.0)] == [[1, 5, 4, 2], [3, 0]]
    assert [len(c) for c in micro_batches(lengths, 64, fixed=10_000.0)] == [6]
    assert [len(c) for c in micro_batches(lengths, 64)] == [6]
    assert [len(c) for c in micro_batches(np.full(10, 7), 4, fixed=5.0)] == [4, 4, 2]


def test_a_forwards_fixed_cost_is_fitted_from_the_thread_timings():
    """runtimes/adapters/threads.Threads.fixed_tokens: a / b of the line through the worker's
    thread timings, within its bounds (no slope: the upper one); None with one shape."""
    import torch

    from fleet.runtimes.adapters.threads import FIXED_TOKENS_RANGE, Threads

    line = [(12, 10.0 + 0.08 * 12), (84, 10.0 + 0.08 * 84), (480, 10.0 + 0.08 * 480)]
    assert Threads(torch, full_ms=line).fixed_tokens() == pytest.approx(125.0)
    assert Threads(torch, full_ms=line[:1]).fixed_tokens() is None
    assert Threads(torch, full_ms=[(12, 5.0), (84, 4.9)]).fixed_tokens() == FIXED_TOKENS_RANGE[1]
    assert Threads(torch, full_ms=[(12, 100.0), (84, 100.1)]).fixed_tokens() == FIXED_TOKENS_RANGE[1]
    assert Threads(torch, full_ms=[(12, 1.0), (84, 7.0)]).fixed_tokens() == FIXED_TOKENS_RANGE[0]


# ---- bad input -----------------------------------------------------------------

LONG = "word " * 300  # > 128 tokens, the tiny models' limit

# (case, path, body, status, code, words the message must contain)
BAD = [
    ("rerank: no documents", "/v1/rerank", {"model": "tiny-rerank", "query": "q"}, 400, "bad_request", "documents"),
    ("rerank: empty documents", "/v1/rerank", {"model": "tiny-rerank", "query": "q", "documents": []},
     400, "bad_request", "empty"),
    ("rerank: documents and texts", "/v1/rerank",
     {"model": "tiny-rerank", "query": "q", "documents": ["a"], "texts": ["b"]}, 400, "bad_request", "both"),
    ("rerank: too many", "/v1/rerank", {"model": "tiny-rerank", "query": "q", "documents": ["a"] * (MAX_INPUTS + 1)},
     400, "bad_request", str(MAX_INPUTS)),
    ("rerank: empty query", "/v1/rerank", {"model": "tiny-rerank", "query": "  ", "documents": ["a"]},
     400, "bad_request", "query"),
    ("rerank: no query", "/v1/rerank", {"model": "tiny-rerank", "documents": ["a"]}, 400, "bad_request", "query"),
    ("rerank: top_n 0", "/v1/rerank", {"model": "tiny-rerank", "query": "q", "documents": ["a"], "top_n": 0},
     400, "bad_request", "top_n"),
    ("rerank: document not a string", "/v1/rerank", {"model": "tiny-rerank", "query": "q", "documents": [{"t": 1}]},
     400, "bad_request", "documents"),
    ("rerank: unknown model", "/v1/rerank", {"model": "no-such-model", "query": "q", "documents": ["a"]},
     404, "model_not_found", "no-such-model"),
    ("rerank: a classifier", "/v1/rerank", {"model": "tiny-classify", "query": "q", "documents": ["a"]},
     400, "bad_request", "classify"),
    ("rerank: too long", "/v1/rerank",
     {"model": "tiny-rerank", "query": "q", "documents": ["short", LONG], "truncate": False},
     422, "input_too_long", "document 1"),
    ("classify: empty inputs", "/v1/classify", {"model": "tiny-classify", "inputs": []}, 400, "bad_request", "empty"),
    ("classify: too many", "/v1/classify", {"model": "tiny-classify", "inputs": ["a"] * (MAX_INPUTS + 1)},
     400, "bad_request", str(MAX_INPUTS)),
    ("classify: top_k 0", "/v1/classify", {"model": "tiny-classify", "inputs": ["a"], "top_k": 0},
     400, "bad_request", "top_k"),
    ("classify: a reranker", "/v1/classify", {"model": "tiny-rerank", "inputs": ["a"]}, 400, "bad_request", "rerank"),
    ("classify: too long", "/v1/classify", {"model": "tiny-classify", "inputs": [LONG], "truncate": False},
     422, "input_too_long", "128"),
    ("extract: labels", "/v1/extract", {"model": "tiny-ner", "inputs": ["a"], "labels": ["person"]},
     400, "bad_request", "LOC, ORG, PER"),
    ("extract: empty inputs", "/v1/extract", {"model": "tiny-ner", "inputs": []}, 400, "bad_request", "empty"),
    ("extract: a classifier", "/v1/extract", {"model": "tiny-classify", "inputs": ["a"]}, 400, "bad_request", "classify"),
    ("extract: too long", "/v1/extract", {"model": "tiny-ner", "inputs": ["ok", LONG], "truncate": False},
     422, "input_too_long", "input 1"),
]


@pytest.mark.parametrize("case,path,body,status,code,words", BAD, ids=[c[0] for c in BAD])
def test_bad_input(fleet, case, path, body, status, code, words):
    for msgpack in (False, True):
        resp = post(fleet, path, body, msgpack=msgpack)
        assert resp.status_code == status, (case, resp.content[:300])
        assert resp.headers["content-type"].startswith(MSGPACK if msgpack else "application/json")
        err = (msgspec.msgpack.decode(resp.content) if msgpack else resp.json())["error"]
        assert err["code"] == code and words in err["message"], err
    # Nothing else changed: the same model still answers.
    ok = {"/v1/rerank": {"model": "tiny-rerank", "query": "q", "documents": ["a", "b"]},
          "/v1/classify": {"model": "tiny-classify", "inputs": ["a"]},
          "/v1/extract": {"model": "tiny-ner", "inputs": ["Angela Merkel"]}}[path]
    assert post(fleet, path, ok).status_code == 200


def test_truncation_is_the_default(fleet):
    reply = decoded(post(fleet, "/v1/classify", {"model": "tiny-classify", "inputs": [LONG]}))
    assert reply["usage"]["input_tokens"] == 128
    reply = decoded(post(fleet, "/v1/rerank", {"model": "tiny-rerank", "query": "q", "documents": [LONG]}))
    assert reply["usage"]["input_tokens"] == 128


# ---- one batch, many requests (in-process adapters, the worker's call) -----------------

def adapter(folders: dict[str, Path], key: str, task: str, runtime: str, micro: int = 3):
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.registry import adapter_class

    spec = ModelSpec(name=f"tiny-{key}", path=folders[key], task=task, runtime=runtime,
                     profile=Profile(dtype="float32", micro_batch_items=micro))
    a = adapter_class(task, runtime)(spec, "cpu")
    a.load()
    return a


def test_one_rerank_batch_answers_each_request_as_if_alone(folders):
    """Requests of one model run in one batch (pairs flattened, length-sorted into
    micro-batches of 3); each answer equals the request run alone, and a request
    that fails (too long, truncate=false) fails alone."""
    from fleet.protocol import RerankRequest
    from fleet.messages import RerankResult, WorkError

    a = adapter(folders, "reranker", "rerank", "transformers")
    batch = [
        RerankRequest(model="m", query=QUERY, documents=DOCS, top_n=4),
        RerankRequest(model="m", query="q", documents=["short", LONG], truncate=False),
        RerankRequest(model="m", query="stock market", texts=DOCS[::-1], raw_scores=True),
        RerankRequest(model="m", query="cats", documents=["a"]),
    ]
    together = a.run_batch(batch)
    assert isinstance(together[1], WorkError) and together[1].code == "input_too_long"
    for req, got in zip(batch, together):
        if req.truncate:
            alone = a.run_batch([req])[0]
            assert isinstance(got, RerankResult) and got.index == alone.index and got.input_tokens == alone.input_tokens
            np.testing.assert_allclose(np.frombuffer(got.scores, "<f4"), np.frombuffer(alone.scores, "<f4"), atol=1e-5)
    assert len(np.frombuffer(together[0].index, "<i4")) == 4


def test_one_classify_and_extract_batch_split_back(folders):
    from fleet.protocol import ClassifyRequest, ExtractRequest

    clf = adapter(folders, "classifier", "classify", "transformers")
    batch = [ClassifyRequest(model="m", inputs=TEXTS, top_k=2), ClassifyRequest(model="m", inputs=TEXTS[:1],
                                                                                multi_label=True)]
    for req, got in zip(batch, clf.run_batch(batch)):
        alone = clf.run_batch([req])[0]
        assert got.shape == alone.shape and got.top == alone.top and got.labels == ["negative", "neutral", "positive"]
        np.testing.assert_allclose(np.frombuffer(got.scores, "<f4"), np.frombuffer(alone.scores, "<f4"), atol=1e-5)
    ner = adapter(folders, "tagger", "extract", "transformers")
    batch = [ExtractRequest(model="m", inputs=NER_TEXTS[:3]), ExtractRequest(model="m", inputs=["x"], labels=["a"]),
             ExtractRequest(model="m", inputs=NER_TEXTS[3:])]
    together = ner.run_batch(batch)
    assert together[1].code == "bad_request"
    for req, got in ((batch[0], together[0]), (batch[2], together[2])):
        alone = ner.run_batch([req])[0]
        assert [[(s.entity, s.start, s.end) for s in row] for row in got.spans] == \
            [[(s.entity, s.start, s.end) for s in row] for row in alone.spans]
        assert got.input_tokens == alone.input_tokens
