"""`fleetctl top` and `GET /v1/top`: the window's figures (a fake clock), NVML's (a fake
NVML: this box has no GPU, so no real part can exist here; the real library is the same
five calls, exercised on a GPU box), the view at 80 columns, and the real CLI against
the session's real daemon. tests/test_loop_lock.py checks the route answers without
waiting for the queue lock on the event loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
from rich.console import Console

from fleet.daemon.top import Recent, gpu_stats, model_rows, nvml_index
from fleetctl.commands.top import render
from tests.conftest import DEFAULT_MODEL, DaemonProc


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_window_rates_percentiles_batches_and_evictions() -> None:
    clock = Clock()
    recent = Recent(clock)
    recent.request("old", 0.5, True)  # falls out of the window below
    clock.t += 20
    for i in range(100):
        recent.request("m", (i + 1) / 1000, True)  # 1..100 ms
    recent.request("m", 5.0, False)  # an error: counted, not in the latencies
    recent.batch("m", 8, 400)
    recent.batch("m", 4, 200)
    recent.served_tokens("m", 600)
    recent.event("m", "load")
    recent.event("m", "lru")
    recent.event("m", "lru")
    got = recent.models(window_s=10)
    assert "old" not in got
    m = got["m"]
    assert m["requests_per_s"] == 10.1 and m["errors_per_s"] == 0.1
    assert 50 <= m["p50_ms"] <= 51 and 95 <= m["p95_ms"] <= 96
    assert (m["batches"], m["batch_items"], m["batch_tokens"], m["tokens_per_s"]) == (2, 6.0, 300.0, 60.0)
    assert (m["loads"], m["evictions"]) == (1, 2)
    clock.t += 11
    assert recent.models(window_s=10) == {}
    assert [e["what"] for e in recent.recent_events()] == ["lru", "lru", "load"]


def test_rows_join_lanes_and_live_profiles() -> None:
    workers = [{"worker": 1, "up": True, "models": {"m": {"settings": {"max_batch_items": 32,
                                                                      "max_batch_tokens": 4096}}}},
               {"worker": 2, "up": False, "models": {"gone": {}}}]
    rows = model_rows({}, workers, [{"model": "waiting", "depth": 3, "oldest_wait_ms": 120.0}])
    by = {r["model"]: r for r in rows}
    assert set(by) == {"m", "waiting"}  # a dead worker's models are not resident
    assert (by["m"]["max_batch_items"], by["m"]["max_batch_tokens"], by["m"]["workers"]) == (32, 4096, [1])
    assert (by["waiting"]["depth"], by["waiting"]["oldest_wait_ms"], by["waiting"]["workers"]) == (3, 120.0, [])


class FakeNvml:
    """pynvml's calls gpu_stats makes (no GPU on this box: no real NVML can answer here)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i: int):
        self.handles.append(i)
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        self.handles.append(uuid)
        return 7

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + h, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) << 30, total=80 << 30, free=0)


def test_gpu_stats_through_nvml(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    got = gpu_stats(["cpu", "cuda:0", "cuda:1"], opener=lambda: nvml)
    assert got == {"cuda:0": {"util_percent": 40.0, "memory_used_bytes": 1 << 30, "memory_total_bytes": 80 << 30},
                   "cuda:1": {"util_percent": 41.0, "memory_used_bytes": 2 << 30, "memory_total_bytes": 80 << 30}}
    # Left open: fleet.nvml opens it once per process (/v1/top runs on the event loop).
    assert not nvml.shut and gpu_stats(["cpu"], opener=lambda: nvml) == {}
    # CUDA numbers only the visible GPUs, in their order; NVML numbers all.
    assert nvml_index("cuda:1", "3,2") == 2 and nvml_index("cuda:0", "GPU-abc,1") == "GPU-abc"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert gpu_stats(["cuda:0"], opener=FakeNvml)["cuda:0"]["util_percent"] == 47.0


def test_gpu_stats_without_nvml_is_empty() -> None:
    def broken():
        raise RuntimeError("NVML Shared Library Not Found")

    assert gpu_stats(["cuda:0"], opener=broken) == {}
    assert gpu_stats(["cuda:0"]) == {}  # this box: fleet.nvml cannot open (no driver)


STATE = {
    "box": "a-box-with-a-long-name", "uptime_s": 1234.5, "window_s": 10.0, "cpu_percent": 57.0,
    "queue": {"depth": 12, "in_flight": 40},
    "models": [{"model": "a-very-long-model-name-that-must-fold-not-cut-qwen3-reranker-0.6b",
                "requests_per_s": 123.4, "errors_per_s": 0.5, "p50_ms": 12.3, "p95_ms": 456.7, "tokens_per_s": 98765.0,
                "batches": 40, "batch_items": 31.5, "batch_tokens": 12000.0, "loads": 1, "evictions": 3, "depth": 12,
                "oldest_wait_ms": 1500.0, "max_batch_items": 256, "max_batch_tokens": 32768,
                "workers": [65536]}],
    "workers": [{"worker": 65536, "pid": 123456, "device": "cuda:0", "up": True, "cpu_percent": 99.5,
                 "rss_bytes": 3 << 30, "loading": "", "models": ["a-very-long-model-name", "another-model-name"]}],
    "slots": [], "devices": [{"device": "cuda:0", "used_bytes": 40 << 30, "budget_bytes": 75 << 30,
                              "util_percent": 93.0, "memory_used_bytes": 70 << 30, "memory_total_bytes": 80 << 30}],
    "batches": [{"id": "batch_0123456789abcdef0123456789abcdef", "status": "in_progress", "model": "some-model",
                 "request_counts": {"total": 1000, "completed": 250, "failed": 1}}],
    "events": [{"ago_s": 3.2, "model": "another-model-name", "what": "lru"}],
}


def test_view_fits_80_columns_and_cuts_no_name() -> None:
    name = STATE["models"][0]["model"]
    for width in (80, 120, 160):
        console = Console(width=width, record=True, highlight=False)
        console.print(render(STATE))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text  # nothing is cut
        # The name and the job id whole on one line each; the name's row has its figures.
        assert "batch_0123456789abcdef0123456789abcdef" in text
        assert next(line for line in text.splitlines() if line.startswith(name)).split()[1] == "123.4"
    # Wide enough, every figure is there; narrower, the table says which columns gave way.
    for figure in ("123.4", "99k", "12.3", "457", "32 · 12k", "93", "250", "evicted (lru)", "3 evicted"):
        assert figure in text, figure


def fleetctl(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_URL": url, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "fleetctl", "top", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_top_against_the_daemon(daemon: DaemonProc) -> None:
    for i in range(6):
        r = httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [f"top {i}", "more"]},
                       timeout=60)
        assert r.status_code == 200
    # A client's made-up model names share one row (no state per junk name).
    r = httpx.post(daemon.url + "/v1/embed", json={"model": "no-such-model-for-top", "inputs": ["x"]}, timeout=60)
    assert r.status_code == 404
    out = fleetctl(daemon.url, "--json", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    m = next(m for m in state["models"] if m["model"] == DEFAULT_MODEL)
    assert m["requests_per_s"] > 0 and m["p50_ms"] > 0 and m["p95_ms"] >= m["p50_ms"]
    assert m["batches"] >= 1 and m["tokens_per_s"] > 0 and m["workers"]
    assert m["max_batch_items"] >= 1 and m["max_batch_tokens"] >= 1
    assert all(w["up"] and w["rss_bytes"] > 0 and w["cpu_percent"] is not None for w in state["workers"])
    assert [d["device"] for d in state["devices"]] == ["cpu"]
    assert state["batches"] == []  # the Batches API is there, with no job running
    names = {m["model"] for m in state["models"]}
    assert "_unknown" in names and "no-such-model-for-top" not in names
    out = fleetctl(daemon.url, "--once", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    assert DEFAULT_MODEL in out.stdout and max(len(line) for line in out.stdout.splitlines()) <= 80
