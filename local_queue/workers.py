"""Worker records, leases and wake-ups (protocol invariant 5 in `local_queue.queue`)."""

from __future__ import annotations

import time

import numpy as np

from . import futex
from .layout import (
    CLAIMED, DEVICE_BYTES, F_LEASE, F_OWNER, F_STATE, H_DEPTH, H_WORK_GEN, H_WORK_WAITERS, INFO_BYTES,
    MAX_LEASE_MS, W_ACTIVE, W_CLAIMED, W_DEVICE_LEN, W_GEN, W_HEARTBEAT, W_INFO_LEN, W_LEASE_MS, W_PID,
    WF, WORKER_BITS,
)
from .records import QueueFull, UnknownWorker, WorkerInfo


class Workers:
    """Worker registry, lease renewal and waiting for work, for LocalQueue."""

    def _worker_index(self, wid: int) -> int | None:
        w = wid & ((1 << WORKER_BITS) - 1)
        if wid < 0 or w >= self._max_workers:
            return None
        W = self._W
        if W[w * WF + W_ACTIVE] and W[w * WF + W_GEN] == wid >> WORKER_BITS:
            return w
        return None

    def register_worker(self, pid: int, device: str) -> int:
        raw = device.encode()
        if len(raw) > DEVICE_BYTES:
            raise ValueError(f"device name longer than {DEVICE_BYTES} bytes")
        W = self._W
        with self._lock:
            for w in range(self._max_workers):
                b = w * WF
                if not W[b + W_ACTIVE]:
                    break
            else:
                raise QueueFull(f"no worker record left ({self._max_workers} registered)")
            gen = W[b + W_GEN] + 1
            W[b + W_GEN], W[b + W_PID] = gen, pid
            W[b + W_HEARTBEAT] = time.monotonic_ns()
            W[b + W_CLAIMED] = W[b + W_INFO_LEN] = 0
            W[b + W_LEASE_MS] = 0
            self._devices[w * DEVICE_BYTES:w * DEVICE_BYTES + len(raw)] = raw
            W[b + W_DEVICE_LEN] = len(raw)
            W[b + W_ACTIVE] = 1  # commit
            return gen << WORKER_BITS | w

    def unregister_worker(self, wid: int) -> None:
        """Forget the worker. Its claims stay until their leases expire (release_worker returns them now)."""
        with self._lock:
            w = self._worker_index(wid)
            if w is not None:
                self._W[w * WF + W_ACTIVE] = 0

    def set_worker_info(self, wid: int, info: bytes) -> None:
        if len(info) > INFO_BYTES:
            raise ValueError(f"worker info longer than {INFO_BYTES} bytes")
        with self._lock:
            w = self._need_worker(wid)
            self._W[w * WF + W_INFO_LEN] = 0
            self._infos[w * INFO_BYTES:w * INFO_BYTES + len(info)] = info
            self._W[w * WF + W_INFO_LEN] = len(info)

    def _need_worker(self, wid: int) -> int:
        w = self._worker_index(wid)
        if w is None:
            raise UnknownWorker(f"worker {wid} is not registered")
        return w

    def workers(self) -> list[WorkerInfo]:
        W, out = self._W, []
        with self._lock:
            for w in range(self._max_workers):
                b = w * WF
                if W[b + W_ACTIVE]:
                    out.append(WorkerInfo(
                        W[b + W_GEN] << WORKER_BITS | w, W[b + W_PID],
                        bytes(self._devices[w * DEVICE_BYTES:w * DEVICE_BYTES + W[b + W_DEVICE_LEN]]).decode(),
                        W[b + W_HEARTBEAT], W[b + W_CLAIMED],
                        bytes(self._infos[w * INFO_BYTES:w * INFO_BYTES + W[b + W_INFO_LEN]])))
        return out

    def heartbeat(self, wid: int) -> bool:
        """Mark the worker alive and renew its leases by its last lease_ms. False if not registered."""
        with self._lock:
            w = self._worker_index(wid)
            if w is None:
                return False
            now = time.monotonic_ns()
            self._W[w * WF + W_HEARTBEAT] = now
            self._renew(wid, now, self._W[w * WF + W_LEASE_MS])
            return True

    def renew(self, worker: int, lease_ms: int) -> int:
        """Extend every lease of `worker` to now + lease_ms. Returns how many items it holds."""
        if not 0 <= lease_ms < MAX_LEASE_MS:
            raise ValueError(f"lease_ms must be in [0, {MAX_LEASE_MS})")
        with self._lock:
            w = self._need_worker(worker)
            self._W[w * WF + W_LEASE_MS] = lease_ms
            return self._renew(worker, time.monotonic_ns(), lease_ms)

    def _renew(self, wid: int, now: int, lease_ms: int) -> int:
        S = self._S_np
        mine = np.flatnonzero((S[:, F_STATE] == CLAIMED) & (S[:, F_OWNER] == wid))
        S[mine, F_LEASE] = now + lease_ms * 1_000_000
        return len(mine)

    def work_generation(self) -> int:
        """Counter bumped whenever items become claimable (put, return, lease expiry)."""
        return self._h[H_WORK_GEN]

    def wait_for_work(self, timeout_s: float, *, since: int | None = None) -> bool:
        """Block until some lane has queued items (True) or the timeout passes (False).

        With `since` (a `work_generation()` value): block until items became
        claimable after it, for a worker whose queued lanes are not its to serve."""
        h = self._h
        if since is None:
            def ready() -> bool:
                return h[H_DEPTH] > 0
        else:
            def ready() -> bool:
                return h[H_WORK_GEN] != since
        if ready():  # aligned int64 reads: a hint, the caller claims under the lock
            return True
        with self._lock:
            if ready():
                return True
            h[H_WORK_WAITERS] += 1
        try:
            return self._wait(ready, timeout_s)
        finally:
            # Out of the count at this process's next critical section (its claim,
            # usually), not in a lock round trip of its own (invariant 5).
            with self._tlock:
                self._unwaited += 1

    def _wait(self, ready, timeout_s: float) -> bool:
        # The caller is counted in the waiters field for the whole loop, so every
        # producer in between wakes it (invariant 5). The generation is read before
        # `ready`: work that comes after the read changes the word, and the futex
        # then does not sleep.
        h, addr = self._h, self._gen_addr
        end = time.monotonic() + timeout_s
        while True:
            seen = h[H_WORK_GEN]
            if ready():
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            futex.wait(addr, seen, left)

    def _wake_work(self, waiters: int) -> None:
        """New claimable work: wake every process counted waiting for work (one syscall)."""
        if waiters > 0:
            futex.wake_all(self._gen_addr)
