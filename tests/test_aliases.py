"""Aliases (issue 39, item 1): a stable name clients use, pointing at one stored version.

At the shipped settings, on a real daemon (tests/alias_models.py: tiny classifiers whose
label names tell which version computed a reply):
- a switch and a rollback under load from 8 clients fail no request, every reply names
  the version that served it (`X-Fleet-Model-Version`) and was computed by that version,
  each client sees v1, then v2, then v1 again, never back and forth (a request runs on the
  version it was admitted with), and the rollback takes well under a second;
- an alias works on every route that takes a model name: native, OpenAI, Ollama, TEI's
  per-model URL and the root dispatch, the hot embed route included;
- changes are the operator's, and a bad one (unknown version, an alias of an alias, another
  task, a stored model's name, a malformed alias) is a 4xx that changes nothing.

Before: no alias existed; every request for one was 404 `model_not_found`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.alias_models import TEXTS, version_of_labels
from tests.conftest import DEFAULT_MODEL

VERSION = "x-fleet-model-version"


def set_alias(d, alias: str, version: str, **extra) -> httpx.Response:
    return httpx.put(f"{d.url}/v1/aliases/{alias}", json={"version": version, **extra}, headers=d.admin, timeout=120)


def aliases(d) -> dict:
    return {a["name"]: a for a in httpx.get(d.url + "/v1/aliases", timeout=30).json()["aliases"]}


def labels_of(reply: dict) -> set[str]:
    return {hit["label"] for row in reply["results"] for hit in row}


def test_a_switch_and_a_rollback_under_load_fail_nothing_and_mix_no_versions(tone_box) -> None:
    d = tone_box
    assert set_alias(d, "tone", "tone-v1").status_code == 200
    stop = threading.Event()
    seen: dict[int, list[tuple[int, str | None, set[str]]]] = {i: [] for i in range(8)}

    def client(i: int) -> None:
        with httpx.Client(base_url=d.url, timeout=60, headers={"X-Fleet-Client": f"client-{i}"}) as c:
            n = 0
            while not stop.is_set():
                r = c.post("/v1/classify", json={"model": "tone", "inputs": TEXTS[n % 6: n % 6 + 3]})
                seen[i].append((r.status_code, r.headers.get(VERSION), labels_of(r.json()) if r.is_success else set()))
                n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        switch = set_alias(d, "tone", "tone-v2", reason="new tone")  # loads tone-v2 first, then switches
        time.sleep(2.0)
        t0 = time.perf_counter()
        rollback = httpx.post(f"{d.url}/v1/aliases/tone/rollback", json={"reason": "bad tone"}, headers=d.admin,
                              timeout=30)
        rollback_s = time.perf_counter() - t0
        time.sleep(2.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert switch.status_code == 200, switch.text
    assert rollback.status_code == 200, rollback.text
    replies = [r for rs in seen.values() for r in rs]
    assert len(replies) > 100
    assert [r for r in replies if r[0] != 200] == []
    for _, version, labels in replies:
        # Computed by the version it names: none ran on another version than it was admitted for.
        assert version in ("tone-v1", "tone-v2") and version_of_labels(labels) == version
    for i, rs in seen.items():
        order = "".join(v[-1] for _, v, _ in rs)
        assert re.fullmatch(r"1+2+1+", order), f"client {i} saw versions in the order {order}"
    assert rollback_s < 1.0 and rollback.json()["seconds"] < 1.0
    assert rollback.json()["alias"]["version"] == "tone-v1"
    events = httpx.get(f"{d.url}/v1/aliases/tone/history", timeout=30).json()["events"]
    assert [(e["kind"], e.get("previous"), e["version"]) for e in events[-2:]] == [
        ("set", "tone-v1", "tone-v2"), ("rollback", "tone-v2", "tone-v1")]
    assert events[-1]["reason"] == "bad tone"


def test_an_alias_works_on_every_route_that_takes_a_model(tone_box) -> None:
    d = tone_box
    assert set_alias(d, "text-embedding-3-small", DEFAULT_MODEL).status_code == 200
    assert set_alias(d, "tone@prod", "tone-v2").status_code == 200
    embed = [("/v1/embed", {"model": "text-embedding-3-small", "inputs": ["hi"]}),
             ("/v1/embeddings", {"model": "text-embedding-3-small", "input": ["hi"]}),
             ("/api/embed", {"model": "text-embedding-3-small", "input": ["hi"]}),
             ("/models/text-embedding-3-small/embed", {"inputs": "hi"}),
             ("/v1/embed?model=text-embedding-3-small", {"inputs": ["hi"]})]
    classify = [("/v1/classify", {"model": "tone@prod", "inputs": ["hi"]}),
                ("/models/tone@prod/predict", {"inputs": "hi"}),
                ("/", {"model": "tone@prod", "inputs": "hi"})]
    for (path, body), version in [*((e, DEFAULT_MODEL) for e in embed), *((c, "tone-v2") for c in classify)]:
        r = httpx.post(d.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert r.headers[VERSION] == version, path
        assert r.headers["x-fleet-alias"] in ("text-embedding-3-small", "tone@prod"), path
    # The body names the model as the client asked for it; the header, the version.
    r = httpx.post(d.url + "/v1/embeddings", json={"model": "text-embedding-3-small", "input": "hi"}, timeout=60)
    assert r.json()["model"] == "text-embedding-3-small"
    # A stored model named directly is its own version.
    r = httpx.post(d.url + "/v1/classify", json={"model": "tone-v1", "inputs": ["hi"]}, timeout=60)
    assert r.headers[VERSION] == "tone-v1" and "x-fleet-alias" not in r.headers


@pytest.mark.parametrize("alias, body, status, words", [
    ("tone-bad", {"version": "no-such-model"}, 404, "no-such-model"),
    ("tone-bad", {"version": "tone"}, 400, "itself an alias"),
    ("tone", {"version": DEFAULT_MODEL}, 400, "serves classify"),
    ("tone-v2", {"version": "tone-v1"}, 400, "a stored model's name"),
    ("Tone!", {"version": "tone-v1"}, 400, "invalid alias"),
    ("tone", {"version": "tone-v1", "canary": "tone-v2"}, 400, "canary_percent"),
    ("tone", {"version": "tone-v1", "colour": "red"}, 400, "colour"),
])
def test_a_bad_change_is_refused_and_changes_nothing(tone_box, alias, body, status, words) -> None:
    d = tone_box
    if "tone" not in aliases(d):
        assert set_alias(d, "tone", "tone-v1").status_code == 200
    before = aliases(d)
    r = set_alias(d, alias, **body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    after = aliases(d)
    assert {n: (a["version"], a["change"]) for n, a in after.items()} == {
        n: (a["version"], a["change"]) for n, a in before.items()}


def test_a_version_an_alias_serves_is_not_deleted(tone_box) -> None:
    d = tone_box
    assert set_alias(d, "keep-me", "tone-same").status_code == 200
    r = httpx.request("DELETE", d.url + "/v1/models/tone-same", headers=d.admin, timeout=60)
    assert r.status_code == 400 and "serves the alias keep-me" in r.json()["error"]["message"], r.text
    assert (d.home / "models" / "tone-same" / "manifest.json").is_file()
    assert httpx.request("DELETE", d.url + "/v1/aliases/keep-me", headers=d.admin, timeout=30).status_code == 200


def test_changes_are_the_operators(tone_box) -> None:
    d = tone_box
    before = aliases(d)
    for method, path in [("PUT", "/v1/aliases/tone"), ("POST", "/v1/aliases/tone/rollback"),
                         ("DELETE", "/v1/aliases/tone")]:
        r = httpx.request(method, d.url + path, json={"version": "tone-v2"}, timeout=30)
        assert r.status_code == 401, (method, path, r.text)
        r = httpx.request(method, d.url + path, json={"version": "tone-v2"}, timeout=30,
                          headers={"Authorization": "Bearer not-the-key"})
        assert r.status_code == 403, (method, path, r.text)
    assert aliases(d).keys() == before.keys()
    assert httpx.get(d.url + "/v1/aliases/nothing-here", timeout=30).status_code == 404


def test_the_cli_sets_lists_rolls_back_and_shows_history(tone_box) -> None:
    d = tone_box
    env = {"FLEET_URL": d.url, "FLEET_HOME": str(d.home), "PATH": "/usr/bin:/bin", "FLEET_OWNER": "ops-team",
           "COLUMNS": "120"}

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "cli-tone -> tone-v1" in cli("alias", "set", "cli-tone", "tone-v1", "--no-warm")
    assert "cli-tone -> tone-v2 (was tone-v1)" in cli("alias", "set", "cli-tone", "tone-v2", "--reason", "try v2")
    assert "cli-tone -> tone-v1 (was tone-v2)" in cli("rollback", "cli-tone")
    listed = cli("alias", "ls")
    assert re.search(r"cli-tone\s+tone-v1", listed), listed
    history = cli("history", "cli-tone", "--json")
    assert '"by": "ops-team"' in history and '"kind": "rollback"' in history and '"try v2"' in history


def test_a_canary_sends_a_share_of_clients_each_to_one_version_and_ps_shows_both(tone_box) -> None:
    d = tone_box
    r = set_alias(d, "tone-canary", "tone-v1", canary="tone-v2", canary_percent=50)
    assert r.status_code == 200, r.text
    seen = {}
    with httpx.Client(base_url=d.url, timeout=60) as c:
        for i in range(16):
            versions = set()
            for _ in range(3):
                r = c.post("/v1/classify", json={"model": "tone-canary", "inputs": ["hi"]},
                           headers={"X-Fleet-Client": f"user-{i}"})
                assert r.status_code == 200
                versions.add(r.headers[VERSION])
                assert version_of_labels(labels_of(r.json())) == r.headers[VERSION]
            assert len(versions) == 1, f"user-{i} saw {versions}"  # one client, one version
            seen[i] = versions.pop()
    assert 3 <= list(seen.values()).count("tone-v2") <= 13, seen
    canary = [a for a in httpx.get(d.url + "/v1/ps", timeout=30).json()["aliases"] if a["name"] == "tone-canary"][0]
    assert canary["canary"] == "tone-v2" and canary["canary_percent"] == 50
    for v in ("tone-v1", "tone-v2"):  # each version's own rate, error rate and latencies
        assert canary["versions"][v]["requests_per_s"] > 0 and canary["versions"][v]["error_rate"] == 0.0
        assert canary["versions"][v]["p95_ms"] is not None
    # top names the alias beside each of its versions, and `fleetctl top` shows it.
    from rich.console import Console

    from fleetctl.commands.top import models_table

    state = httpx.get(d.url + "/v1/top", timeout=30).json()
    assert "tone-canary" in {m["model"]: m["aliases"] for m in state["models"]}["tone-v2"]
    console = Console(width=120, record=True)
    console.print(models_table(state))
    assert re.search(r"tone-v2 .*as tone-canary", console.export_text()), console.export_text()
    # A rollback during a canary ends it: every client back on the version.
    r = httpx.post(f"{d.url}/v1/aliases/tone-canary/rollback", json={}, headers=d.admin, timeout=30)
    assert r.status_code == 200 and r.json()["alias"]["canary"] is None
    for i in range(16):
        r = httpx.post(d.url + "/v1/classify", json={"model": "tone-canary", "inputs": ["hi"]},
                       headers={"X-Fleet-Client": f"user-{i}"}, timeout=60)
        assert r.headers[VERSION] == "tone-v1"


def loaded(d) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in httpx.get(d.url + "/v1/models", timeout=30).json()["data"]}


def test_the_model_list_names_each_alias_and_what_it_points_at(tone_box) -> None:
    """An OpenAI client picks a model from the list: an alias is one, its version beside it."""
    import openai

    d = tone_box
    assert set_alias(d, "listed-tone", "tone-v1").status_code == 200
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused")
    cards = {m.id: m.model_dump() for m in client.models.list()}
    assert cards["listed-tone"]["alias_of"] == "tone-v1" and cards["listed-tone"]["task"] == "classify"
    assert "alias_of" not in cards["tone-v1"]
    assert client.models.retrieve("listed-tone").model_dump()["alias_of"] == "tone-v1"
    assert set_alias(d, "listed-tone", "tone-v2").status_code == 200
    assert client.models.retrieve("listed-tone").model_dump()["alias_of"] == "tone-v2"


def test_a_rollback_loads_its_target_first_when_the_current_version_was_loaded(tone_box) -> None:
    d = tone_box

    def unload(name: str) -> None:
        r = httpx.post(f"{d.url}/v1/models/{name}/unload", headers=d.admin, timeout=60)
        assert r.status_code == 200, r.text

    def rollback() -> None:
        r = httpx.post(d.url + "/v1/aliases/warm-tone/rollback", json={}, headers=d.admin, timeout=120)
        assert r.status_code == 200 and r.json()["alias"]["version"] == "tone-v1", r.text

    assert set_alias(d, "warm-tone", "tone-v1").status_code == 200
    assert set_alias(d, "warm-tone", "tone-v2").status_code == 200  # loads tone-v2
    unload("tone-v1")
    assert loaded(d)["tone-v2"] and not loaded(d)["tone-v1"]
    rollback()
    # No request has asked for tone-v1 since: the rollback loaded it, before switching.
    assert loaded(d)["tone-v1"]
    # The current version was not loaded (nobody is using the alias): nothing is loaded.
    assert set_alias(d, "warm-tone", "tone-v2").status_code == 200
    unload("tone-v1")
    unload("tone-v2")
    rollback()
    assert not loaded(d)["tone-v1"]
