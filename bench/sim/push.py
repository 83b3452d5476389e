"""Push: a router pre-assigns each request to one simulated GPU's private FIFO.

The router is a reasonable one, not a straw man:
  * it routes on *expected completion*: a worker's backlog (device ms of work
    queued there, estimated a + b*tokens per request, plus what its current
    operation has left) plus the model's swap cost when the worker neither
    holds the model nor has it queued (affinity: a busy holder wins over an
    idle stranger until its backlog exceeds the swap);
  * its view of the workers is a snapshot refreshed every `refresh_ms`
    (stale in between), to which it adds its own assignments as it makes
    them, so it does not herd a burst onto one worker.
Each worker runs its FIFO in order: it takes the run of requests for the
head's model at the head of its queue (within the model's profile budget,
through the same `form_batch`), loads the model if it must, runs the batch.
No returns, no stealing. Same devices, swap costs, batch law and eviction
rule as the pull side.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.device import SimDevice
from bench.sim.traffic import SimModel
from runtimes.policy import form_batch


@dataclass
class WorkerView:
    """What the router believes about one worker."""

    backlog_ms: float = 0.0  # device ms of work ahead of a new request
    models: set[int] = field(default_factory=set)  # held or queued there


def assign_worker(views: Sequence[WorkerView], model: int, swap_ms: float) -> int:
    """The worker expected to finish a new request for `model` first: least
    backlog + (swap_ms unless it holds or has queued the model); ties go to
    the smaller backlog, then the lower index."""
    return min(range(len(views)),
               key=lambda w: (views[w].backlog_ms + (0.0 if model in views[w].models else swap_ms),
                              views[w].backlog_ms, w))


class PushRouter:
    def __init__(self, workers: Sequence[PushWorker]) -> None:
        self.workers = workers
        self.views = [WorkerView() for _ in workers]

    def refresh(self) -> None:
        """Replace the view by a fresh snapshot of every worker (one assignment, so
        `route` sees either the old or the new list, never a mix)."""
        self.views = [w.snapshot() for w in self.workers]

    def route(self, model: SimModel, tokens: int) -> int:
        views = self.views
        w = assign_worker(views, model.index, model.swap_ms)
        views[w].backlog_ms += model.batch_ms(tokens)
        views[w].models.add(model.index)
        return w


@dataclass(slots=True)
class _Item:
    rid: int
    model: int
    tokens: int
    est_ms: float


class PushWorker:
    def __init__(self, index: int, device: SimDevice, models: list[SimModel], recorder) -> None:
        self.index = index
        self.device = device
        self.models = models
        self.recorder = recorder
        self.fifo: deque[_Item] = deque()
        self.cond = threading.Condition()
        self.queued_ms = 0.0
        self.queued_models: Counter[int] = Counter()
        #: Resident models as last published by the worker thread (the device's dict is its own).
        self.resident_view: frozenset[int] = frozenset()

    def enqueue(self, item: _Item) -> None:
        with self.cond:
            self.fifo.append(item)
            self.queued_ms += item.est_ms
            self.queued_models[item.model] += 1
            self.cond.notify()

    def snapshot(self) -> WorkerView:
        busy_ms = self.device.busy_for_ns(time.monotonic_ns()) / 1e6 / self.device.time_scale
        with self.cond:
            return WorkerView(self.queued_ms + busy_ms, set(self.queued_models) | self.resident_view)

    def clear(self) -> int:
        """Drop every request still queued (end of a step); returns how many."""
        with self.cond:
            n = len(self.fifo)
            self.fifo.clear()
            self.queued_ms = 0.0
            self.queued_models.clear()
            return n

    def loop(self, stop: threading.Event, idle_wait_s: float) -> None:
        dev, cond, fifo, done = self.device, self.cond, self.fifo, self.recorder.done
        while not stop.is_set():
            with cond:
                if not fifo:
                    cond.wait(idle_wait_s)
                    continue
                model = self.models[fifo[0].model]
                busy = list(self.queued_models)
            # Load outside the lock (the router keeps appending); only this thread pops,
            # so the head is still this model afterwards.
            if dev.ensure(model, busy):
                self.resident_view = frozenset(dev.resident)
            prof = model.profile
            with cond:
                run, total = [], 0
                for item in fifo:
                    if item.model != model.index or len(run) == prof.max_batch_items:
                        break
                    run.append(item.tokens)
                    total += item.tokens
                    if total > prof.max_batch_tokens:
                        break
                keep = form_batch(run, prof.max_batch_items, prof.max_batch_tokens)
                batch = [fifo.popleft() for _ in range(keep)]
                self.queued_ms -= sum(it.est_ms for it in batch)
                self.queued_models[model.index] -= keep
                if self.queued_models[model.index] <= 0:
                    del self.queued_models[model.index]
            end = dev.run(model, keep, sum(it.tokens for it in batch))
            for it in batch:
                done(it.rid, end)


class PushSystem:
    name = "push"

    def __init__(self, models: list[SimModel], workers: int, slots: int, recorder, *, time_scale: float = 1.0,
                 refresh_ms: float = 50.0, idle_wait_s: float = 0.25) -> None:
        self.models = models
        self.time_scale = time_scale
        self.devices = [SimDevice(slots, time_scale) for _ in range(workers)]
        self.workers = [PushWorker(i, d, models, recorder) for i, d in enumerate(self.devices)]
        self.router = PushRouter(self.workers)
        self.refresh_s = refresh_ms * time_scale / 1e3
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=w.loop, args=(self._stop, idle_wait_s * time_scale),
                                          name=f"push-gpu{w.index}", daemon=True) for w in self.workers]
        self._threads.append(threading.Thread(target=self._refresh, name="push-view", daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, rid: int, model: SimModel, tokens: int, payload: memoryview) -> bool:
        w = self.router.route(model, tokens)
        self.workers[w].enqueue(_Item(rid, model.index, tokens, model.batch_ms(tokens)))
        return True

    def cancel_waiting(self) -> int:
        return sum(w.clear() for w in self.workers)

    def close(self) -> None:
        self._stop.set()
        for w in self.workers:
            with w.cond:
                w.cond.notify_all()
        for t in self._threads:
            t.join(timeout=5 * self.time_scale + 5)

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.router.refresh()
