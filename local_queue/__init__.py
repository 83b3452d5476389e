"""Shared-memory multi-producer / multi-consumer queue between the daemon and its workers.

See `local_queue.queue` for the protocol and its invariants.
"""

from .queue import (
    STATUS_EXPIRED,
    STATUS_POISON,
    Claim,
    Done,
    ItemTooLarge,
    LaneStats,
    LocalQueue,
    LockBusy,
    QueueError,
    QueueFull,
    QueueUsage,
    UnknownWorker,
    WorkerInfo,
    put_id,
)

__all__ = [
    "STATUS_EXPIRED", "STATUS_POISON", "Claim", "Done", "ItemTooLarge", "LaneStats", "LocalQueue", "LockBusy",
    "QueueError", "QueueFull", "QueueUsage", "UnknownWorker", "WorkerInfo", "put_id",
]
