"""The one queue lock (protocol invariants 1 and 4 in `local_queue.queue`).

A per-process `threading.Lock` (flock does not exclude threads of one process),
then `fcntl.flock` on `/dev/shm/<name>.lock` (the kernel drops it when the
holder dies, even by SIGKILL). Lock order: thread lock, then flock. The holder
writes its pid into `header[H_HOLDER]` on entry and clears it on a clean exit;
a holder that finds it set repairs first (`Recovery._repair`).
"""

from __future__ import annotations

import os
import threading
from fcntl import LOCK_EX, LOCK_NB, LOCK_UN, flock
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .layout import H_HOLDER, H_WORK_WAITERS
from .records import ItemTooLarge, LockBusy, QueueFull, UnknownWorker

_forks = [0]  # bumped in forked children: a handle must not cross a fork (flock would be shared)
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))
_CLEAN_ERRORS = (QueueFull, ItemTooLarge, UnknownWorker, ValueError, KeyError)
T = TypeVar("T")


class LockHolder(Protocol):
    """What the lock reads and writes of a queue handle (`LocalQueue` is one);
    a protocol, so that this module need not import the queue that imports it."""

    _fork: int  # `_forks[0]` when the handle was made
    _pid: int
    _tlock: threading.Lock
    _lock_fd: int  # the flock file, /dev/shm/<name>.lock
    _h: memoryview  # the shared header, int64 fields
    _nowait_threads: set[int]  # threads that get LockBusy instead of waiting
    _unwaited: int  # waits for work ended here, not yet out of H_WORK_WAITERS

    def _repair(self) -> None: ...


class _Lock:
    """The queue lock (invariants 1 and 4): a context manager, or `lock(fn, *args)`,
    which runs `fn(*args)` holding it. With `wait=False` it raises LockBusy instead of
    waiting, as it does on a thread inside `no_wait()`.

    The call form is the request path's (a put, a collect): one call into this module
    per hold, where `with` makes two (`__enter__`, `__exit__`)."""

    __slots__ = ("q", "wait")

    def __init__(self, q: LockHolder, *, wait: bool = True) -> None:
        self.q = q
        self.wait = wait

    def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        self.__enter__()
        try:
            out = fn(*args)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        self.__exit__(None, None, None)
        return out

    def __enter__(self) -> None:
        q = self.q
        if _forks[0] != q._fork:
            raise RuntimeError("a LocalQueue handle was inherited through fork; attach anew in the child")
        # A thread inside no_wait() gets LockBusy instead of waiting.
        wait = self.wait and not (q._nowait_threads and threading.get_ident() in q._nowait_threads)
        if not q._tlock.acquire(wait):
            raise LockBusy("the queue lock is held by another thread of this process")
        try:
            try:
                flock(q._lock_fd, LOCK_EX if wait else LOCK_EX | LOCK_NB)
            except BlockingIOError:
                raise LockBusy("the queue lock is held by another process") from None
            h = q._h
            try:
                if h[H_HOLDER] != 0:
                    q._repair()
                h[H_HOLDER] = q._pid
                if q._unwaited:
                    # Waits for work that ended since this process last held the lock
                    # leave the waiter count here, not in a lock round trip of their own.
                    h[H_WORK_WAITERS] -= q._unwaited
                    q._unwaited = 0
            except BaseException:
                flock(q._lock_fd, LOCK_UN)
                raise
        except BaseException:
            q._tlock.release()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        q = self.q
        # Errors from _CLEAN_ERRORS are raised before anything is changed; any
        # other exception may have torn a mutation: leave the holder mark so the
        # next holder (maybe us) repairs.
        if exc_type is None or issubclass(exc_type, _CLEAN_ERRORS):
            q._h[H_HOLDER] = 0
        flock(q._lock_fd, LOCK_UN)
        q._tlock.release()
