"""Lease expiry, dead workers and their reservations, and the repair after a
death inside the lock (protocol invariants 4 and 8 in `local_queue.queue`);
`check` verifies every invariant."""

from __future__ import annotations

import time

import numpy as np

from .layout import (
    BATCH_KEY, BATCH_SEQ, CLAIMED, DONE, F_DATA, F_KEY, F_LANE, F_LEASE, F_NEXT, F_OWNER, F_PREV, F_RES, F_SEQ, F_STATE, F_TOKENS,
    FREE, H_DEPTH, H_DONE_COUNT, H_DONE_HEAD, H_DONE_TAIL, H_FREE_TOP, H_N_LANES, H_REPAIRS, H_RESERVED_HEAD, H_SEQ,
    H_WORK_GEN, H_WORK_WAITERS, L_CLAIMED, L_DEPTH, L_HEAD, L_TAIL, L_TOKENS, LF, QUEUED, RESERVED, SF,
    W_ACTIVE, W_CLAIMED, WF,
)
from .slab import ALLOCATED, NIL


class Recovery:
    """Expiry, release of dead workers, repair and checking, for LocalQueue."""

    def expire_leases(self, now_ns: int | None = None, *, max_attempts: int = 3) -> int:
        """Claimed items whose lease passed go back to their lanes (attempts += 1) or, at
        max_attempts, complete with STATUS_POISON. Returns how many moved. Also
        releases the reservations of processes that died holding one."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        with self._lock:
            self._reclaim_dead_reservations()
            S = self._S_np
            late = np.flatnonzero((S[:, F_STATE] == CLAIMED) & (S[:, F_LEASE] < now)).tolist()
            moved, waiters, res_wake = self._settle(late, max_attempts)
        self._wake_work(waiters)
        self._wake_results(res_wake)
        return moved

    def release_worker(self, wid: int, *, max_attempts: int = 3) -> int:
        """A worker known dead: its claims go back now (attempts += 1) or poison; it is unregistered."""
        with self._lock:
            self._reclaim_dead_reservations()
            S = self._S_np
            mine = np.flatnonzero((S[:, F_STATE] == CLAIMED) & (S[:, F_OWNER] == wid)).tolist()
            moved, waiters, res_wake = self._settle(mine, max_attempts)
            w = self._worker_index(wid)
            if w is not None:
                self._W[w * WF + W_ACTIVE] = 0
        self._wake_work(waiters)
        self._wake_results(res_wake)
        return moved

    def _settle(self, slots: list[int], max_attempts: int) -> tuple[int, int, bool]:
        """Lost claims back to their lanes or to poison: (moved, waiters to wake, wake the result consumer)."""
        if not slots:
            return 0, 0, False
        requeued, poisoned = self._requeue(self._requeue_recs(slots), bump=True, max_attempts=max_attempts)
        h = self._h
        h[H_WORK_GEN] += 1
        waiters = h[H_WORK_WAITERS] if requeued else 0
        return requeued + poisoned, waiters, self._results_wake() if poisoned else False

    # -- repair and verification --------------------------------------------------
    def _block_refs(self) -> dict[int, int]:
        """Block -> number of records referring to it, from the slot states."""
        S = self._S_np
        st = S[:, F_STATE]
        data = S[((st == QUEUED) | (st == CLAIMED) | (st == RESERVED)) & (S[:, F_DATA] != NIL), F_DATA]
        res = S[(st == DONE) & (S[:, F_RES] != NIL), F_RES]
        blocks, counts = np.unique(np.concatenate([data, res]), return_counts=True)
        return dict(zip(blocks.tolist(), counts.tolist()))

    def _live_blocks(self, refs: dict[int, int]) -> list[tuple[int, int]]:
        tags, top = self._slab.tags, self._slab.top_order
        if any(not tags[u] & ALLOCATED for u in refs):
            raise RuntimeError("slab: a live block is not tagged allocated; this is a bug")
        live = [(u, tags[u] & ~ALLOCATED) for u in refs]
        if any(k > top for _, k in live):
            raise RuntimeError("slab: a live block has no valid order; this is a bug")
        return live

    def _repair(self) -> None:
        """Rebuild all derived data from the slot states (invariant 4). Caller holds the flock."""
        h, S, L = self._h, self._S_np, self._L_np
        st = S[:, F_STATE]
        free = np.flatnonzero(st == FREE)
        np.frombuffer(self._stack, dtype=np.int64)[:len(free)] = free[::-1]
        h[H_FREE_TOP] = len(free)
        # Blocks that the state no longer owns.
        S[st == FREE, F_DATA] = NIL
        S[st == FREE, F_RES] = NIL
        S[st == DONE, F_DATA] = NIL
        S[(st == QUEUED) | (st == CLAIMED) | (st == RESERVED), F_RES] = NIL  # so _block_refs counts owners only
        # Lanes: QUEUED slots grouped by lane, sorted by (key, seq).
        q = np.flatnonzero(st == QUEUED)
        q = q[np.lexsort((S[q, F_SEQ], S[q, F_KEY], S[q, F_LANE]))]
        lanes = S[q, F_LANE]
        same_next = np.append(lanes[1:] == lanes[:-1], False)[:len(q)]  # (no queued item: empty)
        same_prev = np.insert(lanes[1:] == lanes[:-1], 0, False)[:len(q)]
        S[q, F_NEXT] = np.where(same_next, np.append(q[1:], NIL), NIL)
        S[q, F_PREV] = np.where(same_prev, np.insert(q[:-1], 0, NIL), NIL)
        L[:, L_HEAD] = L[:, L_TAIL] = NIL
        L[lanes[~same_prev], L_HEAD] = q[~same_prev]
        L[lanes[~same_next], L_TAIL] = q[~same_next]
        nl = self._max_lanes
        L[:, L_DEPTH] = np.bincount(lanes, minlength=nl)[:nl]
        L[:, L_TOKENS] = np.bincount(lanes, weights=S[q, F_TOKENS], minlength=nl)[:nl].astype(np.int64)
        c = np.flatnonzero(st == CLAIMED)
        L[:, L_CLAIMED] = np.bincount(S[c, F_LANE], minlength=nl)[:nl]
        h[H_DEPTH] = len(q)
        W = self._W
        owners = S[c, F_OWNER].tolist()
        for w in range(self._max_workers):
            W[w * WF + W_CLAIMED] = 0
        for wid in owners:
            w = self._worker_index(wid)
            if w is not None:
                W[w * WF + W_CLAIMED] += 1
        # Done list in seq order.
        d = np.flatnonzero(st == DONE)
        d = d[np.argsort(S[d, F_SEQ], kind="stable")]
        S[d, F_NEXT] = np.append(d[1:], NIL)
        h[H_DONE_HEAD] = d[0] if len(d) else NIL
        h[H_DONE_TAIL] = d[-1] if len(d) else NIL
        h[H_DONE_COUNT] = len(d)
        # A put torn after some commits had not yet advanced the seq counter,
        # nor told `since` waiters that there is new work.
        h[H_SEQ] = max(h[H_SEQ], int((S[:, F_SEQ] & (BATCH_SEQ - 1)).max()))
        h[H_WORK_GEN] += 1
        refs = self._block_refs()
        R = self._refs
        for u, n in refs.items():
            R[u] = n  # refcounts as the committed states say
        self._slab.rebuild(self._live_blocks(refs))
        # Reservations stay (their processes may be copying right now), unless dead.
        r = np.flatnonzero(st == RESERVED)
        S[r, F_NEXT] = np.append(r[1:], NIL)
        S[r, F_PREV] = np.insert(r[:-1], 0, NIL)
        h[H_RESERVED_HEAD] = r[0] if len(r) else NIL
        self._reclaim_dead_reservations()
        h[H_REPAIRS] += 1

    def check(self) -> None:
        """Verify every invariant of the shared structure; RuntimeError on the first broken one."""
        with self._lock:
            self._check_locked()

    def _check_locked(self) -> None:
        h, S = self._h, self._S
        st = self._S_np[:, F_STATE]
        seen_q = set()
        claimed = [0] * self._max_lanes
        for s in np.flatnonzero(st == CLAIMED).tolist():
            claimed[S[s * SF + F_LANE]] += 1
        for lane in range(h[H_N_LANES]):
            Lb = lane * LF
            s, prev, n, tok, last = self._L[Lb + L_HEAD], NIL, 0, 0, (-1, -1)
            while s != NIL:
                b = s * SF
                if S[b + F_STATE] != QUEUED or S[b + F_LANE] != lane or S[b + F_PREV] != prev:
                    raise RuntimeError(f"lane {lane}: slot {s} does not belong in its list")
                if (S[b + F_KEY], S[b + F_SEQ]) <= last:
                    raise RuntimeError(f"lane {lane}: out of (key, seq) order at slot {s}")
                if (S[b + F_KEY] == BATCH_KEY) != (S[b + F_SEQ] >= BATCH_SEQ):
                    raise RuntimeError(f"lane {lane}: slot {s} is batch work by its key or its seq, not both")
                last = (S[b + F_KEY], S[b + F_SEQ])
                seen_q.add(s)
                n, tok, prev, s = n + 1, tok + S[b + F_TOKENS], s, S[b + F_NEXT]
            if (prev != self._L[Lb + L_TAIL] or n != self._L[Lb + L_DEPTH]
                    or tok != self._L[Lb + L_TOKENS] or claimed[lane] != self._L[Lb + L_CLAIMED]):
                raise RuntimeError(f"lane {lane}: tail or counters off")
        if seen_q != set(np.flatnonzero(st == QUEUED).tolist()) or h[H_DEPTH] != len(seen_q):
            raise RuntimeError("queued slots and lane lists disagree")
        done, s = [], h[H_DONE_HEAD]
        while s != NIL:
            done.append(s)
            s = S[s * SF + F_NEXT]
        if set(done) != set(np.flatnonzero(st == DONE).tolist()) or len(done) != h[H_DONE_COUNT]:
            raise RuntimeError("done list and done slots disagree")
        free = set(self._stack[:h[H_FREE_TOP]].tolist())
        if free != set(np.flatnonzero(st == FREE).tolist()) or len(free) != h[H_FREE_TOP]:
            raise RuntimeError("free slot stack and free slots disagree")
        reserved, s, prev = [], h[H_RESERVED_HEAD], NIL
        while s != NIL and len(reserved) <= self._nslots:
            if S[s * SF + F_STATE] != RESERVED or S[s * SF + F_PREV] != prev:
                raise RuntimeError(f"reservations' list: slot {s} does not belong in it")
            reserved.append(s)
            prev, s = s, S[s * SF + F_NEXT]
        if sorted(reserved) != np.flatnonzero(st == RESERVED).tolist():
            raise RuntimeError("reservations' list and reserved slots disagree")
        refs = self._block_refs()
        R = self._refs
        for u, n in refs.items():
            if R[u] != n:
                raise RuntimeError(f"slab block {u}: refcount {R[u]}, {n} records refer to it")
        self._slab.check(self._live_blocks(refs))
