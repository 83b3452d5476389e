"""fleet.nvml: NVML opened once per process for the reads that recur (a worker's load
decisions every IDLE_NAP_S, /v1/top on the API's event loop), its failure kept.

No GPU or driver here: pynvml is a stand-in module that counts its calls (the only
mock: no real NVML can answer on this box)."""

from __future__ import annotations

import sys
import threading
import types
from types import SimpleNamespace

import pytest

from fleet import nvml as nvml_mod
from fleet.runtimes import device_memory


@pytest.fixture
def fake_pynvml(monkeypatch):
    calls = {"init": 0, "shutdown": 0, "memory": 0}
    fake = types.ModuleType("pynvml")

    def init():
        calls["init"] += 1

    def shutdown():
        calls["shutdown"] += 1

    def memory(handle):
        calls["memory"] += 1
        return SimpleNamespace(total=80 << 30, free=(70 << 30) - calls["memory"], used=0)

    fake.nvmlInit, fake.nvmlShutdown, fake.nvmlDeviceGetMemoryInfo = init, shutdown, memory
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetHandleByUUID = lambda u: u
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_mod, "_opened", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


def test_memory_reads_open_nvml_once_and_leave_it_open(fake_pynvml):
    threads = [threading.Thread(target=lambda: [device_memory.nvml_memory(0) for _ in range(50)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total, free = device_memory.nvml_memory(0)
    assert fake_pynvml == {"init": 1, "shutdown": 0, "memory": 201}
    assert total == 80 << 30 and free == (70 << 30) - 201  # each read is fresh; only the open is kept


def test_a_process_where_nvml_cannot_open_gets_the_same_error_without_trying_again(monkeypatch):
    tries = []

    def init():
        tries.append(1)
        raise RuntimeError("NVML Shared Library Not Found")

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_mod, "_opened", None)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="Shared Library"):
            nvml_mod.nvml()
    assert len(tries) == 1
