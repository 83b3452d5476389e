"""runtimes/adapters/engines.py, runtimes/adapters/openvino.py, fleet/derived.py: the engine a model
runs on, chosen by measurement, a second runtime family (OpenVINO) with parity
against torch, and its converted graph kept as a checked derived file.

The OpenVINO tests need the optional `openvino` package (the fleet-serve[openvino]
extra) and skip without it, saying so; the rest run everywhere. The suite's
install leaves it out (`scripts/setup.sh --test` puts it in `.venv/openvino`);
the README's test command and CI run this file again with it importable:
`PYTHONPATH=.venv/openvino .venv/bin/python -m pytest -q -ra tests/test_engines.py`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fleet.derived import DERIVED, derived
from fleet.errors import ModelLoadFailed
from fleet.protocol import EmbedRequest
from fleet.runtimes.adapters import engines, openvino
from fleet.runtimes.base import ModelSpec, Profile
from tests.conftest import default_model_dir

needs_openvino = pytest.mark.skipif(not openvino.available(),
                                    reason="openvino is not installed (the fleet-serve[openvino] extra; CI runs these "
                                           "with PYTHONPATH=.venv/openvino)")
TEXTS = ["How do I reset my router password?", "Best hiking trails near Lyon " * 8, "a",
         "¿Dónde está la biblioteca? 東京は日本の首都です。"]


# ---- derived files: made once, re-hashed, made again when they do not check ----------

def test_a_derived_file_is_made_once_checked_by_sha256_and_made_again_when_damaged(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    made = []

    def make(folder: Path) -> None:
        made.append(folder)
        (folder / "graph.bin").write_bytes(b"graph of " + (model / "model.safetensors").read_bytes())

    first = derived(model, "test-kind", {"v": "1"}, make)
    again = derived(model, "test-kind", {"v": "1"}, make)
    assert first == again and len(made) == 1  # kept: not made again
    info = json.loads((first / DERIVED).read_text())
    assert info["files"][0]["path"] == "graph.bin" and len(info["files"][0]["sha256"]) == 64
    assert set(info["sources"]) == {"config.json", "model.safetensors"}
    (first / "graph.bin").write_bytes(b"tampered")  # damaged: its sha256 no longer matches
    derived(model, "test-kind", {"v": "1"}, make)
    assert len(made) == 2 and (first / "graph.bin").read_bytes() == b"graph of weights"
    derived(model, "test-kind", {"v": "2"}, make)  # made by another version of the converter
    assert len(made) == 3
    (model / "model.safetensors").write_bytes(b"new weights")  # the model's files changed
    derived(model, "test-kind", {"v": "2"}, make)
    assert len(made) == 4 and (first / "graph.bin").read_bytes() == b"graph of new weights"


# ---- candidates and the choice (no OpenVINO needed) -----------------------------------

def test_a_profile_forces_an_engine_and_a_dtype():
    assert engines.candidates("cpu", "torch", "float32") == [engines.Candidate("torch", "float32")]
    assert all(c.engine == "torch" for c in engines.candidates("cpu", "torch", "auto"))
    with pytest.raises(ModelLoadFailed, match="unknown engine"):
        engines.candidates("cpu", "tensorrt", "auto")
    with pytest.raises(ModelLoadFailed, match="CPU only"):
        engines.candidates("cuda:0", "openvino", "auto")
    if not openvino.available():
        with pytest.raises(ModelLoadFailed, match="not installed"):
            engines.candidates("cpu", "openvino", "auto")


def test_the_fastest_candidate_that_agrees_serves(tmp_path):
    """A fake forward per candidate on a fake clock: the fastest one is refused by
    the accuracy check, so the next fastest serves; the table says why."""
    fast, faster, slow = (engines.Candidate("openvino", "bfloat16"), engines.Candidate("torch", "bfloat16"),
                          engines.REFERENCE)
    cost = {slow: 3.0, fast: 1.0, faster: 0.5}
    now = [0.0]

    def run(serving):
        now[0] += cost[serving] / 1e3

    served, choice = engines.choose(
        "m", tmp_path, "cpu", [slow, faster, fast], build=lambda c: c,
        outputs=lambda c: np.array([[0.0 if c == faster else 1.0]]),
        agree=lambda ref, got: (bool(np.allclose(ref, got)), "diff"),
        workloads=[engines.Workload("one", 10, run)], threads=2, clock=lambda: now[0])
    assert served == fast and choice.by == "measured"
    assert choice.table["torch bfloat16"].startswith("refused")
    assert choice.ms["one"] == pytest.approx(1.0) and choice.tokens_per_s == pytest.approx(10_000)
    assert choice.info()["engine"] == "openvino"
    # A candidate that cannot be built (a graph the converter cannot trace) is dropped, not the load.

    def build(c):
        if c == fast:
            raise ModelLoadFailed("cannot convert 'm' for openvino")
        return c

    served, choice = engines.choose(
        "m", tmp_path, "cpu", [slow, fast], build=build, outputs=lambda c: np.array([[1.0]]),
        agree=lambda ref, got: (True, "same"), workloads=[engines.Workload("one", 10, run)], threads=2,
        clock=lambda: now[0])
    assert served == slow and choice.table["openvino bfloat16"].startswith("refused: cannot convert")


# ---- OpenVINO behind the embedder's contract: parity with torch ------------------------

def embedder(engine: str, dtype: str):
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    spec = ModelSpec("all-minilm-l6-v2", default_model_dir(), "embed", "sentence-transformers",
                     profile=Profile(dtype=dtype, engine=engine, micro_batch_items=8), max_seq_len=256)
    a = SentenceTransformerEmbedder(spec, "cpu")
    a.load()
    return a


def vectors(a, texts: list[str], **kw) -> np.ndarray:
    out = a.run_batch([EmbedRequest(model="all-minilm-l6-v2", inputs=texts, **kw)])[0]
    return np.frombuffer(out.data, dtype="<f4").reshape(out.shape)


@pytest.fixture(scope="module")
def torch_fp32():
    a = embedder("torch", "float32")
    yield a
    a.unload()


@needs_openvino
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_openvino_embeds_as_torch_does(torch_fp32, dtype):
    if dtype not in openvino.dtypes("cpu"):
        pytest.skip(f"this CPU has no native {dtype} in OpenVINO's CPU plugin")
    a = embedder("openvino", dtype)
    try:
        assert a.choice.candidate == engines.Candidate("openvino", dtype) and a.choice.by == "profile"
        assert a.direct is not None  # the same fast tokenizing path
        texts = TEXTS * 5  # several micro-batches of 8, length-sorted
        ref, got = vectors(torch_fp32, texts), vectors(a, texts)
        cosine = np.sum(ref * got, axis=1)  # unit vectors (normalize defaults to true)
        assert got.shape == ref.shape and float(cosine.min()) >= 0.9999
        raw_ref, raw = vectors(torch_fp32, TEXTS, normalize=False), vectors(a, TEXTS, normalize=False)
        assert np.allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(raw_ref, axis=1), rtol=1e-2)
        assert a.footprint_bytes() > torch_fp32.footprint_bytes()  # the graph's weights are counted
    finally:
        a.unload()


@needs_openvino
def test_on_openvino_micro_batches_hold_rows_in_eighths():
    """OpenVINO builds kernels per input shape (base.ROW_MULTIPLES): on it every
    micro-batch but the shortest holds a multiple of 8 texts; torch cuts freely.
    Lengths of ~3, ~22 and ~122 tokens: unconstrained, 40 / 13 / 7 texts a run."""
    from fleet.runtimes.base import BatchContext
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    texts = ["a"] * 40 + ["word " * 20] * 13 + ["word " * 120] * 7
    runs, answers = {}, {}
    for engine in ("openvino", "torch"):
        spec = ModelSpec("all-minilm-l6-v2", default_model_dir(), "embed", "sentence-transformers",
                         profile=Profile(dtype="float32", engine=engine, micro_batch_items=64), max_seq_len=256)
        a = SentenceTransformerEmbedder(spec, "cpu")
        a.load()
        try:
            assert a.row_multiple == (8 if engine == "openvino" else 1)
            runs[engine] = [len(idx) for idx in a._cut(texts, BatchContext())[0]]
            answers[engine] = vectors(a, texts)
        finally:
            a.unload()
    assert sum(runs["openvino"]) == len(texts) and all(r % 8 == 0 for r in runs["openvino"][1:]), runs
    assert any(r % 8 for r in runs["torch"][1:]), runs
    # The same answers, cut otherwise.
    assert float(np.sum(answers["openvino"] * answers["torch"], axis=1).min()) >= 0.9999


@needs_openvino
def test_auto_measures_every_engine_and_publishes_the_choice():
    from fleet.runtimes.info import engine_info

    a = embedder("auto", "auto")
    try:
        assert a.choice.by in ("measured", "cached")
        labels = set(a.choice.table)
        assert {"torch float32", "openvino float32"} <= labels
        info = engine_info(a)["engine"]
        assert info["engine"] == a.choice.candidate.engine and info["tokens_per_s"] > 0
        assert a.dtype == a.choice.candidate.dtype
        assert vectors(a, TEXTS).shape == (len(TEXTS), 384)
    finally:
        a.unload()


# ---- OpenVINO behind the reranker's and the classifier's contracts -------------------
# Tiny random BERTs (tests.arch_models) with a one-label head (rerank) and a
# three-label head (classify); each served on OpenVINO is compared with the torch
# adapter and with its reference library in-process (sentence-transformers'
# CrossEncoder, transformers' model): scores within 1e-3.

QUERY = "how do cats behave at home"
DOCS = ["Cats sleep for most of the day.", "The stock market closed higher. " * 6, "a",
        "Domestic cats groom themselves and mark territory.", "¿Dónde está la biblioteca? 東京は日本の首都です。"]
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    from tests.arch_models import encoder

    root = tmp_path_factory.mktemp("engine-heads")
    return {"rerank": encoder("bert", "seq", root / "reranker", labels=["relevant"]),
            "classify": encoder("bert", "seq", root / "classifier", labels=LABELS)}


def head_adapter(heads, task: str, runtime: str, engine: str, dtype: str):
    from fleet.runtimes.adapters.classify import SequenceClassifier
    from fleet.runtimes.adapters.rerank import SentenceTransformersReranker, TransformersReranker

    cls = {("rerank", "transformers"): TransformersReranker, ("rerank", "sentence-transformers"):
           SentenceTransformersReranker, ("classify", "transformers"): SequenceClassifier}[task, runtime]
    a = cls(ModelSpec("tiny", heads[task], task, runtime,
                      profile=Profile(engine=engine, dtype=dtype, micro_batch_items=4)), "cpu")
    a.load()
    return a


def rerank_scores(a, raw: bool = False) -> np.ndarray:
    """Scores in document order (the reply is best first)."""
    from fleet.protocol import RerankRequest

    out = a.run_batch([RerankRequest(model="tiny", query=QUERY, documents=DOCS * 3, raw_scores=raw)])[0]
    scores = np.empty(len(DOCS) * 3, dtype=np.float32)
    scores[np.frombuffer(out.index, "<i4")] = np.frombuffer(out.scores, "<f4")
    return scores


def class_scores(a, **kw) -> np.ndarray:
    """(inputs, labels) scores in label order (the reply is best first per row)."""
    from fleet.protocol import ClassifyRequest

    out = a.run_batch([ClassifyRequest(model="tiny", inputs=DOCS * 3, **kw)])[0]
    top = np.frombuffer(out.top, "<i4").reshape(out.shape)
    ranked = np.frombuffer(out.scores, "<f4").reshape(out.shape)
    scores = np.empty_like(ranked)
    np.put_along_axis(scores, top, ranked, axis=1)
    return scores


@needs_openvino
@pytest.mark.parametrize("runtime", ["transformers", "sentence-transformers"])
def test_openvino_reranks_as_torch_and_the_cross_encoder_do(heads, runtime):
    from sentence_transformers import CrossEncoder

    torch_a = head_adapter(heads, "rerank", runtime, "torch", "float32")
    a = head_adapter(heads, "rerank", runtime, "openvino", "float32")
    try:
        assert a.choice.candidate == engines.Candidate("openvino", "float32") and a.choice.by == "profile"
        assert a.direct is not None and a.loras is None  # the same fast tokenizing; no LoRA on a graph
        got, ref = rerank_scores(a), rerank_scores(torch_a)
        library = CrossEncoder(str(heads["rerank"]), device="cpu").predict([(QUERY, d) for d in DOCS * 3])
        assert np.abs(got - ref).max() <= 1e-3 and np.abs(got - library).max() <= 1e-3
        assert np.abs(rerank_scores(a, raw=True) - rerank_scores(torch_a, raw=True)).max() <= 1e-3
        assert a.footprint_bytes() > torch_a.footprint_bytes()  # the graph's weights are counted
    finally:
        a.unload()
        torch_a.unload()


@needs_openvino
def test_openvino_classifies_as_torch_and_transformers_do(heads):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch_a = head_adapter(heads, "classify", "transformers", "torch", "float32")
    a = head_adapter(heads, "classify", "transformers", "openvino", "float32")
    try:
        assert a.choice.candidate == engines.Candidate("openvino", "float32") and a.choice.by == "profile"
        tok = AutoTokenizer.from_pretrained(heads["classify"])
        model = AutoModelForSequenceClassification.from_pretrained(heads["classify"]).eval()
        with torch.inference_mode():
            logits = model(**tok(DOCS * 3, padding=True, return_tensors="pt")).logits.numpy()
        softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        got = class_scores(a)
        assert np.abs(got - class_scores(torch_a)).max() <= 1e-3 and np.abs(got - softmax).max() <= 1e-3
        assert np.abs(class_scores(a, multi_label=True) - 1 / (1 + np.exp(-logits))).max() <= 1e-3
        assert np.abs(class_scores(a, raw_scores=True) - logits).max() <= 1e-3
    finally:
        a.unload()
        torch_a.unload()


@needs_openvino
@pytest.mark.parametrize("task", ["rerank", "classify"])
def test_openvino_bf16_serves_when_forced(heads, task):
    """bf16 (8-bit mantissa) on random weights: close, not within 1e-3; a forced
    engine and dtype are obeyed unchecked, as a forced dtype always was."""
    if "bfloat16" not in openvino.dtypes("cpu"):
        pytest.skip("this CPU has no native bfloat16 in OpenVINO's CPU plugin")
    torch_a = head_adapter(heads, task, "transformers", "torch", "float32")
    a = head_adapter(heads, task, "transformers", "openvino", "bfloat16")
    try:
        assert a.choice.candidate == engines.Candidate("openvino", "bfloat16") and a.dtype == "bfloat16"
        scores = rerank_scores if task == "rerank" else class_scores
        assert np.abs(scores(a) - scores(torch_a)).max() <= 0.05
    finally:
        a.unload()
        torch_a.unload()


@needs_openvino
@pytest.mark.parametrize("task", ["rerank", "classify"])
def test_auto_weighs_both_engines_and_goes_back_to_torch_for_a_lora(heads, task, monkeypatch):
    """`auto` times torch and OpenVINO (here OpenVINO is made the fastest: the
    timing is the box's, the choice's rule is under test) and serves it; a LoRA
    adapter then takes the model back to torch fp32, which scores as before, its
    forward traced as at a torch load (kept whatever it measured: MIN_SPEEDUP 0)."""
    from fleet.runtimes.adapters import traced
    from fleet.runtimes.info import engine_info

    openvino_timed_fastest(monkeypatch)
    monkeypatch.setattr(traced, "MIN_SPEEDUP", 0.0)
    a = head_adapter(heads, task, "transformers", "auto", "float32")
    scores = rerank_scores if task == "rerank" else class_scores
    try:
        assert a.choice.by == "measured" and a.choice.candidate == engines.Candidate("openvino", "float32")
        assert {"torch float32", "openvino float32"} <= set(a.choice.table)
        assert engine_info(a)["engine"]["engine"] == "openvino" and a.loras is None and a.compiled is None
        before = scores(a)
        assert a.lora_bank() is not None  # what `attach_lora` asks for a first adapter
        assert a.choice.by == "lora" and a.engine == "torch" and openvino.weight_bytes(a.model) == 0
        assert a.compiled is not None and engine_info(a)["forward"]["traced"] is True, a.traced_why
        assert np.abs(scores(a) - before).max() <= 1e-3
    finally:
        a.unload()


def openvino_timed_fastest(monkeypatch) -> None:
    """The candidates are timed as usual, then OpenVINO is made the fastest (the
    box's timing is not under test; the choice's rule and what follows are)."""
    real = engines.time_all

    def openvino_fastest(alive, workloads, clock, **rounds):
        medians = real(alive, workloads, clock, **rounds)
        if not all(isinstance(c, engines.Candidate) for c in medians):  # a trace against eager (runtimes/adapters/traced.py)
            return medians
        return {c: {w: (1.0 if c.engine == "openvino" else 9.0) for w in m} for c, m in medians.items()}

    monkeypatch.setattr(engines, "time_all", openvino_fastest)


@needs_openvino
def test_an_embedder_on_openvino_goes_back_to_torch_for_a_lora(tmp_path, monkeypatch):
    from fleet.runtimes.adapters import traced
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder
    from tests.arch_models import sentence_transformer

    openvino_timed_fastest(monkeypatch)
    monkeypatch.setattr(traced, "MIN_SPEEDUP", 0.0)  # the trace kept whatever it measured
    folder = sentence_transformer("bert", "mean", tmp_path / "st")
    a = SentenceTransformerEmbedder(ModelSpec("tiny", folder, "embed", "sentence-transformers",
                                              profile=Profile(dtype="float32", micro_batch_items=4)), "cpu")
    a.load()
    try:
        assert a.choice.candidate == engines.Candidate("openvino", "float32") and a.loras is None
        before = vectors(a, TEXTS)
        assert a.lora_bank() is not None and a.choice.by == "lora" and a.engine == "torch"
        assert openvino.weight_bytes(a._modules) == 0 and a.threads is not None  # torch's modules serve again
        assert a.compiled is not None, a.traced_why  # traced, as at a torch load
        assert float(np.sum(vectors(a, TEXTS) * before, axis=1).min()) >= 0.9999
    finally:
        a.unload()


@needs_openvino
def test_a_profile_that_forces_openvino_refuses_a_lora(heads):
    a = head_adapter(heads, "classify", "transformers", "openvino", "float32")
    try:
        spec = ModelSpec("tiny-lora", heads["classify"], "classify", "peft", extra={"base": "tiny"})
        with pytest.raises(ModelLoadFailed, match="does not take LoRA"):
            a.attach_lora(spec)
        assert a.engine == "openvino"
    finally:
        a.unload()


# ---- through fleet: real daemon, real worker, `fleetctl ps` shows the engine ---------

@needs_openvino
@pytest.mark.slow
def test_the_worker_serves_the_engine_chosen_and_ps_shows_it(heads, tmp_path):
    """A reranker forced to OpenVINO, a classifier forced to torch and one left to
    `auto`, pulled into a store and served by a real worker: answers match the
    reference libraries, `fleetctl ps` names each engine and how it was chosen,
    and the converted graph sits in the store with its sha256. A reranker whose
    device-class profile `fleetctl tune --write` stored (engine named with its
    dtype) is served by exactly that engine, and what tune reads of a load's
    choice (the ps record, the verdict's table in the log) reads right."""
    import os
    import subprocess
    import sys

    import httpx
    from sentence_transformers import CrossEncoder
    from tests.conftest import start_daemon

    home = tmp_path / "home"
    home.mkdir()
    models = {"tiny-rr": ("rerank", 'engine = "openvino"\ndtype = "float32"'),
              "tiny-cls": ("classify", 'engine = "torch"\ndtype = "float32"'),
              "tiny-cls-auto": ("classify", 'engine = "auto"'),
              "tiny-rr-tuned": ("rerank", 'engine = "auto"')}
    (home / "models.toml").write_text("\n".join(
        f'[models."{n}"]\nsource = "path:{heads[task].resolve()}"\ntask = "{task}"\nruntime = "transformers"\n'
        f'[models."{n}".profile]\n{profile}\n' for n, (task, profile) in models.items()))
    from fleet.catalog import Profile as CatalogProfile
    from fleet.catalog import TunedInfo, write_tuned_profile
    from fleet.runtimes.device import device_class

    klass = device_class("cpu")
    write_tuned_profile(home, "tiny-rr-tuned", klass, CatalogProfile(engine="openvino", dtype="float32"),
                        TunedInfo(tuned_at="x", knee_tokens_per_s=1.0, knee_p95_ms=1.0,
                                  engine_choice="openvino float32"))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}

    def fleetctl(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        return done.stdout

    for name in models:
        fleetctl("pull", name)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    try:
        body = {"model": "tiny-rr", "query": QUERY, "documents": DOCS}
        reply = httpx.post(d.url + "/v1/rerank", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        got = {r["index"]: r["score"] for r in reply.json()["results"]}
        want = CrossEncoder(str(heads["rerank"]), device="cpu").predict([(QUERY, doc) for doc in DOCS])
        assert np.abs(np.array([got[i] for i in range(len(DOCS))]) - want).max() <= 1e-3
        tuned = httpx.post(d.url + "/v1/rerank", json={**body, "model": "tiny-rr-tuned"}, timeout=120)
        assert tuned.status_code == 200, tuned.text
        for name in ("tiny-cls", "tiny-cls-auto"):
            reply = httpx.post(d.url + "/v1/classify", json={"model": name, "inputs": DOCS}, timeout=120)
            assert reply.status_code == 200, reply.text
            assert all(sorted(x["label"] for x in row) == sorted(LABELS) for row in reply.json()["results"])
        env["FLEET_URL"] = d.url
        served = {name: m for w in json.loads(fleetctl("ps", "--json"))["workers"] for name, m in w["models"].items()}
        assert served["tiny-rr"]["engine"]["engine"] == "openvino" and served["tiny-rr"]["engine"]["by"] == "profile"
        assert served["tiny-cls"]["engine"]["engine"] == "torch" and served["tiny-cls"]["engine"]["by"] == "profile"
        auto = served["tiny-cls-auto"]["engine"]
        assert auto["by"] == "measured" and auto["engine"] in engines.ENGINES and auto["tokens_per_s"] > 0
        text = fleetctl("ps")
        assert "openvino (profile" in text and "torch (profile" in text and f"{auto['engine']} (measured" in text
        # What `fleetctl tune` reads of a load's engine choice: the ps record, the verdict's table in the log.
        from fleet.bench.tune_measure import engine_tables, served_engine

        assert served_engine(served["tiny-rr"]) == {"engine": "openvino", "dtype": "float32", "by": "profile",
                                                    "tokens_per_s": 0.0}
        got = served_engine(served["tiny-cls-auto"])
        assert (got["engine"], got["dtype"], got["by"]) == \
            (auto["engine"], served["tiny-cls-auto"]["dtype"], "measured")
        table = engine_tables(d.log(), "tiny-cls-auto")
        assert f"{got['engine']} {got['dtype']}" in table and "torch float32" in table, table
        assert engine_tables(d.log(), "tiny-rr") == {}  # forced: nothing weighed
        assert served["tiny-rr-tuned"]["profile"] == klass
        assert served_engine(served["tiny-rr-tuned"]) == {"engine": "openvino", "dtype": "float32", "by": "profile",
                                                          "tokens_per_s": 0.0}
    finally:
        d.stop()
    graphs = [p.parent for p in home.rglob(DERIVED) if p.parent.name == "openvino-cross-encoder-logits"]
    assert graphs, "the converted graph is kept in the store"
    files = json.loads((graphs[0] / DERIVED).read_text())["files"]
    assert {"model.xml", "model.bin"} <= {f["path"] for f in files} and all(len(f["sha256"]) == 64 for f in files)


@pytest.mark.parametrize(("flags", "want"), [
    ({"avx2", "avx512f"}, []),  # bf16 emulated: slower than fp32, never a candidate
    ({"avx512f", "avx512_bf16"}, ["bfloat16"]),
    ({"amx_bf16", "amx_tile"}, ["bfloat16"]),
    (set(), []),
])
def test_a_cpu_offers_bf16_only_with_native_bf16(flags, want):
    from fleet.bench.st_local import best_dtype
    from fleet.runtimes.device import cpu_fast_dtypes

    assert cpu_fast_dtypes(flags) == want
    assert best_dtype(flags) == ("bf16" if want else "fp32")  # the bench's "best" follows the same rule
