"""A model load beside serving: its own thread, while the step loop serves the models already here.

A load is seconds to minutes of building modules, reading weights and
measuring (dtype, trace, threads: runtimes.adapters.hf_common, runtimes.adapters.traced,
runtimes.adapters.threads). Run on the step loop, it held every model already resident
on the worker for as long (issue 42: a 265 MB reranker's load held the default
embedder's requests 16.5 s; an 88 s load turned them into timeouts). So
`Residency.ensure` sizes, decides and evicts on the step loop as before, and
hands the load itself to a `PendingLoad`: one thread that builds the adapter and
runs its `load()`, nothing else. The step loop keeps serving; it installs the
adapter (`Residency.settle_load`) once the thread is done, so `Residency.models`
keeps one writer.

Invariants:
- one load at a time per worker (`Residency.pending`), under the device's
  LoadLock from the decision to the settling: the other workers of the device
  find the lock held, and this worker's `loading` in its info blob;
- the thread touches only the adapter it builds and the `load` slot of the
  worker's `Progress` (the heartbeat bounds it by Settings.load_timeout_ms, as it
  bounded a load on the step loop);
- its torch intra-op threads are the worker's: the probes of the load measure
  what serving runs (a thread count torch gives a new thread could differ);
- a thread per load: a CPU worker keeps two malloc arenas (runtimes.heap.
  limit_heap_arenas), so a new thread reuses one instead of adding an arena whose
  freed pages stay in the worker's RSS (+27 MiB steps over load/unload cycles
  without the limit); a load thread kept for the worker's life held ~50 MiB more.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.runtimes.base import Adapter, ModelSpec
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import NotNow
from fleet.runtimes.state import Progress


@dataclass(eq=False)
class PendingLoad:
    """A load running beside serving, and what settling it needs."""

    spec: ModelSpec
    #: The footprint read from its headers, and the estimate the decision used.
    header: Footprint
    estimate: Footprint
    #: Keep it pinned once loaded (a preload or a persisted pin: `Residency.restore`).
    pin: bool = False
    #: Models evicted to make room for it, in eviction order.
    evicted: list[str] = field(default_factory=list)
    #: Control commands answered when it settles (runtimes.commands): (item id, command, perf_counter at claim).
    waiters: list = field(default_factory=list)
    #: Set by the thread before `done`: the adapter loaded, or why not; the load's wall time.
    adapter: Adapter | None = None
    error: BaseException | None = None
    load_ms: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self, build: Callable[[], Adapter], progress: Progress, bound_ms: float) -> None:
        """Run `build()` on a thread of its own (daemon: a stopping worker does not wait for it)."""
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else 0
        threading.Thread(target=self._run, args=(build, progress, bound_ms, threads), name=f"load-{self.name}",
                         daemon=True).start()

    def _run(self, build: Callable[[], Adapter], progress: Progress, bound_ms: float, threads: int) -> None:
        t0 = time.perf_counter()
        try:
            if threads:
                sys.modules["torch"].set_num_threads(threads)
            with progress.running(f"loading {self.name}", bound_ms, slot="load"):
                self.adapter = build()
        except BaseException as exc:  # settled on the step loop (`Residency.settle_load`)
            # The traceback's frames hold the half-loaded model: let it go now.
            traceback.clear_frames(exc.__traceback__)
            self.error = exc
        finally:
            self.load_ms = (time.perf_counter() - t0) * 1e3
            self.done.set()


class LoadRuns(NotNow):
    """The model this worker loads now is not ready, and other work waits here: serve
    that first (the load goes on beside it; its requests stay queued)."""

    def __init__(self, load: PendingLoad, device: str) -> None:
        super().__init__(f"{load.name} is loading on {device}; its requests wait for it")
        self.load = load
