"""Worker-side metrics end to end: a real daemon, real worker, real weights; the
scrape is parsed with prometheus-client's parser and the series must move with
what the test does (batches, loads, evictions by reason, device memory, restarts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DEFAULT_MODEL, start_daemon, wait_until_ready


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def embed(url: str, n: int) -> None:
    r = httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [f"text {i}" for i in range(n)]},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["shape"] == [n, 384]


def worker_pid(url: str) -> int:
    workers = httpx.get(url + "/v1/ps", timeout=10).json()["workers"]
    assert len(workers) == 1
    return workers[0]["pid"]


@pytest.mark.slow
def test_batches_loads_evictions_memory_restarts_move(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # No preload (a preloaded model is pinned, and pinned models refuse `unload`):
    # the model is pulled into the store first, then lazily loaded by the first request.
    (home / "config.toml").write_text("preload = []\n")
    pulled = subprocess.run([sys.executable, "-m", "fleetctl", "pull", DEFAULT_MODEL], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "FLEET_HOME": str(home)})
    assert pulled.returncode == 0, pulled.stderr
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1"})
    try:
        m = DEFAULT_MODEL
        # 1. The first request's lazy load is one load, resident once, device memory known.
        embed(d.url, 1)
        before = scrape(d.url)
        assert value(before, "fleet_model_loads_total", model=m) == 1
        assert value(before, "fleet_model_resident", model=m) == 1
        assert value(before, "fleet_device_memory_used_bytes", device="cpu") > 10 << 20  # the weights, ~90 MB
        assert value(before, "fleet_device_memory_budget_bytes", device="cpu") >= \
            value(before, "fleet_device_memory_used_bytes", device="cpu")

        # 2. Batches: sequential requests are one batch each; a batch's items are its
        #    inputs and its tokens the tokenizer's (tests/test_token_counts.py has them exact).
        for n in (1, 3, 5, 7):
            embed(d.url, n)
        after = scrape(d.url)
        batches = value(after, "fleet_batch_items_count", model=m) - value(before, "fleet_batch_items_count", model=m)
        items = value(after, "fleet_batch_items_sum", model=m) - value(before, "fleet_batch_items_sum", model=m)
        tokens = value(after, "fleet_batch_tokens_sum", model=m) - value(before, "fleet_batch_tokens_sum", model=m)
        assert batches == 4 and items == 1 + 3 + 5 + 7
        assert tokens >= 16 * 3  # 16 inputs of a few tokens each plus the two special ones
        assert value(after, "fleet_batch_items_bucket", model=m, le="1.0") - \
            value(before, "fleet_batch_items_bucket", model=m, le="1.0") == 1

        # 3. An operator unload is an eviction `unload`; the next request loads it again.
        r = httpx.post(f"{d.url}/v1/models/{m}/unload", headers=d.admin, timeout=60)
        assert r.status_code == 200, r.text
        unloaded = scrape(d.url)
        assert value(unloaded, "fleet_model_evictions_total", model=m, reason="unload") == 1
        assert value(unloaded, "fleet_model_resident", model=m) == 0
        embed(d.url, 2)
        reloaded = scrape(d.url)
        assert value(reloaded, "fleet_model_loads_total", model=m) == 2
        assert value(reloaded, "fleet_model_resident", model=m) == 1

        # 4. A worker killed with SIGKILL: restart counted, its models evicted `worker_exit`,
        #    and the next request's load on the new worker is one more.
        pid = worker_pid(d.url)
        os.kill(pid, signal.SIGKILL)  # the daemon's worker: a process this test started (through the daemon)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if worker_pid(d.url) != pid:
                    break
            except AssertionError:
                pass  # between the death and the new worker's registration
            time.sleep(0.2)
        wait_until_ready(d)
        embed(d.url, 1)
        restarted = scrape(d.url)
        assert value(restarted, "fleet_worker_restarts_total", worker="0") == 1
        assert value(restarted, "fleet_model_evictions_total", model=m, reason="worker_exit") == 1
        assert value(restarted, "fleet_model_loads_total", model=m) == 3
        assert value(restarted, "fleet_model_resident", model=m) == 1
    finally:
        d.stop()
