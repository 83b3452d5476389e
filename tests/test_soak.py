"""Soak: a real daemon on 127.0.0.1 under a bounded mixed load for a couple of
minutes must not grow in memory.

Load: 4 clients in a loop, each round a small and a larger embed (JSON and
MessagePack), a bad request, an unknown model and a /metrics scrape, so the
request path, the error path and the metrics path all run many thousand times.
RSS of the API process and of the worker (psutil) is sampled after a warm-up
(allocator pools, caches and the batch-size mix are settled by then) and at the
end. Bound: growth < max(10 %, 24 MiB) for the API process and
< max(10 %, 48 MiB) for the worker; a leak of one reply per request (a few KB)
over the soak's thousands of requests would cross both.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import msgspec
import psutil
import pytest

from tests.conftest import DEFAULT_MODEL, start_daemon

WARMUP_S = float(os.environ.get("FLEET_SOAK_WARMUP_S", "25"))
SOAK_S = float(os.environ.get("FLEET_SOAK_S", "90"))
MIB = 1 << 20


def bound(start: int, floor: int) -> int:
    return max(start // 10, floor)


def client(url: str, stop: threading.Event, counts: dict[str, int], lock: threading.Lock) -> None:
    small = {"model": DEFAULT_MODEL, "inputs": ["soak"]}
    larger = msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": [f"soak text number {i} " * 8 for i in range(16)]})
    mp = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            got = [
                c.post(url + "/v1/embed", json=small).status_code,
                c.post(url + "/v1/embed", content=larger, headers=mp).status_code,
                c.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": []}).status_code,
                c.post(url + "/v1/embed", json={"model": "no-such-model", "inputs": ["x"]}).status_code,
                c.get(url + "/metrics").status_code,
            ]
            with lock:
                counts["rounds"] += 1
                if got != [200, 200, 400, 404, 200]:
                    counts["unexpected"] += 1
                    counts["last_unexpected"] = got  # type: ignore[assignment]


def rss(pids: list[int]) -> list[int]:
    return [psutil.Process(p).memory_info().rss for p in pids]


@pytest.mark.slow
def test_soak_no_memory_growth(tmp_path):
    d = start_daemon(tmp_path / "home", extra_env={"FLEET_CPU_THREADS": "1"})
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"rounds": 0, "unexpected": 0}
    threads = [threading.Thread(target=client, args=(d.url, stop, counts, lock), daemon=True) for _ in range(4)]
    try:
        workers = httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"]
        pids = [d.proc.pid, workers[0]["pid"]]
        for t in threads:
            t.start()
        time.sleep(WARMUP_S)
        warm, warm_rounds = rss(pids), counts["rounds"]
        time.sleep(SOAK_S)
        end, end_rounds = rss(pids), counts["rounds"]
        stop.set()
        for t in threads:
            t.join(timeout=70)
        # The worker served the whole soak (no restart hid a leak behind a fresh process).
        assert httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"][0]["pid"] == pids[1]
    finally:
        stop.set()
        d.stop()
    rounds = end_rounds - warm_rounds
    api_growth, worker_growth = end[0] - warm[0], end[1] - warm[1]
    print(f"soak: {rounds} rounds ({rounds * 5} requests) in {SOAK_S:.0f} s after {WARMUP_S:.0f} s warm-up; "
          f"API rss {warm[0] / MIB:.1f} -> {end[0] / MIB:.1f} MiB, worker rss {warm[1] / MIB:.1f} -> "
          f"{end[1] / MIB:.1f} MiB")
    assert counts["unexpected"] == 0, counts
    assert rounds >= 50, rounds  # the soak really ran load
    assert api_growth < bound(warm[0], 24 * MIB), f"API process grew {api_growth / MIB:.1f} MiB"
    assert worker_growth < bound(warm[1], 48 * MIB), f"worker grew {worker_growth / MIB:.1f} MiB"
