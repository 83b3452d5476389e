"""Pull: the real `local_queue` and the real worker policy, on simulated GPUs.

One lane per model in a real shared-memory `LocalQueue`; the arrival thread
`put`s each request into its model's lane. Each simulated GPU is a worker
thread registered with the queue that runs the same round as
`runtimes.worker.WorkerCore.step`: `choose_lane` over `lane_stats`, load the
model if it must (its requests stay queued meanwhile), `claim` within the
model's profile budget, `form_batch` and `return_items` for over-pull, run,
`ack_many`. A collector thread drains `wait_results`, as the daemon does. The
result of an item is its batch's device end time (int64 ns), so latency is
measured the same way on both sides.
"""

from __future__ import annotations

import os
import struct
import threading
import time

from bench.sim.device import SimDevice
from bench.sim.traffic import SimModel
from local_queue import LocalQueue, QueueFull
from runtimes.policy import choose_lane, form_batch

_END = struct.Struct("<q")


class PullSystem:
    name = "pull"

    def __init__(self, models: list[SimModel], workers: int, slots: int, recorder, *, time_scale: float = 1.0,
                 max_wait_ms: float = 2000.0, idle_wait_s: float = 0.25, lease_ms: int = 60_000,
                 queue_slots: int = 1 << 16) -> None:
        self.models = models
        self.by_name = {m.name: m for m in models}
        self.recorder = recorder
        self.time_scale = time_scale
        # WorkerCore's defaults (max_wait_ms 2000, the process loop's 0.25 s wait), in wall time.
        self.max_wait_ns = int(max_wait_ms * time_scale * 1e6)
        self.idle_wait_s = idle_wait_s * time_scale
        self.lease_ms = lease_ms
        self.queue = LocalQueue.create(slots=queue_slots, slab_bytes=256 << 20,
                                       max_lanes=max(256, len(models)), max_workers=max(64, workers))
        self.lanes = [self.queue.lane_id(m.name) for m in models]
        self.devices = [SimDevice(slots, time_scale) for _ in range(workers)]
        self._put_ids: dict[int, int] = {}  # request id -> put id, until its result is collected
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(w,), name=f"pull-gpu{w}", daemon=True)
                         for w in range(workers)]
        self._threads.append(threading.Thread(target=self._collect, name="pull-collector", daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, rid: int, model: SimModel, tokens: int, payload: memoryview) -> bool:
        """Enqueue one request; False when the queue is full (the daemon answers 429)."""
        try:
            self._put_ids[rid] = self.queue.put(self.lanes[model.index], payload, tokens=tokens, request_id=rid)
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
            t.join(timeout=5 * self.time_scale + 5)
        self.queue.close()
        self.queue.unlink()

    # -- threads -----------------------------------------------------------------
    def _work(self, w: int) -> None:
        q, dev, models, by_name = self.queue, self.devices[w], self.models, self.by_name
        wid = q.register_worker(os.getpid(), f"sim-gpu{w}")
        pack = _END.pack
        while not self._stop.is_set():
            # 1. Choose a lane: starving first, then models held here, then oldest.
            stats = q.lane_stats()
            held = {models[i].name for i in dev.resident}
            lane = choose_lane(stats, held, time.monotonic_ns(), self.max_wait_ns)
            if lane is None:
                q.wait_for_work(self.idle_wait_s)
                continue
            # 2. Load before claiming: while the model loads its requests stay in the lane,
            #    where any worker that already holds it can take them.
            model = by_name[lane.model]
            dev.ensure(model, [by_name[s.model].index for s in stats if s.depth > 0])
            # 3. Claim within the profile budget, give back what does not fit.
            prof = model.profile
            claims = q.claim(lane.lane, worker=wid, max_items=prof.max_batch_items,
                             max_tokens=prof.max_batch_tokens, lease_ms=self.lease_ms)
            if not claims:
                continue
            keep = form_batch([c.tokens for c in claims], prof.max_batch_items, prof.max_batch_tokens)
            if keep < len(claims):
                q.return_items([c.item_id for c in claims[keep:]])
                claims = claims[:keep]
            # 4. Run and ack the whole batch in one call.
            end = pack(dev.run(model, len(claims), sum(c.tokens for c in claims)))
            q.ack_many([(c.item_id, end, 0) for c in claims])
            del claims  # payload views into the slab
        q.unregister_worker(wid)

    def _collect(self) -> None:
        unpack, done = _END.unpack, self.recorder.done
        while not self._stop.is_set():
            for d in self.queue.wait_results(0.1):
                done(d.request_id, unpack(d.result)[0])
                self._put_ids.pop(d.request_id, None)
