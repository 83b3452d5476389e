"""Slab blocks shared by the items of one call, with a refcount in their header.

The payloads of one put_many (the results of one ack_many) are packed into
shared blocks of up to GROUP_BYTES, each with a 16-byte header (refcount,
order): one buddy allocation (slab.py) per block instead of one per item, and
the last item to let go frees it. The queue lock is held by every caller.
"""

from __future__ import annotations

from local_queue.layout import F_DATA, SF
from local_queue.slab import NIL, UNIT, order_for

# A block starts with BLOCK_HDR bytes: int64 refcount (items whose DATA/RES is
# this block) and int64 buddy order.
BLOCK_HDR = 16
GROUP_BYTES = 64 << 10


def _plan_blocks(lens: list[int]) -> tuple[list[tuple[int, list[tuple[int, int]]]], int]:
    """Pack items (by byte length) into blocks: ([(block bytes, [(index, offset)])], units).

    Items of length 0 need no block; an item over GROUP_BYTES gets its own."""
    groups, members, used = [], [], BLOCK_HDR
    for i, ln in enumerate(lens):
        if not ln:
            continue
        if members and used + ln > GROUP_BYTES:
            groups.append((used, members))
            members, used = [], BLOCK_HDR
        members.append((i, used))
        used += ln
    if members:
        groups.append((used, members))
    return groups, sum(1 << order_for(nbytes) for nbytes, _ in groups)


class Blocks:
    """Block allocation and release for LocalQueue (caller holds the lock)."""

    def _alloc_blocks(self, groups: list, n: int) -> tuple[list[int], list[int]] | None:
        """Allocate planned blocks: (block, byte offset) per item, or None (nothing allocated)."""
        slab, Q = self._slab, self._slab.links
        blocks, at, got = [NIL] * n, [NIL] * n, []
        for nbytes, members in groups:
            u = slab.alloc(nbytes)
            if u == NIL:
                for v, k in got:
                    slab.free(v, k)
                return None
            k = order_for(nbytes)
            Q[u * 8], Q[u * 8 + 1] = len(members), k  # header: refcount, order
            got.append((u, k))
            base = u * UNIT
            for i, off in members:
                blocks[i], at[i] = u, base + off
        return blocks, at

    def _unref(self, u: int) -> None:
        """One item lets go of block u (caller holds the lock)."""
        self._drop_refs({u: 1})

    def _drop_refs(self, drops: dict[int, int]) -> None:
        """Items let go of blocks (block -> count); the last one out frees the block."""
        Q, free = self._slab.links, self._slab.free
        for u, n in drops.items():
            r = Q[u * 8] - n
            if r:
                Q[u * 8] = r
            else:
                free(u, Q[u * 8 + 1])

    def _free_data(self, s: int) -> None:
        u = self._S[s * SF + F_DATA]
        if u != NIL:
            self._unref(u)
