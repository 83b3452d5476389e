"""A simulated GPU: which models it holds, what a swap and a batch cost.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.sim.traffic import SimModel

SLACK_NS = 1_000_000


def find_model_to_evict(resident_lru: Sequence[int], busy: Iterable[int]) -> int:
    """The least recently used resident model that has no work waiting here; the
    least recently used one when all have (resident_lru: oldest first, non-empty)."""
    waiting = set(busy)
    for model in resident_lru:
        if model not in waiting:
            return model
    return resident_lru[0]


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
        #: Resident model indices, least recently used first.
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.free_at_ns = 0
        self.stats = DeviceStats()

    def holds(self, model: int) -> bool:
        return model in self.resident

    def busy_for_ns(self, now_ns: int) -> int:
        return max(0, self.free_at_ns - now_ns)

    def _occupy(self, device_ms: float) -> int:
        """Spend device_ms of device time; returns the (virtual) end time, monotonic ns."""
        now = time.monotonic_ns()
        start = self.free_at_ns if 0 <= now - self.free_at_ns <= self.slack_ns else now
        span = int(device_ms * self.time_scale * 1e6)
        end = self.free_at_ns = start + span
        self.stats.busy_ns += span
        delay = end - time.monotonic_ns()
        if delay > 0:
            time.sleep(delay / 1e9)
        return end

    def ensure(self, model: SimModel, busy: Iterable[int]) -> bool:
        """Make `model` resident (evicting per find_model_to_evict). True if it had to load."""
        if model.index in self.resident:
            self.resident.move_to_end(model.index)
            return False
        if len(self.resident) >= self.slots:
            del self.resident[find_model_to_evict(list(self.resident), busy)]
        before = self.stats.busy_ns
        self._occupy(model.swap_ms)
        self.stats.swaps += 1
        self.stats.swap_ns += self.stats.busy_ns - before
        self.resident[model.index] = None
        return True

    def run(self, model: SimModel, items: int, tokens: int) -> int:
        """Run one batch of `model` (which must be resident); returns its end time, monotonic ns."""
        if model.index not in self.resident:
            raise RuntimeError(f"batch for {model.name}, which is not resident: this is a bug")
        end = self._occupy(model.batch_ms(tokens))
        self.resident.move_to_end(model.index)
        s = self.stats
        s.batches += 1
        s.items += items
        s.tokens += tokens
        return end
