"""Results: acks and partial results in, the single consumer's collection out."""

from __future__ import annotations

import time
from collections import Counter

from local_queue.blocks import BLOCK_HDR, _plan_blocks
from local_queue.layout import (
    DONE, EPOCH_SHIFT, F_DATA, F_EPOCH, F_GEN, F_LANE, F_NEXT, F_OWNER, F_REQ, F_RES, F_STATE, GEN_MASK,
    H_DONE_COUNT, H_DONE_HEAD, H_DONE_TAIL, H_FREE_TOP, H_RES_WAITERS, H_SEQ, H_SLAB_FREE, SF, SLOT_BITS,
    SLOT_MASK, STATUS_EXPIRED, STATUS_POISON, _HEAD, _PUT, _RECORD, _RESULT, CLAIMED, FREE,
)
from local_queue.records import Done, ItemTooLarge, QueueFull, _new_tuple
from local_queue.slab import NIL


class Results:
    """ack / emit (workers) and wait_results (the daemon), for LocalQueue."""

    def ack(self, item_id: int, result: bytes | memoryview, *, status: int = 0) -> bool:
        return self.ack_many([(item_id, result, status)])[0]

    def ack_many(self, items: list[tuple[int, bytes | memoryview, int]]) -> list[bool]:
        """Complete claimed items with results. False (nothing changed) for a claim no longer held.

        Puts leave 1/8 of the slab to results. If the results still find no
        space: QueueFull and nothing changed; the worker then acks with an error
        status and empty results, which need no space."""
        limit = self._slab.max_bytes() - BLOCK_HDR
        results = []
        for _, r, st in items:
            if type(r) is not bytes:
                r = memoryview(r).cast("B")
            if len(r) > limit:
                raise ItemTooLarge(f"result of {len(r)} bytes exceeds the queue's largest block ({limit})")
            if not 0 <= st <= 255 or st in (STATUS_EXPIRED, STATUS_POISON):
                raise ValueError(f"status must be a u8 other than {STATUS_EXPIRED} and {STATUS_POISON} (the queue's)")
            results.append(r)
        S, Sb, data, h, nslots = self._S, self._Sb, self._data, self._h, self._nslots
        pack, unpack = _RESULT.pack_into, _HEAD.unpack_from
        # Planned outside the lock for the usual case: every claim still held.
        lens = [len(r) for r in results]
        plan = _plan_blocks(lens)[0]
        # Payload blocks, lanes and owners of the acked items, counted at the end.
        blocks_out, lanes, owners = [], [], []
        first = last = NIL  # acked slots, chained, appended to the done list at the end
        with self._lock:
            # 1. Which claims are still held (each slot once).
            held, out = {}, []
            for i, (cid, _, _) in enumerate(items):
                s = cid & SLOT_MASK
                ok = False
                if s < nslots and s not in held:
                    rec = unpack(Sb, s * SF * 8)
                    ok = (rec[F_STATE] == CLAIMED and rec[F_EPOCH] == cid >> EPOCH_SHIFT
                          and rec[F_GEN] == (cid >> SLOT_BITS) & GEN_MASK)
                    if ok:
                        held[s] = (i, rec)
                out.append(ok)
            # 2. Result blocks for all of them, or nothing changes.
            order = list(held.items())
            if len(order) != len(items):
                lens = [len(results[i]) for _, (i, _) in order]
                plan = _plan_blocks(lens)[0]
            placed = self._alloc_blocks(plan, len(order))
            if placed is None:
                raise QueueFull("no slab space for these results; ack them with empty results")
            blocks, at = placed
            # 3. Per item: copy the result, commit, let go of the payload block.
            for j, (s, (i, rec)) in enumerate(order):
                b = s * SF
                ln = lens[j]
                if ln:
                    a = at[j]
                    data[a:a + ln] = results[i]
                pack(Sb, b * 8 + F_RES * 8, blocks[j], ln, at[j], items[i][2])
                S[b] = DONE  # commit; from here the payload block reference is ours to drop
                blocks_out.append(rec[F_DATA])
                lanes.append(rec[F_LANE])
                owners.append(rec[F_OWNER])
                S[b + F_NEXT] = NIL
                if last == NIL:
                    first = s
                else:
                    S[last * SF + F_NEXT] = s
                last = s
            drops = Counter(blocks_out)
            drops.pop(NIL, None)
            self._drop_refs(drops)
            if first != NIL:
                tail = h[H_DONE_TAIL]
                if tail == NIL:
                    h[H_DONE_HEAD] = first
                else:
                    S[tail * SF + F_NEXT] = first
                h[H_DONE_TAIL] = last
                h[H_DONE_COUNT] += len(order)
                self._drop_claimed(Counter(lanes), Counter(owners))
                posts = min(h[H_RES_WAITERS], 1) - self._res_sem.value
            else:
                posts = 0
        self._post(self._res_sem, posts)
        return out

    def emit(self, item_id: int, result: bytes | memoryview, *, status: int) -> bool:
        return self.emit_many([(item_id, result, status)])[0]

    def emit_many(self, items: list[tuple[int, bytes | memoryview, int]]) -> list[bool]:
        """Publish partial results of claimed items (streaming) without completing them.

        Each becomes a DONE record of its own slot, with the item's request id and
        `status` (the caller's "partial" value; the queue does not interpret it),
        appended to the done list in call order, before the item's final ack.
        False (nothing published) for a claim no longer held. Like puts, partials
        leave the result reserve alone: QueueFull (nothing changed) when it would
        be touched, so final acks always find room. After a repair the done list
        is rebuilt by seq, and an item's final result (put seq) may then precede
        its partials: a reader must take the final result as the whole answer."""
        limit = self._slab.max_bytes() - BLOCK_HDR
        results = []
        for _, r, st in items:
            if type(r) is not bytes:
                r = memoryview(r).cast("B")
            if len(r) > limit:
                raise ItemTooLarge(f"result of {len(r)} bytes exceeds the queue's largest block ({limit})")
            if not 0 <= st <= 255:
                raise ValueError("status must be a u8")
            results.append(r)
        S, Sb, data, h, stack, nslots = self._S, self._Sb, self._data, self._h, self._stack, self._nslots
        unpack = _HEAD.unpack_from
        with self._lock:
            # 1. Which claims are still held (a slot may emit several records in one call).
            held, out = [], []
            for i, (cid, _, _) in enumerate(items):
                s = cid & SLOT_MASK
                ok = False
                if s < nslots:
                    rec = unpack(Sb, s * SF * 8)
                    ok = (rec[F_STATE] == CLAIMED and rec[F_EPOCH] == cid >> EPOCH_SHIFT
                          and rec[F_GEN] == (cid >> SLOT_BITS) & GEN_MASK)
                    if ok:
                        held.append((i, rec))
                out.append(ok)
            if not held:
                return out
            # 2. A slot and result space for each, or nothing changes.
            n, top = len(held), h[H_FREE_TOP]
            if top < n:
                raise QueueFull(f"no free slot for {n} partial results ({top} free)")
            lens = [len(results[i]) for i, _ in held]
            groups, need = _plan_blocks(lens)
            if h[H_SLAB_FREE] - need < self._reserve:
                raise QueueFull("no slab space for partial results outside the result reserve")
            placed = self._alloc_blocks(groups, n)
            if placed is None:
                raise QueueFull("no slab block big enough for these partial results")
            blocks, at = placed
            # 3. Per record: copy, write the slot's fields, commit, chain onto the done list.
            now, seq = time.monotonic_ns(), h[H_SEQ]
            for j, (i, rec) in enumerate(held):
                ln = lens[j]
                if ln:
                    data[at[j]:at[j] + ln] = results[i]
                slot = stack[top - 1 - j]
                b = slot * SF
                seq += 1
                _PUT.pack_into(Sb, b * 8 + F_NEXT * 8, NIL, NIL, S[b + F_GEN] % GEN_MASK + 1, rec[F_LANE], seq, 0,
                               rec[F_REQ], now, 0, 0, NIL, 0, NIL)
                S[b + F_OWNER] = NIL
                _RESULT.pack_into(Sb, b * 8 + F_RES * 8, blocks[j], ln, at[j], items[i][2])
                S[b] = DONE  # commit (invariant 3)
                self._append_done(slot)
            h[H_FREE_TOP] = top - n
            h[H_SEQ] = seq
            posts = min(h[H_RES_WAITERS], 1) - self._res_sem.value
        self._post(self._res_sem, posts)
        return out
    # -- results -----------------------------------------------------------------
    def wait_results(self, timeout_s: float) -> list[Done]:
        """Block until results exist; return all of them (copied out, space freed).

        Meant for one consumer (the daemon); several would split the results."""
        h = self._h
        with self._lock:
            if h[H_DONE_COUNT] > 0:
                return self._take_done()
            h[H_RES_WAITERS] += 1
        try:
            self._wait(self._res_sem, lambda: h[H_DONE_COUNT] > 0, timeout_s)
        except BaseException:
            # Interrupted: leave the results in the queue for the next call.
            with self._lock:
                h[H_RES_WAITERS] -= 1
            raise
        with self._lock:
            h[H_RES_WAITERS] -= 1
            return self._take_done()

    def _take_done(self) -> list[Done]:
        S, Sb, h, data, stack = self._S, self._Sb, self._h, self._data, self._stack
        unpack = _RECORD.unpack_from
        blocks_out = []  # result blocks let go of, counted at the end
        out = []
        s = h[H_DONE_HEAD]
        top = h[H_FREE_TOP]
        while s != NIL:
            b = s * SF
            (_, nxt, _, gen, _, _, _, req, *_, u, ln, at, st) = unpack(Sb, b * 8)
            out.append(_new_tuple(Done, (gen << SLOT_BITS | s, req, st, bytes(data[at:at + ln]) if ln else b"")))
            S[b] = FREE  # commit
            blocks_out.append(u)
            stack[top] = s
            top += 1
            s = nxt
        drops = Counter(blocks_out)
        drops.pop(NIL, None)
        self._drop_refs(drops)
        h[H_FREE_TOP] = top
        h[H_DONE_HEAD] = h[H_DONE_TAIL] = NIL
        h[H_DONE_COUNT] = 0
        return out
