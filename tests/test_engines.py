"""runtimes/engines.py, runtimes/openvino.py, fleet/derived.py: the engine a model
runs on, chosen by measurement, a second runtime family (OpenVINO) with parity
against torch, and its converted graph kept as a checked derived file.

The OpenVINO tests need the optional `openvino` package (the fleet[openvino]
extra) and skip without it, saying so; the rest run everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fleet.derived import DERIVED, derived
from fleet.errors import ModelLoadFailed
from fleet.protocol import EmbedRequest
from runtimes import engines, openvino
from runtimes.base import ModelSpec, Profile
from tests.conftest import default_model_dir

needs_openvino = pytest.mark.skipif(not openvino.available(),
                                    reason="openvino is not installed (pip install openvino: the fleet[openvino] extra)")
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


# ---- OpenVINO behind the embedder's contract: parity with torch ------------------------

def embedder(engine: str, dtype: str):
    from runtimes.sentence_transformer import SentenceTransformerEmbedder

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
def test_auto_measures_every_engine_and_publishes_the_choice():
    from runtimes.info import engine_info

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
