"""Where everything lives in the shared segment, and what the ids mean.

One `multiprocessing.shared_memory` segment, no Python objects in it:

    header   int64[HDR_FIELDS]       counters, list heads, lock-holder pid
    slots    int64[slots, SF]        one record per item (see F_* below)
    stack    int64[slots]            free slot indices (stack[:free_top])
    lanes    int64[max_lanes, LF]    head, tail, depth, tokens, claimed, name length
    names    u8[max_lanes, 128]      lane (model) names, utf-8
    workers  int64[max_workers, WF]  gen, active, pid, heartbeat, claimed, lease, ...
    devices  u8[max_workers, 64];  infos  u8[max_workers, 16384]
    tags     u8[slab / 64]           buddy allocator tags (slab.py)
    refs     int32[slab / 64]        refcount of the block starting at each unit (blocks.py)
    slab     bytes                   payloads and results (blocks.py)

Ids. A put returns `gen << 24 | slot`; `gen` (24 bits, wrapping) is bumped
each time the slot is reused, so a stale id never touches a newer item. A
claim hands out `epoch << 48 | put_id`; `epoch` (15 bits, wrapping) is bumped
on every claim, so an ack or return from a worker that lost its lease (the
item was re-queued, maybe re-claimed) does not match and changes nothing.
`put_id(claim_id)` recovers the put id; a final `Done.item_id` is the put id.
"""

from __future__ import annotations

import re
import struct
from multiprocessing import resource_tracker, shared_memory

from .slab import MAX_ORDERS, UNIT

STATUS_EXPIRED = 250  # deadline passed before a worker took the item
STATUS_POISON = 251  # lease lost max_attempts times (the item kills workers)

MAGIC = 0x464C45455451  # "FLEETQ"
VERSION = 7
NAME_BYTES = 128
DEVICE_BYTES = 64
#: A worker's info blob (runtimes/info.py): 570-720 bytes per resident model (its
#: settings, engine verdict, traced forward), so 20-odd models before entries are cut
#: to their summary (~180 bytes).
INFO_BYTES = 16384
SLOT_BITS, GEN_BITS, EPOCH_BITS = 24, 24, 15
SLOT_MASK = (1 << SLOT_BITS) - 1
GEN_MASK = (1 << GEN_BITS) - 1
PUT_MASK = (1 << (SLOT_BITS + GEN_BITS)) - 1
EPOCH_SHIFT = SLOT_BITS + GEN_BITS
EPOCH_MASK = (1 << EPOCH_BITS) - 1
WORKER_BITS = 16
RESULT_RESERVE = 8  # 1/8 of the slab is only for results
SLOT_RESERVE = 64  # puts leave this many slots for the reservations of claims and acks
HOLD_NS = 2_000_000_000  # a large put's hold on merged free space, from its last try (> the daemon's retry_after)
#: A batch item's seq carries this bit (invariant 2): it sorts after every interactive
#: item of its lane, and among batch items by put order. `promote` clears it.
BATCH_SEQ = 1 << 61
#: A batch item's lane key (invariant 2): above every interactive item's key (a
#: virtual time in tokens, far below it), so batch work sorts after interactive work.
BATCH_KEY = 1 << 62
MAX_LEASE_MS = 1 << 40  # keeps now_ns + lease in int64

# Header fields (int64 indices). H_RESERVED_HEAD: first RESERVED slot (blocks.py).
(H_MAGIC, H_VERSION, H_SLOTS, H_SLAB_BYTES, H_MAX_LANES, H_MAX_WORKERS, H_HOLDER, H_DEPTH,
 H_WORK_WAITERS, H_RES_WAITERS, H_SEQ, H_FREE_TOP, H_DONE_HEAD, H_DONE_TAIL, H_DONE_COUNT,
 H_N_LANES, H_REPAIRS, H_SLAB_FREE, H_WORK_GEN, H_HOLD_ORDER, H_HOLD_UNTIL, H_RESERVED_HEAD) = range(22)
H_FREE_HEADS = 24  # MAX_ORDERS buddy free-list heads
HDR_FIELDS = H_FREE_HEADS + MAX_ORDERS

# Slot record fields. DATA / RES are slab blocks (unit index, NIL if none),
# *_AT the item's byte offset in the slab. Grouped so that each operation
# writes one contiguous run with one struct call: put writes NEXT..DATA_AT,
# claim EPOCH..LEASE, ack RES..STATUS; STATE always last.
(F_STATE, F_NEXT, F_PREV, F_GEN, F_LANE, F_SEQ, F_TOKENS, F_REQ, F_ENQ, F_DEADLINE, F_ATTEMPTS,
 F_DATA, F_DATA_LEN, F_DATA_AT, F_EPOCH, F_OWNER, F_LEASE, F_RES, F_RES_LEN, F_RES_AT,
 F_STATUS) = range(21)
# F_KEY: the item's place in its lane (invariant 2): its flow's virtual start time
# (interactive), BATCH_KEY (batch work). Written at put and promote, before the commit.
F_KEY = 21
# F_FLOW: the flow it was put for (`put_many(flow=)`), handed to its claimer (Claim.flow).
F_FLOW = 22
SF = 24  # 192 B: a record is exactly three 64-byte cache lines
_PUT = struct.Struct("<13q")  # at F_NEXT
_CLAIM = struct.Struct("<3q")  # at F_EPOCH
_RESULT = struct.Struct("<4q")  # at F_RES
_RECORD = struct.Struct("<21q")  # at F_STATE, for reads
_HEAD = struct.Struct("<16q")  # at F_STATE: STATE..OWNER, what claim and ack read
_LINK = struct.Struct("<2q")  # at F_NEXT: NEXT, PREV
# RESERVED: a slot that owns one slab block on behalf of a live process (pid in
# F_OWNER, block in F_DATA) while that process copies bytes outside the lock.
FREE, QUEUED, CLAIMED, DONE, RESERVED = 0, 1, 2, 3, 4

# L_RESULT: the largest result (bytes per item) acked in the lane so far: what a
# claim sets aside for each item's result when its caller does not say.
# L_VTIME: the lane's virtual time (invariant 2): the largest key of an interactive
# item claimed from it; never decreases.
L_HEAD, L_TAIL, L_DEPTH, L_TOKENS, L_CLAIMED, L_NAME_LEN, L_RESULT, L_VTIME = range(8)
LF = 8
W_GEN, W_ACTIVE, W_PID, W_HEARTBEAT, W_CLAIMED, W_LEASE_MS, W_DEVICE_LEN, W_INFO_LEN = range(8)
WF = 8

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def put_id(item_id: int) -> int:
    """The put id of an item, from its put id or from any of its claim ids."""
    return item_id & PUT_MASK


def _layout(slots: int, slab_bytes: int, max_lanes: int, max_workers: int) -> dict[str, int]:
    off, out = 0, {}
    for key, nbytes in (("hdr", HDR_FIELDS * 8), ("slots", slots * SF * 8), ("stack", slots * 8),
                        ("lanes", max_lanes * LF * 8), ("names", max_lanes * NAME_BYTES),
                        ("workers", max_workers * WF * 8), ("devices", max_workers * DEVICE_BYTES),
                        ("infos", max_workers * INFO_BYTES), ("tags", slab_bytes // UNIT),
                        ("refs", slab_bytes // UNIT * 4)):
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
