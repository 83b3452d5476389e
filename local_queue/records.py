"""What the queue hands out (claims, results, reports) and how it refuses."""

from __future__ import annotations

from typing import NamedTuple


class QueueError(Exception):
    """A refusal of the queue, raised before anything changed. `local_queue` knows no
    HTTP or product vocabulary: its users map these (the daemon: QueueFull ->
    overloaded, ItemTooLarge -> payload_too_large)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(QueueError):
    """No slot, slab space, lane or worker record left right now (retry later)."""


class ItemTooLarge(QueueError):
    """A payload or result larger than the slab's largest block: it can never fit."""


class LockBusy(Exception):
    """Raised instead of waiting for the queue lock, inside `LocalQueue.no_wait()`;
    nothing changed. The caller retries where waiting is allowed (a thread)."""


class UnknownWorker(LookupError):
    """The worker id is not registered (never was, unregistered, or released as dead)."""


class Claim(NamedTuple):
    item_id: int  # claim id: pass it to ack / return_items
    request_id: int
    lane: int
    tokens: int
    enqueue_ns: int
    deadline_ns: int
    attempts: int
    payload: memoryview  # into the slab; valid until this item is acked or returned
    batch: bool = False  # put as batch work (below interactive items in its lane; `put_many(batch=True)`)
    flow: int = 0  # the flow it was put for (`put_many(flow=)`: its client)


class Done(NamedTuple):
    item_id: int  # the put id (an emit record's own id for a partial result)
    request_id: int
    status: int
    result: bytes


class LaneStats(NamedTuple):
    lane: int
    model: str
    depth: int
    tokens: int
    oldest_enqueue_ns: int  # of the head item; 0 when the lane has no queued item
    claimed: int
    #: The head is batch work, so every queued item of the lane is (invariant 2).
    head_batch: bool = False


class WorkerInfo(NamedTuple):
    wid: int
    pid: int
    device: str
    last_heartbeat_ns: int
    claimed: int
    info: bytes


class QueueUsage(NamedTuple):
    slots: int
    slots_free: int
    slab_bytes: int
    slab_free_bytes: int
    done: int  # results waiting for wait_results
    repairs: int  # times a holder's death inside a critical section was repaired


_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot paths)
