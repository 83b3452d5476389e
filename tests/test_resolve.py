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


def test_a_resolver_that_sizes_does_not_rehash_and_a_loading_one_does(tmp_path: Path):
    """store_resolver(verify=False) is what a worker sizes a model with when it may not load
    it (runtimes.residency `peek`); a load resolves with verify=True: a changed file is
    reported, never served."""
    import pytest

    from fleet.errors import IntegrityError

    home = tmp_path / "home"
    settings = load_settings(home=str(home))
    ensure_model(Store(settings.store_path), DEFAULT_MODEL, catalog=load_catalog(home))
    folder = store_resolver(settings, "cpu")(DEFAULT_MODEL).path
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in a tensor: the header still reads
    weights.unlink()  # a new file: never write through to another folder's (hard-linked) copy
    weights.write_bytes(bytes(data))
    assert store_resolver(settings, "cpu", verify=False)(DEFAULT_MODEL).path == folder
    with pytest.raises(IntegrityError):
        store_resolver(settings, "cpu")(DEFAULT_MODEL)
