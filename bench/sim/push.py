"""Push: a router pre-assigns each request to one simulated GPU's private FIFO.

The router is a reasonable one, not a straw man:
  * it routes on *expected completion*: a worker's backlog (device ms of work
    queued there, estimated as the worker will batch it: a + b*tokens per run
    of same-model requests in its FIFO, plus what its current operation has
    left) plus, when the worker neither holds the model nor has it queued,
    the load: its swap cost, twice over when the worker is full (the load
    evicts a model that will have to be loaded again). Affinity: a busy
    holder wins over an idle stranger until its backlog exceeds the load;
  * its view of the workers is a snapshot refreshed every `refresh_ms`
    (stale in between), to which it adds its own assignments as it makes
    them, so it does not herd a burst onto one worker.
Each worker runs its FIFO in order: it takes the run of requests for the
head's model at the head of its queue, loads the model if it must, and runs
what the same `form_batch` keeps of that run under the same cost-model cap
(the rest stays where it is, at the head). No returns to a shared queue, no
stealing. Same devices, swap costs, batch law and eviction
order (runtimes.memory) as the pull side; a push worker cannot wait for
room, so where plan_load says WAIT it evicts the first model in that order.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.bench.sim.device import SimDevice
from fleet.bench.sim.traffic import SimModel
from fleet.runtimes.policy import CostModel, batch_token_cap, form_batch, padded_tokens


@dataclass
class WorkerView:
    """What the router believes about one worker."""

    backlog_ms: float = 0.0  # device ms of work ahead of a new request
    models: set[int] = field(default_factory=set)  # held or queued there
    tail_model: int = -1  # model of the last request in its FIFO (-1: empty)


def added_ms(view: WorkerView, model: SimModel, tokens: int) -> float:
    """Device ms a new request adds to a worker's backlog: it joins the batch of
    the run at the FIFO's tail when that run is for the same model (b*tokens),
    else it starts a new batch (a + b*tokens)."""
    if view.tail_model == model.index:
        return model.size.b_ms_per_token * tokens
    return model.batch_ms(tokens)


def load_penalty_ms(view: WorkerView, model: int, swap_ms: float, slots: int) -> float:
    """What sending `model` to this worker costs beyond its backlog: nothing if it
    holds or has queued the model; the swap; twice the swap if that evicts."""
    if model in view.models:
        return 0.0
    return swap_ms * (2.0 if len(view.models) >= slots else 1.0)


def assign_worker(views: Sequence[WorkerView], model: int, swap_ms: float, slots: int) -> int:
    """The worker expected to finish a new request for `model` first: least
    backlog + load_penalty_ms; ties go to the smaller backlog, then the lower index."""
    return min(range(len(views)),
               key=lambda w: (views[w].backlog_ms + load_penalty_ms(views[w], model, swap_ms, slots),
                              views[w].backlog_ms, w))


class PushRouter:
    def __init__(self, workers: Sequence[PushWorker], slots: int) -> None:
        self.workers = workers
        self.slots = slots
        self.views = [WorkerView() for _ in workers]

    def refresh(self) -> None:
        """Replace the view by a fresh snapshot of every worker (one assignment, so
        `route` sees either the old or the new list, never a mix)."""
        self.views = [w.snapshot() for w in self.workers]

    def route(self, model: SimModel, tokens: int) -> int:
        views = self.views
        w = assign_worker(views, model.index, model.swap_ms, self.slots)
        v = views[w]
        v.backlog_ms += added_ms(v, model, tokens)
        v.models.add(model.index)
        v.tail_model = model.index
        return w


@dataclass(slots=True)
class _Item:
    rid: int
    model: int
    tokens: int


class PushWorker:
    def __init__(self, index: int, device: SimDevice, models: list[SimModel], recorder) -> None:
        self.index = index
        self.device = device
        self.models = models
        self.recorder = recorder
        self.fifo: deque[_Item] = deque()
        self.cond = threading.Condition()
        self.queued_models: Counter[int] = Counter()
        #: Resident models as last published by the worker thread (the device's dict is its own).
        self.resident_view: frozenset[int] = frozenset()

    def enqueue(self, item: _Item) -> None:
        with self.cond:
            self.fifo.append(item)
            self.queued_models[item.model] += 1
            self.cond.notify()

    def snapshot(self) -> WorkerView:
        """The worker's own account of its backlog: its FIFO costed run by run, as it
        will batch it (one a per run of same-model requests), plus its current operation."""
        busy_ms = self.device.busy_for_ns(time.monotonic_ns()) / 1e6 / self.device.time_scale
        models = self.models
        with self.cond:
            backlog, last = busy_ms, -1
            for it in self.fifo:
                m = models[it.model]
                backlog += m.size.b_ms_per_token * it.tokens + (m.size.a_ms if it.model != last else 0.0)
                last = it.model
            return WorkerView(backlog, set(self.queued_models) | self.resident_view, last)

    def clear(self) -> int:
        """Drop every request still queued (end of a step); returns how many."""
        with self.cond:
            n = len(self.fifo)
            self.fifo.clear()
            self.queued_models.clear()
            return n

    def loop(self, stop: threading.Event, idle_wait_s: float, target_ms: float) -> None:
        dev, cond, fifo, done = self.device, self.cond, self.fifo, self.recorder.done
        costs: dict[int, CostModel] = {}
        while not stop.is_set():
            with cond:
                if not fifo:
                    cond.wait(idle_wait_s)
                    continue
                model = self.models[fifo[0].model]
                waiting = dict(self.queued_models)
            # Load outside the lock (the router keeps appending); only this thread pops,
            # so the head is still this model afterwards.
            if dev.ensure(model, waiting):
                self.resident_view = frozenset(dev.resident)
            prof = model.profile
            cost = costs.setdefault(model.index, CostModel())
            cap = batch_token_cap(cost, target_ms, prof.max_batch_tokens)
            with cond:
                run, total = [], 0
                for item in fifo:
                    if (item.model != model.index or len(run) == prof.max_batch_items
                            or (run and total + item.tokens > cap)):
                        break
                    run.append(item)
                    total += item.tokens
                keep = form_batch([it.tokens for it in run], [0] * len(run), prof.max_batch_items, cap)
                for _ in run:
                    fifo.popleft()
                kept = set(keep)
                fifo.extendleft(reversed([it for i, it in enumerate(run) if i not in kept]))
                batch = [run[i] for i in keep]
                self.queued_models[model.index] -= len(batch)
                if self.queued_models[model.index] <= 0:
                    del self.queued_models[model.index]
            tokens = [it.tokens for it in batch]
            end = dev.run(model, len(tokens), sum(tokens))
            for it in batch:
                done(it.rid, end)
            cost.observe(padded_tokens(tokens), model.batch_ms(sum(tokens)))


class PushSystem:
    name = "push"

    def __init__(self, models: list[SimModel], workers: int, slots: int, recorder, *, time_scale: float = 1.0,
                 refresh_ms: float = 50.0, target_ms: float = 250.0, idle_wait_s: float = 0.25) -> None:
        self.models = models
        self.time_scale = time_scale
        self.devices = [SimDevice(slots, time_scale) for _ in range(workers)]
        self.workers = [PushWorker(i, d, models, recorder) for i, d in enumerate(self.devices)]
        self.router = PushRouter(self.workers, slots)
        self.refresh_s = refresh_ms * time_scale / 1e3
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=w.loop, args=(self._stop, idle_wait_s * time_scale, target_ms),
                                          name=f"push-gpu{w.index}", daemon=True) for w in self.workers]
        self._threads.append(threading.Thread(target=self._refresh, name="push-view", daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, rid: int, model: SimModel, tokens: int, payload: memoryview) -> bool:
        w = self.router.route(model, tokens)
        self.workers[w].enqueue(_Item(rid, model.index, tokens))
        return True

    def cancel_waiting(self) -> int:
        return sum(w.clear() for w in self.workers)

    def close(self) -> None:
        self._stop.set()
        for w in self.workers:
            with w.cond:
                w.cond.notify_all()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout=5 * self.time_scale + 5)

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.router.refresh()
