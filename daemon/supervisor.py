"""Worker processes: start one per device, watch them, restart the dead.

A watcher thread blocks on the processes' sentinels (real wake-ups, not a
sleep loop). When a worker dies, its claimed items go back to their lanes at
once (`release_worker`), so requests it held are redelivered to whoever pulls
next; the worker is restarted with a bounded backoff. Every `lease_ms / 2` the
watcher also expires leases of workers that are alive but stuck.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass, field

import msgspec

from fleetctl.config import Settings
from local_queue import LocalQueue

log = logging.getLogger("fleet.daemon")

_ctx = mp.get_context("spawn")


@dataclass
class Slot:
    """One supervised worker: which device it is bound to and its current process."""

    index: int
    device: str
    process: mp.process.BaseProcess | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    history: list[float] = field(default_factory=list)


def detect_devices(device: str, workers: int) -> list[str]:
    """Devices for the workers: `--device`, else one per NVIDIA GPU, else one CPU worker."""
    if device.startswith("cuda") and ":" in device:
        return [device] * max(1, workers)
    gpus = 0
    if device in ("auto", "cuda"):
        try:
            import pynvml

            pynvml.nvmlInit()
            gpus = pynvml.nvmlDeviceGetCount()
            pynvml.nvmlShutdown()
        except Exception:  # no driver, no GPU: serve on CPU
            gpus = 0
    if gpus:
        found = [f"cuda:{k}" for k in range(gpus)]
        return [found[i % gpus] for i in range(workers or gpus)]
    return ["cpu"] * max(1, workers)


class Supervisor:
    def __init__(self, settings: Settings, queue: LocalQueue, devices: list[str], *, on_restart=None) -> None:
        self.settings = settings
        self.queue = queue
        self.slots = [Slot(i, d) for i, d in enumerate(devices)]
        self._blob = msgspec.msgpack.encode(settings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_restart = on_restart

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def _spawn(self, slot: Slot) -> None:
        from runtimes.process import run

        proc = _ctx.Process(
            target=run, args=(self.queue.name, slot.index, slot.device, self._blob),
            name=f"fleet-worker-{slot.index}", daemon=False,
        )
        proc.start()
        slot.process = proc
        slot.started_at = time.time()
        log.info("worker %d started on %s (pid %d)", slot.index, slot.device, proc.pid)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.is_alive()]

    def _watch(self) -> None:
        expire_every = max(0.05, self.settings.lease_ms / 2000)
        while not self._stop.is_set():
            sentinels = {s.process.sentinel: s for s in self.slots if s.process is not None}
            pending = [s.next_start - time.time() for s in self.slots if s.process is None]
            timeout = max(0.01, min([expire_every, *pending]))
            ready = mp.connection.wait(list(sentinels), timeout=timeout)
            if self._stop.is_set():
                return
            for sentinel in ready:
                self._worker_died(sentinels[sentinel])
            self.queue.expire_leases(max_attempts=self.settings.max_attempts)
            now = time.time()
            for slot in self.slots:
                if slot.process is None and now >= slot.next_start:
                    self._spawn(slot)

    def _worker_died(self, slot: Slot) -> None:
        proc = slot.process
        assert proc is not None
        proc.join(timeout=0)
        pid = proc.pid
        # 1. Give back what it held, now (not after the lease): nothing is lost.
        moved = 0
        for info in self.queue.workers():
            if info.pid == pid:
                moved += self.queue.release_worker(info.wid, max_attempts=self.settings.max_attempts)
        log.warning("worker %d (pid %d) exited with %s; %d items returned to their lanes",
                    slot.index, pid, proc.exitcode, moved)
        # 2. Restart with backoff: 0.5 s, doubling per restart in the last minute, at most 30 s.
        now = time.time()
        slot.history = [t for t in slot.history if now - t < 60] + [now]
        slot.restarts += 1
        slot.process = None
        slot.next_start = now + min(30.0, 0.5 * 2 ** (len(slot.history) - 1))
        if self._on_restart is not None:
            self._on_restart(slot)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker (each finishes its batch), then SIGKILL stragglers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        procs = [s.process for s in self.slots if s.process is not None]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.time() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
