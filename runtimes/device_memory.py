"""Device memory as measured (effects): a device's budget, its free memory now, the load lock.

The effects the placement policy (runtimes.memory) is fed, injected into the
worker: `device_budget` (NVML with a `torch.cuda.mem_get_info` cross-check on
NVIDIA, psutil on CPU), `device_used_bytes` (what the live workers of a device
publish) and `LoadLock` (one load at a time per device, across worker
processes). torch, pynvml and psutil are imported only where they are read.

Units: bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.nvml import nvml

log = logging.getLogger("fleet.worker")


@dataclass
class DeviceMemory:
    """One device's budget and a live reading of its free memory (minus the reserve)."""

    device: str
    budget_bytes: int
    free_now: Callable[[], int]
    source: str = ""

    @classmethod
    def unlimited(cls, device: str = "cpu") -> DeviceMemory:
        return cls(device, 1 << 62, lambda: 1 << 62, "unlimited")


def cuda_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """NVML's handle for CUDA device `index`. CUDA numbers only the GPUs in
    CUDA_VISIBLE_DEVICES, NVML numbers all of them: match by UUID when torch
    can say it, else assume the same order."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_memory(index: int) -> tuple[int, int]:
    """(total, free) bytes of CUDA device `index` from NVML (nvidia-ml-py), opened once
    per process (fleet.nvml: a worker reads this at every load decision)."""
    pynvml = nvml()
    info = pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml, index))
    return int(info.total), int(info.free)


#: NVML and torch disagreeing by more than this is logged (they count the
#: same physical memory; a gap means another process allocated in between or
#: the indices do not map one to one, e.g. CUDA_VISIBLE_DEVICES reordering).
CROSS_CHECK_SLACK = 256 << 20


def cuda_free(index: int, reserve_bytes: int) -> int:
    """Free bytes on GPU `index` minus the reserve: the smaller of NVML and torch's view."""
    import torch

    torch.cuda.empty_cache()  # blocks cached by torch's allocator are ours to reuse: count them free
    _, nv_free = nvml_memory(index)
    torch_free, _ = torch.cuda.mem_get_info(index)
    if abs(nv_free - torch_free) > CROSS_CHECK_SLACK:
        log.warning("cuda:%d free memory: NVML says %d MiB, torch says %d MiB; using the smaller",
                    index, nv_free >> 20, torch_free >> 20)
    return min(nv_free, torch_free) - reserve_bytes


def device_budget(device: str, *, cpu_budget_bytes: int = 0, cpu_budget_fraction: float = 0.5,
                  cpu_reserve_bytes: int = 256 << 20, gpu_reserve_bytes: int = 512 << 20,
                  fleet_used_bytes: int = 0) -> DeviceMemory:
    """The budget of `device` for this daemon's models.

    NVIDIA: total memory (NVML, cross-checked with torch) minus the reserve;
    what is free right now is re-read at every load decision.
    CPU: `cpu_budget_bytes` if set, else `cpu_budget_fraction` of the RAM
    available now plus what fleet's models on this device already hold (so
    every worker of the device computes the same budget); loads also need
    that much RAM really available, minus `cpu_reserve_bytes`.
    """
    if device.startswith("cuda"):
        import torch

        index = cuda_index(device)
        total, _ = nvml_memory(index)
        _, torch_total = torch.cuda.mem_get_info(index)
        if total != torch_total:
            log.warning("cuda:%d total memory: NVML %d MiB, torch %d MiB; using the smaller",
                        index, total >> 20, torch_total >> 20)
        return DeviceMemory(device, min(total, torch_total) - gpu_reserve_bytes,
                            lambda: cuda_free(index, gpu_reserve_bytes), "nvml")
    import psutil

    if cpu_budget_bytes > 0:
        budget, source = cpu_budget_bytes, "configured"
    else:
        budget = int(cpu_budget_fraction * (psutil.virtual_memory().available + fleet_used_bytes))
        source = f"{cpu_budget_fraction:g} of available RAM"
    return DeviceMemory(device, budget, lambda: psutil.virtual_memory().available - cpu_reserve_bytes, source)


class LoadLock:
    """One load (decision + load) at a time per device, across the worker
    processes of a daemon: an flock on `FLEET_HOME/run/load-<device>.lock`
    (the kernel drops it if the holder dies). Without a path, a no-op (a
    single in-process core)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None

    @classmethod
    def for_device(cls, home: str | Path, device: str) -> LoadLock:
        run = Path(home) / "run"
        run.mkdir(parents=True, exist_ok=True)
        return cls(run / f"load-{device.replace(':', '-')}.lock")

    @contextlib.contextmanager
    def held(self, *, blocking: bool = True) -> Iterator[bool]:
        """Hold the lock for the block; with `blocking=False` the block gets False at
        once (holding nothing) when another process holds it."""
        if not self.acquire(blocking=blocking):
            yield False
            return
        try:
            yield True
        finally:
            self.release()

    def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock (False at once, holding nothing, when another process holds it
        and `blocking` is false). Held until `release`, whichever thread calls it: a load
        that runs beside serving holds it from its decision to its settling
        (runtimes.residency). Not reentrant: the flock is this process's, so one worker
        takes it once (`Residency.pending` keeps one load at a time)."""
        if self.path is None:
            return True
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self.path is not None and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def device_used_bytes(queue: Any, device: str) -> int:
    """What the live workers of `device` report using (their info blobs' `used_bytes`)."""
    import msgspec

    total = 0
    for w in queue.workers():
        if w.device == device and w.info:
            total += int(msgspec.msgpack.decode(w.info).get("used_bytes", 0))
    return total
