"""Zero-shot extraction (runtime `gliner`): fleet's own GLiNER span model against
the real `gliner` package.

The reference runs in its own venv (scripts/setup_gliner_ref.sh: gliner 0.2.29
with the transformers < 5.17 it pins; fleet runs a newer one) as a subprocess,
tests/gliner_reference.py. That venv also builds the models: tiny random GLiNERs
in the library's own layout (GLiNER's config, random init, `save_pretrained`:
gliner_config.json, pytorch_model.bin, the tokenizer with <<ENT>>/<<SEP>>), one
on a DeBERTa-v3-style backbone with a sentencepiece vocabulary, one on a BERT
backbone with a WordPiece vocabulary. fleet pulls them (pickle weights: the
entries allow it) and serves them over HTTP; every answer must equal the
package's `predict_entities` on the same folder: same spans, labels and
character offsets, scores within 1e-4.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import default_model_dir, start_daemon

ROOT = Path(__file__).resolve().parent.parent
REF_VENV = Path(os.environ.get("FLEET_GLINER_REF_VENV", ROOT / "bench" / ".venv-gliner"))
REF_SCRIPT = Path(__file__).with_name("gliner_reference.py")
#: Scores may differ this much from the package's (float32 sums in another order).
SCORE_TOL = 1e-4

TEXTS = [
    "Angela Merkel flew from Berlin to Paris on Tuesday.",
    "José Núñez moved to São Paulo in 2019, then to New-York_City!",
    "nothing here",
    "Ada",
    "",
    "   ",
    "Dr. Ng (CEO of Acme-Corp) met the U.N. envoy in Zürich at 9:30am on 3 March.",
    # More words than the models' max_len (24): the rest is cut, as the library cuts it.
    "The central bank raised interest rates by 25 basis points to curb persistent inflation, citing strong "
    "labour markets and rising services prices across the euro area and beyond it.",
]
LABELS = ["person", "city", "date"]
OTHER_LABELS = ["organization", "date of birth"]


def ref_python() -> Path:
    """The reference venv's python, built on first use; skip (saying why) if it cannot be built."""
    python = REF_VENV / "bin" / "python"
    if python.is_file():
        return python
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_gliner_ref.sh"), str(REF_VENV)],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0 or not python.is_file():
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"the gliner reference venv could not be built (scripts/setup_gliner_ref.sh, "
                    f"needs PyPI): {why[0]}")
    return python


def reference(python: Path, folder: Path, texts: list[str], labels: list[str], threshold: float) -> list[list[dict]]:
    done = subprocess.run([str(python), str(REF_SCRIPT), "predict", str(folder)], capture_output=True, text=True,
                          input=json.dumps({"texts": texts, "labels": labels, "threshold": threshold}),
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def ref() -> Path:
    return ref_python()


@pytest.fixture(scope="module")
def folders(ref: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> a GLiNER folder built by the reference venv."""
    base = tmp_path_factory.mktemp("gliner")
    builds = {
        "deberta": ["--backbone", "deberta", "--corpus", str(ROOT / "bench" / "corpus.txt")],
        "bert": ["--backbone", "bert", "--tokenizer", str(default_model_dir())],
    }
    out = {}
    for kind, extra in builds.items():
        folder = base / kind
        done = subprocess.run([str(ref), str(REF_SCRIPT), "build", str(folder), *extra], capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        out[kind] = folder
        out[f"hub-{kind}"] = hub_layout(folder, base / f"hub-{kind}")
    return out


#: A tokenizer's files, as GLiNER.save_pretrained writes them beside the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spm.model", "vocab.txt")


def hub_layout(folder: Path, out: Path) -> Path:
    """The same checkpoint as the hub holds GLiNER v2.x ones: gliner_config.json without
    encoder_config, class_token_index and vocab_size, and no tokenizer; `model_name`
    names the backbone (here its local folder, which GLiNER takes as it takes a repo id)."""
    import shutil

    shutil.copytree(folder, out)
    config = json.loads((out / "gliner_config.json").read_text())
    for key in ("encoder_config", "class_token_index", "vocab_size"):
        config.pop(key, None)
    (out / "gliner_config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    return out


#: fleet name -> (folder kind, threshold in its entry; None = the default 0.5).
MODELS = {"gliner-deberta": ("deberta", None), "gliner-deberta-low": ("deberta", 0.1), "gliner-bert": ("bert", None),
          "gliner-hub-deberta": ("hub-deberta", None), "gliner-hub-bert": ("hub-bert", None)}


@pytest.fixture(scope="module")
def fleet(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("fleet-gliner")
    entries = []
    for name, (kind, threshold) in MODELS.items():
        entries.append(f'[models."{name}"]\nsource = "path:{folders[kind].resolve()}"\ntask = "extract"\n'
                       f'runtime = "gliner"\nallow_pickle = true\n'
                       + (f"threshold = {threshold}\n" if threshold is not None else "")
                       + f'[models."{name}".profile]\ndtype = "float32"\n')
    (home / "models.toml").write_text("\n".join(entries))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name in MODELS:
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join(MODELS)})
    yield d
    d.stop()


def extract(d, model: str, texts: list[str], labels: list[str] | None, **extra) -> httpx.Response:
    body = {"model": model, "inputs": texts, **({"labels": labels} if labels is not None else {}), **extra}
    return httpx.post(d.url + "/v1/extract", json=body, timeout=120)


def assert_same(got: list[list[dict]], want: list[list[dict]]) -> float:
    """Spans, labels, offsets and texts equal; scores within SCORE_TOL. Returns the largest score difference."""
    assert [[(e["start"], e["end"], e["entity"], e["text"]) for e in row] for row in got] == \
        [[(d["start"], d["end"], d["label"], d["text"]) for d in row] for row in want]
    diffs = [abs(e["score"] - d["score"]) for g, w in zip(got, want) for e, d in zip(g, w)]
    assert max(diffs, default=0.0) <= SCORE_TOL
    return max(diffs, default=0.0)


@pytest.mark.parametrize("name", list(MODELS))
def test_answers_equal_the_gliner_package(fleet, ref, folders, name):
    kind, threshold = MODELS[name]
    for labels in (LABELS, OTHER_LABELS):
        resp = extract(fleet, name, TEXTS, labels)
        assert resp.status_code == 200, resp.text
        reply = resp.json()
        want = reference(ref, folders[kind], TEXTS, labels, 0.5 if threshold is None else threshold)
        assert sum(map(len, want)) > 0, "the reference found nothing: the comparison would be empty"
        diff = assert_same(reply["results"], want)
        print(f"{name} {labels}: {sum(map(len, want))} spans, largest score difference {diff:.2e}")
    # Words read: GLiNER's whitespace splitter's words, at most max_len (24) per text.
    assert reply["usage"]["input_tokens"] == sum(min(len(re.findall(r"\w+(?:[-_]\w+)*|\S", t)), 24)
                                                 for t in TEXTS)


def test_a_low_threshold_keeps_more_spans_greedily(fleet, ref, folders):
    """The entry's threshold applies, and flat decoding keeps no two overlapping spans."""
    default = extract(fleet, "gliner-deberta", TEXTS, LABELS).json()["results"]
    low = extract(fleet, "gliner-deberta-low", TEXTS, LABELS).json()["results"]
    assert sum(map(len, low)) > sum(map(len, default))
    for row in low:
        assert all(a["end"] <= b["start"] for a, b in zip(row, row[1:]))
        assert all(e["score"] > 0.1 for e in row)


def test_concurrent_requests_with_other_labels_each_get_their_own(fleet, ref, folders):
    """Requests that share a worker batch but not a label list never share a forward pass."""
    jobs = [(TEXTS[k % len(TEXTS)], LABELS if k % 2 else OTHER_LABELS) for k in range(16)]
    want = {tuple(labels): reference(ref, folders["deberta"], TEXTS, labels, 0.1)
            for labels in (LABELS, OTHER_LABELS)}

    def one(k: int) -> tuple[int, httpx.Response]:
        text, labels = jobs[k]
        return k, extract(fleet, "gliner-deberta-low", [text], labels)

    with ThreadPoolExecutor(8) as pool:
        for k, resp in pool.map(one, range(len(jobs))):
            assert resp.status_code == 200, resp.text
            text, labels = jobs[k]
            assert_same(resp.json()["results"], [want[tuple(labels)][TEXTS.index(text)]])


@pytest.mark.parametrize("labels, truncate, status, needle", [
    (None, True, 400, "labels"),
    ([], True, 400, "labels"),
    (["person", "person"], True, 400, "duplicates"),
    (["  "], True, 400, "characters"),
    ([f"t{i}" for i in range(65)], True, 400, "limit"),
    (["person"], False, 422, "24 words"),
])
def test_bad_requests_are_refused_alone(fleet, labels, truncate, status, needle):
    long = " ".join(["word"] * 30)
    resp = extract(fleet, "gliner-bert", [long], labels, truncate=truncate)
    assert resp.status_code == status and needle in resp.json()["error"]["message"], resp.text
    assert extract(fleet, "gliner-bert", ["Ada"], ["person"]).status_code == 200


def test_a_hub_checkpoint_gets_its_backbone_at_pull(fleet, folders):
    """The backbone's config and tokenizer are fetched at pull into backbone/ and hashed
    with the model's files; the model then loads from its folder alone (the answers of
    gliner-hub-* above equal the package's, which fetches them at every load)."""
    from fleet.store import Store

    for kind in ("deberta", "bert"):
        manifest = Store(fleet.home / "models").get(f"gliner-hub-{kind}")
        fetched = {f.path for f in manifest.files if f.path.startswith("backbone/")}
        assert "backbone/config.json" in fetched
        assert fetched & {"backbone/tokenizer.json", "backbone/spm.model", "backbone/vocab.txt"}
        assert not any(f.path in TOKENIZER_FILES for f in manifest.files)  # the source had none
        backbone = Path(json.loads((folders[f"hub-{kind}"] / "gliner_config.json").read_text())["model_name"])
        for rel in fetched:
            assert (fleet.home / "models" / manifest.name / rel).read_bytes() == (backbone / rel[9:]).read_bytes()


def test_a_hub_checkpoint_whose_backbone_cannot_be_fetched_is_refused_at_pull(folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["hub-bert"], tmp_path / "lost")
    config = json.loads((folder / "gliner_config.json").read_text())
    config["model_name"] = str(tmp_path / "no-such-backbone")
    (folder / "gliner_config.json").write_text(json.dumps(config))
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models.toml").write_text(
        f'[models.lost]\nsource = "path:{folder}"\ntask = "extract"\nruntime = "gliner"\nallow_pickle = true\n')
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", "lost"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "backbone" in done.stderr and "no-such-backbone" in done.stderr, done.stderr


def test_a_gliner_folder_is_detected_and_its_pickle_needs_consent(folders, tmp_path):
    from fleet.pull_meta import Kind, detect_kind

    assert detect_kind(folders["deberta"]) == Kind("extract", "gliner")
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folders['bert']}", "--name", "g"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "pickle" in done.stderr
