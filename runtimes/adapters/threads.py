"""Threads per forward by its size: a small forward on one thread, measured at load.

fleet's CPU workers run torch's OpenMP with OMP_WAIT_POLICY=PASSIVE
(runtimes/process.py): an idle thread sleeps at once instead of spinning, so the
worker never burns a core the API process or a preempted peer needs. The price
is paid by every parallel region of a forward: the calling thread wakes the
others with a futex (on a VM, an inter-processor interrupt to a halted vCPU)
and waits for the slowest. A forward of one short text is a hundred-odd tiny
regions (matmuls of a few rows, layer norms, softmax), each too small to gain
from a second thread, so the wake-ups are most of what the second thread adds:
torch's defaults hide this by spinning (libgomp's default spins ~300 000
pauses after each region), which fleet cannot afford on a shared box (one
short bf16 forward, 2 threads, load average 5-8 on the 2-core box: 195 ms p50
spinning, 117 ms with GOMP_SPINCOUNT=10000, 26 ms passive).

So a micro-batch of at most `small_tokens` padded tokens runs on one thread:
no region forks, no wake-up, no waiting on a preempted peer. Whether that pays
and up to what size is measured at load on the model's own forward
(`measure`): one thread against the worker's threads, interleaved rounds, on
growing shapes; `small_tokens` is the largest shape where one thread was at
least as fast (0: never). `fleetctl ps` shows the verdict (`info`).

Policy over threads only: which forward runs is the adapter's.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fleet.runtimes.adapters import kept
from fleet.runtimes.device import device_class

log = logging.getLogger("fleet.worker")

#: Timing rounds per shape (one thread and the worker's threads, alternating);
#: the whole measurement stops after BUDGET_S (the shapes measured by then count).
ROUNDS = 7
BUDGET_S = 1.5
#: One thread must be at least this much faster (ratio of medians) to take a shape:
#: a tie keeps the worker's threads, which win as soon as the shape grows.
MARGIN = 1.0
#: Bounds of a measured fixed cost (`Threads.fixed_tokens`), padded tokens.
FIXED_TOKENS_RANGE = (32.0, 512.0)


class Threads:
    """The worker's intra-op threads and the size below which a forward runs on one."""

    def __init__(self, torch: Any, small_tokens: int = 0, table: dict[str, str] | None = None,
                 full_ms: list[tuple[int, float]] | None = None) -> None:
        self._torch = torch
        self.full = torch.get_num_threads()
        #: Micro-batches of at most this many padded tokens run on one thread (0: none).
        self.small_tokens = small_tokens if self.full > 1 else 0
        #: Per shape measured: "1t=<ms> <n>t=<ms>".
        self.table = table or {}
        #: (padded tokens, median ms) of each shape on the worker's threads.
        self.full_ms = full_ms or []

    def fixed_tokens(self) -> float | None:
        """A forward's fixed cost in padded tokens on the worker's threads: a / b of
        the least-squares line ms = a + b x tokens through `full_ms`, within
        FIXED_TOKENS_RANGE (a noisy timing is not let to cut micro-batches to one
        text or never); None with fewer than two shapes."""
        if len(self.full_ms) < 2:
            return None
        x, y = (np.array(v, dtype=np.float64) for v in zip(*self.full_ms))
        b, a = np.polyfit(x, y, 1)
        lo, hi = FIXED_TOKENS_RANGE
        if b <= 0:  # time does not grow with tokens: the fixed cost is all of it
            return hi
        return float(min(hi, max(lo, a / b)))

    def enter(self, tokens: int) -> bool:
        """Before a forward of `tokens` padded tokens: True when it now runs on one
        thread (then `leave()` after it)."""
        if tokens <= self.small_tokens:
            self._torch.set_num_threads(1)
            return True
        return False

    def leave(self) -> None:
        self._torch.set_num_threads(self.full)

    def info(self) -> dict[str, Any]:
        return {"threads": self.full, "one_thread_up_to_tokens": self.small_tokens, "measured": self.table}


def measure(torch: Any, name: str, shapes: list[tuple[int, Callable[[], Any]]], *,
            clock: Callable[[], float] = time.perf_counter, kept_in: Path | None = None) -> Threads:
    """Threads for a model whose forward on each shape is `run()`; `shapes` as
    (padded tokens, run), smallest first. Stops at the first shape where one thread
    loses (bigger ones lose more) or when BUDGET_S is spent. `kept_in`: the model's
    folder: the verdict is kept beside it (runtimes.adapters.kept) and a reload serves it."""
    full = torch.get_num_threads()
    if full <= 1:
        return Threads(torch)
    note = f"threads-{device_class('cpu')}-t{full}"
    under = kept.key(kept_in, "cpu", torch, threads=full, shapes=",".join(str(t) for t, _ in shapes))
    if kept_in is not None and (verdict := kept.recall(kept_in, note, under)) is not None:
        log.info("threads %s: one thread up to %d tokens (kept verdict)", name, verdict["small"])
        return Threads(torch, int(verdict["small"]), dict(verdict["table"]),
                       [(int(t), float(ms)) for t, ms in verdict["full_ms"]])
    small, table, full_ms = 0, {}, []
    started = clock()
    try:
        for tokens, run in shapes:
            one: list[float] = []
            many: list[float] = []
            for n in (1, full):  # warm-up of each (oneDNN picks kernels per thread count)
                torch.set_num_threads(n)
                run()
            for r in range(ROUNDS):
                for n, into in ((1, one), (full, many)) if r % 2 == 0 else ((full, many), (1, one)):
                    torch.set_num_threads(n)
                    t0 = clock()
                    run()
                    into.append((clock() - t0) * 1e3)
            m1, mn = statistics.median(one), statistics.median(many)
            table[str(tokens)] = f"1t={m1:.2f}ms {full}t={mn:.2f}ms"
            full_ms.append((tokens, mn))
            if m1 * MARGIN > mn:
                break
            small = tokens
            if clock() - started > BUDGET_S:
                break
    finally:
        torch.set_num_threads(full)
    log.info("threads %s: one thread up to %d tokens (%s)", name, small, table)
    if kept_in is not None:
        kept.keep(kept_in, note, under, {"small": small, "table": table, "full_ms": full_ms})
    return Threads(torch, small, table, full_ms)
