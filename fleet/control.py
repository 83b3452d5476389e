"""The control path: the daemon tells one worker "load / unload / pin / unpin X".

Protocol (through `local_queue`, no extra IPC):

* Each worker has a control lane named `ctl:<w>`, where `w` is its worker
  record index (`worker_id & 0xFFFF`, stable while it lives; a restarted
  worker that gets the same record serves what was left there). Model names
  cannot contain `:` (fleet.catalog.NAME_RE), so a control lane never
  collides with a model's lane.
* An item is a MessagePack `Command` (array-like, a few dozen bytes), put by
  the daemon with `Broker.submit` (the same future and timeout as a request).
* The worker handles its control lane at the start of every step, before any
  model lane, one command at a time, and acks each with an `Envelope` whose
  body is a `CommandDone` (STATUS_OK) or a `WorkError` (STATUS_ERROR, e.g.
  `model_too_large`, `model_load_failed`). The daemon reads it like any
  result, so errors reach the HTTP caller with their contract code.
* Workers never serve another worker's control lane (`is_control_lane` is
  filtered out of lane choice). A control item of a worker that died comes
  back to its lane on lease expiry and is served by whoever takes that record.
* Commands are idempotent: `load` of a resident model, `unload` of an absent
  one and `pin` of a pinned one succeed and say what they found.
"""

from __future__ import annotations

import msgspec

CONTROL_PREFIX = "ctl:"
WORKER_INDEX_MASK = 0xFFFF

#: Command ops. `evict` is one worker asking a peer of its device for room: the
#: peer drops the model only if it is idle and unpinned (put with request id 0:
#: no caller waits on its reply).
LOAD, UNLOAD, PIN, UNPIN, EVICT = "load", "unload", "pin", "unpin", "evict"
#: `profile`: read the resident models' profiles again (a SIGHUP; `model` is ""): batch
#: settings apply from the next batch, a new dtype at the next load.
PROFILE = "profile"
OPS = (LOAD, UNLOAD, PIN, UNPIN, EVICT, PROFILE)
#: Control items a worker takes per step (each is acked as soon as it is done).
CONTROL_BATCH = 16


class Command(msgspec.Struct, frozen=True, array_like=True):
    op: str
    model: str


class CommandDone(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    op: str
    model: str
    device: str
    #: Resident on this worker after the command.
    loaded: bool
    pinned: bool = False
    #: Measured bytes on the device (0 when not loaded).
    bytes: int = 0
    #: Time the load took here, 0 when nothing was loaded.
    load_ms: float = 0.0
    #: Models evicted to make room, in eviction order.
    evicted: list[str] = []
    #: Nothing to do: it was already in the asked state.
    already: bool = False
    #: `profile`: what changed, one line per model ("<model>: max_batch_tokens 16384 -> 8192").
    changed: list[str] = []


def control_lane(worker_id: int) -> str:
    return f"{CONTROL_PREFIX}{worker_id & WORKER_INDEX_MASK}"


def is_control_lane(name: str) -> bool:
    return name.startswith(CONTROL_PREFIX)


decode_command = msgspec.msgpack.Decoder(Command).decode
decode_done = msgspec.msgpack.Decoder(CommandDone).decode
