"""Pull scheduling end to end: a real daemon with two CPU workers serving two models.

Real `fleetctl serve` (uvicorn, spawned workers, shared-memory queue), real
weights, real HTTP over 127.0.0.1 with a bounded number of concurrent clients.
One worker is SIGKILLed (by the PID `/v1/ps` reports for it) under load: every
request is answered once, with its own vector or a clear error, and the worker
comes back. Backpressure and deadlines are checked on a one-worker daemon
with a tiny queue bound. CPU use is bounded: one intra-op thread per worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_dir, start_daemon

pytestmark = pytest.mark.slow

COPY = "minilm-copy"
MSGPACK = "application/msgpack"
#: Error codes a request may clearly fail with when its worker is killed under it.
CLEAR_CODES = {"timeout", "inference_failed", "overloaded"}


def pull_copy(home: Path) -> None:
    env = {**os.environ, "FLEET_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{default_model_dir()}", "--name", COPY],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def embed(client: httpx.Client, model: str, text: str, **extra) -> tuple[int, dict, httpx.Headers]:
    resp = client.post("/v1/embed", content=msgspec.msgpack.encode({"model": model, "inputs": [text], **extra}),
                       headers={"Content-Type": MSGPACK, "Accept": MSGPACK})
    return resp.status_code, msgspec.msgpack.decode(resp.content), resp.headers


def ps(url: str) -> dict:
    return httpx.get(url + "/v1/ps", timeout=10).json()


def wait_for(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def two_worker_daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-sched")
    pull_copy(home)
    d = start_daemon(home, args=["--workers", "2", "--device", "cpu"],
                     extra_env={"FLEET_CPU_THREADS": "1", "FLEET_PRELOAD": f"{DEFAULT_MODEL},{COPY}",
                                "FLEET_LOG_LEVEL": "info"})
    yield d
    d.stop()


def test_kill_a_worker_under_load_loses_nothing(two_worker_daemon, st_model):
    d = two_worker_daemon
    state = ps(d.url)
    assert len(state["workers"]) == 2 and all(w["up"] for w in state["workers"])
    assert [s["index"] for s in state["slots"]] == [0, 1]

    n, clients = 240, 6
    texts = [f"request {i}: the {['red', 'green', 'blue'][i % 3]} lorry delivered parcel {i * 7919 % 1000}"
             for i in range(n)]
    models = [DEFAULT_MODEL if i % 2 == 0 else COPY for i in range(n)]
    outcomes: dict[int, list[tuple[int, dict, str]]] = {i: [] for i in range(n)}
    done = [0]
    lock = threading.Lock()
    local = threading.local()

    def one(i: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=d.url, timeout=60)
        status, body, headers = embed(local.client, models[i], texts[i])
        with lock:
            outcomes[i].append((status, body, headers.get("x-served-by", "")))
            done[0] += 1

    # 1. Bounded concurrent load; kill worker 0 once a third of it is answered.
    killed = {}

    def killer() -> None:
        wait_for(lambda: done[0] >= n // 3, 120, "a third of the load")
        victim = next(w for w in ps(d.url)["workers"] if w["index"] == 0)
        killed.update(victim)
        os.kill(victim["pid"], signal.SIGKILL)  # a worker process of the daemon this test started

    k = threading.Thread(target=killer)
    k.start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(n)))
    k.join()
    assert killed, "the worker was never killed"

    # 2. Every request answered exactly once: its own vector, or a clear error.
    assert all(len(v) == 1 for v in outcomes.values())
    ok = [i for i, [(status, _, _)] in outcomes.items() if status == 200]
    errors = {i: body["error"]["code"] for i, [(status, body, _)] in outcomes.items() if status != 200}
    assert set(errors.values()) <= CLEAR_CODES, errors
    assert len(ok) >= n * 0.95, errors
    ref = st_model.encode([texts[i] for i in ok], convert_to_numpy=True, normalize_embeddings=True)
    got = np.stack([np.frombuffer(outcomes[i][0][1]["embeddings"], dtype="<f4") for i in ok])
    cos = np.sum(ref * got, axis=1)
    assert cos.min() > 0.99, "a reply carried another request's vector"
    served_by = {outcomes[i][0][2].rsplit("/", 1)[1] for i in ok}
    assert served_by <= {"0", "1"} and served_by

    # 3. The worker comes back (new pid, same slot), and both models are served again.
    def back():
        s = ps(d.url)
        w0 = [w for w in s["workers"] if w["index"] == 0]
        return s if w0 and w0[0]["pid"] != killed["pid"] and w0[0]["up"] and len(s["workers"]) == 2 else None

    state = wait_for(back, 120, "worker 0 to come back")
    assert next(s for s in state["slots"] if s["index"] == 0)["restarts"] == 1
    assert killed["pid"] not in {w["pid"] for w in state["workers"]}
    assert state["queue"]["depth"] == 0
    with httpx.Client(base_url=d.url, timeout=60) as c:
        for model in (DEFAULT_MODEL, COPY):
            status, body, _ = embed(c, model, "after the crash")
            assert status == 200, body
    assert "exited with -9" in d.log()


def test_ps_shows_lanes_workers_batches_and_cost(two_worker_daemon):
    d = two_worker_daemon
    with httpx.Client(base_url=d.url, timeout=60) as c:
        for i in range(8):
            assert embed(c, DEFAULT_MODEL, f"warm {i}")[0] == 200
    state = ps(d.url)
    batches = [w["last_batch"] for w in state["workers"] if w["last_batch"].get("model")]
    assert batches and all(b["items"] >= 1 and b["tokens"] >= 1 and b["ms"] > 0 for b in batches)
    holders = [w for w in state["workers"] if DEFAULT_MODEL in w["models"]]
    assert holders
    cost = holders[0]["models"][DEFAULT_MODEL]["cost"]
    assert cost["samples"] >= 1 and cost["a_ms"] >= 0 and cost["b_ms_per_1k_tokens"] >= 0
    # The CLI renders the same state as tables.
    env = {**os.environ, "FLEET_URL": d.url}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "ps"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "last batch" in out.stdout and DEFAULT_MODEL in out.stdout and "cost" in out.stdout
    js = subprocess.run([sys.executable, "-m", "fleetctl", "ps", "--json"], env=env, capture_output=True, text=True,
                        timeout=60)
    assert msgspec.json.decode(js.stdout)["slots"][0]["index"] == 0


def test_queue_bound_answers_overloaded_with_retry_after(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # One item per batch, so that concurrent requests really pile up in the lane.
    (home / "models.toml").write_text(f'[models."{DEFAULT_MODEL}".profile]\nmax_batch_items = 1\n')
    d = start_daemon(home, args=["--workers", "1", "--device", "cpu"],
                     extra_env={"FLEET_CPU_THREADS": "1", "FLEET_QUEUE_MAX_DEPTH": "2"})
    try:
        long_text = " ".join(["the quarterly report on regional logistics and warehouse capacity"] * 20)
        results: list[tuple[int, dict, httpx.Headers]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            with httpx.Client(base_url=d.url, timeout=60) as c:
                r = embed(c, DEFAULT_MODEL, f"{i} {long_text}")
            with lock:
                results.append(r)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(48)))
        assert len(results) == 48
        over = [r for r in results if r[0] == 429]
        ok = [r for r in results if r[0] == 200]
        assert over and ok and len(over) + len(ok) == 48, {r[0] for r in results}
        for _status, body, headers in over:
            assert body["error"]["code"] == "overloaded"
            assert int(headers["retry-after"]) >= 1
        # Nothing left behind; the daemon serves again once the burst is over.
        state = ps(d.url)
        assert state["queue"]["depth"] == 0 and state["queue"]["in_flight"] == 0
        with httpx.Client(base_url=d.url, timeout=60) as c:
            assert embed(c, DEFAULT_MODEL, "calm again")[0] == 200
            # A deadline shorter than any forward pass: `timeout`, and nothing stays queued.
            status, body, _ = embed(c, DEFAULT_MODEL, long_text, timeout_ms=1)
            assert status == 504 and body["error"]["code"] == "timeout"
            wait_for(lambda: ps(d.url)["queue"]["depth"] == 0, 10, "the timed-out item to leave the lane")
            assert embed(c, DEFAULT_MODEL, "still fine")[0] == 200
    finally:
        d.stop()
