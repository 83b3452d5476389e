"""Tiny classifiers for the alias, promotion and quota tests, and one daemon serving them.

Every version is the same tiny random BERT classifier (tests/arch_models.encoder) with
its own label names, so a reply tells which version computed it: `tone-v1` answers
`one-neg`/`one-pos`, `tone-v2` `two-neg`/`two-pos`. `tone-worse` is tone-v1 with its two
labels swapped: on an evaluation labelled by tone-v1 it is wrong wherever tone-v1 is
right (a regression by construction), and `tone-same` is a copy of tone-v1 (the same
numbers: a promotion that must pass). They are stored in-process (fleet.pull), weights
checked, before the daemon starts.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.bench.daemon import LocalDaemon
from fleet.store import Store

LABELS = {"tone-v1": ["one-neg", "one-pos"], "tone-v2": ["two-neg", "two-pos"],
          "tone-worse": ["one-pos", "one-neg"]}
#: Texts whose tone-v1 labels are not all alike (checked where a test needs it).
TEXTS = ["a calm reply", "THIS IS UNACCEPTABLE!!!", "thanks, that worked", "why is it broken again",
         "fine", "we will look into it today", "no", "great job everyone"]


def build_versions(root: Path, store: Store) -> None:
    """tone-v1 built once; the others are its folder with their own label names written
    into config.json (the same weights, so the same choices under other names)."""
    from fleet.pull import pull_model
    from tests.arch_models import encoder

    first = encoder("bert", "seq", root / "tone-v1", labels=LABELS["tone-v1"])
    for name, labels in LABELS.items():
        folder = root / name
        if folder != first:
            shutil.copytree(first, folder)
            config = json.loads((folder / "config.json").read_text())
            config["id2label"] = dict(enumerate(labels))
            config["label2id"] = {label: i for i, label in enumerate(labels)}
            (folder / "config.json").write_text(json.dumps(config))
        pull_model(store, f"path:{folder}", name=name, task="classify")
    store.clone(store.get("tone-v1"), "tone-same")


def version_of_labels(labels: set[str]) -> str:
    """The version whose label names these are (one version's only, or the test fails)."""
    owners = {name for name, names in LABELS.items() if labels <= set(names) and name != "tone-worse"}
    assert len(owners) == 1, labels
    return owners.pop()


@pytest.fixture(scope="session")  # registered in tests/conftest.py: one daemon for every module
def tone_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    """A daemon at the shipped settings storing the tone versions (and the default MiniLM)."""
    from tests.conftest import start_daemon

    root = tmp_path_factory.mktemp("tone")
    build_versions(root, Store(root / "home" / "models"))
    d = start_daemon(root / "home")
    yield d
    d.stop()
