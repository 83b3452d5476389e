"""Pull: the real `local_queue` and the real `runtimes.worker.WorkerCore`, on simulated GPUs.

One lane per model in a real shared-memory `LocalQueue`; the arrival thread
`put`s each request into its model's lane. Each simulated GPU is a thread
running a real `WorkerCore` (`step()` in a loop, as `runtimes.process` does),
so lane choice, the load decision (`runtimes.placement.decide_load`: the herd
rule, eviction, room on other devices), head-first claims, linger, over-pull
returns, the deadline drop, the cost model and the published worker info are
the product's own. Only its effects are simulated (STYLE.md 3, injected):

* the model: `SimAdapter`, whose load spends the model's swap time and whose
  `run_batch` spends its batch time on the worker's `SimDevice` (sleeping:
  eight simulated GPUs share two cores) and returns the batch's device end time;
* the device memory: a budget of `slots` models, each one SLOT_BYTES (so the
  real eviction rule places them), nothing else using the device;
* the footprint estimate (`Residency.estimate_footprint`): one slot, no file read.

Times are wall time = device time x `time_scale`: the settings that are times
(the wait bound, the batch target, step timeouts) are scaled, and the cost
model fits the wall time it measures. A collector thread drains
`wait_results`, as the daemon does; a result's body is its batch's device end
time (int64 ns), so latency is measured the same way on both sides.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec

from fleet.bench.sim.device import SimDevice
from fleet.bench.sim.traffic import SimModel
from fleet.config import Settings
from fleet.local_queue import LocalQueue, QueueFull
from fleet.runtimes.base import Adapter, ModelSpec
from fleet.runtimes.device_memory import DeviceMemory
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.hosting import Hosting
from fleet.runtimes.worker import WorkerCore

#: One simulated model's size: a device holds `slots` of them.
SLOT_BYTES = 1 << 30


class SimRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request as the daemon would queue it: its token estimate and its text's bytes."""

    tokens: int
    text: bytes


class SimEnvelope(msgspec.Struct, frozen=True, array_like=True):
    """`fleet.messages.Envelope` with the sim's body: the batch's device end time."""

    queue_ms: float
    inference_ms: float
    served_by: str
    body: int


class SimAdapter(Adapter):
    """A model on a simulated GPU. Subclassed per worker with `sim_device` and `sim_models`."""

    request_type = SimRequest
    sim_device: SimDevice
    sim_models: dict[str, SimModel]

    def load(self) -> None:
        self.sim_device.load(self.sim_models[self.spec.name], [])

    def footprint_bytes(self) -> int:
        return SLOT_BYTES

    def run_batch(self, requests: list[SimRequest]) -> list[int]:
        end = self.sim_device.run(self.sim_models[self.spec.name], len(requests), sum(r.tokens for r in requests))
        return [end] * len(requests)

    def unload(self) -> None:
        self.sim_device.evict(self.sim_models[self.spec.name].index)


def keep_freed(device: str) -> None:
    """A simulated device has no allocator to give memory back to."""


class PullSystem:

    def __init__(self, models: list[SimModel], workers: int, slots: int, recorder, *, time_scale: float = 1.0,
                 settings: Settings | None = None, queue_slots: int = 1 << 16) -> None:
        settings = settings or Settings()
        self.name = "pull"
        self.models = models
        self.by_name = {m.name: m for m in models}
        self.recorder = recorder
        self.time_scale = time_scale
        self.queue = LocalQueue.create(slots=queue_slots, slab_bytes=256 << 20,
                                       max_lanes=max(256, len(models) + workers), max_workers=max(64, workers))
        self.lanes = [self.queue.lane_id(m.name) for m in models]
        self.devices = [SimDevice(slots, time_scale) for _ in range(workers)]
        # The daemon's settings, times scaled to wall time (the worker process loop's 0.25 s wait too).
        self.step_timeout_s = 0.25 * time_scale
        self.cores = [self._core(w, slots, settings) for w in range(workers)]
        self._encode = msgspec.msgpack.Encoder().encode
        self._put_ids: dict[int, int] = {}  # request id -> put id, until its result is collected
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(core,), name=f"pull-gpu{w}", daemon=True)
                         for w, core in enumerate(self.cores)]
        self._threads.append(threading.Thread(target=self._collect, name="pull-collector", daemon=True))

    def _core(self, w: int, slots: int, settings: Settings) -> WorkerCore:
        device = f"sim-gpu{w}"
        adapter = type(f"SimAdapter{w}", (SimAdapter,), {"sim_device": self.devices[w], "sim_models": self.by_name})
        profiles = {m.name: m.profile for m in self.models}

        def resolve(name: str) -> ModelSpec:
            return ModelSpec(name, Path("/nonexistent"), "embed", "sim", profile=profiles[name])

        wid = self.queue.register_worker(os.getpid(), device)
        scale = self.time_scale
        core = WorkerCore(
            self.queue, wid, device, resolve, adapter_for=lambda task, runtime: adapter, served_by=f"sim/{w}",
            lease_ms=int(settings.lease_ms * scale), max_wait_ms=int(settings.lane_max_wait_ms * scale),
            target_ms=settings.batch_target_ms * scale, linger_ms=settings.linger_ms * scale,
            hosting=Hosting(memory=DeviceMemory(device, slots * SLOT_BYTES, lambda: 1 << 62, "simulated"),
                            estimate_footprint=lambda spec: Footprint(SLOT_BYTES), return_freed=keep_freed),
        )
        core.publish_info()
        return core

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, rid: int, model: SimModel, tokens: int, payload: memoryview) -> bool:
        """Enqueue one request; False when the queue is full (the daemon answers 429)."""
        try:
            self._put_ids[rid] = self.queue.put(self.lanes[model.index], self._encode(SimRequest(tokens, payload)),
                                                tokens=tokens, request_id=rid)
        except QueueFull:
            return False
        return True

    def cancel_waiting(self) -> int:
        """Drop every request still queued (end of a step); returns how many."""
        ids, self._put_ids = self._put_ids, {}
        return sum(self.queue.cancel(pid) for pid in ids.values())

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout=5 * self.time_scale + 5)
        for core in self.cores:
            self.queue.unregister_worker(core.worker_id)
        self.queue.close()
        self.queue.unlink()

    def _work(self, core: WorkerCore) -> None:
        while not self._stop.is_set():
            core.step(timeout_s=self.step_timeout_s)

    def _collect(self) -> None:
        decode, done = msgspec.msgpack.Decoder(SimEnvelope).decode, self.recorder.done
        while not self._stop.is_set():
            for d in self.queue.wait_results(0.1):
                done(d.request_id, decode(d.result).body)
                self._put_ids.pop(d.request_id, None)
