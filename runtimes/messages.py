"""What workers write back through `local_queue` (results), per task.

A queue item's payload is the task's request Struct from `fleetctl.protocol`,
MessagePack-encoded (for MessagePack clients: the very bytes they sent). Its
result is one of the Structs below, chosen by the item's status. Tensors are raw
little-endian bytes with a shape, never lists.
"""

from __future__ import annotations

import msgspec

#: Item statuses written by `ack` (local_queue treats them as opaque u8 values).
STATUS_OK = 0
STATUS_ERROR = 1


class WorkError(msgspec.Struct, frozen=True, array_like=True):
    code: str
    message: str


class EmbedResult(msgspec.Struct, frozen=True, array_like=True):
    data: bytes  # float32, C order, little-endian
    shape: tuple[int, int]
    input_tokens: int


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """Every result a worker acks: timings, who ran it, and the task's result.

    Encoded by the worker with `body` set to a result Struct; decoded by the
    daemon with `EnvelopeIn`, where `body` stays undecoded (msgspec.Raw) until
    the reply is built, so tensor bytes are copied once, into the reply.
    """

    queue_ms: float
    inference_ms: float
    served_by: str
    body: object


class EnvelopeIn(msgspec.Struct, frozen=True, array_like=True):
    queue_ms: float
    inference_ms: float
    served_by: str
    body: msgspec.Raw


class EmbedResultRaw(msgspec.Struct, frozen=True, array_like=True):
    """`EmbedResult` as the daemon reads it for MessagePack replies (bytes left encoded)."""

    data: msgspec.Raw
    shape: tuple[int, int]
    input_tokens: int
