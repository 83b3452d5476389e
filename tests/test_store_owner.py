"""The daemon owns its store: `fleetctl pull | list | rm` go through the running daemon,
as a user runs them (the real console script in a subprocess, the real daemon over
loopback, tiny real models through the real loading path); and the operator's basics
around it (the access log, `fleetctl logs`, SIGHUP under `serve` flags, names suggested).

They run on the suite's daemon (tests/conftest.py), at the shipped defaults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, free_port

FLEETCTL = shutil.which("fleetctl", path=str(Path(sys.executable).parent)) or shutil.which("fleetctl")

pytestmark = pytest.mark.skipif(FLEETCTL is None, reason="the fleetctl console script is not installed")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "HF_"))}
    env.update(FLEET_HOME=str(home), HF_HUB_OFFLINE="1", COLUMNS="200", **extra)
    return env


def fleetctl(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETCTL, *args], env=cli_env(home, **env), capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)


def ok(p: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert p.returncode == 0, f"rc {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny embedders of the same shape and different weights."""
    from tests.gen_embedders import build_qwen3_embedder

    root = tmp_path_factory.mktemp("tiny")
    return {"a": build_qwen3_embedder(root / "a", seed=0), "b": build_qwen3_embedder(root / "b", seed=1)}


@pytest.fixture(scope="module")
def owner(daemon: DaemonProc) -> DaemonProc:
    """The suite's daemon: these tests add and remove models of their own names only,
    and put back the one setting they change (`access_log`)."""
    return daemon


def embed(d: DaemonProc, model: str) -> httpx.Response:
    return httpx.post(d.url + "/v1/embed", json={"model": model, "inputs": ["the daemon owns its store"]},
                      timeout=120)


def vector(d: DaemonProc, model: str) -> np.ndarray:
    r = embed(d, model)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"][0])


def held(d: DaemonProc, model: str) -> list[int]:
    return [w["worker"] for w in httpx.get(d.url + "/v1/ps", timeout=30).json()["workers"] if model in w["models"]]


def reload(d: DaemonProc) -> str:
    """SIGHUP, then the daemon's log from the signal on, once the workers' profiles are settled."""
    before = len(d.log())
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = d.log()[before:]
        if "reload: the resident models' profiles are unchanged" in text or "reload: profile of" in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"no reload in the log:\n{d.tail()}")


# ---- item 1: pull, re-pull, rm through the daemon -------------------------------------

def test_pull_repull_rm_go_through_the_daemon(owner: DaemonProc, sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"

    def pull(weights: str) -> subprocess.CompletedProcess[str]:
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(sources[weights], src)  # the same source, its weights changed
        return ok(fleetctl(owner.home, "pull", f"path:{src}", "--name", "tiny"))

    assert "no fleet daemon answers" not in pull("a").stderr
    first = vector(owner, "tiny")
    assert held(owner, "tiny")
    assert "tiny" in ok(fleetctl(owner.home, "list")).stdout
    assert "tiny" in {m["name"] for m in json.loads(ok(fleetctl(owner.home, "list", "--json")).stdout)}

    again = pull("b")  # loaded, not pinned: unloaded, the next request loads the new files
    assert "unloaded: the next request loads the new files" in again.stdout, again.stdout
    assert not np.allclose(first, vector(owner, "tiny"), atol=1e-4)

    ok(fleetctl(owner.home, "pin", "tiny"))
    again = pull("a")  # pinned: loaded again at once, and still pinned
    assert "loaded again from the new files (pinned)" in again.stdout, again.stdout
    workers = httpx.get(owner.url + "/v1/ps", timeout=30).json()["workers"]
    assert any(w["models"].get("tiny", {}).get("pinned") for w in workers)
    np.testing.assert_allclose(first, vector(owner, "tiny"), atol=1e-5)  # a's weights answer again

    # A copy whose files leave the store behind the daemon (an older fleetctl, rm -rf):
    # a SIGHUP still re-profiles the other resident models, and unload still reaches it.
    r = httpx.post(owner.url + "/api/copy", json={"source": "tiny", "destination": "gone"}, headers=owner.admin,
                   timeout=60)
    assert r.status_code == 200, r.text
    vector(owner, "gone")
    shutil.rmtree(owner.home / "models" / "gone")
    text = reload(owner)
    assert "kept its profiles" not in text, text
    r = httpx.post(owner.url + "/v1/models/gone/unload", headers=owner.admin, timeout=60)
    assert r.status_code == 200, r.text
    assert held(owner, "gone") == []

    removed = ok(fleetctl(owner.home, "rm", "tiny", "--yes"))
    assert "unloaded from worker" in removed.stdout and "its pin is released" in removed.stdout, removed.stdout
    assert embed(owner, "tiny").status_code == 404
    assert held(owner, "tiny") == []
    assert not (owner.home / "models" / "tiny").exists()


def test_sighup_does_not_report_a_serve_flag_as_a_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleetctl serve --port P --workers 1 --device cpu` and no FLEET_* variables: a SIGHUP
    reads config.toml again and must find no change (it said "port ... need a restart")."""
    from fleet.daemon.core import Daemon
    from fleetctl.commands.serve import flag_settings

    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    for name in ("FLEET_HOST", "FLEET_PORT", "FLEET_WORKERS", "FLEET_DEVICE", "FLEET_NATS"):
        monkeypatch.setenv(name, "")  # unset for load_settings; put back as it was after the test
    settings = flag_settings({"host": None, "port": free_port(), "workers": 1, "device": "cpu", "nats": None})
    applied, restart = Daemon(settings).reload()
    assert (applied, restart) == ([], [])


def test_store_routes_are_the_operators_and_refuse_bad_input(owner: DaemonProc) -> None:
    for method, path in (("GET", "/v1/store"), ("POST", "/v1/store/pull"), ("DELETE", "/v1/models/x")):
        r = httpx.request(method, owner.url + path, json={"source": DEFAULT_MODEL} if method == "POST" else None,
                          timeout=30)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
    pull = owner.url + "/v1/store/pull"
    r = httpx.post(pull, json={"source": "path:relative/dir"}, headers=owner.admin, timeout=30)
    assert r.status_code == 400 and "absolute" in r.text
    r = httpx.post(pull, json={"source": DEFAULT_MODEL, "forse": True}, headers=owner.admin, timeout=30)
    assert r.status_code == 400 and "forse" in r.text and "force" in r.text
    r = httpx.post(pull, json={"source": "all-minilm-l6-v3"}, headers=owner.admin, timeout=30)
    assert r.status_code == 404 and f"did you mean '{DEFAULT_MODEL}'" in r.text
    r = httpx.delete(owner.url + f"/v1/models/{DEFAULT_MODEL}", headers=owner.admin, timeout=30)
    assert r.status_code == 400 and "preload" in r.text
    r = httpx.post(pull, json={"source": DEFAULT_MODEL}, headers=owner.admin, timeout=60)
    assert r.status_code == 200
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[-1]["status"] == "success" and lines[-1]["result"]["status"] == "up_to_date"
    assert embed(owner, DEFAULT_MODEL).status_code == 200  # nothing else changed


# ---- the CLI: where it acts, what it names ---------------------------------------------

def test_ps_and_top_name_the_daemon_and_a_dead_fleet_url_fails(owner: DaemonProc, tmp_path: Path) -> None:
    for verb in (("ps",), ("top", "--once", "--interval", "0.2")):
        out = ok(fleetctl(owner.home, *verb)).stdout
        assert owner.url in out and f"FLEET_HOME {owner.home}" in out, out
    dead, other = closed_url(), tmp_path / "other"
    for verb in (("ps",), ("top", "--once"), ("list",), ("pull", DEFAULT_MODEL), ("rm", "x", "--yes")):
        p = fleetctl(other, *verb, FLEET_URL=dead)
        assert p.returncode == 1 and f"{dead} (FLEET_URL)" in p.stderr, (verb, p.stderr)
    assert not (other / "models").exists()  # nothing written in a store no daemon of that URL reads


def test_a_pull_without_the_daemons_key_is_refused_not_written_elsewhere(owner: DaemonProc, tmp_path: Path) -> None:
    """Another FLEET_HOME (another user, or a shell without the service's home) pointed at
    the daemon: the daemon refuses it, and nothing lands in a store it never reads."""
    other = tmp_path / "other"
    p = fleetctl(other, "pull", DEFAULT_MODEL, FLEET_URL=owner.url)
    assert p.returncode == 1 and "admin key" in p.stderr and "run fleetctl as the daemon's user" in p.stderr, p.stderr
    assert not (other / "models").exists()


def test_without_a_daemon_the_cli_acts_on_the_files_and_says_so(tmp_path: Path) -> None:
    """(tests/test_cli_store.py pulls, lists and removes with no daemon, each verb saying so.)"""
    home, url = tmp_path / "home", closed_url()
    port = url.rsplit(":", 1)[1]
    said = f"no fleet daemon answers at {url}"
    p = fleetctl(home, "pull", "all-minilm-l6-v3", FLEET_PORT=port)
    assert p.returncode == 1 and f"{said}: pulling into the store in {home / 'models'} directly" in p.stderr
    assert f"did you mean '{DEFAULT_MODEL}'" in p.stderr
    assert said in ok(fleetctl(home, "list", FLEET_PORT=port)).stderr
    p = fleetctl(home, "rm", "x", "--yes", FLEET_PORT=port)
    assert p.returncode == 1 and f"{said}: removing from the store" in p.stderr


def test_pin_pull_and_ollama_name_the_model_to_pull(owner: DaemonProc) -> None:
    from fleet.catalog import load_catalog

    p = fleetctl(owner.home, "pin", "all-minilm-l6-v3")
    assert p.returncode == 1 and f"did you mean '{DEFAULT_MODEL}'" in p.stderr, p.stderr
    p = fleetctl(owner.home, "pull", "all-minilm-l6-v3")
    assert p.returncode == 1 and f"did you mean '{DEFAULT_MODEL}'" in p.stderr, p.stderr
    stored = {m["name"] for m in json.loads(ok(fleetctl(owner.home, "list", "--json")).stdout)}
    absent = next(e.name for e in load_catalog(owner.home).all() if e.name not in stored)
    p = fleetctl(owner.home, "pin", absent)
    assert p.returncode == 1 and f"run `fleetctl pull {absent}`" in p.stderr, p.stderr
    for route in ("/api/show", "/api/embed"):
        r = httpx.post(owner.url + route, json={"model": "nope", "input": "x"}, timeout=30)
        assert r.status_code == 404 and "fleetctl pull nope" in r.json()["error"], r.text


CLIENT_ONLY = """
import sys
from fleetctl.app import SERVER_MODULES, main
for name in SERVER_MODULES:  # as in an install without the server extra: not importable
    sys.modules[name] = None
sys.argv = ["fleetctl", *sys.argv[1:]]
main()
"""


def test_client_only_install_goes_through_the_daemon_or_says_it_needs_the_server(owner: DaemonProc,
                                                                                 tmp_path: Path) -> None:
    def client_only(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", CLIENT_ONLY, *args], env=cli_env(home, **env),
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    through = ok(client_only(owner.home, "pull", DEFAULT_MODEL))
    assert "already up to date" in through.stdout
    port = closed_url().rsplit(":", 1)[1]
    p = client_only(tmp_path, "pull", DEFAULT_MODEL, FLEET_PORT=port)
    assert p.returncode == 1 and "needs fleet's server side" in p.stderr and "fleet-serve[server]" in p.stderr, p.stderr
    p = client_only(tmp_path, "pin", DEFAULT_MODEL, FLEET_PORT=port)
    assert p.returncode == 1 and "client-only" in p.stderr and "FLEET_URL" in p.stderr, p.stderr


# ---- item 7: the access log and `fleetctl logs` ----------------------------------------

def access_lines(d: DaemonProc) -> list[dict]:
    out = []
    for line in d.log().splitlines():
        if '"fleet.access"' in line:
            out.append(json.loads(line))
    return out


def test_every_request_has_an_access_line_and_a_setting_turns_it_off(owner: DaemonProc) -> None:
    r = httpx.post(owner.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["hi"]},
                   headers={"X-Request-Id": "access-hot"}, timeout=60)
    assert r.status_code == 200
    assert httpx.post(owner.url + "/v1/embeddings", json={"model": "nope", "input": "hi"},
                      headers={"X-Request-Id": "access-404"}, timeout=60).status_code == 404
    assert httpx.get(owner.url + "/v1/store", headers={"X-Request-Id": "access-401"}, timeout=30).status_code == 401
    time.sleep(0.3)
    by_id = {x.get("request_id"): x for x in access_lines(owner)}
    hot = by_id["access-hot"]
    assert (hot["method"], hot["route"], hot["model"], hot["status"]) == ("POST", "/v1/embed", DEFAULT_MODEL, 200)
    assert hot["ms"] > 0 and hot["client"].startswith("127.0.0.1:") and hot["level"] == "info"
    assert (by_id["access-404"]["model"], by_id["access-404"]["status"]) == ("nope", 404)
    assert (by_id["access-401"]["route"], by_id["access-401"]["status"]) == ("/v1/store", 401)

    config = owner.home / "config.toml"
    kept = config.read_text() if config.exists() else None
    config.write_text((kept or "") + "\naccess_log = false\n")
    try:
        reload(owner)
        assert httpx.get(owner.url + "/healthz", headers={"X-Request-Id": "access-off"}, timeout=30).status_code == 200
        time.sleep(0.3)
        assert "access-off" not in {x.get("request_id") for x in access_lines(owner)}
    finally:
        if kept is None:
            config.unlink()
        else:
            config.write_text(kept)
        reload(owner)


def test_logs_without_systemd_prints_the_file_tail(owner: DaemonProc) -> None:
    p = ok(fleetctl(owner.home, "logs", "-n", "3"))
    assert p.stderr == "", p.stderr  # not systemctl's complaint about a missing systemd
    lines = p.stdout.splitlines()
    assert len(lines) == 3 and all(json.loads(x)["ts"] for x in lines)
