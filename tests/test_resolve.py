"""runtimes.resolve on a real store: a models.toml damaged while the daemon serves is
logged, and the model loads with its manifest's profile (never a client error)."""

from __future__ import annotations

import logging
from pathlib import Path

from fleet.catalog import load_catalog
from fleet.config import load_settings
from fleet.pull import ensure_model
from fleet.store import Store
from fleet.runtimes.resolve import store_resolver
from tests.conftest import DEFAULT_MODEL


def test_a_damaged_catalog_falls_back_to_the_manifest_profile(tmp_path: Path, caplog):
    home = tmp_path / "home"
    settings = load_settings(home=str(home))
    manifest = ensure_model(Store(settings.store_path), DEFAULT_MODEL, catalog=load_catalog(home))
    resolve = store_resolver(settings, "cpu")
    assert resolve(DEFAULT_MODEL).name == DEFAULT_MODEL
    (home / "models.toml").write_text('[models."broken"\nsource = ')
    with caplog.at_level(logging.ERROR, logger="fleet.worker"):
        spec = resolve(DEFAULT_MODEL)
    assert spec.extra["profile"] == "default"
    assert spec.profile.dtype == manifest.profile.dtype and spec.profile.max_batch_items == manifest.profile.max_batch_items
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fleet.worker"]
    assert "cannot read the model catalog" in line and DEFAULT_MODEL in line
