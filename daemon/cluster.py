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
                                  again by its requester every third of its TTL (`Payloads.keep`)
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

The rooms (this module is their facade; the rest of the daemon sees only `Cluster`):
    cluster_names.py       the names above, the limits, the headers
    cluster_access.py      connection options, the start-time checks, where a reconnect goes
    cluster_link.py        the connection every room shares: identity, publishing until acked
    cluster_streams.py     declaring the shared streams and buckets, with their replicas
    cluster_requester.py   this daemon's requests: submit, replies, republishing lapsed ones
    cluster_puller.py      fetch credit, pull loops, serving and acking work messages
    cluster_heartbeats.py  alive signals, and this box's entry in `fleet_boxes`
    cluster_payloads.py    bodies and replies in the object store, kept past its TTL
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.config import Settings
from fleet.local_queue import Done
from fleet.store import Store

from fleet.daemon.broker import Answer, Broker
from fleet.daemon.cluster_access import (check_access, check_deadline, check_settings, choose_server, connect_options,
                                         refusal)
from fleet.daemon.cluster_heartbeats import Heartbeats, Liveness
from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import (ALIVE_PREFIX, BATCH_CREDIT_SHARE, CANCEL_SUBJECT, H_HELD_BY, PAYLOADS_BUCKET,
                                        REPLY_PREFIX, REPLY_STREAM, REPLY_TTL_S, STREAM, batch_consumer_name,
                                        batch_subject, box_token, consumer_name, log, token, work_subject)
from fleet.daemon.cluster_payloads import Payloads
from fleet.daemon.cluster_puller import FetchCredit, Puller
from fleet.daemon.cluster_requester import Requester
from fleet.daemon.cluster_streams import Streams, choose_replicas

#: What the rest of the daemon, `/metrics` and the tests import from here: the facade,
#: the start-time checks and the names of the shared streams (their rooms may move).
__all__ = [
    "BATCH_CREDIT_SHARE", "H_HELD_BY", "PAYLOADS_BUCKET", "REPLY_PREFIX", "REPLY_STREAM", "STREAM", "Cluster", "FetchCredit",
    "batch_consumer_name", "batch_subject", "box_token", "check_access", "check_deadline", "check_settings",
    "choose_replicas", "choose_server", "connect_options", "consumer_name", "refusal", "token", "work_subject",
]


class Cluster:
    """The NATS side of one daemon, as the rest of the daemon uses it: join and leave,
    `submit` a request to whichever box runs it, and the cluster's view of its boxes.

    It owns the connection's life (connect, declare, the loops, reconnects, leaving)
    and wires the rooms together; each room owns its own state: the requester its
    waiting requests, the puller the messages it holds, the heartbeats the boxes' entries."""

    def __init__(self, settings: Settings, broker: Broker, store: Store, *,
                 workers_up: Callable[[], int], loaded: Callable[[], Awaitable[set[str]]],
                 on_lag: Callable[[str, int, int], None] | None = None) -> None:
        #: Validated here, so bad auth/TLS settings fail `serve` at start, not in a task.
        self.link = Link(settings, connect_options(settings))
        self.broker = broker
        self.store = store
        self._workers_up = workers_up
        self._loaded = loaded
        self.payloads = Payloads(self.link)
        self.liveness = Liveness(self.link)
        self.requester = Requester(self.link, broker, self.payloads, self.liveness, self.local_lane)
        self.puller = Puller(self.link, broker, self.payloads, self.requester, lambda: self.capacity)
        #: `on_lag` gets (model, pending, unacked) of each model's work consumer at every
        #: heartbeat (the daemon's `fleet_nats_*_messages` gauges).
        self.heartbeats = Heartbeats(self.link, store, entry=self.entry, follow=self.puller.follow, on_lag=on_lag)
        self.streams = Streams(self.link)
        self.reconnects = 0
        self._left = False
        self._tasks: list[asyncio.Task] = []

    # -- what the daemon reads ----------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self.link.settings

    @property
    def box(self) -> str:
        return self.link.box

    @property
    def instance(self) -> str:
        return self.link.instance

    @property
    def nc(self) -> Any:
        return self.link.nc

    @property
    def js(self) -> Any:
        """The JetStream context now (it changes when the box moves to another server)."""
        return self.link.js

    @property
    def replicas(self) -> int:
        """Copies of the shared streams, as declared at the join."""
        return self.streams.replicas

    @property
    def credit(self) -> FetchCredit:
        return self.puller.credit

    @property
    def joined(self) -> bool:
        return self.link.joined.is_set()

    @property
    def reachable(self) -> bool:
        """Joined and connected now: requests can be queued in JetStream."""
        return self.link.reachable

    @property
    def capacity(self) -> int:
        return self.settings.nats_fetch_per_worker * max(1, self._workers_up())

    async def submit(self, model: str, task: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                     local: bool = False, on_partial: Callable[[Done], None] | None = None,
                     batch: bool = False) -> Answer:
        """`Requester.submit`: queue one request in JetStream, wait for the first reply."""
        return await self.requester.submit(model, task, payload, tokens=tokens, timeout_s=timeout_s, local=local,
                                           on_partial=on_partial, batch=batch)

    def boxes(self) -> list[dict[str, Any]]:
        """Live boxes (heartbeat within 3 periods), this one first, then by name."""
        return self.heartbeats.boxes()

    def check_model(self, model: str, task: str) -> None:
        """For a model this box does not store: some live box must, for `task`."""
        self.heartbeats.check_model(model, task)

    def base_of(self, adapter: str) -> str | None:
        """The base of a LoRA adapter some live box stores (None: none stores it as one)."""
        return self.heartbeats.base_of(adapter)

    def local_lane(self, model: str) -> str:
        """This box's lane for a model its store holds: its base's for a LoRA adapter."""
        return self.store.get(model).base or model

    async def entry(self) -> dict[str, Any]:
        """This box as others see it in `fleet_boxes`."""
        link, requester, puller = self.link, self.requester, self.puller
        return {
            "box": link.box, "instance": link.instance, "url": self.settings.url, "pid": os.getpid(),
            "models": puller.models, "bases": puller.bases, "decides": self.heartbeats.decides,
            "loaded": sorted(await self._loaded()),
            "workers": self._workers_up(),
            "capacity": self.capacity, "held": len(puller.held), "local_depth": self.broker.queue.depth(),
            "waiting": len(requester.pending), "served": puller.served, "duplicates": requester.duplicates,
            "served_locally": requester.served_locally, "reconnects": self.reconnects, "replicas": self.replicas,
            "republished": requester.republished, "cancelled": puller.cancelled,
            "bodies_refreshed": self.payloads.refreshed, "server": link.server_here,
            "at": time.time(),
        }

    # -- lifecycle ------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tasks.append(loop.create_task(self._join(), name="nats-join"))

    async def _join(self) -> None:
        """Connect (retrying until NATS answers), declare the shared names, start pulling."""
        import nats

        link = self.link
        link.nc = await nats.connect(
            **link.options, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected, closed_cb=self._on_closed,
            reconnect_to_server_handler=link.next_server,
        )
        link.js = link.nc.jetstream()
        link.server_here = link.nc.connected_url.netloc
        await link.nc.subscribe(link.reply_prefix + ">", cb=self.requester.on_reply)
        await link.nc.subscribe(ALIVE_PREFIX + ">", cb=self.liveness.on_alive)
        await link.nc.subscribe(CANCEL_SUBJECT, cb=self.puller.on_cancel)
        while True:
            try:
                self.heartbeats.kv, obj = await self.streams.declare()
                await self.payloads.bind(obj)
                await self.heartbeats.beat()
                break
            # Blind on purpose: JetStream not enabled, not permitted, or the server restarting,
            # and the first beat reads the store and the workers too; the join must not die.
            except Exception as exc:
                link.log_error(f"cannot set up JetStream on {self.settings.nats}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(2.0)
        self._tasks.append(asyncio.create_task(self.heartbeats.loop(self.puller.credit.wake), name="nats-heartbeat"))
        self._tasks.append(asyncio.create_task(self.puller.extend_loop(), name="nats-in-progress"))
        self._tasks.append(asyncio.create_task(self._alive_loop(), name="nats-alive"))
        link.joined.set()
        log.info("joined the NATS cluster at %s as %s (replies on %s*)", self.settings.nats, link.box,
                 link.reply_prefix)

    async def _alive_loop(self) -> None:
        """Every ack_wait / ALIVE_SHARE: say this box is alive (core NATS, a few bytes),
        republish requests whose holders went quiet, leave a server cut off from
        JetStream, forget old cancels and old holders."""
        while True:
            await asyncio.sleep(self.liveness.period_s)
            await self.liveness.say_alive()
            self.requester.republish_lapsed()
            await self.link.leave_server_without_jetstream()
            old = time.monotonic() - REPLY_TTL_S
            self.puller.forget_cancels(old)
            self.liveness.forget(old)

    def stop_pulling(self) -> None:
        """Draining (SIGTERM): fetch no new work; what this box holds still runs and is
        answered, and its own requests still wait for their replies."""
        self.puller.stop()

    async def leave(self) -> None:
        """Stop pulling, hand held messages back at once (nak: another box takes them
        now instead of after ack_wait), fail this box's waiters, close the connection.
        Idempotent: the drain bound and the shutdown may both call it."""
        if self._left:
            return
        self._left = True
        self.link.stopping = True
        self.puller.stop()
        for task in self._tasks:
            task.cancel()
        nc = self.link.nc
        if nc is None or nc.is_closed:
            return
        await self.puller.hand_back()
        for task in list(self.link.serving):
            task.cancel()
        self.requester.fail_waiting("daemon shutting down")
        await self.heartbeats.withdraw()
        await nc.close()

    # -- connection events ---------------------------------------------------------------

    async def _on_error(self, exc: Exception) -> None:
        self.link.log_error(f"NATS: {type(exc).__name__}: {exc}")

    async def _on_disconnected(self) -> None:
        # Not listening until `_on_reconnected`: nats.py is connected again (reachable) a
        # round trip before it calls that, and nothing heard during the blip means no box is gone.
        self.liveness.stop_listening()
        if not self.link.stopping:
            log.warning("disconnected from NATS; reconnecting (held and waiting requests are kept; "
                        "requests for this box's own models run here meanwhile)")

    async def _on_reconnected(self) -> None:
        link = self.link
        self.reconnects += 1
        now = time.monotonic()
        self.liveness.listen(now)
        link.jetstream_ok_at = now
        link.server_here = link.nc.connected_url.netloc if link.nc.connected_url else ""
        log.info("reconnected to NATS at %s", link.nc.connected_url.netloc if link.nc.connected_url else "?")
        link.spawn(self.requester.recover_replies())

    async def _on_closed(self) -> None:
        if not self.link.stopping:
            log.error("the NATS connection is closed for good")
