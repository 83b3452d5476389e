"""Several boxes: this daemon's bridge to one NATS JetStream work queue.

With `--nats`, every request any daemon accepts goes into JetStream, and every
box pulls from it the way its workers pull from `local_queue`: in amounts that
match its own free capacity, only for models its store holds. No central router
decides; JetStream is the shared queue and fleet adds no broker of its own.

Names (the same on every box):
    fleet.work.<model>            subjects of the work-queue stream FLEET_WORK (file storage)
    work_<model>                  its durable pull consumer per model, bound by every box holding the model
    fleet.work.<model>.batch      batch work for the model (the lines of offline jobs, daemon/batches.py),
    batch_<model>                 and its own durable pull consumer, bound by every box holding the model
    fleet.reply.<box>.<instance>.<n>    the reply to request n of one daemon process, kept in the
                                  stream FLEET_REPLIES (file storage, REPLY_TTL_S) so a requester
                                  that was away for a blip reads it after reconnecting
    fleet.reply.<box>.<instance>.<n>.p  streamed pieces of request n (core NATS: not kept; the
                                  final reply carries the whole text anyway)
    fleet_boxes                   KV bucket, one heartbeat entry per box (JSON), expiring after 3 periods
    fleet_payloads                object store: request bodies over `nats_large_payload_bytes`, named by
                                  request id, and replies over the server's max_payload (`<id>.reply`);
                                  a body whose request may wait past its TTL (a batch line) is put
                                  again by its requester every third of its TTL (`_keep_body`)
Model names may contain '.', NATS's token separator: in subjects and consumer names it is '~'.

A work message is the request as MessagePack (empty when the body is in the object
store) with its annotation in headers, so a puller decides without decoding it:
Nats-Msg-Id (JetStream dedup), Fleet-Request-Id, Fleet-Model, Fleet-Task,
Fleet-Tokens, Fleet-Deadline-Ms (Unix ms: boxes share wall time, not monotonic
time), Fleet-Reply-To, Fleet-Object. A reply is the worker's result exactly as it
wrote it (`fleet.messages.Envelope` bytes) with Fleet-Request-Id and Fleet-Status.

Invariants:
1. A work message is acked only after its reply is stored in FLEET_REPLIES (or, for
   this box's own requests, handed to the waiting request). A box that dies before
   that loses the message to another box once `ack_wait` passes without
   `in_progress()`: a dead box is noticed within `nats_ack_wait_ms` (5 s), and
   `check_settings` refuses an ack wait that leaves no time to answer elsewhere.
2. The requester answers each request at most once: the first reply pops its
   waiter; a later one (redelivery after a box died, a reply read back after a
   reconnect) finds nobody and is counted in `duplicates`, then dropped.
3. A box holds at most `capacity` messages (fetched, not answered) over all its
   models: its pullers share one `FetchCredit`, and each fetch asks for no more
   than the credit it took.
4. A request never waits past its own deadline: publishing retries until it, and
   the wait for the reply is bounded by it; pullers `term()` expired messages.
5. NATS is not needed for what this box can do alone: while it is unreachable, a
   request for a model in this box's store runs in the local queue.
6. Batch work (a request made inside a job's producer: `daemon.core.BATCH_WORK`) is
   below interactive work at every hop: it is queued under its model's batch subject;
   a box's batch pullers take fetch credit only while no interactive puller waits
   for it, and never more than BATCH_CREDIT_SHARE of it; the box that runs it queues
   it as batch work in its local queue (behind interactive work, promoted after
   `batch_max_wait_ms`). Otherwise it is work like any other: invariants 1-4 hold
   for it, so a box killed mid-batch loses none of its lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import random
import secrets
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from fleet.config import Settings
from fleet.errors import BadRequest, FleetError, ModelNotFound, Overloaded, Timeout, Unavailable
from fleet.messages import STATUS_ERROR, STATUS_PARTIAL, Envelope, WorkError
from fleet.store import Store
from fleet.local_queue import STATUS_POISON, Done

from fleet.daemon import timeline, tracing
from fleet.daemon.broker import Answer, Broker

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
#: TTL (`_keep_body`): JetStream expires each chunk by age, and a re-put is the object store's
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

_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


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


def connect_options(settings: Settings) -> dict[str, Any]:
    """nats.connect keyword arguments from settings: servers, reconnects, auth, TLS.

    Reconnects never stop (a box outlives a NATS restart); pings every 5 s notice a
    dead TCP connection in about 15 s instead of nats.py's default 4 minutes."""
    servers = [s.strip() for s in settings.nats.split(",") if s.strip()]
    if not servers:
        raise BadRequest("--nats: no server URL given, e.g. nats://127.0.0.1:4222")
    opts: dict[str, Any] = {
        "servers": servers, "name": f"fleet {settings.box_name}", "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1, "connect_timeout": 2, "ping_interval": 5, "max_outstanding_pings": 3,
        "pending_size": PENDING_BYTES,
    }
    if settings.nats_creds_file or settings.nats_nkey_file:
        try:
            import nkeys  # noqa: F401  (nats.py signs the server's nonce with it)
        except ImportError:
            raise BadRequest("nats_creds_file and nats_nkey_file need the nkeys package: pip install nkeys") from None
    for name in NATS_FILES:
        path = getattr(settings, name)
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise BadRequest(f"{name}: no readable file where it points")
    if settings.nats_creds_file:
        opts["user_credentials"] = settings.nats_creds_file
    elif settings.nats_nkey_file:
        opts["nkeys_seed"] = settings.nats_nkey_file
    if settings.nats_token:
        opts["token"] = settings.nats_token
    if settings.nats_user:
        opts["user"], opts["password"] = settings.nats_user, settings.nats_password
    if settings.nats_tls_ca or settings.nats_tls_cert:
        try:
            ctx = ssl.create_default_context(cafile=settings.nats_tls_ca or None)
        except ssl.SSLError as exc:
            raise BadRequest(f"nats_tls_ca: not a PEM certificate ({exc.reason or exc})") from None
        if settings.nats_tls_cert:
            try:
                ctx.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key or None)
            except ssl.SSLError as exc:
                raise BadRequest(f"nats_tls_cert / nats_tls_key: not a PEM certificate and its private key "
                                 f"({exc.reason or exc})") from None
        opts["tls"] = ctx
    return opts


def check_access(settings: Settings) -> None:
    """At start (`serve`, before anything runs): NATS must let this box in with its
    credentials and certificates, else `serve` exits 1 with one line naming the server
    and what it refused. Every server is tried once, all at once, within ACCESS_CHECK_S.

    A server that cannot be reached (down, not up yet, cut off) says nothing about the
    settings: the box starts and joins when one answers, serving its own models
    meanwhile. Refused by some servers but let in by another: a warning names them."""
    refused: list[str] = []
    reached = False
    # asyncio warns ("returning true from eof_received() has no effect when using ssl") when
    # a TLS server closes a refused connection: noise around the one line that matters.
    quiet = logging.getLogger("asyncio")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        tried = asyncio.run(_try_servers(settings))
    finally:
        quiet.setLevel(level)
    for url, exc, info in tried:
        if exc is None:
            reached = True
            continue
        why = refusal(exc, settings, info)
        if why is not None:
            refused.append(f"NATS at {_host_port(url)} {why}")
    if refused and not reached:
        raise BadRequest(refused[0])
    for line in refused:
        log.warning("%s (another server let this box in)", line)


async def _try_servers(settings: Settings) -> list[tuple[str, BaseException | None, dict[str, Any]]]:
    """Connect once to each server alone, no reconnects: (url, None, {}) or (url, the error,
    the INFO the server greets a plain connection with, when it answers one)."""
    import nats

    opts = connect_options(settings)

    async def quiet(_exc: Exception) -> None:
        return None

    async def one(url: str) -> tuple[str, BaseException | None, dict[str, Any]]:
        try:
            nc = await asyncio.wait_for(nats.connect(**{
                **opts, "servers": [url], "allow_reconnect": False, "max_reconnect_attempts": 0,
                "error_cb": quiet}), ACCESS_CHECK_S)
        except Exception as exc:
            try:
                return url, exc, await asyncio.wait_for(_server_info(url), 2.0)
            except Exception:  # down or away: it says nothing
                return url, exc, {}
        await nc.close()
        return url, None, {}

    return list(await asyncio.gather(*(one(url) for url in opts["servers"])))


async def _server_info(url: str) -> dict[str, Any]:
    """The INFO a NATS server greets any TCP connection with (before TLS, before auth)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
    try:
        line = await reader.readline()
    finally:
        writer.close()
    return msgspec.json.decode(line[5:]) if line.startswith(b"INFO ") else {}


def refusal(exc: BaseException, settings: Settings, info: dict[str, Any] | None = None) -> str | None:
    """What a failed connect says against this box's settings, or None when it says
    nothing about them (refused or cut connections, timeouts: the server is down or away).
    `info`: the server's INFO, read after the failure (a server that asks for client
    certificates says so there, and may drop a connection without one after the handshake)."""
    from nats.errors import Error as NatsError

    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"has a certificate this box does not trust ({exc.verify_message}): "
                "nats_tls_ca must name the CA that signed it")
    asks_cert = bool((info or {}).get("tls_verify"))
    alert = isinstance(exc, ssl.SSLError) and "ALERT" in (exc.reason or "")  # the server's TLS alert
    if asks_cert and not settings.nats_tls_cert and (alert or isinstance(exc, (OSError, NatsError))):
        return "asks for a TLS client certificate and this box has none: set nats_tls_cert and nats_tls_key"
    if alert or (asks_cert and isinstance(exc, (ConnectionError, ssl.SSLError))):
        why = f" ({exc.reason})" if isinstance(exc, ssl.SSLError) and exc.reason else ""
        return f"refused this box's TLS client certificate{why}: nats_tls_cert must be signed by a CA it trusts"
    text = str(exc).removeprefix("nats: ").strip("'")
    if isinstance(exc, NatsError) and ("Authorization" in text or "Authentication" in text):
        return f"refused this box's credentials ({_credentials(settings)}): {text}"
    return None


def _credentials(settings: Settings) -> str:
    given = [name for name in ("nats_creds_file", "nats_nkey_file", "nats_token", "nats_user") if getattr(settings, name)]
    if any(urlsplit(u.strip()).username for u in settings.nats.split(",") if u.strip()):
        given.append("the URL's user")
    return ", ".join(given) or "none given: set nats_creds_file, nats_nkey_file, nats_token or nats_user"


def _host_port(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname}:{parts.port or 4222}"


def check_settings(settings: Settings) -> None:
    """Refuse, before anything starts, NATS settings under which accepted requests
    would be lost: a dead box's work redelivered too late to answer it before the
    request's deadline, or an ack wait so short that a busy live box loses its own."""
    connect_options(settings)
    ack_ms, timeout_ms = settings.nats_ack_wait_ms, settings.timeout_ms
    if ack_ms < MIN_ACK_WAIT_MS:
        raise BadRequest(f"nats_ack_wait_ms is {ack_ms}: it must be at least {MIN_ACK_WAIT_MS} (a box extends "
                         "the work it holds every third of it; shorter, a busy box loses work it is running)")
    check_deadline(timeout_ms, ack_ms)
    if not 0 <= settings.nats_replicas <= MAX_REPLICAS:
        raise BadRequest(f"nats_replicas must be between 0 (3 on a cluster that can place them, else 1) and "
                         f"{MAX_REPLICAS} (JetStream's most), got {settings.nats_replicas}")
    if settings.nats_fetch_per_worker < 1:
        raise BadRequest(f"nats_fetch_per_worker must be at least 1, got {settings.nats_fetch_per_worker}")


def choose_replicas(setting: int, wanted: int, have: int) -> int:
    """Replicas for a shared stream that exists with `have`: the setting when set (raised or
    lowered to it); else what this cluster takes (`wanted`), never fewer than it has (an
    operator may have raised it by hand)."""
    return setting or max(wanted, have)


def choose_server(servers: list[Any], avoid: set[str], wait_s: float) -> tuple[Any, float]:
    """Where a reconnect goes, from nats.py's pool (each with `uri` and `reconnects`, the
    failed attempts since it was last connected): at random among those not yet failed,
    other than those in `avoid` (host:port: the server just lost, one cut off from
    JetStream's majority); when none is left, one of those that failed least, after `wait_s`."""
    fresh = [s for s in servers if s.reconnects == 0 and s.uri.netloc not in avoid]
    if fresh:
        return random.choice(fresh), 0.0
    fewest = min(s.reconnects for s in servers)
    return random.choice([s for s in servers if s.reconnects == fewest]), wait_s


def check_deadline(timeout_ms: int, ack_ms: int) -> None:
    """The default deadline must leave another box time to answer a dead box's requests:
    at least ACK_WAIT_SHARE ack waits (at start, and for a SIGHUP's new `timeout_ms`)."""
    if ack_ms * ACK_WAIT_SHARE > timeout_ms:
        raise BadRequest(
            f"nats_ack_wait_ms ({ack_ms}) must be at most a third of timeout_ms ({timeout_ms}): a box that dies "
            "holding a request is noticed only after the ack wait, and another box needs the rest of the "
            "deadline to answer it",
            hint=f"set FLEET_NATS_ACK_WAIT_MS to {timeout_ms // ACK_WAIT_SHARE} or less (default 5000)")


class FetchCredit:
    """The work messages one box may hold, shared by the pullers of all its models.

    `used` counts the messages held plus the credit taken by fetches in flight: a
    puller takes credit before it fetches and gives back what the fetch did not fill,
    then one per message as it is answered. Waiters get room in arrival order, so a
    puller that gives back and takes again in a loop cannot starve another one.
    Event loop only (no lock)."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity
        self.used = 0
        #: Of `used`, what batch work holds (`take_spare`).
        self.batch_used = 0
        #: Waiters handed the turn that have not taken their room yet: batch work waits for them too.
        self._woken = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def free(self) -> int:
        return self._capacity() - self.used

    async def take(self, want: int) -> int:
        """Wait for room (and for the pullers that waited first), then take up to
        `want` messages' worth, at least one."""
        front = False
        while self.free <= 0 or (self._waiters and not front):
            await self._wait_turn(front)
            front = True  # woken: first in line from now on, even if someone took the room meanwhile
        n = min(max(1, want), self.free)
        self.used += n
        self.wake()
        return n

    async def take_spare(self, want: int, most: int) -> int:
        """Batch work's credit (invariant 6): wait until no puller waits for credit and
        batch work holds less than `most` (its messages and its fetches in flight),
        then take up to `want` of what is free, at most what brings it to `most`."""
        while True:
            n = min(max(1, want), self.free, most - self.batch_used)
            if n > 0 and not self._waiters and not self._woken:
                self.used += n
                self.batch_used += n
                return n
            await asyncio.sleep(BATCH_CREDIT_POLL_S)

    def give(self, n: int, *, batch: bool = False) -> None:
        self.used -= n
        if batch:
            self.batch_used -= n
        self.wake()

    def wake(self) -> None:
        """Hand the room to the first waiter (also when capacity grew: workers came up)."""
        if self._waiters and self.free > 0:
            self._waiters.popleft().set_result(None)
            self._woken += 1

    async def _wait_turn(self, front: bool) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self._waiters:
                self._waiters.remove(fut)
            else:
                self._woken -= 1
                self.wake()  # woken and cancelled at once: pass the turn on
            raise
        self._woken -= 1


@dataclass
class _Pending:
    """A request of this box waiting for its reply on `subject` (and its pieces, streaming),
    with what it takes to publish it again (`work_subject`, `body`, `headers`), its work
    message's stream sequence (`seq`, from the PubAck) and which other box holds it
    (`holder`, from its held notice; "" while unknown or this box)."""

    fut: asyncio.Future[Done]
    subject: str
    on_partial: Callable[[Done], None] | None = None
    model: str = ""
    work_subject: str = ""
    body: bytes = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    deadline: float = 0.0
    published_at: float = 0.0
    holder: str = ""
    seq: int = 0
    attempt: int = 1


class Cluster:
    """The NATS side of one daemon: requester (`submit`) and puller (`_pull`)."""

    def __init__(self, settings: Settings, broker: Broker, store: Store, *,
                 workers_up: Callable[[], int], loaded: Callable[[], Awaitable[set[str]]],
                 on_lag: Callable[[str, int, int], None] | None = None) -> None:
        self.settings = settings
        #: Gets (model, pending, unacked) of each model's work consumer at every heartbeat
        #: (the daemon's `fleet_nats_*_messages` gauges).
        self._on_lag = on_lag
        self.broker = broker
        self.store = store
        self.box = settings.box_name
        self.key = box_token(self.box)
        self.instance = secrets.token_hex(4)
        #: Replies to this daemon's requests arrive on <reply_prefix><n>, pieces on <...><n>.p.
        self.reply_prefix = f"{REPLY_PREFIX}{self.key}.{self.instance}."
        #: This daemon as a holder of work, in held notices and on its alive subject.
        self.holder_id = f"{self.key}.{self.instance}"
        #: Validated here, so bad auth/TLS settings fail `serve` at start, not in a task.
        self._options = connect_options(settings)
        self._workers_up = workers_up
        self._loaded = loaded
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        #: Work messages this box holds (fetched, not answered), by stream sequence; the
        #: tasks serving them by request id (a requester's cancel stops one).
        self._held: dict[int, Any] = {}
        self._running: dict[str, asyncio.Task] = {}
        #: Request ids their requesters cancelled (a client went away), with when: a work
        #: message of one taken later is dropped unrun. Kept REPLY_TTL_S (past any deadline).
        self._cancelled: dict[str, float] = {}
        #: Holders' last alive signal (monotonic s), by holder id; and since when this box
        #: has been listening for them (a requester that was away judges no lapse; inf
        #: while it is away).
        self._alive: dict[str, float] = {}
        self._quiet: set[str] = set()
        self._listening_since = time.monotonic()
        #: When a JetStream call last went through this box's NATS server (monotonic s), and
        #: the server (host:port) it left for not letting them through (`choose_server`).
        self._jetstream_ok_at = time.monotonic()
        self._avoid_server = ""
        #: The server (host:port) this box is (or was last) connected to.
        self._server_here = ""
        self.credit = FetchCredit(lambda: self.capacity)
        self._joined = asyncio.Event()
        self._stopping = False
        self._pulling = True
        self._left = False
        self._tasks: list[asyncio.Task] = []
        self._serving: set[asyncio.Task] = set()
        #: Pull loops by (model, batch work or not).
        self._pullers: dict[tuple[str, bool], asyncio.Task] = {}
        self._models: dict[str, str] = {}
        self._boxes: dict[str, dict[str, Any]] = {}
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None
        self.obj: Any = None
        #: The payload bucket's TTL (s) as JetStream keeps it (read at the join: a bucket keeps
        #: the config of the box that created it); 0: objects never expire.
        self.payload_ttl_s = PAYLOAD_TTL_S
        #: Copies of the shared streams, as declared at the join (`_declare`).
        self.replicas = 1
        self.served = 0
        self.duplicates = 0
        self.reconnects = 0
        self.served_locally = 0
        self.republished = 0
        self.cancelled = 0
        #: Bodies put again in the object store so they outlive its TTL (`_keep_body`).
        self.bodies_refreshed = 0
        self._last_error_log = 0.0

    # -- lifecycle ------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self._joined.is_set()

    @property
    def reachable(self) -> bool:
        """Joined and connected now: requests can be queued in JetStream."""
        return self._joined.is_set() and self.nc is not None and self.nc.is_connected

    @property
    def capacity(self) -> int:
        return self.settings.nats_fetch_per_worker * max(1, self._workers_up())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tasks.append(loop.create_task(self._join(), name="nats-join"))

    async def _join(self) -> None:
        """Connect (retrying until NATS answers), declare the shared names, start pulling."""
        import nats

        self.nc = await nats.connect(
            **self._options, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected, closed_cb=self._on_closed,
            reconnect_to_server_handler=self._next_server,
        )
        self.js = self.nc.jetstream()
        self._server_here = self.nc.connected_url.netloc
        await self.nc.subscribe(self.reply_prefix + ">", cb=self._on_reply)
        await self.nc.subscribe(ALIVE_PREFIX + ">", cb=self._on_alive)
        await self.nc.subscribe(CANCEL_SUBJECT, cb=self._on_cancel)
        while True:
            try:
                await self._declare()
                await self._beat()
                break
            except Exception as exc:  # JetStream not enabled, not permitted, or the server restarting
                self._log_error(f"cannot set up JetStream on {self.settings.nats}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(2.0)
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="nats-heartbeat"))
        self._tasks.append(asyncio.create_task(self._extend_loop(), name="nats-in-progress"))
        self._tasks.append(asyncio.create_task(self._alive_loop(), name="nats-alive"))
        self._joined.set()
        log.info("joined the NATS cluster at %s as %s (replies on %s*)", self.settings.nats, self.box,
                 self.reply_prefix)

    async def _declare(self) -> None:
        """The streams, KV bucket and object store every box shares, `self.replicas`
        copies each. Declaring is idempotent; a box with other limits updates them (the
        last one wins), and raises a stream with fewer replicas in place (one log line)."""
        from nats.js.api import DiscardPolicy, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
        from nats.js.client import KV_STREAM_TEMPLATE, OBJ_STREAM_TEMPLATE

        def work(replicas: int) -> StreamConfig:
            return StreamConfig(
                name=STREAM, subjects=[WORK_PREFIX + ">"], retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE, discard=DiscardPolicy.NEW, max_msgs=self.settings.nats_max_queued,
                duplicate_window=DEDUP_WINDOW_S, num_replicas=replicas,
            )

        def replies(replicas: int) -> StreamConfig:
            # Final replies only (<box>.<instance>.<n>): pieces (one token more) are not kept.
            return StreamConfig(
                name=REPLY_STREAM, subjects=[REPLY_PREFIX + "*.*.*"], retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=REPLY_TTL_S,
                max_bytes=REPLY_STREAM_BYTES, duplicate_window=DEDUP_WINDOW_S, num_replicas=replicas,
            )

        def boxes(replicas: int) -> Awaitable[Any]:
            return self.js.create_key_value(bucket=BOXES_BUCKET, ttl=3 * self.settings.nats_heartbeat_ms / 1000.0,
                                            history=1, storage=StorageType.FILE, replicas=replicas)

        def payloads(replicas: int) -> Awaitable[Any]:
            return self.js.create_object_store(PAYLOADS_BUCKET, ObjectStoreConfig(
                ttl=PAYLOAD_TTL_S, storage=StorageType.FILE, replicas=replicas))

        self.replicas = self.settings.nats_replicas or CLUSTER_REPLICAS
        changed: list[str] = []
        for config in (work, replies):
            await self._put_stream(STREAM if config is work else REPLY_STREAM,
                                   lambda r, c=config: self.js.add_stream(c(r)), changed,
                                   update=lambda r, c=config: self.js.update_stream(c(r)))
        self.kv = await self._put_stream(KV_STREAM_TEMPLATE.format(bucket=BOXES_BUCKET), boxes, changed,
                                         bind=lambda: self.js.key_value(BOXES_BUCKET))
        self.obj = await self._put_stream(OBJ_STREAM_TEMPLATE.format(bucket=PAYLOADS_BUCKET), payloads, changed,
                                          bind=lambda: self.js.object_store(PAYLOADS_BUCKET))
        self.payload_ttl_s = (await self.obj.status()).ttl or 0.0
        if changed:
            log.info("replicas changed in place to %d: %s", self.replicas, ", ".join(changed))

    async def _put_stream(self, name: str, create: Callable[[int], Awaitable[Any]], changed: list[str], *,
                          update: Callable[[int], Awaitable[Any]] | None = None,
                          bind: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Create stream `name` (`create(replicas)`), or, when it exists, `update` it to
        this box's config (a bucket keeps its own) with `choose_replicas` copies; then
        `bind` to it (a bucket's handle).

        Where JetStream cannot place the copies and the setting left the number to
        fleet: on a single server one copy, silently; on a cluster with fewer than three
        JetStream servers up (or out of storage), one copy and a warning; the next box to
        join raises it. `self.replicas` follows, so the next streams skip the try.
        Consumers keep `num_replicas` 0 and so follow their stream's replicas."""
        from nats.js.errors import APIError

        try:
            try:
                created = await create(self.replicas)
            except APIError as exc:
                if not self._may_place_fewer(exc):
                    raise
                self._cannot_place(name, self.replicas, exc)
                self.replicas = 1
                created = await create(1)
            return created if bind is None else await bind()
        except APIError as exc:
            if exc.err_code != ERR_STREAM_EXISTS:
                raise
        info = await self.js.stream_info(name)
        have = info.config.num_replicas or 1
        want = choose_replicas(self.settings.nats_replicas, self.replicas, have)
        if update is None:  # a bucket: only its replicas change
            async def update(replicas: int) -> None:
                await self.js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))

            if want == have:
                return await bind()
        try:
            await update(want)
        except APIError as exc:
            if not self._may_place_fewer(exc):
                raise
            self._cannot_place(name, want, exc)
            want = have
            await update(have)
        if want != have:
            changed.append(f"{name} (had {have})")
        return None if bind is None else await bind()

    def _may_place_fewer(self, exc: Any) -> bool:
        """JetStream could not place the copies, and the number was fleet's to choose."""
        return not self.settings.nats_replicas and self.replicas > 1 and \
            exc.err_code in ERR_CANNOT_PLACE

    def _cannot_place(self, name: str, replicas: int, exc: Any) -> None:
        if exc.err_code != ERR_NOT_CLUSTERED:  # a single server has one copy by nature: nothing to say
            log.warning("%s: the NATS cluster cannot place %d replicas now (%s: fewer than three JetStream "
                        "servers up, or out of storage); keeping 1, raised when a box joins and it can",
                        name, replicas, exc.description)

    def stop_pulling(self) -> None:
        """Draining (SIGTERM): fetch no new work; what this box holds still runs and is
        answered, and its own requests still wait for their replies."""
        self._pulling = False
        for task in self._pullers.values():
            task.cancel()

    async def leave(self) -> None:
        """Stop pulling, hand held messages back at once (nak: another box takes them
        now instead of after ack_wait), fail this box's waiters, close the connection.
        Idempotent: the drain bound and the shutdown may both call it."""
        if self._left:
            return
        self._left = True
        self._stopping = True
        self._pulling = False
        for task in [*self._tasks, *self._pullers.values()]:
            task.cancel()
        if self.nc is None or self.nc.is_closed:
            return
        for msg in list(self._held.values()):
            try:
                await msg.nak()
            except Exception as exc:  # the connection may be down: ack_wait redelivers instead
                log.warning("could not hand back a held message: %s", exc)
        for task in list(self._serving):
            task.cancel()
        for pend in self._pending.values():
            if not pend.fut.done():
                pend.fut.set_exception(Unavailable("daemon shutting down"))
        try:
            await self.kv.delete(self.key)
        except Exception as exc:
            log.warning("could not remove this box from %s: %s", BOXES_BUCKET, exc)
        await self.nc.close()

    # -- requester --------------------------------------------------------------------

    async def submit(self, model: str, task: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                     local: bool = False, on_partial: Callable[[Done], None] | None = None,
                     batch: bool = False) -> Answer:
        """Queue one request in JetStream and wait for the first reply from any box.

        `local`: this box stores the model, so while NATS is unreachable (not joined
        yet, disconnected, or gone while queueing) it runs in this box's own queue
        instead (invariant 5). `on_partial` gets streamed pieces, from whichever box
        runs the request, in order; a piece lost on the way is filled in by the final reply.
        `batch`: a job's line (daemon.batches), batch work (invariant 6)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if local and not self.reachable:
            return await self._run_here(model, payload, tokens, deadline, on_partial, batch)
        if not self._joined.is_set():
            try:
                await asyncio.wait_for(self._joined.wait(), timeout_s)
            except TimeoutError:
                raise Timeout(f"{model}: not joined to the NATS cluster at {self.settings.nats} yet") from None
        n = next(self._ids)
        rid, reply_to = f"{self.key}-{self.instance}-{n}", f"{self.reply_prefix}{n}"
        body = payload if type(payload) is bytes else bytes(payload)
        headers = {
            H_MSG_ID: rid, H_RID: rid, H_MODEL: model, H_TASK: task, H_TOKENS: str(tokens),
            H_DEADLINE: str(int((time.time() + timeout_s) * 1000)), H_REPLY_TO: reply_to,
            **tracing.headers(),  # W3C traceparent: the box that runs it continues the trace
        }
        # Over the threshold, or over what this server accepts in one message (max_payload, 1 MiB by default).
        large = len(body) > min(self.settings.nats_large_payload_bytes, self.nc.max_payload - HEADER_ROOM)
        big = body
        if large:
            await self._put_object(rid, body, deadline)
            headers[H_OBJECT], body = rid, b""
        fut: asyncio.Future[Done] = asyncio.get_running_loop().create_future()
        subject = batch_subject(model) if batch else work_subject(model)
        pend = self._pending[rid] = _Pending(fut, reply_to, on_partial, model, subject, body, headers, deadline)
        # A deadline past the object's expiry (a batch line): this box keeps the body in the store.
        keeper = asyncio.create_task(self._keep_body(rid, big, pend)) \
            if large and self.payload_ttl_s and deadline > time.monotonic() + self.payload_ttl_s else None
        try:
            ack = await self._publish(subject, body, headers, deadline, offline_gives_up=local)
            if ack is None:
                self._pending.pop(rid, None)
                return await self._run_here(model, payload, tokens, deadline, on_partial, batch)
            pend.seq, pend.published_at = pend.seq or ack.seq, time.monotonic()
            timeline.stamp("published")
            done = await asyncio.wait_for(fut, deadline - time.monotonic())
            timeline.stamp("collected")
        except TimeoutError:
            raise Timeout(f"{model}: no answer from the cluster within {timeout_s * 1000:.0f} ms") from None
        except asyncio.CancelledError:
            # The client went away (a stream closed): whichever box runs it stops (`_on_cancel`).
            self._spawn(self._publish_cancel(rid))
            raise
        finally:
            self._pending.pop(rid, None)
            if keeper is not None:
                keeper.cancel()
            if large:
                self._spawn(self._delete_object(rid))
        answer = self.broker.answer(model, done)
        # Waiting, as the client sees it, includes the NATS hops and the time in JetStream.
        waited_ms = (time.monotonic() - t0) * 1000.0 - answer.inference_ms
        return dataclasses.replace(answer, queue_ms=max(answer.queue_ms, waited_ms))

    async def _run_here(self, model: str, payload: bytes | memoryview, tokens: int, deadline: float,
                        on_partial: Callable[[Done], None] | None, batch: bool = False) -> Answer:
        """NATS is unreachable and this box stores the model: its own queue runs the request."""
        self.served_locally += 1
        return await self.broker.submit(model, payload, tokens=tokens, timeout_s=max(0.001, deadline - time.monotonic()),
                                        on_partial=on_partial, batch=batch)

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str], deadline: float, *,
                       offline_gives_up: bool = False) -> Any:
        """Publish until JetStream acks (its PubAck: stream, seq) or the deadline passes.
        Retrying is safe: the stream drops a second copy with the same Nats-Msg-Id (dedup
        window). With `offline_gives_up`, a failure while disconnected returns None at once."""
        import nats.errors
        from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("could not queue the request in JetStream before its deadline (NATS unreachable?)")
            try:
                ack = await self.js.publish(subject, body, headers=headers, timeout=min(left, 2.0))
                self._jetstream_ok_at = time.monotonic()
                return ack
            except APIError as exc:
                if exc.err_code == 10077 or "maximum messages" in (exc.description or ""):
                    raise Overloaded(f"the cluster queue is full ({self.settings.nats_max_queued} waiting); "
                                     "retry shortly", retry_after_s=1.0) from None
                in_process = "in process" in (exc.description or "")
                if not (in_process or isinstance(exc, ServiceUnavailableError) or exc.code == 503):
                    raise Unavailable(f"JetStream refused the request: {exc.description}") from None
                # For now: the stream has no leader (503: an election, a server cut from the
                # others), or this message id's first try is still being agreed on (a retry
                # after a timeout, 10158). Publish again within the deadline: the id dedups.
                self._log_error(f"JetStream is not taking the request yet ({exc.description or 'no stream leader'}); "
                                "publishing again")
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            except (TimeoutError, NoStreamResponseError, nats.errors.ConnectionClosedError,
                    nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError):
                if offline_gives_up and not self.nc.is_connected:
                    return None
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    async def _put_object(self, name: str, body: bytes, deadline: float) -> None:
        try:
            await asyncio.wait_for(self.obj.put(name, body), max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            raise Timeout("could not store a body in the JetStream object store in time") from None

    async def _keep_body(self, rid: str, body: bytes, pend: _Pending) -> None:
        """Keep request `rid`'s body in the object store until the request is answered
        (this task is cancelled then), though its deadline is past the bucket's TTL.

        JetStream expires every chunk of an object by its age, and the object store has
        no per-object TTL or touch: the body is put again under the same name (new
        chunks, then the meta, then the old chunks purged) every KEEP_EVERY of the TTL,
        timed from the start of the last put, also while a box holds the request (it
        may hand it back: `nak`, or die). A puller reading it just then reads purged
        chunks: its read is bounded (OBJECT_READ_S) and the message read again. If this box dies, nobody puts the body again: an orphan
        lives at most one TTL."""
        ttl = self.payload_ttl_s
        put_at = time.monotonic()  # the first put ended just before: an upper bound of its start
        while pend.deadline > put_at + ttl:  # else the body outlives the request as it is
            await asyncio.sleep(max(0.0, put_at + ttl * KEEP_EVERY - time.monotonic()))
            started = time.monotonic()
            try:
                await self.obj.put(rid, body)
            except Exception as exc:  # NATS away: again soon, within the two thirds of the TTL left
                self._log_error(f"could not put the body of {rid} again: {type(exc).__name__}: {exc}")
                await asyncio.sleep(ttl / 16)
                continue
            put_at = started
            self.bodies_refreshed += 1

    async def _delete_object(self, name: str) -> None:
        try:
            await self.obj.delete(name)
        except Exception as exc:  # the bucket's TTL removes it anyway
            log.warning("could not delete payload object %s: %s", name, exc)

    async def _on_reply(self, msg: Any) -> None:
        """A reply or a streamed piece for one of this daemon's requests (live, or
        read back from FLEET_REPLIES after a reconnect)."""
        h = msg.headers or {}
        rid = h.get(H_RID, "")
        if H_HELD_BY in h:
            self._note_holder(rid, h[H_HELD_BY], int(h.get(H_SEQ, 0)))
            return
        status = int(h.get(H_STATUS, STATUS_ERROR))
        if status == STATUS_PARTIAL:
            pend = self._pending.get(rid)
            if pend is not None and pend.on_partial is not None:
                pend.on_partial(Done(0, 0, STATUS_PARTIAL, msg.data))
            return
        if H_OBJECT in h:
            if rid in self._pending:
                self._spawn(self._resolve_from_object(rid, status, h[H_OBJECT]))
            else:
                self.duplicates += 1
            return
        self._resolve(rid, status, msg.data)

    async def _resolve_from_object(self, rid: str, status: int, name: str) -> None:
        """A reply too large for one message: its body is in the object store."""
        try:
            data = (await self.obj.get(name)).data
        except Exception as exc:  # the request answers `timeout` at its deadline
            self._log_error(f"could not read reply object {name}: {type(exc).__name__}: {exc}")
            return
        self._resolve(rid, status, data)
        await self._delete_object(name)

    def _resolve(self, rid: str, status: int, result: bytes) -> None:
        pend = self._pending.pop(rid, None)
        if pend is None or pend.fut.done():
            self.duplicates += 1  # invariant 2: answered already (or given up); drop it
            return
        pend.fut.set_result(Done(0, 0, status, result))

    def _note_holder(self, rid: str, holder: str, seq: int) -> None:
        """A box took one of this daemon's requests: watch that box's alive signal."""
        pend = self._pending.get(rid)
        if pend is not None:
            pend.holder, pend.seq = holder, seq
            self._alive[holder] = time.monotonic()  # the notice is a sign of life too

    def _republish_lapsed(self) -> None:
        """Publish again each waiting request whose holder has been quiet LAPSE_PERIODS alive
        periods (it died, or lost NATS): the copy goes to a live box now, not after the ack
        wait, so a request with a deadline shorter than 3 ack waits survives its holder.
        Judged only while this box has listened that long itself."""
        if not self.reachable:
            return
        now = time.monotonic()
        lapse = LAPSE_PERIODS * self._alive_period_s
        quiet = {h for h, at in self._alive.items() if now - max(at, self._listening_since) >= lapse}
        newly_quiet, self._quiet = quiet - self._quiet, quiet
        for rid, pend in list(self._pending.items()):
            if pend.holder in quiet and not pend.fut.done():
                self._republish_soon(rid, pend)
        if newly_quiet:
            self._spawn(self._republish_unannounced(now - self._alive_period_s))

    def _republish_soon(self, rid: str, pend: _Pending) -> None:
        if pend.attempt >= self.settings.nats_max_deliver:
            return  # as many tries as JetStream itself would give it: the deadline answers it
        holder, seq = pend.holder, pend.seq
        pend.holder, pend.attempt = "", pend.attempt + 1
        self._spawn(self._republish(rid, pend, holder, seq))

    async def _republish_unannounced(self, before: float) -> None:
        """A box went quiet: requests JetStream delivered (their sequence is at or under
        their consumer's last delivered one) whose holder never said so were, most likely,
        on their way to that box when it died (in its socket, not yet read). Queue them
        again too. One consumer_info per model; a live holder whose notice is late costs
        one duplicate run."""
        # By consumer: a batch line (on its model's batch subject) is delivered by the batch one.
        waiting: dict[str, list[tuple[str, _Pending]]] = {}
        for rid, pend in self._pending.items():
            if not pend.holder and pend.seq and not pend.fut.done() and pend.published_at < before:
                batch = pend.work_subject == batch_subject(pend.model)
                name = batch_consumer_name(pend.model) if batch else consumer_name(pend.model)
                waiting.setdefault(name, []).append((rid, pend))
        for name, requests in waiting.items():
            try:
                delivered = (await self.js.consumer_info(STREAM, name)).delivered.stream_seq
            except Exception as exc:  # JetStream away: the ack wait redelivers them
                self._log_error(f"could not read {name}: {type(exc).__name__}: {exc}")
                continue
            for rid, pend in requests:
                if not pend.holder and pend.seq <= delivered and not pend.fut.done():
                    self._republish_soon(rid, pend)

    async def _republish(self, rid: str, pend: _Pending, holder: str, seq: int) -> None:
        """Queue request `rid` again (a new message id, so JetStream's dedup lets it in;
        the same request id, so the first reply from any copy answers it), then delete the
        lapsed holder's message so JetStream does not redeliver it as well."""
        from nats.js.errors import APIError

        self.republished += 1
        self._log_error(f"request {rid} was held by {holder or 'a box'} that went quiet; queued it again")
        headers = {**pend.headers, H_MSG_ID: f"{rid}.{pend.attempt}", H_ATTEMPT: str(pend.attempt)}
        try:
            ack = await self._publish(pend.work_subject, pend.body, headers, pend.deadline)
            pend.seq, pend.published_at = ack.seq, time.monotonic()
            if seq:
                await self.js.delete_msg(STREAM, seq)
        except (FleetError, APIError) as exc:  # the deadline answers it; a deleted-already message is fine
            self._log_error(f"republishing request {rid}: {exc}")
        except Exception as exc:  # disconnected: the next lapse check or the ack wait tries again
            self._log_error(f"republishing request {rid}: {type(exc).__name__}: {exc}")

    async def _publish_cancel(self, rid: str) -> None:
        try:
            await self.nc.publish(CANCEL_SUBJECT, b"", headers={H_RID: rid})
        except Exception as exc:  # the deadline stops the work anyway
            self._log_error(f"could not send the cancel of {rid}: {exc}")

    async def _recover_replies(self) -> None:
        """After a reconnect: a core subscriber misses what is published while it is
        away, so every request still waiting reads its reply back from FLEET_REPLIES.
        One with none there is not answered yet: its work message is still in
        JetStream (held by a live box, or redelivered from a dead one)."""
        from nats.js.errors import NotFoundError

        for pend in list(self._pending.values()):
            if pend.fut.done():
                continue
            try:
                msg = await self.js.get_last_msg(REPLY_STREAM, pend.subject)
            except NotFoundError:
                continue
            except Exception as exc:  # disconnected again: the next reconnect reads them
                self._log_error(f"could not read back replies after a reconnect: {type(exc).__name__}: {exc}")
                return
            await self._on_reply(msg)

    # -- puller -------------------------------------------------------------------------

    def _sync_pullers(self, models: dict[str, str]) -> None:
        """One pull loop per model in this box's store (a model pulled later joins at the next beat)."""
        self._models = models
        if not self._pulling:
            return
        for name in models:
            for batch in (False, True):
                key = (name, batch)
                if key not in self._pullers or self._pullers[key].done():
                    self._pullers[key] = asyncio.create_task(
                        self._pull(name, batch=batch), name=f"nats-pull-{name}{BATCH_SUFFIX if batch else ''}")
        for key in list(self._pullers):
            if key[0] not in models:
                self._pullers.pop(key).cancel()

    async def _pull(self, model: str, *, batch: bool = False) -> None:
        """Fetch work for `model` (its batch work with `batch`: invariant 6) in amounts
        this box can take now, and serve it.

        1. Bind the model's durable consumer (declared here, shared by every box).
        2. Take credit from the box's one `FetchCredit` (invariant 3): one message
           while the model's subject is idle, all the room there is while it is busy.
        3. Idle: a long poll for one message (it returns as soon as one arrives).
           Busy: what is waiting now, up to the credit (FETCH_BURST_S at most).
        4. Give back the credit the fetch did not fill; serve each message in its
           own task (it waits in local_queue like any request).
        Batch work's credit is what interactive work leaves (`FetchCredit.take_spare`)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        name = batch_consumer_name(model) if batch else consumer_name(model)
        while not self._stopping:
            try:
                await self.js.add_consumer(STREAM, ConsumerConfig(
                    durable_name=name, filter_subject=batch_subject(model) if batch else work_subject(model),
                    ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                    ack_wait=self.settings.nats_ack_wait_ms / 1000.0, max_deliver=-1, max_ack_pending=-1,
                ))
                psub = await self.js.pull_subscribe_bind(name, STREAM)
                break
            except Exception as exc:  # NATS away: retry while reconnecting
                self._log_error(f"cannot bind the consumer for {model}: {exc}")
                await asyncio.sleep(1.0)
        else:
            return
        busy = False
        while not self._stopping:
            if batch:
                most = max(1, int(self.capacity * BATCH_CREDIT_SHARE))  # workers come and go
                taken = await self.credit.take_spare(self.capacity if busy else 1, most)
            else:
                taken = await self.credit.take(self.capacity if busy else 1)
            msgs: list[Any] = []
            failed = False
            try:
                msgs = await psub.fetch(taken, timeout=FETCH_BURST_S if busy else FETCH_POLL_S)
            except TimeoutError:  # nothing waiting (nats.errors.TimeoutError is one too)
                pass
            except Exception as exc:  # disconnected, or the server restarting
                self._log_error(f"fetch for {model} failed: {type(exc).__name__}: {exc}")
                failed = True
            finally:
                # A fetch may return more than asked (deliveries of an earlier, expired
                # pull request): they count too, so `used` stays exact.
                self.credit.give(taken - len(msgs), batch=batch)
            if failed:
                await asyncio.sleep(0.5)
            busy = bool(msgs)
            for msg in msgs:
                self._held[msg.metadata.sequence.stream] = msg
                task = asyncio.create_task(self._serve(model, msg, batch=batch))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)

    async def _serve(self, model: str, msg: Any, *, batch: bool = False) -> None:
        """Run one work message on this box, reply to its requester, then ack (invariant 1).
        Tell another box's requester who holds it (`_note_holder`); its cancel stops it."""
        rid = ""
        try:
            h = msg.headers or {}
            try:
                rid, reply_to = h[H_RID], h[H_REPLY_TO]
                tokens, deadline_ms = int(h[H_TOKENS]), int(h[H_DEADLINE])
                attempt = int(h.get(H_ATTEMPT, 1))
            except (KeyError, ValueError):
                log.warning("dropping a malformed work message (headers %s)", sorted(h))
                await msg.term()  # poison: nobody to answer
                return
            left = deadline_ms / 1000.0 - time.time()
            if left <= 0 or rid in self._cancelled:
                await msg.term()  # expired (its requester answered `timeout`), or its client went away
                return
            deadline = time.monotonic() + left
            # Deliveries of this copy, and of the copies before it (republished by the requester).
            delivered = msg.metadata.num_delivered + attempt - 1
            if delivered > self.settings.nats_max_deliver:
                await self._reply(reply_to, rid, STATUS_ERROR, _work_error(
                    "inference_failed", f"{model}: delivered {delivered} times and never "
                    "answered (boxes died running it); dropped so it cannot take down more boxes"), deadline)
                await msg.term()
                return
            self._running[rid] = asyncio.current_task()  # type: ignore[assignment]
            if self._is_mine(reply_to):
                self._note_holder(rid, self.holder_id, msg.metadata.sequence.stream)
            else:
                self._spawn(self.nc.publish(reply_to + PIECE_SUFFIX, b"", headers={
                    H_RID: rid, H_HELD_BY: self.holder_id, H_SEQ: str(msg.metadata.sequence.stream)}))
            payload = msg.data
            if H_OBJECT in h:
                try:
                    payload = (await asyncio.wait_for(self.obj.get(h[H_OBJECT]), OBJECT_READ_S)).data
                except Exception as exc:
                    from nats.js.errors import NotFoundError

                    if not isinstance(exc, NotFoundError):
                        # NATS trouble, or the body was put again under this read: try again
                        # later, maybe elsewhere.
                        self._log_error(f"reading the body of {rid} failed: {type(exc).__name__}: {exc}")
                        await msg.nak(delay=1.0)
                        return
                    await self._reply(reply_to, rid, STATUS_ERROR, _work_error(
                        "bad_request", f"{model}: the request body is gone from the object store"), deadline)
                    await msg.term()
                    return
            span = tracing.begin_remote(h, model, self.box)  # None unless tracing is on
            try:
                done = await self.broker.run(model, payload, tokens=tokens, timeout_s=left,
                                             on_partial=self._piece_sink(reply_to, rid), batch=batch)
            except Overloaded:
                await msg.nak(delay=1.0)  # this box is full now; another (or this one, later) takes it
                return
            except Timeout:
                await msg.term()  # past its deadline here: the requester answers `timeout`
                return
            except FleetError as exc:  # it can never run here (e.g. larger than the queue's slab)
                await self._reply(reply_to, rid, STATUS_ERROR, _work_error(exc.code, exc.message), deadline)
                await msg.term()
                return
            await self._reply(reply_to, rid, done.status, done.result, deadline)
            tracing.end_remote(span, done.result)
            self.served += 1
            if done.status == STATUS_POISON:
                await msg.term()  # it killed this box's workers max_attempts times: never redeliver
            else:
                await msg.ack()
        except asyncio.CancelledError:
            if rid not in self._cancelled:
                raise  # this box is leaving
            self.cancelled += 1
            await self._term_quietly(msg)  # its requester's client went away: never redeliver it
        except Exception as exc:  # connection trouble while replying/acking: ack_wait redelivers
            self._log_error(f"serving a work message for {model} failed: {exc}")
        finally:
            if self._running.get(rid) is asyncio.current_task():
                del self._running[rid]
            self._held.pop(msg.metadata.sequence.stream, None)
            self.credit.give(1, batch=batch)

    async def _term_quietly(self, msg: Any) -> None:
        try:
            await msg.term()
        except Exception as exc:  # the ack wait redelivers it; the cancel mark drops it then
            self._log_error(f"could not drop a cancelled work message: {exc}")

    async def _on_cancel(self, msg: Any) -> None:
        """A requester's client went away: stop its request here if this box runs it (the
        broker cancels its queue item, a generation leaves its batch at the next step), and
        drop it unrun if it is taken later."""
        rid = (msg.headers or {}).get(H_RID, "")
        if not rid:
            return
        self._cancelled[rid] = time.monotonic()
        task = self._running.get(rid)
        if task is not None:
            task.cancel()

    def _is_mine(self, reply_to: str) -> bool:
        return reply_to.startswith(self.reply_prefix)

    def _piece_sink(self, reply_to: str, rid: str) -> Callable[[Done], None]:
        """Where the streamed pieces of a work message go: this box's own waiter, or
        the requester's piece subject (core NATS, in order; not kept)."""
        if self._is_mine(reply_to):
            def to_waiter(done: Done) -> None:
                pend = self._pending.get(rid)
                if pend is not None and pend.on_partial is not None:
                    pend.on_partial(done)

            return to_waiter
        subject, headers = reply_to + PIECE_SUFFIX, {H_RID: rid, H_STATUS: str(STATUS_PARTIAL)}
        # Tasks start in creation order and each publish only appends to nats.py's
        # buffer, so pieces go out in order, and before the final reply.
        return lambda done: self._spawn(self.nc.publish(subject, done.result, headers=headers))

    async def _reply(self, reply_to: str, rid: str, status: int, result: bytes, deadline: float) -> None:
        """Hand a result to its requester: this box's own waiter directly; another box's
        through FLEET_REPLIES, stored (PubAck) before the caller acks (invariant 1), so
        it survives the requester's blip. Over max_payload, the body goes to the object store."""
        if self._is_mine(reply_to):
            self._resolve(rid, status, result)  # this box's own request: no NATS hop back
            return
        headers = {H_MSG_ID: rid + ".reply", H_RID: rid, H_STATUS: str(status)}
        if len(result) > self.nc.max_payload - HEADER_ROOM:
            name = rid + ".reply"
            await self._put_object(name, result, deadline)
            headers[H_OBJECT], result = name, b""
        await self._publish(reply_to, result, headers, deadline)

    async def _extend_loop(self) -> None:
        """Every ack_wait / 3, tell JetStream the held messages are still being worked
        on (`in_progress` restarts their ack timer), so live work is not redelivered
        while a dead box's is, within ack_wait."""
        period = self.settings.nats_ack_wait_ms / 3000.0
        while True:
            await asyncio.sleep(period)
            for msg in list(self._held.values()):
                try:
                    await msg.in_progress()
                except Exception as exc:
                    self._log_error(f"in_progress failed: {exc}")
                    break

    @property
    def _alive_period_s(self) -> float:
        return self.settings.nats_ack_wait_ms / 1000.0 / ALIVE_SHARE

    async def _alive_loop(self) -> None:
        """Every ack_wait / ALIVE_SHARE: say this box is alive (core NATS, a few bytes),
        republish requests whose holders went quiet, forget old cancels."""
        subject = ALIVE_PREFIX + self.holder_id
        while True:
            await asyncio.sleep(self._alive_period_s)
            if self.nc.is_connected:
                try:
                    await self.nc.publish(subject, b"")
                except Exception as exc:
                    self._log_error(f"alive signal failed: {exc}")
            self._republish_lapsed()
            await self._leave_server_without_jetstream()
            old = time.monotonic() - REPLY_TTL_S
            while self._cancelled and next(iter(self._cancelled.values())) < old:
                self._cancelled.pop(next(iter(self._cancelled)))
            for holder in [h for h, at in self._alive.items() if at < old]:
                del self._alive[holder]

    async def _leave_server_without_jetstream(self) -> None:
        """Connected, yet no JetStream call has gone through for JETSTREAM_LOST_ACK_WAITS
        ack waits (past any Raft election): this box's server is cut off from the cluster's
        majority. Reconnect elsewhere (`choose_server` avoids this one)."""
        lost_s = JETSTREAM_LOST_ACK_WAITS * self.settings.nats_ack_wait_ms / 1000.0
        if not self.nc.is_connected or time.monotonic() - self._jetstream_ok_at < lost_s:
            return
        log.warning("JetStream has not answered through NATS server %s for %.0f s (cut off from the "
                    "cluster's majority?): reconnecting to another server", self._server_here, lost_s)
        self._avoid_server = self._server_here
        self._jetstream_ok_at = time.monotonic()
        await self.nc.force_reconnect()

    def _next_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        """nats.py's reconnect_to_server_handler: `choose_server`, then connect after the wait it says."""
        return choose_server(servers, {self._avoid_server, self._server_here}, self._options["reconnect_time_wait"])

    async def _on_alive(self, msg: Any) -> None:
        self._alive[msg.subject[len(ALIVE_PREFIX):]] = time.monotonic()

    # -- heartbeat and cluster view ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.nats_heartbeat_ms / 1000.0)
            self.credit.wake()  # workers that came up since add room without anything given back
            try:
                await self._beat()
            except Exception as exc:
                self._log_error(f"heartbeat failed: {exc}")

    async def _beat(self) -> None:
        """Publish this box's entry, read everyone's, follow this box's store."""
        from nats.js.errors import NoKeysError

        models = await asyncio.to_thread(lambda: {m.name: m.task for m in self.store.list()})
        self._sync_pullers(models)
        await self._read_lag(models)
        await self.kv.put(self.key, _json(await self.entry()))
        self._jetstream_ok_at = time.monotonic()
        boxes: dict[str, dict[str, Any]] = {}
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            keys = []
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except Exception:  # expired between keys() and get()
                continue
            if entry.value:
                boxes[key] = _json_decode(entry.value)
        self._boxes = boxes

    async def _read_lag(self, models: dict[str, str]) -> None:
        """Each stored model's work in JetStream: not yet delivered to any box (pending) and
        delivered but not answered (unacked), from its consumer, for `on_lag`."""
        if self._on_lag is None:
            return
        for model in models:
            try:
                info = await self.js.consumer_info(STREAM, consumer_name(model))
            except Exception:  # not bound yet, or JetStream busy: the next heartbeat reads it
                continue
            self._on_lag(model, info.num_pending, info.num_ack_pending)

    async def entry(self) -> dict[str, Any]:
        """This box as others see it in `fleet_boxes`."""
        return {
            "box": self.box, "instance": self.instance, "url": self.settings.url, "pid": os.getpid(),
            "models": self._models, "loaded": sorted(await self._loaded()), "workers": self._workers_up(),
            "capacity": self.capacity, "held": len(self._held), "local_depth": self.broker.queue.depth(),
            "waiting": len(self._pending), "served": self.served, "duplicates": self.duplicates,
            "served_locally": self.served_locally, "reconnects": self.reconnects, "replicas": self.replicas,
            "republished": self.republished, "cancelled": self.cancelled,
            "bodies_refreshed": self.bodies_refreshed, "server": self._server_here,
            "at": time.time(),
        }

    def boxes(self) -> list[dict[str, Any]]:
        """Live boxes (heartbeat within 3 periods), this one first, then by name."""
        stale_s = 3 * self.settings.nats_heartbeat_ms / 1000.0
        now = time.time()
        live = [{**b, "age_s": round(now - b["at"], 1)} for b in self._boxes.values() if now - b["at"] < stale_s]
        return sorted(live, key=lambda b: (b["instance"] != self.instance, b["box"]))

    def check_model(self, model: str, task: str) -> None:
        """For a model this box does not store: some live box must, for `task`."""
        tasks = {b["models"][model] for b in self.boxes() if model in b["models"]}
        if not tasks:
            raise ModelNotFound(f"unknown model {model!r}: no box in the cluster has it")
        if task not in tasks:
            raise BadRequest(f"model {model!r} serves task {sorted(tasks)[0]!r}, not {task!r}")

    # -- connection events ---------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    def _log_error(self, text: str) -> None:
        # One line per 10 s: a NATS outage must not flood the log.
        now = time.monotonic()
        if now - self._last_error_log >= 10.0:
            self._last_error_log = now
            log.warning("%s", text)

    async def _on_error(self, exc: Exception) -> None:
        self._log_error(f"NATS: {type(exc).__name__}: {exc}")

    async def _on_disconnected(self) -> None:
        # Not listening until `_on_reconnected`: nats.py is connected again (reachable) a
        # round trip before it calls that, and nothing heard during the blip means no box is gone.
        self._listening_since = math.inf
        if not self._stopping:
            log.warning("disconnected from NATS; reconnecting (held and waiting requests are kept; "
                        "requests for this box's own models run here meanwhile)")

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        self._listening_since = self._jetstream_ok_at = time.monotonic()
        self._server_here = self.nc.connected_url.netloc if self.nc.connected_url else ""
        log.info("reconnected to NATS at %s", self.nc.connected_url.netloc if self.nc.connected_url else "?")
        self._spawn(self._recover_replies())

    async def _on_closed(self) -> None:
        if not self._stopping:
            log.error("the NATS connection is closed for good")


def _work_error(code: str, message: str) -> bytes:
    return _encode(Envelope(0.0, 0.0, "", WorkError(code, message)))
