"""The producer's side of the queue: put, and cancel (the protocol: `local_queue.queue`).

A put of at most COPY_INLINE bytes holds the lock once: its payloads are placed in the
slab (blocks.py: planned, allocated, copied, referenced) and its items committed to
their lane at their fair places (invariant 2), in `_put_held`. A larger one reserves its
blocks, copies outside the lock and commits under it again (invariant 8). Every method
here is a `LocalQueue`'s (a mixin, like lanes.py and results.py).
"""

from __future__ import annotations

import threading
import time

from .blocks import COPY_INLINE, _copy_in, _plan_blocks
from .layout import (
    BATCH_KEY, BATCH_SEQ, CLAIMED, FREE, F_DEADLINE, F_FLOW, F_GEN, F_KEY, F_NEXT, F_STATE, GEN_MASK, H_DEPTH,
    H_FREE_TOP, H_SEQ, H_WORK_GEN, H_WORK_WAITERS, LF, L_DEPTH, L_HEAD, L_TAIL, L_TOKENS, QUEUED, SF, SLOT_BITS,
    SLOT_MASK, _PUT,
)
from .records import ItemTooLarge, LockBusy, QueueFull
from .slab import NIL


class Producer:
    """Put and cancel, for LocalQueue."""

    # -- producer ----------------------------------------------------------------
    def put(self, lane: int, payload: bytes | memoryview, *, tokens: int, request_id: int,
            deadline_ns: int = 0, batch: bool = False, flow: int = 0, wait: bool = True) -> int:
        return self.put_many(lane, [payload], tokens=[tokens], request_ids=[request_id],
                             deadline_ns=deadline_ns, batch=batch, flow=flow, wait=wait)[0]

    def put_many(self, lane: int, payloads: list, *, tokens: list[int], request_ids: list[int],
                 deadline_ns: int = 0, batch: bool = False, flow: int = 0, wait: bool = True) -> list[int]:
        """Enqueue in `lane`, all or nothing (QueueFull leaves the queue unchanged):
        interactive items at their flow's fair place (`flow`: who sent them, e.g. a
        client, >= 0; invariant 2; their claims carry it), batch items (`batch`) at
        its tail, behind everything. `wait=False`: LockBusy, with nothing changed,
        instead of waiting for the lock, as inside `no_wait()` (an event loop's put)."""
        n = len(payloads)
        if len(tokens) != n or len(request_ids) != n:
            raise ValueError("payloads, tokens and request_ids differ in length")
        # Checked up front: a bad value inside the commit loop would leave a prefix queued.
        if n and not (0 <= min(tokens) and max(tokens) < 1 << 40 and -(1 << 63) <= min(request_ids)
                      and max(request_ids) < 1 << 63 and 0 <= deadline_ns < 1 << 63 and 0 <= flow < 1 << 63):
            raise ValueError("tokens must be in [0, 2**40), request ids, deadline_ns and flow int64")
        self._check_lane(lane)
        views, lens, limit = [], [], self._slab.max_bytes
        for p in payloads:
            if type(p) is not bytes:
                p = memoryview(p).cast("B")
            ln = len(p)
            if ln > limit:
                raise ItemTooLarge(f"payload of {ln} bytes exceeds the queue's largest block ({limit})")
            views.append(p)
            lens.append(ln)
        if sum(lens) <= COPY_INLINE:
            # One lock hold: room, copy, commit (`_put_held`).
            ids, waiters = (self._lock if wait else self._try_lock)(self._put_held, lane, n, views, lens, tokens,
                                                                    request_ids, deadline_ns, batch, flow)
        else:
            ids, waiters = self._put_outside(lane, n, views, lens, tokens, request_ids, deadline_ns, batch, flow,
                                             wait=wait)
        self._wake_work(waiters)
        return ids

    def _put_held(self, lane: int, n: int, views: list, lens: list[int], tokens: list[int],
                  request_ids: list[int], deadline_ns: int, batch: bool, flow: int) -> tuple[list[int], int]:
        """(Under the lock.) A put of at most COPY_INLINE bytes: its payloads placed in
        the slab (`Blocks._place`) and its items committed."""
        blocks, at = self._place(views, lens, n)
        return self._commit_put(lane, n, lens, tokens, request_ids, deadline_ns, blocks, at, batch, flow)

    def _put_outside(self, lane: int, n: int, views: list, lens: list[int], tokens: list[int],
                     request_ids: list[int], deadline_ns: int, batch: bool, flow: int, *,
                     wait: bool) -> tuple[list[int], int]:
        """A larger put: reserve, copy outside the lock, commit (invariant 8), so a large
        body never stalls the workers and the daemon while it is copied."""
        if not wait or (self._nowait_threads and threading.get_ident() in self._nowait_threads):
            raise LockBusy("a large put copies outside the lock: not on a thread that must not wait")
        groups, need = _plan_blocks(lens)
        h = self._h
        with self._lock:
            blocks, at, units, held = self._room_for_put(groups, need, n, reserve=True)
        try:
            _copy_in(self._data, views, lens, at)
            with self._lock:
                if h[H_FREE_TOP] - n < self._slot_reserve:
                    raise QueueFull(f"queue full: {h[H_FREE_TOP]} free slots, {n} needed")
                ids, waiters = self._commit_put(lane, n, lens, tokens, request_ids, deadline_ns, blocks, at,
                                                batch, flow)
                self._add_refs(units)
                for s in held:
                    self._release(s)
                held = []
        finally:
            if held:
                with self._lock:
                    for s in held:
                        self._release(s)
        return ids, waiters

    def _commit_put(self, lane: int, n: int, lens: list[int], tokens: list[int], request_ids: list[int],
                    deadline_ns: int, blocks: list[int], at: list[int], batch: bool,
                    flow: int) -> tuple[list[int], int]:
        """Slot records for copied payloads, committed one by one and chained behind
        the lane's tail when their keys are the lane's largest (a lone flow's puts,
        batch work); otherwise inserted at their places (`_commit_put_at`).
        Returns (ids, waiters to wake)."""
        S, Sb, stack, h, L = self._S, self._Sb, self._stack, self._h, self._L
        keys = [BATCH_KEY] * n if batch else self._fair_keys(lane, flow, tokens)
        Lb = lane * LF
        prev = L[Lb + L_TAIL]
        if prev != NIL and S[prev * SF + F_KEY] > keys[0]:
            return self._commit_put_at(lane, n, lens, tokens, request_ids, deadline_ns, blocks, at, keys, flow)
        pack = _PUT.pack_into
        ids = []
        top = h[H_FREE_TOP]
        now = time.monotonic_ns()
        seq = h[H_SEQ]
        flag = BATCH_SEQ if batch else 0
        for i in range(n):
            s = stack[top - 1 - i]
            b = s * SF
            gen = S[b + F_GEN] % GEN_MASK + 1
            seq += 1
            pack(Sb, b * 8 + F_NEXT * 8, NIL, prev, gen, lane, seq | flag, tokens[i], request_ids[i], now,
                 deadline_ns, 0, blocks[i], lens[i], at[i])
            S[b + F_KEY], S[b + F_FLOW] = keys[i], flow
            S[b] = QUEUED  # commit (invariant 3)
            if prev == NIL:
                L[Lb + L_HEAD] = s
            else:
                S[prev * SF + F_NEXT] = s
            prev = s
            ids.append(gen << SLOT_BITS | s)
        h[H_FREE_TOP] = top - n
        h[H_SEQ] = seq
        if n:
            L[Lb + L_TAIL] = prev
        L[Lb + L_DEPTH] += n
        L[Lb + L_TOKENS] += sum(tokens)
        h[H_DEPTH] += n
        h[H_WORK_GEN] += 1
        return ids, h[H_WORK_WAITERS]  # wake every waiter (invariant 5)

    def _commit_put_at(self, lane: int, n: int, lens: list[int], tokens: list[int], request_ids: list[int],
                       deadline_ns: int, blocks: list[int], at: list[int], keys: list[int],
                       flow: int) -> tuple[list[int], int]:
        """`_commit_put` of interactive items that go ahead of the lane's tail (another
        flow has more queued, or the tail is batch work): committed unlinked, then
        inserted at their (key, seq) places, walking from the end nearer their keys."""
        S, Sb, stack, h, L = self._S, self._Sb, self._stack, self._h, self._L
        pack = _PUT.pack_into
        ids, placed = [], []
        top = h[H_FREE_TOP]
        now = time.monotonic_ns()
        seq = h[H_SEQ]
        for i in range(n):
            s = stack[top - 1 - i]
            b = s * SF
            gen = S[b + F_GEN] % GEN_MASK + 1
            seq += 1
            pack(Sb, b * 8 + F_NEXT * 8, NIL, NIL, gen, lane, seq, tokens[i], request_ids[i], now,
                 deadline_ns, 0, blocks[i], lens[i], at[i])
            S[b + F_KEY], S[b + F_FLOW] = keys[i], flow
            S[b] = QUEUED  # commit (invariant 3); a repair links it if we die before the insert
            placed.append((keys[i], seq, s, tokens[i]))
            ids.append(gen << SLOT_BITS | s)
        h[H_FREE_TOP] = top - n
        h[H_SEQ] = seq
        Lb = lane * LF
        head_key, tail_key = S[L[Lb + L_HEAD] * SF + F_KEY], S[L[Lb + L_TAIL] * SF + F_KEY]
        if keys[0] - head_key < min(tail_key, BATCH_KEY) - keys[-1]:
            self._insert_sorted(lane, placed)
        else:
            self._insert_from_tail(lane, placed)
        h[H_WORK_GEN] += 1
        return ids, h[H_WORK_WAITERS]

    def cancel(self, item_id: int) -> bool:
        """Withdraw a request (it timed out, or its client went away). A still-queued
        item is removed (True; no Done is produced). A claimed one keeps its claim but
        its deadline becomes 1 ns, long past (False): its worker reads that between
        steps (`deadlines`) and stops work on it."""
        s, gen = item_id & SLOT_MASK, (item_id >> SLOT_BITS) & GEN_MASK
        if s >= self._nslots:
            return False
        S, b = self._S, s * SF
        with self._lock:
            if S[b + F_GEN] != gen:
                return False
            if S[b + F_STATE] == CLAIMED:
                S[b + F_DEADLINE] = 1
                return False
            if S[b + F_STATE] != QUEUED:
                return False
            self._unlink(s)
            S[b + F_STATE] = FREE  # commit
            self._free_data(s)
            self._push_free_slot(s)
            return True
