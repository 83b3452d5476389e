"""Several boxes: the names every box's NATS bridge shares, and its limits.

Subjects, streams, buckets, consumers and headers are the wire contract between boxes
(daemon/cluster.py describes each); they live apart from the rooms that use them so
that the requester, the puller, the heartbeats and the payload store spell them one
way, and so that `/metrics` and the tests can name a stream without the bridge.
Nothing here imports nats.py: the API process pays for it only with `--nats`.
"""

from __future__ import annotations

import logging

import msgspec

from fleet.messages import Envelope, WorkError

#: One logger for every room of the bridge: operators filter on it.
log = logging.getLogger("fleet.cluster")

STREAM = "FLEET_WORK"
REPLY_STREAM = "FLEET_REPLIES"
WORK_PREFIX = "fleet.work."
REPLY_PREFIX = "fleet.reply."
PIECE_SUFFIX = ".p"
BOXES_BUCKET = "fleet_boxes"
PAYLOADS_BUCKET = "fleet_payloads"
#: Objects outlive any interactive request (timeout_ms is at most 600 000), and a requester
#: that died leaks nothing for longer. A body whose request may wait longer (a batch line,
#: due when its job expires) is put again by its requester every KEEP_EVERY of the bucket's
#: TTL (`Payloads.keep`): JetStream expires each chunk by age, and a re-put is the object store's
#: only refresh (no per-object TTL, no touch).
PAYLOAD_TTL_S = 900.0
#: A kept body is put again this share of the TTL after its last put *began* (JetStream
#: stamps the chunks as they come): the rest, two thirds, is the slack for a slow put or
#: a busy event loop before the object would expire (at a half, tests/test_batches_nats_ttl's
#: 3 s bucket once held 5 of 6 bodies of waiting lines: one had expired).
KEEP_EVERY = 1 / 3
#: A puller's read of a body from the object store, at most: nats.py's `get` waits forever
#: for chunks purged under it (its requester put the body again, or deleted it, meanwhile).
OBJECT_READ_S = 30.0
#: Replies are kept past any request's deadline (timeout_ms is at most 600 000), then dropped.
REPLY_TTL_S = 660.0
#: Bytes of replies FLEET_REPLIES keeps (oldest dropped first); replies over the
#: server's max_payload go through the object store, so this is thousands of replies.
REPLY_STREAM_BYTES = 1 << 30
#: JetStream drops a re-published message with a Nats-Msg-Id seen within this window.
DEDUP_WINDOW_S = 120.0
#: Long-poll of an idle puller's one-message fetch: it asks again this often.
FETCH_POLL_S = 1.0
#: How long a busy puller's fetch waits for more than what is already waiting.
FETCH_BURST_S = 0.02
#: Batch work's subject under its model's (invariant 6).
BATCH_SUFFIX = ".batch"
#: The share of a box's fetch credit batch work may hold: the rest is always there for
#: interactive work, which the box's batch work never makes wait in JetStream.
BATCH_CREDIT_SHARE = 0.5
#: How often a batch puller that found no credit to spare looks again.
BATCH_CREDIT_POLL_S = 0.05
#: Bytes of a work message's max_payload kept for its headers.
HEADER_ROOM = 4096
#: Outgoing bytes nats.py buffers while reconnecting (replies, acks, publishes).
PENDING_BYTES = 64 << 20
#: The shortest ack wait `serve` accepts: a box extends what it holds every third of
#: it from an event loop that also serves HTTP; shorter, a busy box would lose live work.
MIN_ACK_WAIT_MS = 1_000
#: Replicas of the shared streams on a NATS cluster (`nats_replicas` 0): a Raft group of three
#: keeps serving through the loss of any one server.
CLUSTER_REPLICAS = 3
MAX_REPLICAS = 5
#: JetStream API error codes: replicas asked of a server that is not clustered; too few servers
#: up to place them (no suitable peers; insufficient resources, also for storage); a stream
#: name in use with another configuration.
ERR_NOT_CLUSTERED, ERR_NO_PEERS, ERR_INSUFFICIENT, ERR_STREAM_EXISTS = 10074, 10005, 10023, 10058
ERR_CANNOT_PLACE = (ERR_NOT_CLUSTERED, ERR_NO_PEERS, ERR_INSUFFICIENT)
#: Noticing a dead box may take at most 1/ACK_WAIT_SHARE of the request deadline
#: (`timeout_ms`): the rest is for another box to queue and run the redelivered work.
ACK_WAIT_SHARE = 3
#: Seconds `serve` gives each NATS server at start to say whether it lets this box in.
ACCESS_CHECK_S = 5.0
#: Settings that name files: each must be readable before anything connects.
NATS_FILES = ("nats_creds_file", "nats_nkey_file", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")

#: Each box says it is alive (core NATS, not kept) this many times per ack wait: a requester
#: whose request's holder went quiet for LAPSE_PERIODS of them republishes the request, long
#: before JetStream would redeliver it (after the ack wait).
ALIVE_SHARE = 10
LAPSE_PERIODS = 3
#: A box whose NATS server has not let a JetStream call through for this many ack waits
#: (longer than a Raft election takes) moves to another server: its own is cut off from the
#: cluster's majority (a network partition) and would never answer.
JETSTREAM_LOST_ACK_WAITS = 2
ALIVE_PREFIX = "fleet.alive."
CANCEL_SUBJECT = "fleet.cancel"

H_MSG_ID = "Nats-Msg-Id"
H_RID, H_MODEL, H_TASK, H_TOKENS = "Fleet-Request-Id", "Fleet-Model", "Fleet-Task", "Fleet-Tokens"
H_DEADLINE, H_REPLY_TO, H_OBJECT, H_STATUS = "Fleet-Deadline-Ms", "Fleet-Reply-To", "Fleet-Object", "Fleet-Status"
#: A held notice (holder -> requester, on the piece subject): who took the request, and its
#: work message's stream sequence; a republished request's attempt number (1 = first).
H_HELD_BY, H_SEQ, H_ATTEMPT = "Fleet-Held-By", "Fleet-Seq", "Fleet-Attempt"

encode = msgspec.msgpack.Encoder().encode
json_encode = msgspec.json.Encoder().encode
json_decode = msgspec.json.Decoder().decode


def token(name: str) -> str:
    """A model or box name as one NATS subject token ('.' separates tokens)."""
    return name.replace(".", "~")


def box_token(box: str) -> str:
    """A box name as a subject token and KV key: [A-Za-z0-9_-] only."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in box) or "box"


def work_subject(model: str) -> str:
    return WORK_PREFIX + token(model)


def consumer_name(model: str) -> str:
    return "work_" + token(model)


def batch_subject(model: str) -> str:
    return work_subject(model) + BATCH_SUFFIX


def batch_consumer_name(model: str) -> str:
    return "batch_" + token(model)


def nats_trouble() -> tuple[type[BaseException], ...]:
    """What a call through nats.py raises when NATS or JetStream cannot do it now (nats.py's
    own family, and the socket's: timeouts are OSErrors); the bridge logs it and tries again,
    or lets the ack wait redeliver. Anything else is a bug and propagates. Named late (an
    `except` evaluates it only when something was raised), so importing the bridge does not
    import nats.py."""
    from nats.errors import Error as NatsError

    return (NatsError, OSError)


def work_error(code: str, message: str) -> bytes:
    """A worker-shaped error reply (an `Envelope` with a `WorkError`) the bridge answers itself."""
    return encode(Envelope(0.0, 0.0, "", WorkError(code, message)))
