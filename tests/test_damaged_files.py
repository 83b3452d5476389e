"""Damaged files are set aside, never fatal (issue 25, deliverable 4).

A stored model whose manifest.json cannot be read (truncated JSON, wrong types)
is listed nowhere and served by nobody, logged once with its path, reported by
`fleetctl list` and `fleetctl doctor` with the fix; every other model keeps
listing and serving. A damaged config.toml or models.toml stops a CLI verb with
one line naming the file, exit 1, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.errors import IntegrityError
from fleet.pull import pull_model
from fleet.store import MANIFEST, Store
from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir, free_port, start_daemon

COPY = "minilm-copy"
#: What a manifest can be after a crash mid-write or a hand edit.
DAMAGE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "wrong types": lambda raw: json.dumps({**json.loads(raw), "files": "all of them"}).encode(),
}


def two_models(home: Path) -> Store:
    """The default model and a copy of it under another name, both embedders."""
    store = Store(home / "models")
    pull_model(store, DEFAULT_MODEL)
    pull_model(store, f"path:{default_model_dir()}", name=COPY)
    return store


def damage(store: Store, name: str, how: str) -> Path:
    path = store.path(name) / MANIFEST
    path.write_bytes(DAMAGE[how](path.read_bytes()))
    return path


def fleetctl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # No daemon: a port nothing listens on, as the box's own setting (FLEET_PORT), so the
    # verbs act on the files (an unreachable FLEET_URL is an error: the user named it). Not
    # where the home has a config.toml: its own port is what those cases damage.
    env = {k: v for k, v in os.environ.items() if k != "FLEET_URL"} | {"FLEET_HOME": str(home)}
    if not (home / "config.toml").exists():
        env["FLEET_PORT"] = str(free_port())
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_manifest_is_listed_nowhere_and_logged_once(tmp_path: Path, how: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    store = two_models(tmp_path / "home")
    path = damage(store, COPY, how)
    with caplog.at_level(logging.ERROR, logger="fleet.store"):
        for _ in range(3):
            assert [m.name for m in store.list()] == [DEFAULT_MODEL]
    logged = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(logged) == 1 and f"fleetctl rm {COPY}" in logged[0]
    assert store.damaged() == [COPY]
    with pytest.raises(IntegrityError, match="unreadable manifest"):
        store.get(COPY)


def test_fleetctl_list_and_doctor_report_the_damaged_model_with_its_fix(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = two_models(home)
    damage(store, COPY, "truncated")

    listed = fleetctl(home, "list")
    assert listed.returncode == 0, listed.stderr
    assert DEFAULT_MODEL in listed.stdout and COPY not in listed.stdout
    assert "Traceback" not in listed.stderr
    line = next(ln for ln in listed.stderr.splitlines() if COPY in ln)
    assert line.startswith("damaged") and f"fleetctl rm {COPY}" in line

    as_json = fleetctl(home, "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert [m["name"] for m in json.loads(as_json.stdout)] == [DEFAULT_MODEL]

    doctor = fleetctl(home, "doctor", "--json")
    assert "Traceback" not in doctor.stderr
    findings = [f for f in json.loads(doctor.stdout) if f["check"] == "store"]
    assert [f["level"] for f in findings] == ["warn"]
    assert COPY in findings[0]["detail"] and f"fleetctl rm {COPY}" in findings[0]["fix"]

    # The catalog view measures a damaged catalog model as if it were not pulled.
    damage(store, DEFAULT_MODEL, "wrong types")
    catalog = fleetctl(home, "list", "--catalog", "--json")
    assert catalog.returncode == 0, catalog.stderr
    assert {r["name"]: r["pulled"] for r in json.loads(catalog.stdout)}[DEFAULT_MODEL] is True


@pytest.mark.parametrize(("file", "text", "verb", "said"), [
    ("config.toml", 'port = "7744\n', ("list",), "config.toml is not valid TOML"),
    ("config.toml", 'port = "seven"\n', ("list",), "bad setting in"),
    ("config.toml", 'port = "seven"\n', ("serve",), "bad setting in"),
    ("models.toml", "[models.x\n", ("list", "--catalog"), "models.toml: not valid TOML"),
    ("models.toml", "[models.x\n", ("serve",), "models.toml: not valid TOML"),
    ("models.toml", '[models.x]\nsource = 5\n', ("pull", "x"), "models.toml"),
])
def test_a_damaged_settings_file_stops_the_cli_with_one_line(tmp_path: Path, file: str, text: str,
                                                             verb: tuple[str, ...], said: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / file).write_text(text)
    out = fleetctl(home, *verb)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and said in errors[0] and str(home / file) in errors[0], out.stderr


@pytest.fixture(scope="module")
def damaged_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, Path]]:
    home = tmp_path_factory.mktemp("fleet-damaged") / "home"
    path = damage(two_models(home), COPY, "truncated")
    d = start_daemon(home)
    yield d, path
    d.stop()


def test_the_daemon_lists_and_serves_every_other_model(damaged_daemon: tuple[DaemonProc, Path]) -> None:
    d, path = damaged_daemon
    for _ in range(2):
        models = httpx.get(d.url + "/v1/models", timeout=30)
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [DEFAULT_MODEL]
        tags = httpx.get(d.url + "/api/tags", timeout=30)
        assert tags.status_code == 200, tags.text
        assert [m["name"] for m in tags.json()["models"]] == [f"{DEFAULT_MODEL}:latest"]
    # No `model`: the only readable embedder is the default.
    embedded = httpx.post(d.url + "/v1/embed", json={"inputs": ["a text"]}, timeout=60)
    assert embedded.status_code == 200, embedded.text
    assert embedded.json()["model"] == DEFAULT_MODEL
    named = httpx.post(d.url + "/v1/embed", json={"model": COPY, "inputs": ["a text"]}, timeout=60)
    assert named.status_code == 500 and named.json()["error"]["code"] == "integrity_error"
    assert str(path) not in named.text  # messages never name paths
    assert d.log().count(f"{path} is damaged") == 1
