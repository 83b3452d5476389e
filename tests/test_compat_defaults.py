"""The model a request runs on when it names none: a table of cases for the
pure rule, and the setting as config.toml and FLEET_DEFAULT_MODELS spell it."""

from __future__ import annotations

import pytest

from fleet.daemon.defaults import choose_default_model
from fleet.config import load_settings
from fleet.errors import BadRequest

STORED = [("minilm", "embed"), ("bge-small", "embed"), ("ms-marco", "rerank"), ("sst2", "classify")]


@pytest.mark.parametrize("task,configured,stored,want", [
    ("rerank", {}, STORED, "ms-marco"),                        # the only one of its task
    ("embed", {"embed": "bge-small"}, STORED, "bge-small"),    # configured wins over several
    ("rerank", {"rerank": "other"}, STORED, "other"),          # configured even if not stored: submit says 404
    ("classify", {"embed": "bge-small"}, STORED, "sst2"),      # another task's default does not matter
])
def test_choose_default_model(task, configured, stored, want):
    assert choose_default_model(task, configured, stored) == want


@pytest.mark.parametrize("task,stored,words", [
    ("embed", STORED, ["2 embed models", "bge-small, minilm", "default_models.embed"]),
    ("extract", STORED, ["no extract model is stored", "fleetctl pull"]),
])
def test_choose_default_model_refuses_with_the_candidates(task, stored, words):
    with pytest.raises(BadRequest) as err:
        choose_default_model(task, {}, stored)
    assert all(w in err.value.message for w in words) and err.value.param == "model"


def test_default_models_from_config_toml_and_env(tmp_path, monkeypatch):
    (tmp_path / "config.toml").write_text('[default_models]\nembed = "bge-small"\nrerank = "ms-marco"\n')
    assert load_settings(home=str(tmp_path)).default_models == {"embed": "bge-small", "rerank": "ms-marco"}
    monkeypatch.setenv("FLEET_DEFAULT_MODELS", "embed = minilm, classify=sst2")
    assert load_settings(home=str(tmp_path)).default_models == {"embed": "minilm", "classify": "sst2"}


def test_the_stored_listing_is_read_again_after_a_pull_and_an_rm(tmp_path):
    from fleet.daemon.defaults import stored_tasks
    from fleet.pull import pull_model
    from fleet.store import Store
    from tests.conftest import default_model_dir

    store = Store(tmp_path / "models")
    assert stored_tasks(store) == []
    pull_model(store, f"path:{default_model_dir()}", name="one")
    assert stored_tasks(store) == [("one", "embed")]
    assert stored_tasks(store) is stored_tasks(store)  # unchanged store: the cached listing
    pull_model(store, f"path:{default_model_dir()}", name="two")
    assert stored_tasks(store) == [("one", "embed"), ("two", "embed")]
    store.remove("one")
    assert stored_tasks(store) == [("two", "embed")]
