"""Results: acks and partial results in, the single consumer's collection out.

Bytes move outside the lock where they can (invariants 8 and 9 in
`local_queue.queue`): a result that fits the space its claim set aside is
copied there before the ack takes the lock; other results over COPY_INLINE
bytes are copied into reserved blocks between two short critical sections;
wait_results copies more than COPY_INLINE bytes out of reserved blocks after
the slots are already free.
"""

from __future__ import annotations

import os
import select
import time

from .blocks import COPY_INLINE, _plan_blocks, _tally
from .layout import (
    CLAIMED, DONE, EPOCH_SHIFT, F_DATA, F_EPOCH, F_GEN, F_LANE, F_NEXT, F_OWNER, F_REQ, F_RES, F_STATE, FREE,
    GEN_MASK, H_DONE_COUNT, H_DONE_HEAD, H_DONE_TAIL, H_FREE_TOP, H_RES_WAITERS, H_SEQ, H_SLAB_FREE, L_RESULT, LF,
    SF, SLOT_BITS, SLOT_MASK, STATUS_EXPIRED, STATUS_POISON, _HEAD, _PUT, _RECORD, _RESULT,
)
from .records import Done, ItemTooLarge, LockBusy, QueueFull, _new_tuple
from .slab import NIL


def _as_bytes(items: list, limit: int, reserved: tuple[int, ...]) -> list:
    """The result buffers of (id, result, status) items, checked before anything changes:
    a status is a u8 other than the `reserved` ones."""
    results = []
    for _, r, st in items:
        if type(r) is not bytes:
            r = memoryview(r).cast("B")
        if len(r) > limit:
            raise ItemTooLarge(f"result of {len(r)} bytes exceeds the queue's largest block ({limit})")
        if not 0 <= st <= 255 or st in reserved:
            raise ValueError("status must be a u8" + (f" other than {STATUS_EXPIRED} and {STATUS_POISON} (the queue's)"
                                                     if reserved else ""))
        results.append(r)
    return results


class Results:
    """ack / emit (workers) and wait_results (the daemon), for LocalQueue."""

    def ack(self, item_id: int, result: bytes | memoryview, *, status: int = 0) -> bool:
        return self.ack_many([(item_id, result, status)])[0]

    def ack_many(self, items: list[tuple[int, bytes | memoryview, int]]) -> list[bool]:
        """Complete claimed items with results. False (nothing changed) for a claim no longer held.

        A result no larger than the space its claim set aside (invariant 9)
        always has room. A larger one needs a new block: if none is free,
        QueueFull and nothing changed (the worker then acks with a short error,
        which fits)."""
        results = _as_bytes(items, self._slab.max_bytes, (STATUS_EXPIRED, STATUS_POISON))
        S, Sb, data, h, nslots, R = self._S, self._Sb, self._data, self._h, self._nslots, self._refs
        pack, unpack = _RESULT.pack_into, _HEAD.unpack_from
        # 1. Outside the lock: results that fit their claim's space are copied there.
        areas = self._areas
        where: list = [None] * len(items)  # (block, byte offset) of each result, once known
        spill = []
        get = areas.get
        for i, (cid, _, _) in enumerate(items):
            r = results[i]
            ln = len(r)
            a = get(cid)
            if a is not None and ln <= a[3]:
                _, u, at, _ = a
                if ln:
                    data[at:at + ln] = r
                where[i] = (u, at)
            elif ln:
                spill.append(i)
        # 2. Large results without such space: reserve, copy outside the lock.
        held_blocks = []
        if spill and sum(len(results[i]) for i in spill) > COPY_INLINE:
            held_blocks = self._reserve_and_copy([results[i] for i in spill], "results", where, spill)
        blocks_out, lanes, owners = [], [], []  # payload blocks, lanes, owners of the acked items
        first = last = NIL  # acked slots, chained, appended to the done list at the end
        try:
            with self._lock:
                # 3. Which claims are still held (each slot once).
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
                # 4. Small results without space: blocks for the held ones, copied here.
                if spill and not held_blocks:
                    rest = [i for i, _ in held.values() if where[i] is None and len(results[i])]
                    if rest:
                        self._place_inline([results[i] for i in rest], where, rest)
                # 5. Per item: commit, then let go of the payload block.
                refs_in = []  # result blocks, one entry per committed item
                lens = []
                for s, (i, rec) in held.items():
                    b = s * SF
                    ln = len(results[i])
                    if ln:
                        u, at = where[i]
                        refs_in.append(u)
                    else:
                        u = at = NIL
                    pack(Sb, b * 8 + F_RES * 8, u, ln, at, items[i][2])
                    S[b] = DONE  # commit; from here the payload block reference is ours to drop
                    blocks_out.append(rec[F_DATA])
                    lanes.append(rec[F_LANE])
                    lens.append(ln)
                    owners.append(rec[F_OWNER])
                    S[b + F_NEXT] = NIL
                    if last == NIL:
                        first = s
                    else:
                        S[last * SF + F_NEXT] = s
                    last = s
                for u, n in _tally(refs_in).items():
                    R[u] += n
                self._learn_result_sizes(lanes, lens)
                self._let_go_blocks(blocks_out)
                if areas:
                    self._let_go_areas([cid for cid, _, _ in items])
                for s in held_blocks:
                    self._release(s)
                held_blocks = []
                if first != NIL:
                    tail = h[H_DONE_TAIL]
                    if tail == NIL:
                        h[H_DONE_HEAD] = first
                    else:
                        S[tail * SF + F_NEXT] = first
                    h[H_DONE_TAIL] = last
                    h[H_DONE_COUNT] += len(held)
                    self._drop_claimed(_tally(lanes), _tally(owners))
                    wake = self._results_wake()
                else:
                    wake = False
        finally:
            if held_blocks:
                with self._lock:
                    for s in held_blocks:
                        self._release(s)
        if wake:
            self._wake_results(wake)
        return out

    def _learn_result_sizes(self, lanes: list[int], lens: list[int]) -> None:
        """Raise each lane's L_RESULT to the largest result just acked in it."""
        L = self._L
        if not lanes:
            return
        if lanes.count(lanes[0]) == len(lanes):
            top = {lanes[0]: max(lens)}
        else:
            top = {}
            for lane, ln in zip(lanes, lens):
                if ln > top.get(lane, -1):
                    top[lane] = ln
        for lane, ln in top.items():
            if ln > L[lane * LF + L_RESULT]:
                L[lane * LF + L_RESULT] = ln

    def _place_inline(self, results: list, where: list, index: list[int]) -> None:
        """Blocks for `results`, copied under the lock; where[index[j]] = (block, offset).
        QueueFull (nothing allocated) when they do not fit."""
        groups = _plan_blocks([len(r) for r in results])[0]
        placed = self._alloc_blocks(groups, len(results))
        if placed is None and self._reclaim_dead_reservations():
            placed = self._alloc_blocks(groups, len(results))
        if placed is None:
            raise QueueFull("no slab space for these results; ack them with short error results")
        blocks, at, _ = placed
        data = self._data
        for j, r in enumerate(results):
            data[at[j]:at[j] + len(r)] = r
            where[index[j]] = (blocks[j], at[j])

    def _reserve_and_copy(self, results: list, what: str, where: list, index: list[int],
                          *, need_free: int = 0) -> list[int]:
        """Reserve blocks for `results` under the lock, copy them outside it;
        where[index[j]] = (block, offset). Returns the reservation slots (the caller
        releases them after its commit). QueueFull (nothing changed) when they do
        not fit, or would leave fewer than `need_free` units free."""
        groups, need = _plan_blocks([len(r) for r in results])
        with self._lock:
            placed = None
            if self._h[H_SLAB_FREE] - need >= need_free:
                placed = self._reserve_blocks(groups, len(results))
                if placed is None and self._reclaim_dead_reservations():
                    placed = self._reserve_blocks(groups, len(results))
            if placed is None:
                raise QueueFull(f"no slab space for these {what}")
        blocks, at, _, held = placed
        try:
            data = self._data
            for j, r in enumerate(results):
                data[at[j]:at[j] + len(r)] = r
                where[index[j]] = (blocks[j], at[j])
        except BaseException:
            with self._lock:
                for s in held:
                    self._release(s)
            raise
        return held

    def _let_go_areas(self, item_ids: list[int]) -> None:
        """These claims no longer need the result space set aside for them (caller holds
        the lock): a claim's reservation ends with its last item acked or returned."""
        pop, left = self._areas.pop, self._area_left
        ended: dict[int, int] = {}
        last, k = NIL, 0  # runs of one reservation: the items of one claim come together
        for cid in item_ids:
            a = pop(cid, None)
            if a is not None:
                if a[0] != last:
                    if k:
                        ended[last] = ended.get(last, 0) + k
                    last, k = a[0], 0
                k += 1
        if k:
            ended[last] = ended.get(last, 0) + k
        for s, k in ended.items():
            n = left[s] - k
            if n:
                left[s] = n
            else:
                del left[s]
                self._release(s)

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
        results = _as_bytes(items, self._slab.max_bytes, ())
        S, Sb, h, stack, nslots, R = self._S, self._Sb, self._h, self._stack, self._nslots, self._refs
        unpack = _HEAD.unpack_from
        where: list = [None] * len(items)
        held_blocks = []
        if sum(len(r) for r in results) > COPY_INLINE:
            nonempty = [i for i, r in enumerate(results) if len(r)]
            held_blocks = self._reserve_and_copy([results[i] for i in nonempty], "partial results outside the "
                                                 "result reserve", where, nonempty, need_free=self._reserve)
        try:
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
                if top - n < self._slot_reserve:
                    raise QueueFull(f"no free slot for {n} partial results ({top} free)")
                if not held_blocks:
                    rest = [i for i, _ in held if len(results[i])]
                    need = _plan_blocks([len(results[i]) for i in rest])[1]
                    if h[H_SLAB_FREE] - need < self._reserve:
                        raise QueueFull("no slab space for partial results outside the result reserve")
                    if rest:
                        self._place_inline([results[i] for i in rest], where, rest)
                # 3. Per record: write the slot's fields, commit, chain onto the done list.
                now, seq = time.monotonic_ns(), h[H_SEQ]
                for j, (i, rec) in enumerate(held):
                    ln = len(results[i])
                    if ln:
                        u, at = where[i]
                        R[u] += 1
                    else:
                        u = at = NIL
                    slot = stack[top - 1 - j]
                    b = slot * SF
                    seq += 1
                    _PUT.pack_into(Sb, b * 8 + F_NEXT * 8, NIL, NIL, S[b + F_GEN] % GEN_MASK + 1, rec[F_LANE], seq,
                                   0, rec[F_REQ], now, 0, 0, NIL, 0, NIL)
                    S[b + F_OWNER] = NIL
                    _RESULT.pack_into(Sb, b * 8 + F_RES * 8, u, ln, at, items[i][2])
                    S[b] = DONE  # commit (invariant 3)
                    self._append_done(slot)
                h[H_FREE_TOP] = top - n
                h[H_SEQ] = seq
                for s in held_blocks:
                    self._release(s)
                held_blocks = []
                wake = self._results_wake()
        finally:
            if held_blocks:
                with self._lock:
                    for s in held_blocks:
                        self._release(s)
        self._wake_results(wake)
        return out

    # -- collection -----------------------------------------------------------------
    def results_fd(self) -> int:
        """A descriptor that becomes readable when results may be waiting (invariant 5):
        an event loop watches it (`add_reader`), then calls `collect`."""
        return self._res_fd

    def collect(self, *, wait: bool = True) -> list[Done]:
        """Every result now waiting (copied out, space freed), possibly none; arms the
        wake-up, so the next result after this call makes `results_fd` readable.
        `wait=False`: LockBusy, with nothing taken, instead of waiting for the lock, as
        inside `no_wait()` (an event loop's collect).

        Meant for one consumer (the daemon); several would split the results."""
        self._drain_wake()
        taken = (self._lock if wait else self._try_lock)(self._take_done)
        return self._copied_out(taken, wait) if taken is not None else []

    def wait_results(self, timeout_s: float) -> list[Done]:
        """Block until results exist (or `timeout_s` passed: then []); return all of them."""
        h, fd = self._h, self._res_fd
        end = time.monotonic() + timeout_s
        woken = False
        while True:
            # Armed, nothing done (lock-free reads, hints) and the FIFO not readable:
            # the next result writes it, so wait without a collect (a lock round
            # trip) first. A readable FIFO is always collected (that drains it).
            if woken or h[H_DONE_COUNT] or not h[H_RES_WAITERS]:
                done = self.collect()
                if done:
                    return done
            left = end - time.monotonic()
            woken = left > 0 and bool(select.select((fd,), (), (), left)[0])
            if not woken and h[H_DONE_COUNT] == 0:
                return []

    def _drain_wake(self) -> None:
        try:
            while len(os.read(self._res_fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def _results_wake(self) -> bool:
        """(Under the lock, as results were added.) True when the consumer is armed:
        the caller writes the wake-up after the lock (`_wake_results`); disarmed here,
        so a batch of acks costs one write, not one per ack."""
        if self._h[H_RES_WAITERS]:
            self._h[H_RES_WAITERS] = 0
            return True
        return False

    def _wake_results(self, wake: bool) -> None:
        if wake:
            try:
                os.write(self._res_fd, b"\1")
            except BlockingIOError:  # 64 KiB of unread wake-ups: the consumer will wake anyway
                pass

    def _copied_out(self, taken: tuple[list, list[int]], wait: bool = True) -> list[Done]:
        """Results taken by `_take_done`, their late bytes copied outside the lock."""
        out, held = taken
        if not held:
            return out
        data = self._data
        try:
            return [d if type(d) is Done else _new_tuple(Done, (d[0], d[1], d[2], bytes(data[d[3]:d[3] + d[4]])))
                    for d in out]
        finally:
            # The results are ours already: a caller that must not wait (the event loop)
            # must not lose them to LockBusy here. Their blocks are let go now if the
            # lock is free, else at the next collect.
            self._late_release.extend(held)
            try:
                (self._lock if wait else self._try_lock)(self._release_late)
            except LockBusy:
                pass

    def _release_late(self) -> None:
        """(Under the lock.) Let go of the reservations of results already copied out."""
        for s in self._late_release:
            self._release(s)
        self._late_release.clear()

    def _take_done(self) -> tuple[list, list[int]] | None:
        """`collect`'s hold (the caller holds the lock): the reservations of results
        copied out before let go, the wake-up armed, and the done list taken: (results,
        reservations), None when it is empty. The first COPY_INLINE bytes are copied
        here; the rest are copied by the caller after it released the lock, from blocks
        held by the reservations taken here as their slots were freed (invariant 8):
        those results are (id, request id, status, offset, length) rows until then."""
        if self._late_release:
            self._release_late()
        S, Sb, h, data, stack = self._S, self._Sb, self._h, self._data, self._stack
        h[H_RES_WAITERS] = 1
        if h[H_DONE_COUNT] <= 0:
            return None
        unpack = _RECORD.unpack_from
        blocks_out = []  # result blocks let go of, counted at the end
        out = []
        late = False
        budget = COPY_INLINE
        s = h[H_DONE_HEAD]
        top = h[H_FREE_TOP]
        while s != NIL:
            b = s * SF
            (_, nxt, _, gen, _, _, _, req, *_, u, ln, at, st) = unpack(Sb, b * 8)
            if ln <= budget:
                budget -= ln
                out.append(_new_tuple(Done, (gen << SLOT_BITS | s, req, st, bytes(data[at:at + ln]) if ln else b"")))
            else:
                late = True
                budget = 0
                out.append((gen << SLOT_BITS | s, req, st, at, ln))
            S[b] = FREE  # commit
            blocks_out.append(u)
            stack[top] = s
            top += 1
            s = nxt
        h[H_FREE_TOP] = top
        h[H_DONE_HEAD] = h[H_DONE_TAIL] = NIL
        h[H_DONE_COUNT] = 0
        # Late copies: each block stays ours (one reservation) until its bytes are out.
        return out, self._let_go_blocks(blocks_out, hold=late)
