"""Every encoder architecture the catalog serves, proven on a tiny instance.

Each case of `tests.arch_models.ENCODER_CASES` is a tiny random model of one
architecture in its hub folder layout (config, safetensors, the family's own
tokenizer class; sentence-transformers modules for embedders). The catalog
overlay names them with `path:` sources, the daemon pulls them (preload) and
one worker serves them all; each is asked over real HTTP and its answer is
compared with the reference library run in-process on the same folder:
sentence-transformers for embedders and cross-encoders, transformers for
classifiers and (its pipeline) for taggers.

Models run in float32 (the overlay's profile), so answers agree to float
rounding; the largest difference per architecture is printed (`-s`).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.arch_models import ENCODER_CASES, build_cases
from tests.conftest import DaemonProc, start_daemon

#: Texts that reach each family's edge cases: accents and ß (Unigram and
#: byte-level pieces), a one-letter text, punctuation, and one long enough (in
#: these tiny vocabularies) to run past ModernBERT's and Gemma's sliding windows.
TEXTS = [
    "José Núñez moved from São Paulo to Zürich.",
    "hello world",
    "a",
    "Angela Merkel met Emmanuel Macron in Berlin on Tuesday.",
    "The stock market closed higher on Friday; quarterly revenue grew 12% year over year.",
    "¿Los gatos duermen mucho? Das Essen war ausgezeichnet, der Kellner sehr freundlich.",
]
QUERY = "how do cats behave at home"
#: The largest difference to the reference, per case (printed at the end of the module).
LARGEST: dict[str, str] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_cases(ENCODER_CASES, tmp_path_factory.mktemp("arch-encoders"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    home = tmp_path_factory.mktemp("fleet-arch-encoders")
    lines = []
    for name, case in ENCODER_CASES.items():
        lines += [f'[models."{name}"]', f'source = "path:{folders[name]}"', f'task = "{case.task}"',
                  f'runtime = "{case.runtime}"', f'[models."{name}".profile]', 'dtype = "float32"', ""]
    (home / "models.toml").write_text("\n".join(lines))
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join(ENCODER_CASES), "FLEET_CPU_THREADS": "1"})
    yield d
    d.stop()
    if LARGEST:
        print("\nlargest difference to the reference, per architecture:")
        for name, text in LARGEST.items():
            print(f"  {name:28} {text}")


def post(d: DaemonProc, path: str, body: dict) -> dict:
    resp = httpx.post(d.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def token_count(folder: Path, texts, pairs=None) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return sum(len(ids) for ids in tok(texts, pairs, truncation=True)["input_ids"])


def cases_of(task: str) -> list[str]:
    return [name for name, case in ENCODER_CASES.items() if case.task == task]


@pytest.mark.parametrize("name", cases_of("embed"))
def test_embedder_matches_sentence_transformers(fleet, folders, name):
    from sentence_transformers import SentenceTransformer

    reply = post(fleet, "/v1/embed", {"model": name, "inputs": TEXTS})
    got = np.asarray(reply["embeddings"], dtype=np.float32)
    model = SentenceTransformer(str(folders[name]), device="cpu")
    ref = model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    assert got.shape == ref.shape == tuple(reply["shape"])
    cos = (got * ref).sum(axis=1)
    LARGEST[name] = f"min cosine {cos.min():.7f}, max |diff| {np.abs(got - ref).max():.1e}"
    assert cos.min() > 0.99999, cos
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # normalize: false is the reference's normalize_embeddings=False: the model's own
    # output (its Normalize module applied where it has one, the pooled vector where not) ...
    raw = np.asarray(post(fleet, "/v1/embed", {"model": name, "inputs": TEXTS, "normalize": False})["embeddings"])
    np.testing.assert_allclose(raw, model.encode(TEXTS, convert_to_numpy=True), rtol=1e-4, atol=1e-5)
    unit = np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-5)
    assert unit == (type(list(model)[-1]).__name__ == "Normalize")
    # ... and cut by `dimensions` as truncate_dim cuts it (not made unit length again).
    cut = post(fleet, "/v1/embed", {"model": name, "inputs": TEXTS, "normalize": False, "dimensions": 8})
    np.testing.assert_allclose(cut["embeddings"], model.encode(TEXTS, truncate_dim=8), rtol=1e-4, atol=1e-5)
    features = model.tokenize(TEXTS)
    assert reply["usage"]["input_tokens"] == int(features["attention_mask"].sum())


@pytest.mark.parametrize("name", cases_of("rerank"))
def test_cross_encoder_matches_sentence_transformers(fleet, folders, name):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(folders[name]), device="cpu")
    pairs = [(QUERY, t) for t in TEXTS]
    ref = np.asarray(ce.predict(pairs), dtype=np.float32)
    reply = post(fleet, "/v1/rerank", {"model": name, "query": QUERY, "documents": TEXTS})
    index = [r["index"] for r in reply["results"]]
    scores = np.array([r["score"] for r in reply["results"]], dtype=np.float32)
    assert sorted(index) == list(range(len(TEXTS))) and np.all(np.diff(scores) <= 0)
    raw = post(fleet, "/v1/rerank", {"model": name, "query": QUERY, "documents": TEXTS, "raw_scores": True})
    logits = np.asarray(ce.predict(pairs, activation_fn=__import__("torch").nn.Identity()), dtype=np.float32)
    raw_scores = np.empty(len(TEXTS), dtype=np.float32)
    raw_scores[[r["index"] for r in raw["results"]]] = [r["score"] for r in raw["results"]]
    diff = max(np.abs(scores - ref[index]).max(), np.abs(raw_scores - logits).max())
    LARGEST[name] = f"max |score diff| {diff:.1e} (sigmoid and logits)"
    np.testing.assert_allclose(scores, ref[index], atol=1e-5)
    np.testing.assert_allclose(raw_scores, logits, atol=1e-4)
    assert reply["usage"]["input_tokens"] == token_count(folders[name], [QUERY] * len(TEXTS), TEXTS)


@pytest.mark.parametrize("name", cases_of("classify"))
def test_classifier_matches_transformers(fleet, folders, name):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = folders[name]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(**tok(TEXTS, padding=True, return_tensors="pt")).logits.numpy()
    multi = model.config.problem_type == "multi_label_classification"
    probs = 1 / (1 + np.exp(-logits)) if multi else np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = [model.config.id2label[i] for i in range(logits.shape[1])]
    reply = post(fleet, "/v1/classify", {"model": name, "inputs": TEXTS, "top_k": len(labels)})
    got = np.array([[{e["label"]: e["score"] for e in row}[lab] for lab in labels] for row in reply["results"]])
    LARGEST[name] = f"max |probability diff| {np.abs(got - probs).max():.1e} ({'sigmoid' if multi else 'softmax'})"
    np.testing.assert_allclose(got, probs, atol=1e-5)
    assert [row[0]["label"] for row in reply["results"]] == [labels[i] for i in probs.argmax(axis=1)]
    assert reply["usage"]["input_tokens"] == token_count(folder, TEXTS)


@pytest.mark.parametrize("name", cases_of("extract"))
def test_tagger_matches_the_pipeline(fleet, folders, name):
    from transformers import pipeline

    pipe = pipeline("token-classification", model=str(folders[name]), aggregation_strategy="simple", device="cpu")
    reply = post(fleet, "/v1/extract", {"model": name, "inputs": TEXTS})
    largest, spans = 0.0, 0
    for text, got in zip(TEXTS, reply["results"]):
        ref = pipe(text)
        assert [(e["entity"], e["start"], e["end"]) for e in got] == \
            [(r["entity_group"], r["start"], r["end"]) for r in ref], text
        assert all(e["text"] == text[e["start"]:e["end"]] for e in got)
        diffs = [abs(e["score"] - float(r["score"])) for e, r in zip(got, ref)]
        largest, spans = max([largest, *diffs]), spans + len(got)
    LARGEST[name] = f"same {spans} spans, max |score diff| {largest:.1e}"
    assert spans > 0 and largest < 1e-5
    assert reply["usage"]["input_tokens"] == token_count(folders[name], TEXTS)
