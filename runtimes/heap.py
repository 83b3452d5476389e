"""The worker process's C heap: give freed pages back, keep few malloc arenas.

Its own concern apart from the device memory policy (runtimes.memory): glibc keeps
memory a worker freed (batch buffers, a load thread's arena) in the process's RSS,
which the CPU budget then reads as used. `HeapTrim` (the step loop, when idle),
`return_freed_heap` (after a load or unload) and `limit_heap_arenas` (at the
worker's start, runtimes.process) hand it back. No-ops off glibc.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_LIBC: Any = None

#: Heap trims (`HeapTrim`) at most this often: one costs a few ms on a large heap.
TRIM_EVERY_NS = 1_000_000_000


@dataclass
class HeapTrim:
    """Returns the heap freed by a worker's batches to the system when it idles, at
    most every TRIM_EVERY_NS (issue 16: worker RSS kept climbing under mixed load)."""

    trim: Callable[[], None] = field(default=lambda: return_freed_heap())
    #: (batches run, clock ns) at the last trim.
    last: tuple[int, int] = (0, 0)

    def if_due(self, batches: int, now_ns: int) -> None:
        """Nothing waits: trim if batches ran since the last trim, long enough ago."""
        seq, at = self.last
        if batches != seq and now_ns - at >= TRIM_EVERY_NS:
            self.trim()
            self.last = (batches, now_ns)


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`). Freed
    batch buffers (tokenizer output, activations under glibc's raised mmap threshold)
    otherwise stay in the worker's RSS as free heap, and it climbs with every new
    batch shape. A no-op where the C library has no malloc_trim."""
    if libc := glibc():
        libc.malloc_trim(0)


def glibc() -> Any:
    """The C library when it is glibc (it has malloc_trim and mallopt), else False."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


#: glibc's mallopt parameter for the most malloc arenas a process keeps.
M_ARENA_MAX = -8
#: Arenas a CPU worker keeps (`limit_heap_arenas`).
CPU_HEAP_ARENAS = 2


def limit_heap_arenas(arenas: int) -> bool:
    """Keep at most `arenas` malloc arenas in this process (glibc `mallopt`), unless the
    environment sets MALLOC_ARENA_MAX. Call before the process starts a thread: glibc
    fixes the limit when a thread first needs an arena of its own. Without it a worker
    that starts a thread per load (runtimes.loading) now and then took a new arena
    for one, and the freed pages it kept stayed in the worker's RSS (+27 MiB steps over
    load/unload cycles of a 57 MB reranker; flat with two). False where it does not apply."""
    if "MALLOC_ARENA_MAX" in os.environ or not (libc := glibc()):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))
