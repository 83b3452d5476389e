"""The shared-memory queue between the daemon and its workers.

The daemon puts requests into per-model *lanes*; worker processes pull
(`claim`) batches from the lane they choose, give back what they over-pulled
(`return_items`, to the head, order kept) and `ack` with results, which the
daemon collects (`wait_results`); a worker may `emit` partial results of an
item it still holds (streaming), collected the same way before its ack. A
claim is a lease: if the worker dies, the items go back to their lane
(`expire_leases`, `release_worker`) and no request is lost or answered twice.

Memory (one `multiprocessing.shared_memory` segment, no Python objects in it):

    header   int64[HDR_FIELDS]       counters, list heads, lock-holder pid
    slots    int64[slots, SF]        one record per item (see F_* below)
    stack    int64[slots]            free slot indices (stack[:free_top])
    lanes    int64[max_lanes, LF]    head, tail, depth, tokens, claimed, name length
    names    u8[max_lanes, 128]      lane (model) names, utf-8
    workers  int64[max_workers, WF]  gen, active, pid, heartbeat, claimed, lease, ...
    devices  u8[max_workers, 64];  infos  u8[max_workers, 4096]
    tags     u8[slab / 64]           buddy allocator tags (slab.py)
    slab     bytes                   payloads and results

Slab: a binary buddy allocator (slab.py). The payloads of one put_many (the
results of one ack_many) are packed into shared blocks of up to GROUP_BYTES,
each with a 16-byte header (refcount, order): one allocation per block, and
the last item to let go frees it. Puts leave 1/8 of the slab free, so workers
can always write results (which frees payloads) when producers fill it.

Item life: FREE -> QUEUED (put) -> CLAIMED (claim) -> DONE (ack, or the queue
completes it with STATUS_EXPIRED / STATUS_POISON) -> FREE (wait_results copies
the result out). CLAIMED -> QUEUED on return / lease expiry / release; QUEUED ->
FREE on cancel. FREE -> DONE (emit): a partial result of a CLAIMED item, in a
slot of its own carrying the item's request id; the item stays CLAIMED.

Ids. A put returns `gen << 24 | slot`; `gen` (24 bits, wrapping) is bumped
each time the slot is reused, so a stale id never touches a newer item. A
claim hands out `epoch << 48 | put_id`; `epoch` (15 bits, wrapping) is bumped
on every claim, so an ack or return from a worker that lost its lease (the
item was re-queued, maybe re-claimed) does not match and changes nothing.
`put_id(claim_id)` recovers the put id; a final `Done.item_id` is the put id.

Protocol and invariants:
1. Every read-modify-write of shared state happens under the ONE queue lock:
   a per-process `threading.Lock` (flock does not exclude threads of one
   process), then `fcntl.flock` on `/dev/shm/<name>.lock` (the kernel drops it
   when the holder dies, even by SIGKILL). Lock order: thread lock, then flock.
   Nothing is waited for while holding it; semaphores are posted after it is
   released. Lock-free reads are single aligned int64 loads, used as hints only.
2. A lane is a doubly linked list of QUEUED slots sorted by `seq` (a global
   counter assigned at put, under the lock, so it follows enqueue time). Put
   appends at the tail; claim takes a prefix; returns and expiries insert back
   by `seq`, so a lane's order is always enqueue order, whoever returns first.
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
   work (put, return, requeue) posts `waiters - sem.value` times: every
   waiter counted before it blocked wakes, because the worker that wakes may
   decline the lane (not its model) and the one that would serve it must not
   sleep on. Waiters re-check after waking; spurious wake-ups are fine. Not
   exact: a waiter that starts waiting between a post and its consumption
   can take one of the posts, and the waiter it was meant for then wakes on
   the next work or at its timeout. The single result consumer gets one post
   per batch of acks. A process killed while waiting leaves its count behind:
   that costs at most spurious wake-ups.
6. Time is `time.monotonic_ns()` everywhere (CLOCK_MONOTONIC is system-wide).
7. Payload views handed out by claim point into the slab; they stay valid
   until the item is acked or returned (or its lease is lost).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import struct
import threading
import time
from collections import Counter
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import _posixshmem
import numpy as np
import posix_ipc

from local_queue.slab import MAX_ORDERS, NIL, UNIT, Slab, order_for

STATUS_EXPIRED = 250  # deadline passed before a worker took the item
STATUS_POISON = 251  # lease lost max_attempts times (the item kills workers)

MAGIC = 0x464C45455451  # "FLEETQ"
VERSION = 1
NAME_BYTES = 128
DEVICE_BYTES = 64
INFO_BYTES = 4096
SLOT_BITS, GEN_BITS, EPOCH_BITS = 24, 24, 15
SLOT_MASK = (1 << SLOT_BITS) - 1
GEN_MASK = (1 << GEN_BITS) - 1
PUT_MASK = (1 << (SLOT_BITS + GEN_BITS)) - 1
EPOCH_SHIFT = SLOT_BITS + GEN_BITS
EPOCH_MASK = (1 << EPOCH_BITS) - 1
WORKER_BITS = 16
RESULT_RESERVE = 8  # 1/8 of the slab is only for results
MAX_LEASE_MS = 1 << 40  # keeps now_ns + lease in int64

# Header fields (int64 indices).
(H_MAGIC, H_VERSION, H_SLOTS, H_SLAB_BYTES, H_MAX_LANES, H_MAX_WORKERS, H_HOLDER, H_DEPTH,
 H_WORK_WAITERS, H_RES_WAITERS, H_SEQ, H_FREE_TOP, H_DONE_HEAD, H_DONE_TAIL, H_DONE_COUNT,
 H_N_LANES, H_REPAIRS, H_SLAB_FREE, H_WORK_GEN) = range(19)
H_FREE_HEADS = 24  # MAX_ORDERS buddy free-list heads
HDR_FIELDS = H_FREE_HEADS + MAX_ORDERS

# Slot record fields. DATA / RES are slab blocks (unit index, NIL if none),
# *_AT the item's byte offset in the slab. Grouped so that each operation
# writes one contiguous run with one struct call: put writes NEXT..DATA_AT,
# claim EPOCH..LEASE, ack RES..STATUS; STATE always last.
(F_STATE, F_NEXT, F_PREV, F_GEN, F_LANE, F_SEQ, F_TOKENS, F_REQ, F_ENQ, F_DEADLINE, F_ATTEMPTS,
 F_DATA, F_DATA_LEN, F_DATA_AT, F_EPOCH, F_OWNER, F_LEASE, F_RES, F_RES_LEN, F_RES_AT,
 F_STATUS) = range(21)
SF = 24  # 192 B: a record is exactly three 64-byte cache lines
_PUT = struct.Struct("<13q")  # at F_NEXT
_CLAIM = struct.Struct("<3q")  # at F_EPOCH
_RESULT = struct.Struct("<4q")  # at F_RES
_RECORD = struct.Struct("<21q")  # at F_STATE, for reads
_HEAD = struct.Struct("<16q")  # at F_STATE: STATE..OWNER, what claim and ack read
_LINK = struct.Struct("<2q")  # at F_NEXT: NEXT, PREV

# Payloads of one put_many (results of one ack_many) share slab blocks of up to
# GROUP_BYTES: one allocation per block instead of one per item. A block starts
# with BLOCK_HDR bytes: int64 refcount (items whose DATA/RES is this block) and
# int64 buddy order; the last item to let go frees it.
BLOCK_HDR = 16
GROUP_BYTES = 64 << 10
FREE, QUEUED, CLAIMED, DONE = 0, 1, 2, 3

L_HEAD, L_TAIL, L_DEPTH, L_TOKENS, L_CLAIMED, L_NAME_LEN = range(6)
LF = 8
W_GEN, W_ACTIVE, W_PID, W_HEARTBEAT, W_CLAIMED, W_LEASE_MS, W_DEVICE_LEN, W_INFO_LEN = range(8)
WF = 8

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class QueueError(Exception):
    """A refusal of the queue, raised before anything changed. `local_queue` knows no
    HTTP or product vocabulary: its users map these (the daemon: QueueFull ->
    overloaded, ItemTooLarge -> payload_too_large)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(QueueError):
    """No slot, slab space, lane or worker record left right now (retry later)."""


class ItemTooLarge(QueueError):
    """A payload or result larger than the slab's largest block: it can never fit."""


class UnknownWorker(LookupError):
    """The worker id is not registered (never was, unregistered, or released as dead)."""


class Claim(NamedTuple):
    item_id: int  # claim id: pass it to ack / return_items
    request_id: int
    lane: int
    tokens: int
    enqueue_ns: int
    deadline_ns: int
    attempts: int
    payload: memoryview  # into the slab; valid until this item is acked or returned


class Done(NamedTuple):
    item_id: int  # the put id (an emit record's own id for a partial result)
    request_id: int
    status: int
    result: bytes


class LaneStats(NamedTuple):
    lane: int
    model: str
    depth: int
    tokens: int
    oldest_enqueue_ns: int  # of the head item; 0 when the lane has no queued item
    claimed: int


class WorkerInfo(NamedTuple):
    wid: int
    pid: int
    device: str
    last_heartbeat_ns: int
    claimed: int
    info: bytes


class QueueUsage(NamedTuple):
    slots: int
    slots_free: int
    slab_bytes: int
    slab_free_bytes: int
    done: int  # results waiting for wait_results
    repairs: int  # times a holder's death inside a critical section was repaired


def put_id(item_id: int) -> int:
    """The put id of an item, from its put id or from any of its claim ids."""
    return item_id & PUT_MASK


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


_forks = [0]  # bumped in forked children: a handle must not cross a fork (flock would be shared)
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))
_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__
_CLEAN_ERRORS = (QueueFull, ItemTooLarge, UnknownWorker, ValueError, KeyError)


class _Lock:
    """Context manager for the queue lock (invariants 1 and 4)."""

    __slots__ = ("q",)

    def __init__(self, q: LocalQueue) -> None:
        self.q = q

    def __enter__(self) -> None:
        q = self.q
        if _forks[0] != q._fork:
            raise RuntimeError("a LocalQueue handle was inherited through fork; attach anew in the child")
        q._tlock.acquire()
        try:
            fcntl.flock(q._lock_fd, fcntl.LOCK_EX)
            try:
                if q._h[H_HOLDER] != 0:
                    q._repair()
                q._h[H_HOLDER] = q._pid
            except BaseException:
                fcntl.flock(q._lock_fd, fcntl.LOCK_UN)
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
        fcntl.flock(q._lock_fd, fcntl.LOCK_UN)
        q._tlock.release()


def _layout(slots: int, slab_bytes: int, max_lanes: int, max_workers: int) -> dict[str, int]:
    off, out = 0, {}
    for key, nbytes in (("hdr", HDR_FIELDS * 8), ("slots", slots * SF * 8), ("stack", slots * 8),
                        ("lanes", max_lanes * LF * 8), ("names", max_lanes * NAME_BYTES),
                        ("workers", max_workers * WF * 8), ("devices", max_workers * DEVICE_BYTES),
                        ("infos", max_workers * INFO_BYTES), ("tags", slab_bytes // UNIT)):
        out[key] = off
        off = (off + nbytes + 63) & ~63
    out["slab"] = (off + 4095) & ~4095
    out["size"] = out["slab"] + slab_bytes
    return out


def _open_segment(name: str, create: bool, size: int) -> shared_memory.SharedMemory:
    # Before Python 3.13 every SharedMemory (even an attach) registers with the
    # resource tracker, which unlinks the segment when *that* process exits.
    # The queue's lifetime is explicit (the creator unlinks), so keep it out.
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return shared_memory.SharedMemory(name, create=create, size=size)
    finally:
        resource_tracker.register = register


class LocalQueue:
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
            for suffix in (".work", ".results"):
                sem = posix_ipc.Semaphore(f"/{name}{suffix}", posix_ipc.O_CREX, mode=0o600, initial_value=0)
                made.append(sem.unlink)
                sem.close()
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
        self._work_sem = posix_ipc.Semaphore(f"/{name}.work")
        self._res_sem = posix_ipc.Semaphore(f"/{name}.results")
        self._lane_ids: dict[str, int] = {}
        self._lane_names: dict[int, str] = {}

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
        self._work_sem.close()
        self._res_sem.close()
        self._slab.release_views()
        del self._S_np, self._L_np
        for mv in (self._S, self._Sb, self._stack, self._L, self._names, self._W, self._devices, self._infos,
                   self._data, self._h):
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
        """Remove the segment, semaphores and lock file (the creator's job; any handle may do it)."""
        for sem in (f"/{self.name}.work", f"/{self.name}.results"):
            try:
                posix_ipc.unlink_semaphore(sem)
            except posix_ipc.ExistentialError:
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
        h[H_DONE_HEAD] = h[H_DONE_TAIL] = NIL
        self._L_np[:] = 0
        self._L_np[:, L_HEAD] = self._L_np[:, L_TAIL] = NIL
        self._slab.format()

    # -- lanes -------------------------------------------------------------------
    def lane_id(self, model: str, *, create: bool = True) -> int:
        """Lane of `model`, created if needed. KeyError if absent and not create."""
        lane = self._lane_ids.get(model)
        if lane is not None:
            return lane
        raw = model.encode()
        if not 1 <= len(raw) <= NAME_BYTES:
            raise ValueError(f"lane name must be 1..{NAME_BYTES} bytes of utf-8, got {len(raw)}")
        with self._lock:
            self._refresh_lane_names()
            lane = self._lane_ids.get(model)
            if lane is None:
                if not create:
                    raise KeyError(model)
                lane = self._h[H_N_LANES]
                if lane >= self._max_lanes:
                    raise QueueFull(f"no lane left for {model!r} ({self._max_lanes} in use)")
                self._names[lane * NAME_BYTES:lane * NAME_BYTES + len(raw)] = raw
                self._L[lane * LF + L_NAME_LEN] = len(raw)
                self._h[H_N_LANES] = lane + 1  # commit: lanes are never removed
                self._lane_ids[model], self._lane_names[lane] = lane, model
        return lane

    def _refresh_lane_names(self) -> None:
        for lane in range(len(self._lane_names), self._h[H_N_LANES]):
            ln = self._L[lane * LF + L_NAME_LEN]
            model = bytes(self._names[lane * NAME_BYTES:lane * NAME_BYTES + ln]).decode()
            self._lane_ids[model], self._lane_names[lane] = lane, model

    def lane_name(self, lane: int) -> str:
        if lane not in self._lane_names:
            if not 0 <= lane < self._h[H_N_LANES]:
                raise ValueError(f"no lane {lane}")
            with self._lock:
                self._refresh_lane_names()
        return self._lane_names[lane]

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self._h[H_N_LANES]:
            raise ValueError(f"no lane {lane}")

    def lane_stats(self) -> list[LaneStats]:
        """Lanes with queued or claimed items, in lane order."""
        with self._lock:
            n = self._h[H_N_LANES]
            if len(self._lane_names) < n:
                self._refresh_lane_names()
            L = self._L_np[:n]
            busy = np.flatnonzero((L[:, L_DEPTH] > 0) | (L[:, L_CLAIMED] > 0)).tolist()
            rows = L[busy].tolist()
            S, out = self._S, []
            for lane, row in zip(busy, rows):
                head = row[L_HEAD]
                out.append(LaneStats(lane, self._lane_names[lane], row[L_DEPTH], row[L_TOKENS],
                                     S[head * SF + F_ENQ] if head != NIL else 0, row[L_CLAIMED]))
            return out

    def depth(self) -> int:
        """Items queued (not claimed) over all lanes."""
        return self._h[H_DEPTH]

    def usage(self) -> QueueUsage:
        h = self._h
        with self._lock:
            return QueueUsage(self._nslots, h[H_FREE_TOP], len(self._data), h[H_SLAB_FREE] * UNIT,
                              h[H_DONE_COUNT], h[H_REPAIRS])

    # -- producer ----------------------------------------------------------------
    def put(self, lane: int, payload: bytes | memoryview, *, tokens: int, request_id: int,
            deadline_ns: int = 0) -> int:
        return self.put_many(lane, [payload], tokens=[tokens], request_ids=[request_id],
                             deadline_ns=deadline_ns)[0]

    def put_many(self, lane: int, payloads: list, *, tokens: list[int], request_ids: list[int],
                 deadline_ns: int = 0) -> list[int]:
        """Enqueue at the tail of `lane`, all or nothing (QueueFull leaves the queue unchanged)."""
        n = len(payloads)
        if len(tokens) != n or len(request_ids) != n:
            raise ValueError("payloads, tokens and request_ids differ in length")
        # Checked up front: a bad value inside the commit loop would leave a prefix queued.
        if n and not (0 <= min(tokens) and max(tokens) < 1 << 62 and -(1 << 63) <= min(request_ids)
                      and max(request_ids) < 1 << 63 and 0 <= deadline_ns < 1 << 63):
            raise ValueError("tokens must be in [0, 2**62), request ids and deadline_ns int64")
        self._check_lane(lane)
        views, limit = [], self._slab.max_bytes() - BLOCK_HDR
        for p in payloads:
            if type(p) is not bytes:
                p = memoryview(p).cast("B")
            if len(p) > limit:
                raise ItemTooLarge(f"payload of {len(p)} bytes exceeds the queue's largest block ({limit})")
            views.append(p)
        lens = [len(p) for p in views]
        groups, need = _plan_blocks(lens)
        S, Sb, stack, data, h, L = self._S, self._Sb, self._stack, self._data, self._h, self._L
        pack = _PUT.pack_into
        ids = []
        with self._lock:
            top = h[H_FREE_TOP]
            if top < n:
                raise QueueFull(f"queue full: {top} free slots, {n} needed")
            if h[H_SLAB_FREE] - need < self._reserve:
                raise QueueFull("queue full: the payload slab is full")
            placed = self._alloc_blocks(groups, n)
            if placed is None:
                raise QueueFull("queue full: no slab block big enough")
            blocks, at = placed
            # Slot records, committed one by one and chained behind the lane's
            # tail: new seqs are the largest, so the lane stays sorted.
            now = time.monotonic_ns()
            seq = h[H_SEQ]
            Lb = lane * LF
            prev = L[Lb + L_TAIL]
            for i in range(n):
                ln = lens[i]
                if ln:
                    a = at[i]
                    data[a:a + ln] = views[i]
                s = stack[top - 1 - i]
                b = s * SF
                gen = S[b + F_GEN] % GEN_MASK + 1
                seq += 1
                pack(Sb, b * 8 + F_NEXT * 8, NIL, prev, gen, lane, seq, tokens[i], request_ids[i], now,
                     deadline_ns, 0, blocks[i], ln, at[i])
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
            posts = h[H_WORK_WAITERS] - self._work_sem.value  # wake every waiter (invariant 5)
        self._post(self._work_sem, posts)
        return ids

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

    @staticmethod
    def _post(sem: posix_ipc.Semaphore, n: int) -> None:
        for _ in range(n):
            sem.release()

    def cancel(self, item_id: int) -> bool:
        """Remove a still-queued item (its request timed out); no Done is produced."""
        s, gen = item_id & SLOT_MASK, (item_id >> SLOT_BITS) & GEN_MASK
        if s >= self._nslots:
            return False
        S, b = self._S, s * SF
        with self._lock:
            if S[b + F_STATE] != QUEUED or S[b + F_GEN] != gen:
                return False
            self._unlink(s)
            S[b + F_STATE] = FREE  # commit
            self._free_data(s)
            self._push_free_slot(s)
            return True

    # -- slot helpers (caller holds the lock) ----------------------------------
    def _unlink(self, s: int) -> None:
        S, L, b = self._S, self._L, s * SF
        Lb = S[b + F_LANE] * LF
        n, p = S[b + F_NEXT], S[b + F_PREV]
        if p == NIL:
            L[Lb + L_HEAD] = n
        else:
            S[p * SF + F_NEXT] = n
        if n == NIL:
            L[Lb + L_TAIL] = p
        else:
            S[n * SF + F_PREV] = p
        L[Lb + L_DEPTH] -= 1
        L[Lb + L_TOKENS] -= S[b + F_TOKENS]
        self._h[H_DEPTH] -= 1

    def _free_data(self, s: int) -> None:
        u = self._S[s * SF + F_DATA]
        if u != NIL:
            self._unref(u)

    def _push_free_slot(self, s: int) -> None:
        h = self._h
        self._stack[h[H_FREE_TOP]] = s
        h[H_FREE_TOP] += 1

    def _append_done(self, s: int) -> None:
        h, S = self._h, self._S
        S[s * SF + F_NEXT] = NIL
        tail = h[H_DONE_TAIL]
        if tail == NIL:
            h[H_DONE_HEAD] = s
        else:
            S[tail * SF + F_NEXT] = s
        h[H_DONE_TAIL] = s
        h[H_DONE_COUNT] += 1

    def _complete_empty(self, s: int, status: int) -> None:
        """QUEUED/CLAIMED (already unlinked and uncounted) -> DONE with an empty result."""
        S, b = self._S, s * SF
        _RESULT.pack_into(self._Sb, b * 8 + F_RES * 8, NIL, 0, NIL, status)
        S[b] = DONE  # commit
        self._free_data(s)
        self._append_done(s)

    def _insert_sorted(self, lane: int, items: list[tuple[int, int, int]]) -> None:
        """Insert QUEUED slots, given as (seq, slot, tokens) sorted by seq, into `lane` at
        their seq positions: one merge pass from the head (returns land near it)."""
        S, Sb, L, Lb, link = self._S, self._Sb, self._L, lane * LF, _LINK.pack_into
        prev, cur = NIL, L[Lb + L_HEAD]
        cur_seq = S[cur * SF + F_SEQ] if cur != NIL else 0
        ntok = 0
        before_cur = False  # items were inserted in front of cur: its PREV is stale
        for sq, s, t in items:
            while cur != NIL and cur_seq < sq:
                if before_cur:
                    S[cur * SF + F_PREV] = prev
                    before_cur = False
                prev, cur = cur, S[cur * SF + F_NEXT]
                cur_seq = S[cur * SF + F_SEQ] if cur != NIL else 0
            link(Sb, s * SF * 8 + F_NEXT * 8, cur, prev)
            if prev == NIL:
                L[Lb + L_HEAD] = s
            else:
                S[prev * SF + F_NEXT] = s
            prev = s
            before_cur = True
            ntok += t
        if cur == NIL:
            if items:
                L[Lb + L_TAIL] = prev
        elif before_cur:
            S[cur * SF + F_PREV] = prev
        L[Lb + L_DEPTH] += len(items)
        L[Lb + L_TOKENS] += ntok
        self._h[H_DEPTH] += len(items)

    def _requeue(self, recs: list[tuple[int, int, int, int, int]], *, bump: bool,
                 max_attempts: int) -> tuple[int, int]:
        """CLAIMED slots, as (seq, slot, lane, owner, tokens), back to their lanes
        (attempts += 1 if bump; poison at max_attempts). Returns (requeued, poisoned)."""
        S = self._S
        recs.sort()
        by_lane: dict[int, list[tuple[int, int, int]]] = {}
        poisoned = 0
        for sq, s, lane, _, t in recs:
            b = s * SF
            if bump:
                S[b + F_ATTEMPTS] += 1
                if S[b + F_ATTEMPTS] >= max_attempts:
                    self._complete_empty(s, STATUS_POISON)
                    poisoned += 1
                    continue
            S[b] = QUEUED  # commit (F_OWNER only means something while CLAIMED)
            by_lane.setdefault(lane, []).append((sq, s, t))
        self._drop_claimed(Counter(r[2] for r in recs), Counter(r[3] for r in recs))
        for lane, group in by_lane.items():
            self._insert_sorted(lane, group)
        return len(recs) - poisoned, poisoned

    def _requeue_recs(self, slots: list[int]) -> list[tuple[int, int, int, int, int]]:
        Sb, unpack, out = self._Sb, _HEAD.unpack_from, []
        for s in slots:
            r = unpack(Sb, s * SF * 8)
            out.append((r[F_SEQ], s, r[F_LANE], r[F_OWNER], r[F_TOKENS]))
        return out

    # -- workers -----------------------------------------------------------------
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
            return self._wait(self._work_sem, ready, timeout_s)
        finally:
            with self._lock:
                h[H_WORK_WAITERS] -= 1

    def _wait(self, sem: posix_ipc.Semaphore, ready, timeout_s: float) -> bool:
        # The caller is counted in the waiters field for the whole loop, so every
        # producer in between posts for it (invariant 5).
        end = time.monotonic() + timeout_s
        while not ready():
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                sem.acquire(left)
            except posix_ipc.BusyError:
                return ready()
        return True

    def claim(self, lane: int, *, worker: int, max_items: int, max_tokens: int, lease_ms: int) -> list[Claim]:
        """Take items from the head of `lane`, in order, within max_items and max_tokens.

        Always at least one item when the lane holds one, even over max_tokens.
        Items past their deadline complete with STATUS_EXPIRED instead."""
        if max_items < 1 or not 0 <= lease_ms < MAX_LEASE_MS:
            raise ValueError(f"max_items must be >= 1 and lease_ms in [0, {MAX_LEASE_MS})")
        self._check_lane(lane)
        S, Sb, L, Lb, data = self._S, self._Sb, self._L, lane * LF, self._data
        unpack, pack = _HEAD.unpack_from, _CLAIM.pack_into
        taken_rows = []
        with self._lock:
            w = self._need_worker(worker)
            now = time.monotonic_ns()
            lease = now + lease_ms * 1_000_000
            s = L[Lb + L_HEAD]
            taken = ntok = expired = expired_tok = 0
            while s != NIL and taken < max_items:
                b = s * SF
                (_, nxt, _, gen, _, _, t, req, enq, dl, att, _, ln, at, epoch, _) = unpack(Sb, b * 8)
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
                taken_rows.append((epoch << EPOCH_SHIFT | gen << SLOT_BITS | s, req, t, enq, dl, att, at, ln))
                taken += 1
                ntok += t
                s = nxt
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
            posts = min(self._h[H_RES_WAITERS], 1) - self._res_sem.value if expired else 0
        self._post(self._res_sem, posts)
        # Outside the lock: these blocks belong to our claims until ack/return.
        empty = data[0:0]
        return [_new_tuple(Claim, (cid, req, lane, t, enq, dl, att, data[at:at + ln] if ln else empty))
                for cid, req, t, enq, dl, att, at, ln in taken_rows]

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
                        recs.append((r[F_SEQ], s, r[F_LANE], r[F_OWNER], r[F_TOKENS]))
            moved, _ = self._requeue(recs, bump=False, max_attempts=0)
            self._h[H_WORK_GEN] += 1
            posts = self._h[H_WORK_WAITERS] - self._work_sem.value if moved else 0
        self._post(self._work_sem, posts)
        return moved

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

    def _drop_claimed(self, lanes: dict[int, int], owners: dict[int, int]) -> None:
        L, W = self._L, self._W
        for lane, n in lanes.items():
            L[lane * LF + L_CLAIMED] -= n
        for wid, n in owners.items():
            w = self._worker_index(wid)
            if w is not None:
                W[w * WF + W_CLAIMED] -= n

    # -- recovery ----------------------------------------------------------------
    def expire_leases(self, now_ns: int | None = None, *, max_attempts: int = 3) -> int:
        """Claimed items whose lease passed go back to their lanes (attempts += 1) or, at
        max_attempts, complete with STATUS_POISON. Returns how many moved."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        with self._lock:
            S = self._S_np
            late = np.flatnonzero((S[:, F_STATE] == CLAIMED) & (S[:, F_LEASE] < now)).tolist()
            moved, work_posts, res_posts = self._settle(late, max_attempts)
        self._post(self._work_sem, work_posts)
        self._post(self._res_sem, res_posts)
        return moved

    def release_worker(self, wid: int, *, max_attempts: int = 3) -> int:
        """A worker known dead: its claims go back now (attempts += 1) or poison; it is unregistered."""
        with self._lock:
            S = self._S_np
            mine = np.flatnonzero((S[:, F_STATE] == CLAIMED) & (S[:, F_OWNER] == wid)).tolist()
            moved, work_posts, res_posts = self._settle(mine, max_attempts)
            w = self._worker_index(wid)
            if w is not None:
                self._W[w * WF + W_ACTIVE] = 0
        self._post(self._work_sem, work_posts)
        self._post(self._res_sem, res_posts)
        return moved

    def _settle(self, slots: list[int], max_attempts: int) -> tuple[int, int, int]:
        """Lost claims back to their lanes or to poison: (moved, work posts, result posts)."""
        if not slots:
            return 0, 0, 0
        requeued, poisoned = self._requeue(self._requeue_recs(slots), bump=True, max_attempts=max_attempts)
        h = self._h
        h[H_WORK_GEN] += 1
        work_posts = h[H_WORK_WAITERS] - self._work_sem.value if requeued else 0
        res_posts = min(h[H_RES_WAITERS], 1) - self._res_sem.value if poisoned else 0
        return requeued + poisoned, work_posts, res_posts

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

    # -- repair and verification --------------------------------------------------
    def _block_refs(self) -> dict[int, int]:
        """Block -> number of items referring to it, from the slot states."""
        S = self._S_np
        st = S[:, F_STATE]
        data = S[((st == QUEUED) | (st == CLAIMED)) & (S[:, F_DATA] != NIL), F_DATA]
        res = S[(st == DONE) & (S[:, F_RES] != NIL), F_RES]
        blocks, counts = np.unique(np.concatenate([data, res]), return_counts=True)
        return dict(zip(blocks.tolist(), counts.tolist()))

    def _live_blocks(self, refs: dict[int, int]) -> list[tuple[int, int]]:
        Q, top = self._slab.links, self._slab.top_order
        live = [(u, Q[u * 8 + 1]) for u in refs]
        if any(not 0 <= k <= top for _, k in live):
            raise RuntimeError("slab: a live block header has no valid order; this is a bug")
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
        S[(st == QUEUED) | (st == CLAIMED), F_RES] = NIL  # so _block_refs counts owners only
        # Lanes: QUEUED slots grouped by lane, sorted by seq.
        q = np.flatnonzero(st == QUEUED)
        q = q[np.lexsort((S[q, F_SEQ], S[q, F_LANE]))]
        lanes = S[q, F_LANE]
        same_next = np.append(lanes[1:] == lanes[:-1], False)
        same_prev = np.insert(lanes[1:] == lanes[:-1], 0, False)
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
        h[H_SEQ] = max(h[H_SEQ], int(S[:, F_SEQ].max()))
        h[H_WORK_GEN] += 1
        refs = self._block_refs()
        Q = self._slab.links
        for u, n in refs.items():
            Q[u * 8] = n  # refcounts as the committed states say
        self._slab.rebuild(self._live_blocks(refs))
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
            s, prev, n, tok, last = self._L[Lb + L_HEAD], NIL, 0, 0, -1
            while s != NIL:
                b = s * SF
                if S[b + F_STATE] != QUEUED or S[b + F_LANE] != lane or S[b + F_PREV] != prev:
                    raise RuntimeError(f"lane {lane}: slot {s} does not belong in its list")
                if S[b + F_SEQ] <= last:
                    raise RuntimeError(f"lane {lane}: out of seq order at slot {s}")
                last = S[b + F_SEQ]
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
        refs = self._block_refs()
        Q = self._slab.links
        for u, n in refs.items():
            if Q[u * 8] != n:
                raise RuntimeError(f"slab block {u}: refcount {Q[u * 8]}, {n} items refer to it")
        self._slab.check(self._live_blocks(refs))
