"""Binary buddy allocator for the payload/result slab in shared memory.

Why buddy: payloads and results range from ~100 B to several MB and are freed out
of order. A buddy allocator is simple, O(log slab) per operation (amortised O(1)
splits/merges when allocations slide through the slab as a FIFO queue does),
and its fragmentation is bounded: a block is the request rounded up to a power
of two of 64-byte units (internal waste < 2x), and two free buddies are always
merged at once, so free space never splinters below what live blocks force.

State, all inside the shared segment and only touched under the queue lock:
- `tags[u]` (u8 per 64-byte unit) = order + 1 if unit `u` starts a free block on
  free list `order`; ALLOCATED | order if it starts an allocated block; else 0.
  Exact at all times: every push sets it, every removal clears it, alloc tags
  what it hands out. So a block's bytes are all its owner's (no in-block
  header): a payload of exactly 2**k bytes takes a 2**k block.
- `heads[k]`: first free block of order k (NIL = -1). Free lists are doubly
  linked through the first 16 bytes of each free block (`links[u*8]` = next,
  `links[u*8+1]` = prev); a free block's bytes belong to the allocator.
- `hdr[free_index]`: free units, for usage reports and tests.

The slab need not be a power of two: it is covered greedily by the largest
aligned power-of-two blocks ("top blocks"); any aligned block inside the slab
lies inside one top block, so merging two in-range buddies is always legal.

After a process dies inside a critical section the free lists may be torn;
`rebuild` recreates tags, lists and the counter from the list of live blocks
(which the queue derives from its slot records).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

UNIT = 64  # bytes in the smallest block; also the alignment of every block
MAX_ORDERS = 48  # 64 B << 47: far above any slab we map
NIL = -1
ALLOCATED = 0x80  # tag bit of an allocated block's first unit (free tags are 1..MAX_ORDERS)


def order_for(nbytes: int) -> int:
    """Order (log2 of the unit count) of the block that holds `nbytes` (> 0)."""
    return (((nbytes + UNIT - 1) >> 6) - 1).bit_length()


def top_blocks(units: int) -> list[tuple[int, int]]:
    """Greedy cover of [0, units) by maximal aligned power-of-two blocks."""
    out, u = [], 0
    while u < units:
        k = (units - u).bit_length() - 1
        while u & ((1 << k) - 1):
            k -= 1
        out.append((u, k))
        u += 1 << k
    return out


class Slab:
    """Views over the slab's shared state; the caller holds the queue lock."""

    __slots__ = ("units", "top_order", "max_bytes", "links", "tags", "heads", "hdr", "free_index")

    def __init__(self, data: memoryview, tags: memoryview, heads: memoryview,
                 hdr: memoryview, free_index: int) -> None:
        self.units = len(tags)
        self.links = data.cast("q")
        self.tags = tags
        self.heads = heads
        self.hdr = hdr
        self.free_index = free_index
        self.top_order = max(k for _, k in top_blocks(self.units))
        #: Largest block that could ever be allocated (bytes).
        self.max_bytes = UNIT << self.top_order

    def release_views(self) -> None:
        self.links.release()

    # -- free lists --------------------------------------------------------------
    def _push(self, k: int, u: int) -> None:
        links, heads = self.links, self.heads
        h = heads[k]
        links[u * 8] = h
        links[u * 8 + 1] = NIL
        if h != NIL:
            links[h * 8 + 1] = u
        heads[k] = u
        self.tags[u] = k + 1

    def largest_free(self) -> int:
        """Bytes of the largest free block (0 if none): an alloc of at most that succeeds."""
        heads = self.heads
        for k in range(self.top_order, -1, -1):
            if heads[k] != NIL:
                return UNIT << k
        return 0

    # -- alloc / free ------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Unit index of a new block of >= nbytes (> 0), or NIL if none is free."""
        # Hot path: list operations are written out inline (see _push).
        k = (((nbytes + UNIT - 1) >> 6) - 1).bit_length()
        heads, top = self.heads, self.top_order
        j = k
        while j <= top and heads[j] == NIL:
            j += 1
        if j > top:
            return NIL
        links, tags = self.links, self.tags
        u = heads[j]
        n = links[u * 8]
        heads[j] = n
        if n != NIL:
            links[n * 8 + 1] = NIL
        # Split down to order k; the upper halves go on the lower lists, which are
        # empty (lists k..j-1 were found empty above): each upper half is alone on its list.
        while j > k:
            j -= 1
            v = u + (1 << j)
            links[v * 8] = NIL
            links[v * 8 + 1] = NIL
            heads[j] = v
            tags[v] = j + 1
        tags[u] = ALLOCATED | k
        self.hdr[self.free_index] -= 1 << k
        return u

    def free(self, u: int) -> None:
        """Give back the allocated block at unit u."""
        k = self.tags[u] & ~ALLOCATED
        self.tags[u] = 0
        self.hdr[self.free_index] += 1 << k
        tags, units, top, links, heads = self.tags, self.units, self.top_order, self.links, self.heads
        # Merge with the buddy while it is a free block of the same order.
        while k < top:
            b = u ^ (1 << k)
            if b + (1 << k) > units or tags[b] != k + 1:
                break
            n, p = links[b * 8], links[b * 8 + 1]
            if p == NIL:
                heads[k] = n
            else:
                links[p * 8] = n
            if n != NIL:
                links[n * 8 + 1] = p
            tags[b] = 0
            u &= ~(1 << k)
            k += 1
        self._push(k, u)

    # -- repair and verification -------------------------------------------------
    def format(self) -> None:
        """Everything free."""
        self.rebuild([])

    def rebuild(self, live: list[tuple[int, int]]) -> None:
        """Recreate free lists and tags given every live block as (unit, order)."""
        live = sorted(live)
        starts = [u for u, _ in live]
        for (u, k), nxt in zip(live, starts[1:] + [self.units]):
            if u & ((1 << k) - 1) or u + (1 << k) > nxt:
                raise RuntimeError(f"slab: live block ({u}, {k}) misaligned or overlapping; this is a bug")
        np.frombuffer(self.tags, dtype=np.uint8)[:] = 0
        for u, k in live:
            self.tags[u] = ALLOCATED | k
        for k in range(MAX_ORDERS):
            self.heads[k] = NIL
        self.hdr[self.free_index] = 0

        def cover(u: int, k: int, lo: int, hi: int) -> None:
            # Live blocks live[lo:hi] lie inside [u, u + 2**k).
            if lo == hi:
                self._push(k, u)
                self.hdr[self.free_index] += 1 << k
                return
            if hi - lo == 1 and live[lo] == (u, k):
                return
            half = 1 << (k - 1)
            m = bisect_left(starts, u + half, lo, hi)
            cover(u, k - 1, lo, m)
            cover(u + half, k - 1, m, hi)

        for u, k in top_blocks(self.units):
            lo = bisect_left(starts, u)
            cover(u, k, lo, bisect_left(starts, u + (1 << k), lo))

    def check(self, live: list[tuple[int, int]]) -> None:
        """Raise RuntimeError unless free lists + live blocks tile the slab exactly."""
        free = []
        for k in range(MAX_ORDERS):
            u, prev = self.heads[k], NIL
            while u != NIL:
                if self.tags[u] != k + 1 or self.links[u * 8 + 1] != prev:
                    raise RuntimeError(f"slab: free list {k} broken at unit {u}")
                free.append((u, k))
                prev, u = u, self.links[u * 8]
        tags = np.frombuffer(self.tags, dtype=np.uint8)
        if np.count_nonzero((tags > 0) & (tags < ALLOCATED)) != len(free):
            raise RuntimeError("slab: stray free tags")
        if sorted(np.flatnonzero(tags >= ALLOCATED).tolist()) != sorted(u for u, _ in live) or any(
                tags[u] != ALLOCATED | k for u, k in live):
            raise RuntimeError("slab: allocated tags and live blocks disagree")
        free_set = set(free)
        for u, k in free:
            b = u ^ (1 << k)
            if (b, k) in free_set:
                raise RuntimeError(f"slab: free buddies ({u}, {k}) not merged")
        pos = 0
        for u, k in sorted(free + list(live)):
            if u != pos:
                raise RuntimeError(f"slab: gap or overlap at unit {pos} (next block at {u})")
            pos = u + (1 << k)
        if pos != self.units:
            raise RuntimeError("slab: blocks do not cover the slab")
        if self.hdr[self.free_index] != sum(1 << k for _, k in free):
            raise RuntimeError("slab: free-unit counter is off")
