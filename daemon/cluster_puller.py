"""Several boxes: the puller, this box taking work from JetStream the way its workers
take it from `local_queue`.

Each model in this box's store gets two pull loops (interactive work and batch work,
invariant 6 of daemon/cluster.py) on the durable consumers every box holding the model
shares. They fetch only what the box can take now (one `FetchCredit` for the box,
invariant 3), hand each message to `local_queue` through `Broker.run`, reply to its
requester through FLEET_REPLIES, and ack only then (invariant 1). While a message is
held, `extend_loop` tells JetStream it is still being worked on; a requester's cancel
stops it. What the box holds is handed back at once when it leaves (`hand_back`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fleet.errors import FleetError, Overloaded, Timeout
from fleet.local_queue import STATUS_POISON, Done
from fleet.messages import STATUS_ERROR, STATUS_PARTIAL

from fleet.daemon import tracing
from fleet.daemon.broker import Broker
from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import (BATCH_CREDIT_POLL_S, BATCH_CREDIT_SHARE, BATCH_SUFFIX, FETCH_BURST_S,
                                        FETCH_POLL_S, H_ATTEMPT, H_DEADLINE, H_HELD_BY, H_MSG_ID, H_OBJECT,
                                        H_REPLY_TO, H_RID, H_SEQ, H_STATUS, H_TOKENS, HEADER_ROOM, PIECE_SUFFIX,
                                        STREAM, batch_consumer_name, batch_subject, consumer_name, log, nats_trouble,
                                        work_error, work_subject)
from fleet.daemon.cluster_payloads import Payloads
from fleet.daemon.cluster_requester import Requester


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


class Puller:
    """This box's pull loops, the work messages it holds, and the cancels it has heard."""

    def __init__(self, link: Link, broker: Broker, payloads: Payloads, requester: Requester,
                 capacity: Callable[[], int]) -> None:
        self.link = link
        self.broker = broker
        self.payloads = payloads
        self.requester = requester
        self._capacity = capacity
        self.credit = FetchCredit(capacity)
        #: Work messages this box holds (fetched, not answered), by stream sequence; the
        #: tasks serving them by request id (a requester's cancel stops one).
        self.held: dict[int, Any] = {}
        self._running: dict[str, asyncio.Task] = {}
        #: Request ids their requesters cancelled (a client went away), with when: a work
        #: message of one taken later is dropped unrun. Kept REPLY_TTL_S (past any deadline).
        self._cancels: dict[str, float] = {}
        self.pulling = True
        #: Pull loops by (model, batch work or not).
        self._pullers: dict[tuple[str, bool], asyncio.Task] = {}
        #: This box's stored models (name -> task), as the last heartbeat read them.
        self.models: dict[str, str] = {}
        #: Its LoRA adapters' bases (adapter -> base): an adapter's work runs in its base's lane.
        self.bases: dict[str, str] = {}
        self.served = 0
        self.cancelled = 0

    def follow(self, models: dict[str, str], bases: dict[str, str]) -> None:
        """One pull loop per model in this box's store (a model pulled later joins at the next beat).
        A LoRA adapter has its own (only a box storing the adapter takes its work), and its
        work runs in its base's lane, as a request made on this box would (`lane_of`)."""
        self.models, self.bases = models, bases
        if not self.pulling:
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

    def stop(self) -> None:
        """Fetch no new work; what this box holds still runs and is answered."""
        self.pulling = False
        for task in self._pullers.values():
            task.cancel()

    async def hand_back(self) -> None:
        """Nak every held message: another box takes it now instead of after the ack wait."""
        for msg in list(self.held.values()):
            try:
                await msg.nak()
            except nats_trouble() as exc:  # the connection may be down: ack_wait redelivers instead
                log.warning("could not hand back a held message: %s", exc)

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

        link = self.link
        name = batch_consumer_name(model) if batch else consumer_name(model)
        while not link.stopping:
            try:
                await link.js.add_consumer(STREAM, ConsumerConfig(
                    durable_name=name, filter_subject=batch_subject(model) if batch else work_subject(model),
                    ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                    ack_wait=link.settings.nats_ack_wait_ms / 1000.0, max_deliver=-1, max_ack_pending=-1,
                ))
                psub = await link.js.pull_subscribe_bind(name, STREAM)
                break
            except nats_trouble() as exc:  # NATS away: retry while reconnecting
                link.log_error(f"cannot bind the consumer for {model}: {exc}")
                await asyncio.sleep(1.0)
        else:
            return
        busy = False
        while not link.stopping:
            capacity = self._capacity()
            if batch:
                most = max(1, int(capacity * BATCH_CREDIT_SHARE))  # workers come and go
                taken = await self.credit.take_spare(capacity if busy else 1, most)
            else:
                taken = await self.credit.take(capacity if busy else 1)
            msgs: list[Any] = []
            failed = False
            try:
                msgs = await psub.fetch(taken, timeout=FETCH_BURST_S if busy else FETCH_POLL_S)
            except TimeoutError:  # nothing waiting (nats.errors.TimeoutError is one too)
                pass
            except nats_trouble() as exc:  # disconnected, or the server restarting
                link.log_error(f"fetch for {model} failed: {type(exc).__name__}: {exc}")
                failed = True
            finally:
                # A fetch may return more than asked (deliveries of an earlier, expired
                # pull request): they count too, so `used` stays exact.
                self.credit.give(taken - len(msgs), batch=batch)
            if failed:
                await asyncio.sleep(0.5)
            busy = bool(msgs)
            for msg in msgs:
                self.held[msg.metadata.sequence.stream] = msg
                link.spawn(self._serve(model, msg, batch=batch))

    def lane_of(self, model: str) -> str:
        """The local lane a work message for `model` queues in: its own, or its base's for a
        LoRA adapter (the worker holding the base attaches the adapter the request names)."""
        return self.bases.get(model, model)

    async def _serve(self, model: str, msg: Any, *, batch: bool = False) -> None:
        """Run one work message on this box, reply to its requester, then ack (invariant 1).
        Tell another box's requester who holds it (`Requester.note_holder`); its cancel stops it."""
        link = self.link
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
            if left <= 0 or rid in self._cancels:
                await msg.term()  # expired (its requester answered `timeout`), or its client went away
                return
            deadline = time.monotonic() + left
            # Deliveries of this copy, and of the copies before it (republished by the requester).
            delivered = msg.metadata.num_delivered + attempt - 1
            if delivered > link.settings.nats_max_deliver:
                await self._reply(reply_to, rid, STATUS_ERROR, work_error(
                    "inference_failed", f"{model}: delivered {delivered} times and never "
                    "answered (boxes died running it); dropped so it cannot take down more boxes"), deadline)
                await msg.term()
                return
            self._running[rid] = asyncio.current_task()  # type: ignore[assignment]
            if link.is_mine(reply_to):
                self.requester.note_holder(rid, link.holder_id, msg.metadata.sequence.stream)
            else:
                link.spawn(link.nc.publish(reply_to + PIECE_SUFFIX, b"", headers={
                    H_RID: rid, H_HELD_BY: link.holder_id, H_SEQ: str(msg.metadata.sequence.stream)}))
            payload = msg.data
            if H_OBJECT in h:
                from nats.js.errors import NotFoundError

                try:
                    payload = await self.payloads.read_body(h[H_OBJECT])
                except NotFoundError:
                    await self._reply(reply_to, rid, STATUS_ERROR, work_error(
                        "bad_request", f"{model}: the request body is gone from the object store"), deadline)
                    await msg.term()
                    return
                except nats_trouble() as exc:
                    # NATS trouble, or the body was put again under this read: try again
                    # later, maybe elsewhere.
                    link.log_error(f"reading the body of {rid} failed: {type(exc).__name__}: {exc}")
                    await msg.nak(delay=1.0)
                    return
            span = tracing.begin_remote(h, model, link.box)  # None unless tracing is on
            try:
                done = await self.broker.run(self.lane_of(model), payload, tokens=tokens, timeout_s=left,
                                             on_partial=self._piece_sink(reply_to, rid), batch=batch)
            except Overloaded:
                await msg.nak(delay=1.0)  # this box is full now; another (or this one, later) takes it
                return
            except Timeout:
                await msg.term()  # past its deadline here: the requester answers `timeout`
                return
            except FleetError as exc:  # it can never run here (e.g. larger than the queue's slab)
                await self._reply(reply_to, rid, STATUS_ERROR, work_error(exc.code, exc.message), deadline)
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
            if rid not in self._cancels:
                raise  # this box is leaving
            self.cancelled += 1
            await self._term_quietly(msg)  # its requester's client went away: never redeliver it
        # Replying gave up at the deadline (a FleetError), or the connection failed while
        # replying or acking: the ack wait redelivers it.
        except (FleetError, *nats_trouble()) as exc:
            link.log_error(f"serving a work message for {model} failed: {exc}")
        finally:
            if self._running.get(rid) is asyncio.current_task():
                del self._running[rid]
            self.held.pop(msg.metadata.sequence.stream, None)
            self.credit.give(1, batch=batch)

    async def _term_quietly(self, msg: Any) -> None:
        try:
            await msg.term()
        except nats_trouble() as exc:  # the ack wait redelivers it; the cancel mark drops it then
            self.link.log_error(f"could not drop a cancelled work message: {exc}")

    async def on_cancel(self, msg: Any) -> None:
        """A requester's client went away: stop its request here if this box runs it (the
        broker cancels its queue item, a generation leaves its batch at the next step), and
        drop it unrun if it is taken later."""
        rid = (msg.headers or {}).get(H_RID, "")
        if not rid:
            return
        self._cancels[rid] = time.monotonic()
        task = self._running.get(rid)
        if task is not None:
            task.cancel()

    def forget_cancels(self, before: float) -> None:
        """Drop cancel marks older than `before` (monotonic s; marks are kept in order)."""
        while self._cancels and next(iter(self._cancels.values())) < before:
            self._cancels.pop(next(iter(self._cancels)))

    def _piece_sink(self, reply_to: str, rid: str) -> Callable[[Done], None]:
        """Where the streamed pieces of a work message go: this box's own waiter, or
        the requester's piece subject (core NATS, in order; not kept)."""
        if self.link.is_mine(reply_to):
            return lambda done: self.requester.partial(rid, done)
        subject, headers = reply_to + PIECE_SUFFIX, {H_RID: rid, H_STATUS: str(STATUS_PARTIAL)}
        # Tasks start in creation order and each publish only appends to nats.py's
        # buffer, so pieces go out in order, and before the final reply.
        return lambda done: self.link.spawn(self.link.nc.publish(subject, done.result, headers=headers))

    async def _reply(self, reply_to: str, rid: str, status: int, result: bytes, deadline: float) -> None:
        """Hand a result to its requester: this box's own waiter directly; another box's
        through FLEET_REPLIES, stored (PubAck) before the caller acks (invariant 1), so
        it survives the requester's blip. Over max_payload, the body goes to the object store."""
        if self.link.is_mine(reply_to):
            self.requester.resolve(rid, status, result)  # this box's own request: no NATS hop back
            return
        headers = {H_MSG_ID: rid + ".reply", H_RID: rid, H_STATUS: str(status)}
        if len(result) > self.link.nc.max_payload - HEADER_ROOM:
            name = rid + ".reply"
            await self.payloads.put(name, result, deadline)
            headers[H_OBJECT], result = name, b""
        await self.link.publish(reply_to, result, headers, deadline)

    async def extend_loop(self) -> None:
        """Every ack_wait / 3, tell JetStream the held messages are still being worked
        on (`in_progress` restarts their ack timer), so live work is not redelivered
        while a dead box's is, within ack_wait."""
        period = self.link.settings.nats_ack_wait_ms / 3000.0
        while True:
            await asyncio.sleep(period)
            for msg in list(self.held.values()):
                try:
                    await msg.in_progress()
                except nats_trouble() as exc:
                    self.link.log_error(f"in_progress failed: {exc}")
                    break
