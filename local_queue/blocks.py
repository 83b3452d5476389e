"""Slab blocks shared by the items of one call, refcounted, and reservations.

The payloads of one put_many (the results of one ack_many, the result space of
one claim) are packed into shared blocks of up to GROUP_BYTES: one buddy
allocation (slab.py) per block instead of one per item. `refs[u]` counts the
slot records that refer to the block starting at unit u: items whose DATA or
RES it is, and RESERVED slots. The last one to let go frees it. A block's
bytes are all payload (no in-block header), so a block fits its bytes exactly.

Reservations (protocol invariant 8 in `local_queue.queue`): a process that
copies bytes outside the lock first takes, under the lock, a RESERVED slot
(its pid in F_OWNER, the block in F_DATA) that holds one reference to the
block. While it holds it nobody frees the block, so it may write or read the
block's bytes without the lock; it commits its items (each adds a reference)
and releases the slot, both under the lock. A reservation whose process died
is released by `_reclaim_dead_reservations` (lease expiry, a dead worker's
release, a failed allocation, a repair), which walks the reservations' list:
RESERVED slots are doubly linked through F_NEXT / F_PREV from
header[H_RESERVED_HEAD] (derived data, rebuilt by a repair). Every method
here expects the caller to hold the queue lock.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from .layout import (
    F_DATA, F_NEXT, F_OWNER, F_PREV, F_STATE, FREE, HOLD_NS, H_FREE_TOP, H_HOLD_ORDER, H_HOLD_UNTIL, H_RESERVED_HEAD,
    H_SLAB_FREE, RESERVED, SF,
)
from .records import QueueFull
from .slab import NIL, UNIT, order_for

GROUP_BYTES = 64 << 10
# A call moving at most this many bytes copies them under the lock: one more
# lock round trip (two flock syscalls and the bookkeeping) costs more than
# copying 64 KiB. Above it the bytes are copied outside (reserve, copy, commit).
COPY_INLINE = GROUP_BYTES


def _plan_blocks(lens: list[int]) -> tuple[list[tuple[int, list[tuple[int, int]]]], int]:
    """Pack items (by byte length) into blocks: ([(block bytes, [(index, offset)])], units).

    Items of length 0 need no block; an item over GROUP_BYTES gets its own."""
    groups, members, used = [], [], 0
    for i, ln in enumerate(lens):
        if not ln:
            continue
        if members and used + ln > GROUP_BYTES:
            groups.append((used, members))
            members, used = [], 0
        members.append((i, used))
        used += ln
    if members:
        groups.append((used, members))
    units = 0
    for nbytes, _ in groups:
        units += 1 << (((nbytes + UNIT - 1) >> 6) - 1).bit_length()  # slab.order_for, written out (hot)
    return groups, units


def _tally(values: list[int]) -> dict[int, int]:
    """How many times each value occurs: one entry without Counter's cost when all
    are equal (the usual case: one claim's items share lane, owner and blocks)."""
    if values and values.count(values[0]) == len(values):
        return {values[0]: len(values)}
    return Counter(values)


def _copy_in(data: memoryview, buffers: list, lens: list[int], at: list[int]) -> None:
    """Copy each buffer to its byte offset in the slab (empty ones have none)."""
    for i, ln in enumerate(lens):
        if ln:
            data[at[i]:at[i] + ln] = buffers[i]


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie has stopped running: dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        stat = os.read(fd, 1024)
    finally:
        os.close(fd)
    state = stat.rpartition(b")")[2].split()[:1]
    return bool(state) and state[0] != b"Z"


class Blocks:
    """Block allocation, release and reservations for LocalQueue (caller holds the lock)."""

    # -- a put's room --------------------------------------------------------------
    def _place(self, views: list, lens: list[int], n: int) -> tuple[list[int], list[int]]:
        """A put of at most COPY_INLINE bytes, in one go under the lock: its payloads
        planned into blocks, given room (`_room_for_put`), copied in, and one reference
        per item added: (block, byte offset) per item. The references come before the
        items' commit; a holder that dies between leaves its mark, and the repair derives
        them again from the slot records (invariant 3)."""
        groups, need = _plan_blocks(lens)
        blocks, at, units = self._room_for_put(groups, need, n, reserve=False)
        _copy_in(self._data, views, lens, at)
        R = self._refs
        for u, k in units:
            R[u] += k
        return blocks, at

    def _room_for_put(self, groups: list, need: int, n: int, *, reserve: bool) -> tuple:
        """Slots and slab blocks for a put (reserved ones if `reserve`), or QueueFull
        with nothing changed. Puts leave the result reserve and the reservation
        slots alone, and wait behind a larger put waiting for room (`_hold_for_large`)."""
        h = self._h
        top = h[H_FREE_TOP]
        if top - n - (len(groups) if reserve else 0) < self._slot_reserve:
            raise QueueFull(f"queue full: {top} free slots, {n} needed")
        if h[H_SLAB_FREE] - need < self._reserve and not (
                self._reclaim_dead_reservations() and h[H_SLAB_FREE] - need >= self._reserve):
            raise QueueFull("queue full: the payload slab is full")
        until = h[H_HOLD_UNTIL]
        held = until and until > time.monotonic_ns()
        if held and groups and max(order_for(nbytes) for nbytes, _ in groups) < h[H_HOLD_ORDER]:
            raise QueueFull("queue full: a larger payload waits for slab room first")
        placed = self._reserve_blocks(groups, n) if reserve else self._alloc_blocks(groups, n)
        if placed is None and self._reclaim_dead_reservations():
            placed = self._reserve_blocks(groups, n) if reserve else self._alloc_blocks(groups, n)
        if placed is None:
            self._hold_for_large(max(order_for(nbytes) for nbytes, _ in groups))
            raise QueueFull("queue full: no slab block big enough")
        if held:
            h[H_HOLD_UNTIL] = 0  # the waiting payload (or a larger one) got its room
        return placed

    def _hold_for_large(self, order: int) -> None:
        """A put found free space but no free block of `order` (the slab is fragmented):
        until HOLD_NS after its last try, smaller puts wait behind it, so the space
        consumers free merges into a block it can take instead of being taken by
        small payloads first; large payloads get their turn however many small ones
        arrive. Claims and acks go on (they free space)."""
        h = self._h
        now = time.monotonic_ns()
        if h[H_HOLD_UNTIL] <= now or order < h[H_HOLD_ORDER]:
            h[H_HOLD_ORDER] = order
        h[H_HOLD_UNTIL] = now + HOLD_NS

    def _alloc_blocks(self, groups: list, n: int) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
        """Allocate planned blocks: (block, byte offset) per item and [(block, members)],
        or None (nothing allocated). A new block has no reference yet: the caller
        adds one per committed item (`_add_refs`) or reserves it."""
        slab = self._slab
        blocks, at, got = [NIL] * n, [NIL] * n, []
        for nbytes, members in groups:
            u = slab.alloc(nbytes)
            if u == NIL:
                for v, _ in got:
                    slab.free(v)
                return None
            self._refs[u] = 0
            got.append((u, len(members)))
            base = u * UNIT
            for i, off in members:
                blocks[i], at[i] = u, base + off
        return blocks, at, got

    def _add_refs(self, units: list[tuple[int, int]]) -> None:
        R = self._refs
        for u, n in units:
            R[u] += n

    def _unref(self, u: int) -> None:
        """One record lets go of block u."""
        R = self._refs
        r = R[u] - 1
        R[u] = r
        if not r:
            self._slab.free(u)

    def _let_go_blocks(self, blocks_out: list[int], *, hold: bool = False) -> list[int]:
        """Records let go of their blocks (NIL: none), each block counted once
        (`_tally`); the last one out frees the block. With `hold`, each block is kept by
        a reservation of this process first, for bytes still to be copied out: those
        slots (else [])."""
        drops = _tally(blocks_out)
        drops.pop(NIL, None)
        held = [self._reserve_block(u) for u in drops] if hold else []
        R, free = self._refs, self._slab.free
        for u, n in drops.items():
            r = R[u] - n
            R[u] = r
            if not r:
                free(u)
        return held

    def _free_data(self, s: int) -> None:
        u = self._S[s * SF + F_DATA]
        if u != NIL:
            self._unref(u)

    # -- reservations ----------------------------------------------------------------
    def _reserve_block(self, u: int) -> int:
        """A RESERVED slot holding one reference to block u for this process, at the
        head of the reservations' list. The caller made sure a slot is free."""
        h, S = self._h, self._S
        top = h[H_FREE_TOP] - 1
        s = self._stack[top]
        h[H_FREE_TOP] = top
        b = s * SF
        head = h[H_RESERVED_HEAD]
        S[b + F_OWNER] = self._pid
        S[b + F_DATA] = u
        S[b + F_NEXT] = head
        S[b + F_PREV] = NIL
        S[b + F_STATE] = RESERVED  # commit (invariant 3)
        if head != NIL:
            S[head * SF + F_PREV] = s
        h[H_RESERVED_HEAD] = s
        self._refs[u] += 1
        return s

    def _release(self, s: int) -> None:
        """End a reservation: the slot is free again, its block reference dropped."""
        S, h, b = self._S, self._h, s * SF
        u, nxt, prev = S[b + F_DATA], S[b + F_NEXT], S[b + F_PREV]
        S[b + F_STATE] = FREE  # commit
        S[b + F_DATA] = NIL
        if prev == NIL:
            h[H_RESERVED_HEAD] = nxt
        else:
            S[prev * SF + F_NEXT] = nxt
        if nxt != NIL:
            S[nxt * SF + F_PREV] = prev
        top = h[H_FREE_TOP]
        self._stack[top] = s
        h[H_FREE_TOP] = top + 1
        self._unref(u)

    def _reserve_blocks(self, groups: list, n: int):
        """Allocate planned blocks and reserve each: (blocks, at, units, reservation slots) or None."""
        if self._h[H_FREE_TOP] < len(groups):
            return None
        placed = self._alloc_blocks(groups, n)
        if placed is None:
            return None
        blocks, at, units = placed
        return blocks, at, units, [self._reserve_block(u) for u, _ in units]

    def _reclaim_dead_reservations(self) -> int:
        """Release the reservations of processes that died between reserve and commit.

        Called where space is short (a full put, a claim whose results fit
        nowhere) and by the sweeps: a walk of the reservations' list (not of
        every slot), each other process holding one looked up once."""
        S, alive, dead = self._S, {self._pid: True}, []
        s = self._h[H_RESERVED_HEAD]
        while s != NIL:
            b = s * SF
            pid = S[b + F_OWNER]
            ok = alive.get(pid)
            if ok is None:
                ok = alive[pid] = _alive(pid)
            if not ok:
                dead.append(s)
            s = S[b + F_NEXT]
        for s in dead:
            self._release(s)
        return len(dead)
