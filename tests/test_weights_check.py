"""Weights that do not fit their architecture are refused, never served (issue 42, item 3).

A folder with MiniLM's config.json and a model.safetensors holding one tensor `foo`
used to pull, load (transformers initialised every parameter at random and only
warned), answer 200 with noise, and measure 1.74 GB against an estimate of 4 bytes:
that ratio then sized every other model of its runtime 4e8 times too large (507 for
each) until a restart. Now the pull asks transformers, from the safetensors headers
on the meta device (fleet.weights), what a load would leave at random, and refuses;
a worker asks again before every load, so a model stored before the check is
refused there; and no measurement scales another model's estimate past
RATIO_BOUNDS (tests/test_memory_policy.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.errors import BadRequest
from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir, free_port, start_daemon

FOO = "foo-weights"
TWIN = "minilm-twin"
#: The foo folder as an operator's catalog entry (FLEET_HOME/models.toml): what /api/pull takes.
LISTED_FOO = "foo-listed"


def minilm_with(folder: Path, tensors: dict) -> Path:
    """MiniLM's folder (config.json, tokenizer, sentence-transformers modules) with other weights."""
    from safetensors.torch import save_file

    shutil.copytree(default_model_dir(), folder)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def minilm_tensors() -> dict:
    from safetensors.torch import load_file

    return load_file(str(default_model_dir() / "model.safetensors"))


def foo_folder(folder: Path) -> Path:
    """The issue's folder: a transformers config and one tensor named foo."""
    import torch

    return minilm_with(folder, {"foo": torch.zeros(1)})


def test_the_issue_folder_is_refused_at_pull_naming_what_is_missing(tmp_path: Path):
    store = Store(tmp_path / "home" / "models")
    with pytest.raises(BadRequest) as caught:
        pull_model(store, f"path:{foo_folder(tmp_path / 'foo')}", name=FOO)
    message = caught.value.message
    assert message.startswith(f"cannot pull {FOO}: its weights do not match its architecture (BertModel")
    assert "101 parameters missing (embeddings.LayerNorm.bias, " in message and "and 98 more" in message
    assert "initialise at random" in message and "1 tensors the architecture does not have (foo)" in message
    assert str(tmp_path) not in message  # names the model, never a path
    assert not store.exists(FOO) and store.names() == []


@pytest.mark.parametrize(("case", "task", "runtime", "why"), [
    # An embedder without its pooler (sentence-transformers and TEI folders often lack
    # it): embedders pool token states themselves, the pooler is never read.
    ("no pooler", None, None, None),
    # The same weights as a BERT cross-encoder: its classifier reads the pooler, and
    # the classifier itself is missing.
    ("no pooler", "rerank", "transformers", "4 parameters missing (bert.pooler.dense.bias, bert.pooler.dense.weight, "
                                            "classifier.bias and 1 more)"),
    # Saved under the architecture's prefix (a BertFor... checkpoint): transformers strips it.
    ("bert. prefix", None, None, None),
    ("shape", None, None, "1 of another shape (encoder.layer.0.intermediate.dense.weight [10, 384] where the "
                          "architecture has [1536, 384])"),
])
def test_what_transformers_tolerates_pulls_and_what_it_would_randomise_does_not(
        tmp_path: Path, case: str, task: str | None, runtime: str | None, why: str | None):
    import torch

    tensors = minilm_tensors()
    if case == "no pooler":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("pooler.")}
    elif case == "bert. prefix":
        tensors = {f"bert.{k}": v for k, v in tensors.items()}
    else:
        tensors["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(10, 384)
    folder = minilm_with(tmp_path / "m", tensors)
    if task is not None:
        (folder / "modules.json").unlink()
    store = Store(tmp_path / "home" / "models")
    if why is None:
        result = pull_model(store, f"path:{folder}", name="m", task=task, runtime=runtime)
        assert result.status == "pulled" and store.exists("m")
        return
    with pytest.raises(BadRequest, match="its weights do not match its architecture") as caught:
        pull_model(store, f"path:{folder}", name="m", task=task, runtime=runtime)
    assert why in caught.value.message
    assert not store.exists("m")


def test_an_index_naming_a_shard_that_is_not_there_is_refused(tmp_path: Path):
    folder = minilm_with(tmp_path / "m", minilm_tensors())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(BadRequest, match="its weights cannot be read: model-00002-of-00002.safetensors"):
        pull_model(Store(tmp_path / "home" / "models"), f"path:{folder}", name="m")


def test_fleetctl_pull_refuses_it_in_one_line_and_exit_1(tmp_path: Path):
    """The CLI never imports torch itself: the check runs in a child process."""
    home = tmp_path / "home"
    # No daemon (a port nothing listens on), so the CLI pulls itself: an unreachable
    # FLEET_URL would be an error the user named (fleetctl.owner).
    env = {k: v for k, v in os.environ.items() if k != "FLEET_URL"} | {"FLEET_HOME": str(home),
                                                                       "FLEET_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{foo_folder(tmp_path / 'foo')}",
                          "--name", FOO], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stderr
    assert "its weights do not match its architecture" in out.stderr and "(foo)" in out.stderr
    assert "Traceback" not in out.stderr
    assert not Store(home / "models").exists(FOO)


# ---- a store from before the check: the worker refuses the load ----------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    root = tmp_path_factory.mktemp("weights")
    home = root / "home"
    store = Store(home / "models")
    pull_model(store, DEFAULT_MODEL)
    # Stored as a pull before this check stored it (the check is what is under test).
    foo = foo_folder(root / "foo")
    pull_model(store, f"path:{foo}", name=FOO, weights_check=False)
    pull_model(store, f"path:{default_model_dir()}", name=TWIN)
    (home / "models.toml").write_text(f'[models."{LISTED_FOO}"]\nsource = "path:{foo}"\ntask = "embed"\n'
                                      'runtime = "sentence-transformers"\n')
    d = start_daemon(home, args=["--workers", "1"])
    yield d
    d.stop()


def embed(d: DaemonProc, model: str) -> httpx.Response:
    return httpx.post(d.url + "/v1/embed", json={"model": model, "inputs": ["hello world"]}, timeout=120)


def test_a_stored_model_with_mismatched_weights_is_refused_at_load_and_sizes_nothing(served: DaemonProc):
    r = embed(served, FOO)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "model_load_failed"
    assert f"cannot load '{FOO}': its weights do not match its architecture" in error["message"]
    assert "101 parameters missing" in error["message"] and "(foo)" in error["message"]
    # Another model of the same runtime, not yet resident, loads and answers: nothing
    # measured from the refused one scaled its estimate.
    twin = embed(served, TWIN)
    assert twin.status_code == 200, twin.text
    assert embed(served, DEFAULT_MODEL).json()["embeddings"] == twin.json()["embeddings"]
    ps = httpx.get(served.url + "/v1/ps", timeout=30).json()
    resident = {m for w in ps["workers"] for m in w.get("models", {})}
    assert TWIN in resident and FOO not in resident


def test_a_pull_through_the_api_is_refused_400_and_the_daemon_keeps_serving(served: DaemonProc):
    """The API process never maps torch: its pull checks in a child process."""
    r = httpx.post(served.url + "/api/pull", json={"model": LISTED_FOO, "stream": False}, headers=served.admin,
                   timeout=300)
    assert r.status_code == 400, r.text
    assert f"cannot pull {LISTED_FOO}: its weights do not match its architecture" in r.json()["error"]
    assert "(foo)" in r.json()["error"]
    assert not Store(served.home / "models").exists(LISTED_FOO)
    tags = httpx.get(served.url + "/api/tags", timeout=30).json()["models"]
    assert tags and not any(m["name"].startswith(LISTED_FOO) for m in tags)
    assert embed(served, DEFAULT_MODEL).status_code == 200


def test_a_verdict_is_kept_by_what_the_check_reads_and_a_change_is_checked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The check's verdict is kept under a digest of what it reads (config.json, the
    safetensors headers, the class, the versions): the same weights again, in any
    folder, are not built again; another shape or config is; a damaged kept file is
    checked again and replaced."""
    import torch

    from fleet import weights

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ("embed", "sentence-transformers")
    good = minilm_with(tmp_path / "good", minilm_tensors())
    first = weights.check_weights(good, *args)
    assert first.model_class == "BertModel" and not first.missing and not first.skipped
    key = weights.verdict_key(good, *args)
    kept = tmp_path / "cache" / "fleet" / "weights" / f"{key}.json"
    assert kept.is_file()
    copy = Path(shutil.copytree(good, tmp_path / "copy"))
    with monkeypatch.context() as m:
        def no_check(*_a, **_k):
            raise AssertionError("the weights were checked again")

        m.setattr(weights, "weights_report", no_check)
        m.setattr(weights, "report_in_child", no_check)
        assert weights.check_weights(copy, *args) == first  # another folder, the same files
    shape = minilm_with(tmp_path / "shape", {**minilm_tensors(),
                                             "encoder.layer.0.intermediate.dense.weight": torch.zeros(10, 384)})
    assert weights.verdict_key(shape, *args) != key
    assert weights.refusal(weights.check_weights(shape, *args), *args) is not None  # checked, refused
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    assert weights.verdict_key(copy, *args) != key
    assert "encoder.layer.6" in " ".join(weights.check_weights(copy, *args).missing)
    kept.write_text("{damaged")
    assert weights.check_weights(good, *args) == first
    assert json.loads(kept.read_text())["model_class"] == "BertModel"
