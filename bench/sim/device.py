"""A simulated GPU: which models it holds, what a swap and a batch cost.

Pull's workers (real `WorkerCore`s) decide what to load and evict themselves
and tell the device (`load`, `evict`). The push router's workers use `ensure`,
decided by the real `runtimes.memory.plan_load` (one slot = one model's
footprint): evict the models with no waiting requests first, least recently
used with the reload cost credited as recency; WAIT rather than evict a model
busier than the one coming in.

Device time is spent by sleeping (`time.sleep` releases the CPU, so eight
simulated GPUs run side by side on two cores). The device keeps its own
virtual clock so that sleep overshoot and short host work do not count as
device time: an operation that follows the previous one within `slack_ns`
starts when that one ended (a real GPU has the next kernel queued), otherwise
when it is issued. Wall time = device time x `time_scale`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.bench.sim.traffic import SimModel
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import LOAD, LoadPlan, ResidentView, eviction_order, plan_load

SLACK_NS = 1_000_000
#: A resident model's footprint: memory is counted in slots, one model per slot.
SLOT = Footprint(weights_bytes=1)


@dataclass
class DeviceStats:
    batches: int = 0
    items: int = 0
    tokens: int = 0
    swaps: int = 0
    busy_ns: int = 0  # device time spent (wall ns), swaps included
    swap_ns: int = 0


class SimDevice:
    def __init__(self, slots: int, time_scale: float = 1.0, slack_ns: int = SLACK_NS) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self.time_scale = time_scale
        self.slack_ns = slack_ns
        #: Resident model indices, least recently used first; last use (device s) and reload cost (s).
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.last_used: dict[int, float] = {}
        self.reload_s: dict[int, float] = {}
        self.free_at_ns = 0
        self.stats = DeviceStats()

    def holds(self, model: int) -> bool:
        return model in self.resident

    def busy_for_ns(self, now_ns: int) -> int:
        return max(0, self.free_at_ns - now_ns)

    def _occupy(self, device_ms: float, *, swap: bool = False) -> int:
        """Spend device_ms of device time; returns the (virtual) end time, monotonic ns.
        Counted when issued (before the sleep), busy and swap time alike."""
        now = time.monotonic_ns()
        start = self.free_at_ns if 0 <= now - self.free_at_ns <= self.slack_ns else now
        span = int(device_ms * self.time_scale * 1e6)
        end = self.free_at_ns = start + span
        self.stats.busy_ns += span
        if swap:
            self.stats.swap_ns += span
        delay = end - time.monotonic_ns()
        if delay > 0:
            time.sleep(delay / 1e9)
        return end

    def _views(self, waiting: Mapping[int, int]) -> list[ResidentView]:
        return [ResidentView(str(i), 0, SLOT, False, self.last_used[i], self.reload_s[i], waiting.get(i, 0))
                for i in self.resident]

    def plan_load(self, model: SimModel, waiting: Mapping[int, int]) -> LoadPlan:
        """runtimes.memory.plan_load for `model` (not resident) with `waiting`: model index -> queued items."""
        return plan_load(model.name, SLOT, self._views(waiting), worker=0, device="sim",
                         budget_bytes=self.slots * SLOT.weights_bytes, free_now_bytes=1 << 62,
                         incoming_waiting=waiting.get(model.index, 0))

    def load(self, model: SimModel, evict: list[int]) -> None:
        """Evict `evict` (model indices), then spend the swap loading `model`."""
        for i in evict:
            del self.resident[i]
        if len(self.resident) >= self.slots:
            raise RuntimeError(f"loading {model.name} into a full device: this is a bug")
        self.stats.swaps += 1
        self._occupy(model.swap_ms, swap=True)
        self.resident[model.index] = None
        self.reload_s[model.index] = model.swap_ms / 1e3
        self._touch(model.index)

    def evict(self, model: int) -> None:
        """Take model index `model` off the device (its worker decided to)."""
        del self.resident[model]

    def ensure(self, model: SimModel, waiting: Mapping[int, int]) -> bool:
        """Make `model` resident, whatever it takes (a worker that must run its head
        item): evict per plan_load, or, when it says WAIT, the first model in its
        eviction order regardless. True if it had to load."""
        if model.index in self.resident:
            self._touch(model.index)
            return False
        plan = self.plan_load(model, waiting)
        if plan.verdict == LOAD:
            evict = [int(n) for n in plan.evict]
        else:
            evict = [int(min(self._views(waiting), key=eviction_order).name)]
        self.load(model, evict)
        return True

    def _touch(self, i: int) -> None:
        self.resident.move_to_end(i)
        self.last_used[i] = time.monotonic() / self.time_scale  # device seconds, like reload_s

    def run(self, model: SimModel, items: int, tokens: int) -> int:
        """Run one batch of `model` (which must be resident); returns its end time, monotonic ns."""
        if model.index not in self.resident:
            raise RuntimeError(f"batch for {model.name}, which is not resident: this is a bug")
        end = self._occupy(model.batch_ms(tokens))
        self._touch(model.index)
        s = self.stats
        s.batches += 1
        s.items += items
        s.tokens += tokens
        return end
