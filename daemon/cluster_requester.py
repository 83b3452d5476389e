"""Several boxes: the requester, this daemon's side of the requests it queues in JetStream.

`submit` publishes a request on its model's work subject and waits for the first reply
from any box (invariant 2 of daemon/cluster.py: a later one is a duplicate, dropped).
While it waits it watches who holds the request: a holder that goes quiet (its alive
signal, `Liveness`) gets the request queued again under a new message id, and a box
that went quiet before saying it held anything gets the requests JetStream delivered
to it queued again too. After a reconnect it reads the replies it may have missed back
from FLEET_REPLIES. The puller calls `resolve` and `note_holder` for this daemon's own
requests, which skip the NATS hop back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.errors import FleetError, Timeout, Unavailable
from fleet.local_queue import Done
from fleet.messages import STATUS_ERROR, STATUS_PARTIAL

from fleet.daemon import timeline, tracing
from fleet.daemon.broker import Answer, Broker
from fleet.daemon.cluster_heartbeats import Liveness
from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import (CANCEL_SUBJECT, H_ATTEMPT, H_DEADLINE, H_HELD_BY, H_MODEL, H_MSG_ID, H_OBJECT,
                                        H_REPLY_TO, H_RID, H_SEQ, H_STATUS, H_TASK, H_TOKENS, HEADER_ROOM, REPLY_STREAM,
                                        STREAM, batch_consumer_name, batch_subject, consumer_name, nats_trouble,
                                        work_subject)
from fleet.daemon.cluster_payloads import Payloads


@dataclass
class Pending:
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


class Requester:
    """This daemon's requests in JetStream, by request id, until each is answered once."""

    def __init__(self, link: Link, broker: Broker, payloads: Payloads, liveness: Liveness,
                 lane_of: Callable[[str], str]) -> None:
        self.link = link
        #: This box's lane for a model it stores (a LoRA adapter's is its base's): where
        #: `_run_here` queues a request published under the model's own name.
        self.lane_of = lane_of
        self.broker = broker
        self.payloads = payloads
        self.liveness = liveness
        self.pending: dict[str, Pending] = {}
        self._ids = itertools.count(1)
        self.duplicates = 0
        self.served_locally = 0
        self.republished = 0

    async def submit(self, model: str, task: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                     local: bool = False, on_partial: Callable[[Done], None] | None = None,
                     batch: bool = False) -> Answer:
        """Queue one request in JetStream and wait for the first reply from any box.

        `local`: this box stores the model, so while NATS is unreachable (not joined
        yet, disconnected, or gone while queueing) it runs in this box's own queue
        instead (invariant 5). `on_partial` gets streamed pieces, from whichever box
        runs the request, in order; a piece lost on the way is filled in by the final reply.
        `batch`: a job's line (daemon.batches), batch work (invariant 6)."""
        link = self.link
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if local and not link.reachable:
            return await self._run_here(model, payload, tokens, deadline, on_partial, batch)
        if not link.joined.is_set():
            try:
                await asyncio.wait_for(link.joined.wait(), timeout_s)
            except TimeoutError:
                raise Timeout(f"{model}: not joined to the NATS cluster at {link.settings.nats} yet") from None
        n = next(self._ids)
        rid, reply_to = f"{link.key}-{link.instance}-{n}", f"{link.reply_prefix}{n}"
        body = payload if type(payload) is bytes else bytes(payload)
        headers = {
            H_MSG_ID: rid, H_RID: rid, H_MODEL: model, H_TASK: task, H_TOKENS: str(tokens),
            H_DEADLINE: str(int((time.time() + timeout_s) * 1000)), H_REPLY_TO: reply_to,
            **tracing.headers(),  # W3C traceparent: the box that runs it continues the trace
        }
        # Over the threshold, or over what this server accepts in one message (max_payload, 1 MiB by default).
        large = len(body) > min(link.settings.nats_large_payload_bytes, link.nc.max_payload - HEADER_ROOM)
        big = body
        if large:
            await self.payloads.put(rid, body, deadline)
            headers[H_OBJECT], body = rid, b""
        fut: asyncio.Future[Done] = asyncio.get_running_loop().create_future()
        subject = batch_subject(model) if batch else work_subject(model)
        pend = self.pending[rid] = Pending(fut, reply_to, on_partial, model, subject, body, headers, deadline)
        # A deadline past the object's expiry (a batch line): this box keeps the body in the store.
        ttl = self.payloads.ttl_s
        keeper = asyncio.create_task(self.payloads.keep(rid, big, deadline)) \
            if large and ttl and deadline > time.monotonic() + ttl else None
        try:
            ack = await link.publish(subject, body, headers, deadline, offline_gives_up=local)
            if ack is None:
                self.pending.pop(rid, None)
                return await self._run_here(model, payload, tokens, deadline, on_partial, batch)
            pend.seq, pend.published_at = pend.seq or ack.seq, time.monotonic()
            timeline.stamp("published")
            done = await asyncio.wait_for(fut, deadline - time.monotonic())
            timeline.stamp("collected")
        except TimeoutError:
            raise Timeout(f"{model}: no answer from the cluster within {timeout_s * 1000:.0f} ms") from None
        except asyncio.CancelledError:
            # The client went away (a stream closed): whichever box runs it stops (`Puller.on_cancel`).
            link.spawn(self._publish_cancel(rid))
            raise
        finally:
            self.pending.pop(rid, None)
            if keeper is not None:
                keeper.cancel()
            if large:
                link.spawn(self.payloads.delete(rid))
        answer = self.broker.answer(model, done)
        # Waiting, as the client sees it, includes the NATS hops and the time in JetStream.
        waited_ms = (time.monotonic() - t0) * 1000.0 - answer.inference_ms
        return dataclasses.replace(answer, queue_ms=max(answer.queue_ms, waited_ms))

    async def _run_here(self, model: str, payload: bytes | memoryview, tokens: int, deadline: float,
                        on_partial: Callable[[Done], None] | None, batch: bool = False) -> Answer:
        """NATS is unreachable and this box stores the model: its own queue runs the request."""
        self.served_locally += 1
        return self.broker.answer(model, await self.broker.run(
            self.lane_of(model), payload, tokens=tokens, timeout_s=max(0.001, deadline - time.monotonic()),
            on_partial=on_partial, batch=batch))

    # -- replies ----------------------------------------------------------------------

    async def on_reply(self, msg: Any) -> None:
        """A reply or a streamed piece for one of this daemon's requests (live, or
        read back from FLEET_REPLIES after a reconnect)."""
        h = msg.headers or {}
        rid = h.get(H_RID, "")
        if H_HELD_BY in h:
            self.note_holder(rid, h[H_HELD_BY], int(h.get(H_SEQ, 0)))
            return
        status = int(h.get(H_STATUS, STATUS_ERROR))
        if status == STATUS_PARTIAL:
            pend = self.pending.get(rid)
            if pend is not None and pend.on_partial is not None:
                pend.on_partial(Done(0, 0, STATUS_PARTIAL, msg.data))
            return
        if H_OBJECT in h:
            if rid in self.pending:
                self.link.spawn(self._resolve_from_object(rid, status, h[H_OBJECT]))
            else:
                self.duplicates += 1
            return
        self.resolve(rid, status, msg.data)

    async def _resolve_from_object(self, rid: str, status: int, name: str) -> None:
        """A reply too large for one message: its body is in the object store."""
        try:
            data = await self.payloads.read(name)
        except nats_trouble() as exc:  # the request answers `timeout` at its deadline
            self.link.log_error(f"could not read reply object {name}: {type(exc).__name__}: {exc}")
            return
        self.resolve(rid, status, data)
        await self.payloads.delete(name)

    def resolve(self, rid: str, status: int, result: bytes) -> None:
        pend = self.pending.pop(rid, None)
        if pend is None or pend.fut.done():
            self.duplicates += 1  # invariant 2: answered already (or given up); drop it
            return
        pend.fut.set_result(Done(0, 0, status, result))

    def partial(self, rid: str, done: Done) -> None:
        """A streamed piece of this daemon's own request, run on this box."""
        pend = self.pending.get(rid)
        if pend is not None and pend.on_partial is not None:
            pend.on_partial(done)

    async def recover_replies(self) -> None:
        """After a reconnect: a core subscriber misses what is published while it is
        away, so every request still waiting reads its reply back from FLEET_REPLIES.
        One with none there is not answered yet: its work message is still in
        JetStream (held by a live box, or redelivered from a dead one)."""
        from nats.js.errors import NotFoundError

        for pend in list(self.pending.values()):
            if pend.fut.done():
                continue
            try:
                msg = await self.link.js.get_last_msg(REPLY_STREAM, pend.subject)
            except NotFoundError:
                continue
            except nats_trouble() as exc:  # disconnected again: the next reconnect reads them
                self.link.log_error(f"could not read back replies after a reconnect: {type(exc).__name__}: {exc}")
                return
            await self.on_reply(msg)

    def fail_waiting(self, why: str) -> None:
        """Answer every waiting request `unavailable` (this daemon is leaving)."""
        for pend in self.pending.values():
            if not pend.fut.done():
                pend.fut.set_exception(Unavailable(why))

    # -- holders ----------------------------------------------------------------------

    def note_holder(self, rid: str, holder: str, seq: int) -> None:
        """A box took one of this daemon's requests: watch that box's alive signal."""
        pend = self.pending.get(rid)
        if pend is not None:
            pend.holder, pend.seq = holder, seq
            self.liveness.heard(holder)  # the notice is a sign of life too

    def republish_lapsed(self) -> None:
        """Publish again each waiting request whose holder has been quiet LAPSE_PERIODS alive
        periods (it died, or lost NATS): the copy goes to a live box now, not after the ack
        wait, so a request with a deadline shorter than 3 ack waits survives its holder.
        Judged only while this box has listened that long itself."""
        if not self.link.reachable:
            return
        now = time.monotonic()
        quiet, newly_quiet = self.liveness.judge(now)
        for rid, pend in list(self.pending.items()):
            if pend.holder in quiet and not pend.fut.done():
                self._republish_soon(rid, pend)
        if newly_quiet:
            self.link.spawn(self._republish_unannounced(now - self.liveness.period_s))

    def _republish_soon(self, rid: str, pend: Pending) -> None:
        if pend.attempt >= self.link.settings.nats_max_deliver:
            return  # as many tries as JetStream itself would give it: the deadline answers it
        holder, seq = pend.holder, pend.seq
        pend.holder, pend.attempt = "", pend.attempt + 1
        self.link.spawn(self._republish(rid, pend, holder, seq))

    async def _republish_unannounced(self, before: float) -> None:
        """A box went quiet: requests JetStream delivered (their sequence is at or under
        their consumer's last delivered one) whose holder never said so were, most likely,
        on their way to that box when it died (in its socket, not yet read). Queue them
        again too. One consumer_info per model; a live holder whose notice is late costs
        one duplicate run."""
        # By consumer: a batch line (on its model's batch subject) is delivered by the batch one.
        waiting: dict[str, list[tuple[str, Pending]]] = {}
        for rid, pend in self.pending.items():
            if not pend.holder and pend.seq and not pend.fut.done() and pend.published_at < before:
                batch = pend.work_subject == batch_subject(pend.model)
                name = batch_consumer_name(pend.model) if batch else consumer_name(pend.model)
                waiting.setdefault(name, []).append((rid, pend))
        for name, requests in waiting.items():
            try:
                delivered = (await self.link.js.consumer_info(STREAM, name)).delivered.stream_seq
            except nats_trouble() as exc:  # JetStream away: the ack wait redelivers them
                self.link.log_error(f"could not read {name}: {type(exc).__name__}: {exc}")
                continue
            for rid, pend in requests:
                if not pend.holder and pend.seq <= delivered and not pend.fut.done():
                    self._republish_soon(rid, pend)

    async def _republish(self, rid: str, pend: Pending, holder: str, seq: int) -> None:
        """Queue request `rid` again (a new message id, so JetStream's dedup lets it in;
        the same request id, so the first reply from any copy answers it), then delete the
        lapsed holder's message so JetStream does not redeliver it as well."""
        from nats.js.errors import APIError

        self.republished += 1
        self.link.log_error(f"request {rid} was held by {holder or 'a box'} that went quiet; queued it again")
        headers = {**pend.headers, H_MSG_ID: f"{rid}.{pend.attempt}", H_ATTEMPT: str(pend.attempt)}
        try:
            ack = await self.link.publish(pend.work_subject, pend.body, headers, pend.deadline)
            pend.seq, pend.published_at = ack.seq, time.monotonic()
            if seq:
                await self.link.js.delete_msg(STREAM, seq)
        except (FleetError, APIError) as exc:  # the deadline answers it; a deleted-already message is fine
            self.link.log_error(f"republishing request {rid}: {exc}")
        except nats_trouble() as exc:  # disconnected: the next lapse check or the ack wait tries again
            self.link.log_error(f"republishing request {rid}: {type(exc).__name__}: {exc}")

    async def _publish_cancel(self, rid: str) -> None:
        try:
            await self.link.nc.publish(CANCEL_SUBJECT, b"", headers={H_RID: rid})
        except nats_trouble() as exc:  # the deadline stops the work anyway
            self.link.log_error(f"could not send the cancel of {rid}: {exc}")
