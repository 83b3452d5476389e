"""Device memory policy: what fits on a device, what to evict, what a failed load answers.

Pure policy over plain data (STYLE.md 3), tested with tables: `fits_on_device`,
`find_model_to_evict`, and `plan_load`, which composes them into one decision:
load now (after evicting these), wait (the room is held by models with more
demand), or never (`model_too_large`, naming what holds the memory); then
`load_error` and `run_split_on_oom` for the memory a load or a batch could not
get. What it reads comes from its neighbours: a model's `Footprint` from
runtimes.footprint (headers, corrected by measurement), a device's budget and
free memory from runtimes.device_memory (the effects, injected into the worker).

Units: bytes everywhere; times in seconds (wall clock, `time.time()`).

Accounting. A device's `used` is the weights of every model resident on it
(all workers on the device, read from their info blobs; a generator's counts
the key/value cache its admitted sequences reserve) plus, per worker, the
largest activation allowance among its models: a worker runs one batch at a
time, so its models share one activation area; two workers on one device can
run batches at once, so their areas add up.

No torch import: the daemon imports this module.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fleet.runtimes.footprint import Footprint

log = logging.getLogger("fleet.worker")

#: The library each runtime imports on its first load. The worker imports it
#: before timing a load: a one-time import is not part of a reload's cost.
RUNTIME_LIBRARIES = {"sentence-transformers": "sentence_transformers", "transformers": "transformers", "peft": "peft"}
#: Reload cost credit: a model that takes s seconds to load counts as used s
#: seconds more recently when choosing what to evict (cheap reloads go first).
RELOAD_CREDIT = 1.0


# ---- policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidentView:
    """One model resident on the device, as the policy sees it."""

    name: str
    worker: int
    footprint: Footprint
    pinned: bool = False
    last_used: float = 0.0
    #: Seconds its last load took (what evicting it costs when it is needed again).
    reload_s: float = 0.0
    #: Items queued for it now.
    waiting: int = 0
    #: When it finished loading (wall clock, seconds).
    loaded_at: float = 0.0


@dataclass(frozen=True)
class LoadPlan:
    verdict: str  # LOAD | WAIT | TOO_LARGE
    evict: tuple[str, ...] = ()
    reason: str = ""


LOAD, WAIT, TOO_LARGE = "load", "wait", "too_large"

#: Demand credited to an explicit load or pin (an operator asked): it may
#: evict unpinned models even while requests wait for them.
EXPLICIT_DEMAND = 1 << 30
#: A peer whose heartbeat is older than this is not counted (its memory is
#: being given back; the supervisor releases dead workers at once).
PEER_STALE_NS = 30 * 1_000_000_000
#: How long a worker naps when the only waiting work is not its to serve.
IDLE_NAP_S = 0.02


class NotNow(Exception):
    """Not a failure: this worker should not load the model now (another worker
    of the device holds or loads it, or its room is held by busier models).
    Its requests stay queued."""


def used_bytes(residents: Iterable[ResidentView]) -> int:
    """Weights of all, plus the largest activation allowance per worker."""
    weights = 0
    act: dict[int, int] = {}
    for r in residents:
        weights += r.footprint.weights_bytes
        act[r.worker] = max(act.get(r.worker, 0), r.footprint.activation_bytes)
    return weights + sum(act.values())


def fits_on_device(budget_bytes: int, free_now_bytes: int, residents: list[ResidentView],
                   incoming: Footprint, worker: int) -> bool:
    """Would `incoming`, loaded by `worker`, fit next to `residents`?

    Both limits hold: the budget (what fleet may use on this device) and the
    memory free right now (other processes use the device too). `free_now`
    is measured with the residents loaded, so only the new bytes count there.
    """
    after = residents + [ResidentView("", worker, incoming)]
    grow = used_bytes(after) - used_bytes(residents)
    return used_bytes(after) <= budget_bytes and grow <= free_now_bytes


def eviction_order(r: ResidentView) -> tuple[int, float]:
    """Sort key: no waiting requests first, then least recently used, with
    the reload cost credited as recency."""
    return (r.waiting, r.last_used + RELOAD_CREDIT * r.reload_s)


def find_model_to_evict(residents: list[ResidentView], worker: int, incoming_waiting: int) -> ResidentView | None:
    """The model `worker` should evict next to make room, or None.

    Only the worker's own models (one owner per device memory, STYLE.md 5),
    never a pinned one, and never one with waiting requests for a model that
    has no more waiting than it: a busy model is not thrown out for a quiet
    one (its queue drains first, then it is evictable).
    """
    candidates = [
        r for r in residents
        if r.worker == worker and not r.pinned and (r.waiting == 0 or r.waiting < incoming_waiting)
    ]
    return min(candidates, key=eviction_order, default=None)


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def plan_load(name: str, incoming: Footprint, residents: list[ResidentView], *, worker: int, device: str,
              budget_bytes: int, free_now_bytes: int, incoming_waiting: int = 0) -> LoadPlan:
    """Decide how `worker` can load `name` on `device`.

    1. It fits: load.
    2. Evict `find_model_to_evict` one by one until it fits: load after those.
    3. It would fit if models that are busy now were evicted: wait (its
       requests stay queued; the busy queues drain, then step 2 succeeds).
    4. Not even evicting every unpinned model of this worker makes room:
       `too_large`, naming what holds the memory.
    """
    left = list(residents)
    free = free_now_bytes
    evict: list[str] = []
    while not fits_on_device(budget_bytes, free, left, incoming, worker):
        victim = find_model_to_evict(left, worker, incoming_waiting)
        if victim is None:
            break
        left.remove(victim)
        free += victim.footprint.weights_bytes
        evict.append(victim.name)
    else:
        return LoadPlan(LOAD, tuple(evict))
    # Could it fit if this worker's busy unpinned models went too?
    movable = [r for r in left if r.worker == worker and not r.pinned]
    fixed = [r for r in left if r not in movable]
    free_all = free + sum(r.footprint.weights_bytes for r in movable)
    if movable and fits_on_device(budget_bytes, free_all, fixed, incoming, worker):
        busy = ", ".join(f"{r.name} ({r.waiting} waiting)" for r in movable)
        return LoadPlan(WAIT, (), f"{name} waits for room held by busier models: {busy}")
    return LoadPlan(TOO_LARGE, (), too_large_reason(name, incoming, fixed, device=device,
                                                    budget_bytes=budget_bytes, free_now_bytes=free_all))


def budget_setting(device: str) -> str:
    """The settings that size `device`'s budget, for a model that cannot fit in it."""
    if device.startswith("cuda"):
        return ("the budget is the GPU's memory less gpu_reserve_bytes (FLEET_GPU_RESERVE_BYTES): lower it, or "
                "serve the model on a larger GPU")
    return ("raise cpu_budget_bytes (FLEET_CPU_BUDGET_BYTES; 0 = cpu_budget_fraction of the available RAM) in "
            "config.toml, then restart the daemon")


def too_large_reason(name: str, incoming: Footprint, holders: list[ResidentView], *, device: str,
                     budget_bytes: int, free_now_bytes: int) -> str:
    """One clear sentence: what the model needs, what the device allows, who holds the rest."""
    need = f"{name} needs {_mb(incoming.total_bytes)} ({_mb(incoming.weights_bytes)} weights + " \
           f"{_mb(incoming.activation_bytes)} activations)"
    if incoming.total_bytes > budget_bytes:
        smaller = (", or lower its profile's max_batch_tokens (models.toml) for smaller batches"
                   if incoming.activation_bytes > incoming.weights_bytes else "")
        return f"{need}, more than the whole {device} budget of {_mb(budget_bytes)}; {budget_setting(device)}{smaller}"
    held = sorted(holders, key=lambda r: -r.footprint.weights_bytes)
    parts = [
        f"{r.name} ({_mb(r.footprint.weights_bytes)}, {'pinned' if r.pinned else f'worker {r.worker}'})"
        for r in held
    ]
    text = f"{need}; {device} has a budget of {_mb(budget_bytes)}"
    if parts:
        text += f" and {_mb(used_bytes(holders))} is held by " + ", ".join(parts)
    if free_now_bytes < incoming.total_bytes:
        text += f"; only {_mb(max(0, free_now_bytes))} is free on the device right now (other processes use the rest)"
    return text


def load_error(name: str, device: str, exc: BaseException) -> Exception:
    """The error a failed load answers its waiting requests with."""
    from fleet.errors import FleetError, ModelLoadFailed, ModelTooLarge

    if isinstance(exc, FleetError):
        return exc
    if is_out_of_memory(exc):
        return ModelTooLarge(f"out of memory loading {name} on {device}: {type(exc).__name__}: {exc}",
                             hint="unpin or unload a model, or use a device with more memory")
    return ModelLoadFailed(f"cannot load {name!r} on {device}: {type(exc).__name__}: {exc}")


# ---- OOM during a batch --------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM, a failed host allocation, or Python's MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def run_split_on_oom(run: Callable[[list[Any]], list[Any]], requests: list[Any],
                     on_oom: Callable[[], None] = lambda: None) -> list[Any]:
    """`run(requests)`; on out-of-memory, free what can be freed (`on_oom`) and
    run each half on its own, down to single requests. A single request that
    still does not fit raises the OOM (the caller answers it)."""
    try:
        return run(requests)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(requests) < 2:
            raise
        log.warning("out of memory on a batch of %d; splitting it", len(requests))
    on_oom()
    mid = len(requests) // 2
    return run_split_on_oom(run, requests[:mid], on_oom) + run_split_on_oom(run, requests[mid:], on_oom)
