"""The shared-memory queue between the daemon and its workers.

The daemon puts requests into per-model *lanes*; worker processes pull
(`claim`) batches from the lane they choose, give back what they over-pulled
(`return_items`, to the head, order kept) and `ack` with results, which the
daemon collects (`wait_results`, or `collect` from an event loop woken by
`results_fd`); a worker may `emit` partial results of an
item it still holds (streaming), collected the same way before its ack. A
claim is a lease: if the worker dies, the items go back to their lane
(`expire_leases`, `release_worker`) and no request is lost or answered twice.

Memory: one shared segment (layout.py). Slab: a binary buddy allocator
(slab.py) whose blocks are shared by the items of one call (blocks.py) and
fit their bytes exactly. Puts leave 1/8 of the slab free, so workers can
always write results (which frees payloads) when producers fill it; a claim
sets aside room for its items' results (invariant 9); a large put that finds
the slab fragmented makes smaller puts wait behind it until its room merges
(`_hold_for_large`).

Where the code lives: layout.py (segment layout, record fields, ids),
lock.py (the lock), put.py (put and cancel), blocks.py and slab.py (slab
space), lanes.py (lanes and the done list), workers.py (worker records, leases,
wake-ups), results.py (ack, emit, collection), recovery.py (expiry, repair,
check). This module is the facade: lifecycle, claim and return.

Item life: FREE -> QUEUED (put) -> CLAIMED (claim) -> DONE (ack, or the queue
completes it with STATUS_EXPIRED / STATUS_POISON) -> FREE (wait_results copies
the result out). CLAIMED -> QUEUED on return / lease expiry / release; QUEUED ->
FREE on cancel. FREE -> DONE (emit): a partial result of a CLAIMED item, in a
slot of its own carrying the item's request id; the item stays CLAIMED.
FREE -> RESERVED -> FREE: a slot that holds a slab block for a process copying
bytes outside the lock (invariant 8); it never carries an item.

Protocol and invariants:
1. Every read-modify-write of shared state happens under the ONE queue lock:
   a per-process `threading.Lock` (flock does not exclude threads of one
   process), then `fcntl.flock` on `/dev/shm/<name>.lock` (the kernel drops it
   when the holder dies, even by SIGKILL). Lock order: thread lock, then flock.
   Nothing is waited for while holding it; semaphores are posted after it is
   released. Lock-free reads are single aligned int64 loads, used as hints only.
2. A lane is a doubly linked list of QUEUED slots sorted by (`key`, `seq`).
   `seq` is a global counter assigned at put, under the lock, so it follows
   enqueue time; `key` is the item's virtual start time in its lane (fair
   queueing by flow, start-time fair queueing over tokens): an interactive put
   of flow f (`put_many(flow=)`: a client) gets key = max(the lane's virtual
   time L_VTIME, f's finish time), and f's finish time becomes key + tokens; a
   claim raises L_VTIME to the largest key it took (never lowers it). So one
   flow's items keep put order, and a flow that sends little is not queued
   behind a flow that sends much: its item starts at the virtual time, ahead
   of the other flow's later items. Flows' finish times live in the producer's
   handle (`_flows`, under the lock), not in the segment: each producer keeps
   its own (the daemon is the one producer); a flow put through two handles
   gets a share from each. Put appends at the tail when its key is the
   largest, else it is inserted at its place, walking from the nearer end;
   claim takes a prefix; returns and expiries insert back by (key, seq), so a
   lane's order never depends on who returns first.
   Batch work (`put_many(batch=True)`) has key BATCH_KEY and carries
   BATCH_SEQ in its seq: a lane is its interactive items in key order, then
   its batch items in enqueue order, so a claim takes interactive work first
   and fills the rest of its budget with batch work. `promote` clears the bit
   of a queued batch item and gives it the lane's virtual time as its key:
   ahead of interactive items not yet due.
   DONE slots form one FIFO list (singly linked through F_NEXT).
3. A slot's `state` field is its commit point and is written last: all other
   fields of the new state (and its block bytes, fully copied) are written
   before it; the old state's block reference is dropped after it. Everything
   else is derived from the slot records: lane and done lists, free-slot
   stack, depth/token/claimed counters, block refcounts, the slab free lists,
   the seq counter's lower bound.
4. The lock holder writes its pid into `header[H_HOLDER]` on entry and clears it
   on a clean exit. If the next holder finds it set, the previous one died (or
   raised) inside a critical section: it calls `_repair`, which rebuilds all
   derived data from the slot records.
   Guaranteed after such a death: every item is in exactly one state; items
   committed by the dead holder keep that state, the others keep their old
   one (a batch call is applied to a prefix of its items); no slab byte is
   lost or shared. Not guaranteed: the dead caller's return value is gone
   (items it had claimed come back through lease expiry / release_worker);
   an expiry torn between "attempts += 1" and its commit counts that attempt
   twice.
5. Wake-ups: waiter counters live in the header, changed under the lock. New
   work (put, return, requeue) bumps H_WORK_GEN under the lock and then, when
   any waiter is counted, wakes every process sleeping on the generation's low
   32-bit word (one FUTEX_WAKE, `local_queue.futex`): the worker that wakes may
   decline the lane (not its model) and the one that would serve it must not
   sleep on. A waiter reads the generation, re-checks its condition, and
   sleeps only while the word still reads what it read, so work that comes in
   between is never slept through, and no waiter can take another's wake-up
   (a shared counting semaphore let a worker that declined the lane and
   waited again at once take the post still pending for the holder, which
   then slept its whole timeout: 1-5 % of a lone client's requests +250 ms
   with two workers). Spurious wake-ups are fine. A waiter leaves the count at
   its process's next critical section (lock.py), not in a lock round trip of
   its own: until then a producer may wake once more for it, which costs a
   syscall with nobody to wake. The single result consumer gets one post
   per batch of acks, through a FIFO rather than a semaphore, so that an
   event loop can wait for it (`results_fd`) without a thread: the consumer
   arms H_RES_WAITERS (under the lock) whenever it has taken the done list;
   the first producer of results after that disarms it and writes one byte.
   A process killed while waiting leaves its count (or the armed flag) behind:
   that costs at most spurious wake-ups.
6. Time is `time.monotonic_ns()` everywhere (CLOCK_MONOTONIC is system-wide).
7. Payload views handed out by claim point into the slab; they stay valid
   until the item is acked or returned (or its lease is lost).
8. Reserve, copy, commit. A call moving more than COPY_INLINE bytes (put_many,
   ack_many, emit_many, wait_results) never copies them under the lock:
   (a) under the lock it allocates the blocks and takes one RESERVED slot per
   block (F_OWNER = its pid, F_DATA = the block, one reference); (b) without
   the lock it copies; (c) under the lock it commits its items (invariant 3;
   each adds a reference) and releases the RESERVED slots. A reserved block is
   never freed while its RESERVED slot lives, so (b) needs no lock. If the
   process dies between (a) and (c), its RESERVED slots outlive it: the next
   holder that expires leases, releases a dead worker, fails an allocation
   or repairs finds their pid dead and releases them (their blocks return to
   the slab, nothing was committed: the put never happened, the ack did not
   complete and its items come back through their leases). A pid reused
   before that keeps the space until the new process exits.
9. Results always have room. A claim sets aside one block for its items'
   results (`result_bytes` each, default the lane's largest result so far,
   L_RESULT), held by a RESERVED slot of the claiming process, and takes
   only as many items as that block fits (none when not one fits: the
   items stay queued until results are collected). An ack copies a result
   that fits its item's space there before it takes the lock, and needs no
   allocation; the handle ends the reservation when the last of the claim's
   items is acked or returned (`_let_go_areas`), held or not. Only a result
   larger than its item's space allocates, and only that can be QueueFull.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory

import _posixshmem
import numpy as np

from . import futex
from .blocks import Blocks
from .layout import (
    BATCH_SEQ, CLAIMED, DEVICE_BYTES, EPOCH_MASK, EPOCH_SHIFT, F_DATA, F_DEADLINE, F_EPOCH, F_FLOW,
    F_GEN, F_KEY, F_LANE, F_OWNER, F_PREV, F_RES, F_SEQ, F_STATE, F_TOKENS, GEN_MASK, HDR_FIELDS, H_DEPTH,
    H_DONE_COUNT, H_DONE_HEAD, H_DONE_TAIL, H_FREE_HEADS, H_FREE_TOP, H_MAGIC,
    H_MAX_LANES, H_MAX_WORKERS, H_REPAIRS, H_RESERVED_HEAD, H_SLAB_BYTES, H_SLAB_FREE, H_SLOTS, H_VERSION,
    H_WORK_GEN, H_WORK_WAITERS, INFO_BYTES, LF, L_CLAIMED, L_DEPTH, L_HEAD, L_RESULT, L_TAIL, L_TOKENS, L_VTIME, MAGIC,
    MAX_LEASE_MS,
    NAME_BYTES, RESULT_RESERVE, SF, SLOT_BITS, SLOT_MASK, SLOT_RESERVE, STATUS_EXPIRED, STATUS_POISON,
    VERSION, WF, WORKER_BITS, W_CLAIMED, W_LEASE_MS, put_id, _CLAIM, _HEAD, _NAME_RE, _layout,
    _open_segment,
)
from .lanes import Lanes
from .lock import _forks, _Lock
from .put import Producer
from .records import (
    Claim, Done, ItemTooLarge, LaneStats, LockBusy, QueueError, QueueFull, QueueUsage, UnknownWorker,
    WorkerInfo, _new_tuple,
)
from .recovery import Recovery
from .results import Results
from .slab import MAX_ORDERS, NIL, UNIT, Slab
from .workers import Workers

# What `from local_queue.queue import ...` has always offered its users.
__all__ = [
    "DEVICE_BYTES", "INFO_BYTES", "NAME_BYTES", "STATUS_EXPIRED", "STATUS_POISON", "Claim", "Done",
    "ItemTooLarge", "LaneStats", "LocalQueue", "LockBusy", "QueueError", "QueueFull", "QueueUsage", "UnknownWorker",
    "WorkerInfo", "put_id",
]


class LocalQueue(Producer, Lanes, Blocks, Workers, Results, Recovery):
    """Handle on a shared queue. Thread-safe; one handle per process (spawn, not fork)."""

    # -- lifecycle ---------------------------------------------------------------
    @classmethod
    def create(cls, name: str | None = None, *, slots: int = 16384, slab_bytes: int = 256 << 20,
               max_lanes: int = 256, max_workers: int = 64) -> LocalQueue:
        name = name or f"fleet-q-{secrets.token_hex(6)}"
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"queue name {name!r}: use 1-100 of A-Z a-z 0-9 _ . -")
        if not 1 <= slots <= SLOT_MASK + 1:
            raise ValueError(f"slots must be in 1..{SLOT_MASK + 1}")
        if slab_bytes < 4096:
            raise ValueError("slab_bytes must be >= 4096")
        if not 1 <= max_lanes <= 1 << 20 or not 1 <= max_workers <= 1 << WORKER_BITS:
            raise ValueError("max_lanes / max_workers out of range")
        slab_bytes -= slab_bytes % UNIT
        lay = _layout(slots, slab_bytes, max_lanes, max_workers)
        lock_path = f"/dev/shm/{name}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        made = []
        try:
            shm = _open_segment(name, True, lay["size"])
            made.append(lambda: (shm.close(), _posixshmem.shm_unlink(f"/{name}")))
            wake = f"/dev/shm/{name}.wake"
            os.mkfifo(wake, 0o600)
            made.append(lambda: os.unlink(wake))
        except BaseException:
            for undo in made:
                undo()
            os.close(fd)
            os.unlink(lock_path)
            raise
        h = shm.buf[:HDR_FIELDS * 8].cast("q")
        for i, v in ((H_SLOTS, slots), (H_SLAB_BYTES, slab_bytes), (H_MAX_LANES, max_lanes),
                     (H_MAX_WORKERS, max_workers), (H_VERSION, VERSION)):
            h[i] = v
        h.release()
        q = cls(name, shm, fd, owner=True)
        q._format()
        q._h[H_MAGIC] = MAGIC  # last: an attach before this point is refused
        return q

    @classmethod
    def attach(cls, name: str) -> LocalQueue:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"queue name {name!r} is not valid")
        shm = _open_segment(name, False, 0)
        try:
            fd = os.open(f"/dev/shm/{name}.lock", os.O_RDWR)
        except BaseException:
            shm.close()
            raise
        return cls(name, shm, fd, owner=False)

    def __init__(self, name: str, shm: shared_memory.SharedMemory, lock_fd: int, *, owner: bool) -> None:
        self.name = name
        self._shm, self._lock_fd, self._owner = shm, lock_fd, owner
        self._pid = os.getpid()
        self._fork = _forks[0]
        self._tlock = threading.Lock()
        self._lock = _Lock(self)
        self._try_lock = _Lock(self, wait=False)
        buf = shm.buf
        h = buf[:HDR_FIELDS * 8].cast("q")
        if not owner and (h[H_MAGIC] != MAGIC or h[H_VERSION] != VERSION):
            h.release()
            shm.close()
            os.close(lock_fd)
            raise ValueError(f"shared memory {name!r} is not a fleet queue (version {VERSION})")
        self._h = h
        self._nslots, slab_bytes = h[H_SLOTS], h[H_SLAB_BYTES]
        self._max_lanes, self._max_workers = h[H_MAX_LANES], h[H_MAX_WORKERS]
        lay = _layout(self._nslots, slab_bytes, self._max_lanes, self._max_workers)
        n = self._nslots

        def region(key: str, nbytes: int) -> memoryview:
            return buf[lay[key]:lay[key] + nbytes]

        # Scalar access through memoryviews (fast per field); numpy views over
        # the same bytes for whole-table scans.
        self._Sb = region("slots", n * SF * 8)  # bytes, for struct record reads/writes
        self._S = self._Sb.cast("q")
        self._stack = region("stack", n * 8).cast("q")
        self._L = region("lanes", self._max_lanes * LF * 8).cast("q")
        self._names = region("names", self._max_lanes * NAME_BYTES)
        self._W = region("workers", self._max_workers * WF * 8).cast("q")
        self._devices = region("devices", self._max_workers * DEVICE_BYTES)
        self._infos = region("infos", self._max_workers * INFO_BYTES)
        self._data = region("slab", slab_bytes)
        self._S_np = np.frombuffer(self._S, dtype=np.int64).reshape(n, SF)
        self._L_np = np.frombuffer(self._L, dtype=np.int64).reshape(self._max_lanes, LF)
        # Puts leave this many slab units free, so that workers can still write
        # results (and so free payloads) when producers have filled the slab.
        self._reserve = (slab_bytes // UNIT) // RESULT_RESERVE
        self._slab = Slab(self._data, region("tags", slab_bytes // UNIT),
                          h[H_FREE_HEADS:H_FREE_HEADS + MAX_ORDERS], h, H_SLAB_FREE)
        # The work wake-up (invariant 5): a futex on the low word of the work generation.
        self._gen_addr = futex.low_word_address(buf, H_WORK_GEN * 8)
        # The results' wake-up (invariant 5): a FIFO every process opens read-write
        # (never blocks, never ENXIO); only the result consumer reads it.
        self._res_fd = os.open(f"/dev/shm/{name}.wake", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._refs = region("refs", slab_bytes // UNIT * 4).cast("i")
        # Puts leave this many slots free for the reservations of claims and acks.
        self._slot_reserve = min(SLOT_RESERVE, n // 8)
        self._lane_ids: dict[str, int] = {}
        self._lane_names: dict[int, str] = {}
        #: (lane, flow) -> the flow's finish time in the lane's virtual time (invariant 2).
        self._flows: dict[tuple[int, int], int] = {}
        # Result space set aside by this handle's claims (invariant 9):
        # claim id -> (reservation slot, block, byte offset, bytes), and per
        # reservation slot the claims not yet acked or returned.
        self._areas: dict[int, tuple[int, int, int, int]] = {}
        self._area_left: dict[int, int] = {}
        # Threads inside `no_wait()`: they get LockBusy instead of waiting for the lock.
        self._nowait_threads: set[int] = set()
        # Reservations of results already copied out, let go at the next lock (collect).
        self._late_release: list[int] = []
        # Waits for work ended here, not yet taken out of H_WORK_WAITERS (lock.py).
        self._unwaited = 0

    @contextmanager
    def no_wait(self) -> Iterator[None]:
        """Inside, on this thread, a call that would wait for the queue lock raises
        LockBusy instead, with nothing changed; so does a put too large to copy
        under the lock. For an event loop, which must never block: it retries
        such a call on a thread of its own."""
        tid = threading.get_ident()
        self._nowait_threads.add(tid)
        try:
            yield
        finally:
            self._nowait_threads.discard(tid)

    def __reduce__(self):
        return (LocalQueue.attach, (self.name,))

    def __enter__(self) -> LocalQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop this process's handle (the mapping itself lives while claim payload views do)."""
        if self._shm is None:
            return
        if self._area_left or self._unwaited or self._late_release:
            with self._lock:  # (which also takes this process's ended waits out of the count)
                for s in self._area_left:
                    self._release(s)
                self._release_late()
            self._areas.clear()
            self._area_left.clear()
        os.close(self._res_fd)
        self._slab.release_views()
        del self._S_np, self._L_np
        for mv in (self._S, self._Sb, self._stack, self._L, self._names, self._W, self._devices, self._infos,
                   self._refs, self._data, self._h):
            mv.release()
        try:
            self._shm.close()
        except BufferError:
            # Payload views of claims are still alive; they keep the mmap object
            # (and so the mapping) until they are dropped, then it unmaps itself.
            self._shm._mmap = None
        os.close(self._lock_fd)
        self._shm = None

    def unlink(self) -> None:
        """Remove the segment, wake FIFO and lock file (the creator's job; any handle may do it)."""
        try:
            os.unlink(f"/dev/shm/{self.name}.wake")
        except FileNotFoundError:
            pass
        try:
            # Not SharedMemory.unlink(): before 3.13 it also messages the resource
            # tracker, which never heard of this segment (see _open_segment).
            _posixshmem.shm_unlink(f"/{self.name}")
        except FileNotFoundError:
            pass
        try:
            os.unlink(f"/dev/shm/{self.name}.lock")
        except FileNotFoundError:
            pass

    def _format(self) -> None:
        h, S, n = self._h, self._S_np, self._nslots
        S[:] = 0
        S[:, F_DATA] = S[:, F_RES] = S[:, F_OWNER] = NIL
        np.frombuffer(self._stack, dtype=np.int64)[:] = np.arange(n - 1, -1, -1)
        h[H_FREE_TOP] = n
        h[H_DONE_HEAD] = h[H_DONE_TAIL] = h[H_RESERVED_HEAD] = NIL
        self._L_np[:] = 0
        self._L_np[:, L_HEAD] = self._L_np[:, L_TAIL] = NIL
        self._slab.format()

    def depth(self) -> int:
        """Items queued (not claimed) over all lanes."""
        return self._h[H_DEPTH]

    def usage(self) -> QueueUsage:
        h = self._h
        with self._lock:
            return QueueUsage(self._nslots, h[H_FREE_TOP], len(self._data), h[H_SLAB_FREE] * UNIT,
                              h[H_DONE_COUNT], h[H_REPAIRS])

    # -- consumer ----------------------------------------------------------------
    def deadlines(self, item_ids: list[int]) -> list[int]:
        """The deadline now (monotonic ns, 0 = none) of each item this worker holds
        a claim on: the one it was put with, or 1 once `cancel`ed. Lock-free reads
        (hints, invariant 1): a claim no longer held may read another item's."""
        return self._S_np[np.asarray(item_ids, dtype=np.int64) & SLOT_MASK, F_DEADLINE].tolist()

    def claim(self, lane: int, *, worker: int, max_items: int, max_tokens: int, lease_ms: int,
              result_bytes: int | None = None) -> list[Claim]:
        """Take items from the head of `lane`, in order, within max_items and max_tokens.

        Always at least one item when the lane holds one, even over max_tokens,
        unless the slab has no room for its result: each claimed item gets
        `result_bytes` of result space set aside (default: the largest result
        acked in this lane so far), and a claim takes only as many items as
        that space fits (invariant 9). Items past their deadline complete with
        STATUS_EXPIRED instead."""
        if max_items < 1 or not 0 <= lease_ms < MAX_LEASE_MS:
            raise ValueError(f"max_items must be >= 1 and lease_ms in [0, {MAX_LEASE_MS})")
        if result_bytes is not None and not 0 <= result_bytes <= self._slab.max_bytes:
            raise ValueError(f"result_bytes must be in [0, {self._slab.max_bytes}]")
        self._check_lane(lane)
        S, Sb, L, Lb, data = self._S, self._Sb, self._L, lane * LF, self._data
        if not L[Lb + L_DEPTH]:
            # An empty lane (a lock-free hint, invariant 1): nothing to take, no lock
            # round trip. A put racing this claim is missed, as if it came just after.
            self._need_worker(worker)
            return []
        unpack, pack = _HEAD.unpack_from, _CLAIM.pack_into
        taken_rows = []
        with self._lock:
            w = self._need_worker(worker)
            now = time.monotonic_ns()
            lease = now + lease_ms * 1_000_000
            # 1. Results need room (invariant 9): take no more items than the largest
            #    free block holds results for (0 when not one fits, or no slot is free
            #    for the reservation). Dead processes' reservations are looked for
            #    only when not one result fits.
            size = L[Lb + L_RESULT] if result_bytes is None else result_bytes
            if size:
                room = self._result_room()
                if room < size and self._reclaim_dead_reservations():
                    room = self._result_room()
                if room < size * max_items:
                    max_items = room // size
            # 2. Claim the head in order, expired items completing as they are met.
            s = L[Lb + L_HEAD]
            taken = ntok = expired = expired_tok = 0
            last = NIL  # the last interactive item taken: its key is the lane's virtual time now
            while s != NIL and taken < max_items:
                b = s * SF
                (_, nxt, _, gen, _, sq, t, req, enq, dl, att, _, ln, at, epoch, _) = unpack(Sb, b * 8)
                if dl and dl <= now:
                    expired += 1
                    expired_tok += t
                    self._complete_empty(s, STATUS_EXPIRED)
                    s = nxt
                    continue
                if taken and ntok + t > max_tokens:
                    break
                epoch = epoch % EPOCH_MASK + 1
                pack(Sb, b * 8 + F_EPOCH * 8, epoch, worker, lease)
                S[b] = CLAIMED  # commit
                taken_rows.append((epoch << EPOCH_SHIFT | gen << SLOT_BITS | s, req, t, enq, dl, att, at, ln,
                                   sq >= BATCH_SEQ, S[b + F_FLOW]))
                if sq < BATCH_SEQ:
                    last = s
                taken += 1
                ntok += t
                s = nxt
            if last != NIL and S[last * SF + F_KEY] > L[Lb + L_VTIME]:
                L[Lb + L_VTIME] = S[last * SF + F_KEY]
            # The claimed/expired prefix leaves the list in one step.
            L[Lb + L_HEAD] = s
            if s == NIL:
                L[Lb + L_TAIL] = NIL
            else:
                S[s * SF + F_PREV] = NIL
            L[Lb + L_DEPTH] -= taken + expired
            L[Lb + L_TOKENS] -= ntok + expired_tok
            L[Lb + L_CLAIMED] += taken
            self._h[H_DEPTH] -= taken + expired
            self._W[w * WF + W_CLAIMED] += taken
            self._W[w * WF + W_LEASE_MS] = lease_ms
            # 3. The results' block, exactly as large as the items taken (it fits: step 1).
            if size and taken:
                u = self._slab.alloc(taken * size)
                self._refs[u] = 0
                area, at, areas = self._reserve_block(u), u * UNIT, self._areas
                for row in taken_rows:
                    areas[row[0]] = (area, u, at, size)
                    at += size
                self._area_left[area] = taken
            wake = self._results_wake() if expired else False
        if wake:
            self._wake_results(wake)
        # Outside the lock: these blocks belong to our claims until ack/return.
        empty = data[0:0]
        return [_new_tuple(Claim, (cid, req, lane, t, enq, dl, att, data[at:at + ln] if ln else empty, bt, fl))
                for cid, req, t, enq, dl, att, at, ln, bt, fl in taken_rows]

    def _result_room(self) -> int:
        """Bytes of the largest free slab block, 0 if no slot is free to reserve it."""
        return self._slab.largest_free() if self._h[H_FREE_TOP] else 0

    def return_items(self, item_ids: list[int]) -> int:
        """Give claimed items back to the head of their lanes (in lane order, attempts unchanged).

        Ids whose claim is no longer held are skipped. Returns how many went back."""
        Sb, unpack, nslots = self._Sb, _HEAD.unpack_from, self._nslots
        with self._lock:
            recs, seen = [], set()
            for cid in item_ids:
                s = cid & SLOT_MASK
                if s < nslots and s not in seen:
                    r = unpack(Sb, s * SF * 8)
                    if (r[F_STATE] == CLAIMED and r[F_EPOCH] == cid >> EPOCH_SHIFT
                            and r[F_GEN] == (cid >> SLOT_BITS) & GEN_MASK):
                        seen.add(s)
                        recs.append((self._S[s * SF + F_KEY], r[F_SEQ], s, r[F_LANE], r[F_OWNER], r[F_TOKENS]))
            moved, _ = self._requeue(recs, bump=False, max_attempts=0)
            if self._areas:
                self._let_go_areas(item_ids)
            self._h[H_WORK_GEN] += 1
            waiters = self._h[H_WORK_WAITERS] if moved else 0
        self._wake_work(waiters)
        return moved
