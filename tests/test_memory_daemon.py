"""Memory manager end to end: a real `fleetctl serve` with a small CPU budget,
tiny real BERTs built from a config (pulled through the store from `path:`),
real HTTP, real `fleetctl pin|unpin|ps` subprocesses.

Budget: one worker's activation allowance plus 2.5 models' weights, so two of
the three tiny models fit and the third needs an eviction.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from fleet.runtimes.footprint import estimate_footprint
from tests.conftest import DaemonProc, default_model_dir, start_daemon

pytestmark = pytest.mark.slow

MSGPACK = "application/msgpack"
TINY = ("tiny-a", "tiny-b", "tiny-c")


def fleetctl(url: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_URL": url, "FLEET_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """FLEET_HOME with tiny-a/b/c, tiny-big (over the budget) and tiny-bad (garbage weights), all
    float32 (no dtype check: sizes are the same on every CPU); returns (home, budget bytes)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("memory-models")
    home = tmp_path_factory.mktemp("memory-home")
    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def build(name: str, seed: int, hidden: int, layers: int) -> Path:
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128)
        BertModel(cfg).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        return root / name

    folders = {name: build(name, i, 64, 2) for i, name in enumerate(TINY)}
    folders["tiny-big"] = build("tiny-big", 7, 256, 2)
    bad = build("tiny-bad", 8, 64, 2)
    # Its whole header (the pull checks every tensor against the architecture), the data
    # cut short: the store hashes it fine and the estimate reads it, but the load itself fails.
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[:8 + int.from_bytes(raw[:8], "little")] + b"\0" * 100)
    folders["tiny-bad"] = bad
    (home / "models.toml").write_text("".join(
        f'[models."{name}"]\nsource = "path:{folder}"\ntask = "embed"\nruntime = "sentence-transformers"\n'
        f'profile = {{ dtype = "float32" }}\n\n'
        for name, folder in folders.items()
    ))
    env = {**os.environ, "FLEET_HOME": str(home)}
    for name in folders:
        out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    fp = estimate_footprint(home / "models" / "tiny-a", "sentence-transformers", dtype="float32")
    return home, fp.activation_bytes + int(2.5 * fp.weights_bytes)


def serve(home: Path, budget: int, workers: int = 1) -> DaemonProc:
    return start_daemon(home, extra_env={
        "FLEET_PRELOAD": ",", "FLEET_CPU_BUDGET_BYTES": str(budget), "FLEET_WORKERS": str(workers),
        "FLEET_DEVICE": "cpu", "FLEET_CPU_THREADS": "1",
    })


@pytest.fixture(scope="module")
def fleet(tiny_home):
    home, budget = tiny_home
    d = serve(home, budget)
    yield d
    d.stop()


def embed(url: str, model: str, texts: list[str], timeout_ms: int = 30_000) -> httpx.Response:
    body = {"model": model, "inputs": texts, "timeout_ms": timeout_ms}
    return httpx.post(url + "/v1/embed", content=msgspec.msgpack.encode(body), headers={"Content-Type": MSGPACK},
                      timeout=timeout_ms / 1000 + 30)


def vectors(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.content
    body = msgspec.msgpack.decode(resp.content)
    return np.frombuffer(body["embeddings"], dtype="<f4").reshape(body["shape"])


def ps(url: str) -> dict:
    return httpx.get(url + "/v1/ps", timeout=10).json()


def resident(url: str) -> dict[str, dict]:
    return {name: m for w in ps(url)["workers"] for name, m in w["models"].items()}


def error(resp: httpx.Response) -> tuple[int, str, str]:
    msgpack = resp.headers["content-type"].startswith(MSGPACK)
    body = (msgspec.msgpack.decode(resp.content) if msgpack else resp.json())["error"]
    return resp.status_code, body["code"], body["message"]


# ---- scenarios (in order: they share one daemon) ------------------------------------


def test_pin_from_the_cli_loads_now(fleet):
    out = fleetctl(fleet.url, fleet.home, "pin", "tiny-a")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pinned tiny-a on cpu")
    models = resident(fleet.url)
    assert set(models) == {"tiny-a"} and models["tiny-a"]["pinned"] is True
    assert (fleet.home / "pins.json").is_file()


def test_rotating_traffic_keeps_the_pin_and_swaps_the_others(fleet):
    seen: dict[str, np.ndarray] = {}
    other = None  # the unpinned model resident next to tiny-a
    for _ in range(3):
        for model in TINY:
            got = vectors(embed(fleet.url, model, ["the same text for every model"]))
            assert got.shape == (1, 64)
            if model in seen:  # the same model answered (same weights, same vector)
                np.testing.assert_allclose(got, seen[model], atol=1e-5)
            seen[model] = got
            other = other if model == "tiny-a" else model
            models = resident(fleet.url)
            # Two fit: the pinned one and the last other one asked for; the pin never leaves.
            assert set(models) == {"tiny-a"} | ({other} if other else set()), models
            assert models["tiny-a"]["pinned"] is True
    # Different weights, different answers: each lane reached its own model.
    assert not np.allclose(seen["tiny-b"], seen["tiny-c"])


def test_unpinned_models_are_evicted_least_recently_used_first(fleet):
    out = fleetctl(fleet.url, fleet.home, "unpin", "tiny-a")
    assert out.returncode == 0 and out.stdout.startswith("unpinned tiny-a"), out.stderr
    assert resident(fleet.url)["tiny-a"]["pinned"] is False
    # Now resident: tiny-a and tiny-c (the rotation ended on c). b, a, b, c tells LRU from
    # FIFO: at the last step LRU evicts a (used before b's second use), FIFO would evict b.
    for model in ("tiny-b", "tiny-a", "tiny-b", "tiny-c"):
        before = resident(fleet.url)
        time.sleep(1.0)  # uses further apart than a reload's cost credit (runtimes.memory.RELOAD_CREDIT)
        vectors(embed(fleet.url, model, ["lru"]))
        after = resident(fleet.url)
        assert len(after) == 2 and model in after
        gone = set(before) - set(after)
        if model in before:
            assert not gone
        else:
            lru = min(before, key=lambda n: before[n]["last_used"] + before[n]["load_ms"] / 1e3)
            assert gone == {lru}, (before, after)
            assert lru == min(before, key=lambda n: before[n]["last_used"])
    assert set(resident(fleet.url)) == {"tiny-b", "tiny-c"}


def test_no_request_is_lost_under_concurrent_rotating_traffic(fleet):
    rng = random.Random(4)
    plan = [[rng.choice(TINY) for _ in range(8)] for _ in range(4)]
    answers: list[tuple[str, int, tuple]] = []
    lock = threading.Lock()

    def client(models: list[str]) -> None:
        for model in models:
            resp = embed(fleet.url, model, ["concurrent", "traffic"])
            shape = msgspec.msgpack.decode(resp.content).get("shape") if resp.status_code == 200 else None
            with lock:
                answers.append((model, resp.status_code, tuple(shape or ())))

    threads = [threading.Thread(target=client, args=(p,)) for p in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert len(answers) == 32
    assert all(status == 200 and shape == (2, 64) for _, status, shape in answers), answers
    state = ps(fleet.url)
    assert state["queue"]["depth"] == 0 and len(resident(fleet.url)) <= 2


def test_ps_shows_budget_used_and_each_resident_model(fleet, tiny_home):
    _, budget = tiny_home
    vectors(embed(fleet.url, "tiny-a", ["ps"]))
    state = ps(fleet.url)
    (worker,) = state["workers"]
    assert worker["budget_bytes"] == budget
    fp = estimate_footprint(fleet.home / "models" / "tiny-a", "sentence-transformers", dtype="float32")
    weights = sum(m["bytes"] for m in worker["models"].values())
    assert worker["used_bytes"] == weights + fp.activation_bytes <= budget
    for m in worker["models"].values():
        assert abs(m["bytes"] - fp.weights_bytes) < 64 << 10  # measured after load: the header's count, +buffers
        assert {"pinned", "last_used", "served", "loaded_at"} <= set(m)
    out = fleetctl(fleet.url, fleet.home, "ps")
    assert out.returncode == 0, out.stderr
    assert "budget MiB" in out.stdout  # the Devices table: one unit, named in the header
    assert any(line.lstrip().startswith("cpu") and f"{budget / (1 << 20):,.1f}" in line
               for line in out.stdout.splitlines()), out.stdout
    assert "tiny-a" in out.stdout


def test_admin_unload_then_load_and_pinned_unload_is_refused(fleet):
    r = httpx.post(fleet.url + "/v1/models/tiny-b/load", headers=fleet.admin, timeout=60)
    assert r.status_code == 200, r.text
    assert "tiny-b" in resident(fleet.url)
    r = httpx.post(fleet.url + "/v1/models/tiny-b/unload", headers=fleet.admin, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["loaded"] is False
    assert "tiny-b" not in resident(fleet.url)
    r = httpx.post(fleet.url + "/v1/models/tiny-b/load", headers=fleet.admin, timeout=60)
    result = r.json()["results"][0]
    assert r.status_code == 200 and result["loaded"] and result["load_ms"] > 0 and not result.get("already")
    again = httpx.post(fleet.url + "/v1/models/tiny-b/load", headers=fleet.admin, timeout=60)
    assert again.json()["results"][0]["already"] is True
    assert httpx.post(fleet.url + "/v1/models/tiny-b/pin", headers=fleet.admin, timeout=60).status_code == 200
    status, code, message = error(httpx.post(fleet.url + "/v1/models/tiny-b/unload", headers=fleet.admin, timeout=60))
    assert (status, code) == (400, "bad_request") and "unpin it first" in message
    assert "tiny-b" in resident(fleet.url)
    unpinned = httpx.delete(fleet.url + "/v1/models/tiny-b/pin", headers=fleet.admin, timeout=60)
    assert unpinned.json()["was_pinned"] is True
    missing = httpx.post(fleet.url + "/v1/models/nope/load", headers=fleet.admin, timeout=60)
    assert error(missing)[:2] == (404, "model_not_found")
    bad = httpx.post(fleet.url + "/v1/models/BAD..name/pin", headers=fleet.admin, timeout=60)
    assert error(bad)[:2] == (400, "bad_request")
    r = httpx.post(fleet.url + "/v1/models/tiny-b/load", json={"device": "cuda:3"}, headers=fleet.admin, timeout=60)
    assert error(r)[:2] == (400, "bad_request") and "no worker runs on device 'cuda:3'" in error(r)[2]


def test_a_model_bigger_than_the_budget_gets_model_too_large(fleet, tiny_home):
    _, budget = tiny_home
    pins_before = (fleet.home / "pins.json").read_bytes()
    status, code, message = error(embed(fleet.url, "tiny-big", ["too big"]))
    assert (status, code) == (507, "model_too_large")
    assert "tiny-big needs" in message and f"cpu budget of {budget / (1 << 20):.1f} MiB" in message
    out = fleetctl(fleet.url, fleet.home, "pin", "tiny-big")
    assert out.returncode == 1 and "tiny-big needs" in out.stderr
    assert (fleet.home / "pins.json").read_bytes() == pins_before  # refused: nothing changed
    assert "tiny-big" not in resident(fleet.url)
    assert vectors(embed(fleet.url, "tiny-a", ["still serving"])).shape == (1, 64)


def test_pinning_more_than_fits_names_what_holds_the_memory(fleet):
    for model in ("tiny-a", "tiny-b"):
        assert httpx.post(fleet.url + f"/v1/models/{model}/pin", headers=fleet.admin, timeout=60).status_code == 200
    status, code, message = error(httpx.post(fleet.url + "/v1/models/tiny-c/pin", headers=fleet.admin, timeout=60))
    assert (status, code) == (507, "model_too_large")
    assert "tiny-a (" in message and "tiny-b (" in message and "pinned" in message
    # A request for the third model cannot evict pins either: a clear error, not an OOM.
    assert error(embed(fleet.url, "tiny-c", ["x"]))[:2] == (507, "model_too_large")
    for model in ("tiny-a", "tiny-b"):
        assert httpx.delete(fleet.url + f"/v1/models/{model}/pin", headers=fleet.admin, timeout=60).status_code == 200
    assert vectors(embed(fleet.url, "tiny-c", ["room again"])).shape == (1, 64)


def test_a_load_that_fails_answers_its_requests_and_the_worker_stays_healthy(fleet):
    pid = ps(fleet.url)["workers"][0]["pid"]
    status, code, message = error(embed(fleet.url, "tiny-bad", ["x"]))
    assert (status, code) == (500, "model_load_failed") and "tiny-bad" in message
    assert vectors(embed(fleet.url, "tiny-c", ["after the failure"])).shape == (1, 64)
    assert ps(fleet.url)["workers"][0]["pid"] == pid  # same worker process, still serving


def test_pins_survive_a_daemon_restart(tiny_home, fleet):
    home, budget = tiny_home
    assert httpx.post(fleet.url + "/v1/models/tiny-c/pin", headers=fleet.admin, timeout=60).status_code == 200
    fleet.stop()
    again = serve(home, budget)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and "tiny-c" not in resident(again.url):
            time.sleep(0.2)
        models = resident(again.url)
        assert set(models) == {"tiny-c"} and models["tiny-c"]["pinned"] is True
    finally:
        again.stop()


def test_two_workers_on_one_device_never_load_the_same_model_twice(tiny_home, tmp_path):
    home, budget = tiny_home
    (home / "pins.json").unlink(missing_ok=True)
    d = serve(home, budget * 4, workers=2)
    try:
        results: list[int] = []

        def ask() -> None:
            # A fresh worker's first load also imports the model libraries: minutes on a busy box.
            results.append(embed(d.url, "tiny-b", ["two workers"], timeout_ms=300_000).status_code)

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=360)
        assert results == [200] * 8
        holders = [w for w in ps(d.url)["workers"] if "tiny-b" in w["models"]]
        assert len(holders) == 1
        assert d.log().count("loaded tiny-b on cpu") == 1
    finally:
        d.stop()
