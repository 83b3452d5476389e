"""The daemon's side of `local_queue`: put requests in, route results back.

One `Broker` per daemon. The event loop calls `submit`, and collects
finished items itself: it watches the queue's results descriptor
(`LocalQueue.results_fd`, readable when a worker acked) and takes them all at
each wake-up; no thread stands between a worker's ack and the waiting
request (one hop less per request than a collector thread). Each request id has at
most one waiter, removed when it is answered or times out, so a late or
duplicate result finds nobody and is dropped: no request is answered twice.

The loop never waits for the queue's cross-process lock: it tries it
(`LocalQueue.no_wait`) and, when another thread or process holds it, hands
the call to the broker's queue thread (puts, lanes, cancels, and the reads
behind readiness, `/v1/ps` and the admin routes: `Daemon.workers`) or tries
again a millisecond later (the gauges' reads, which must stay on the loop).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from fleet.errors import FleetError, InferenceFailed, Overloaded, PayloadTooLarge, Timeout, from_code
from fleet.messages import STATUS_OK, STATUS_PARTIAL, WORKER_STAGES, EnvelopeIn, WorkError
from fleet.daemon.timeline import STAMPS
from fleet.local_queue import STATUS_EXPIRED, STATUS_POISON, Done, ItemTooLarge, LocalQueue, LockBusy, QueueError, QueueFull

log = logging.getLogger("fleet.daemon")

T = TypeVar("T")

#: How long the loop keeps retrying a lock it must not wait for (gauge reads), in
#: READ_RETRY_S steps, before it gives up until the next read.
READ_RETRY_S, READ_GIVE_UP_S = 0.001, 0.05
#: A collect that failed is tried again after this long.
RETRY_COLLECT_S = 0.01

_envelope = msgspec.msgpack.Decoder(EnvelopeIn)
_work_error = msgspec.msgpack.Decoder(WorkError)


@dataclass(frozen=True, slots=True)
class Answer:
    """A successful result: the task's encoded result plus where and how long."""

    body: msgspec.Raw
    queue_ms: float
    inference_ms: float
    served_by: str
    #: The batch it ran in (fleet.messages.Envelope): inputs, tokenizer tokens, LoRA
    #: adapters mixed in, and its size in the daemon's token estimate (daemon.pieces).
    batch_items: int = 0
    batch_tokens: int = 0
    loras: tuple[str, ...] = ()
    batch_estimate: int = 0
    #: Queue items the request ran as (daemon.pieces: a large request is cut into pieces).
    pieces: int = 1


class Broker:
    def __init__(self, queue: LocalQueue, *, max_depth: int, max_attempts: int, batch_max_wait_ms: int = 0) -> None:
        self.queue = queue
        self.max_depth = max_depth
        self.max_attempts = max_attempts
        #: Batch work queued longer than this is promoted to interactive (0: never).
        self.batch_max_wait_ms = batch_max_wait_ms
        #: request id -> (queue item, put at: monotonic ns) of batch work still queued or running.
        self._batch_items: dict[int, tuple[int, int]] = {}
        self._promoting: asyncio.Task | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Done]] = {}
        #: request id -> where its partial results go (streaming requests only).
        self._partials: dict[int, Callable[[Done], None]] = {}
        #: request id -> (its queue item, its lane) (so a shutdown can take unclaimed ones back out).
        self._items: dict[int, tuple[int, str]] = {}
        #: Told of each item withdrawn (`cancel`), on the loop: (lane, whether it left its lane unrun).
        self.on_withdrawn: Callable[[str, bool], None] | None = None
        self._lanes: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        #: A collect handed to the queue thread (the lock was busy), and whether
        #: the descriptor woke again meanwhile.
        self._collecting: asyncio.Future | None = None
        self._again = False
        #: When results were last collected (CLOCK_MONOTONIC ns).
        self.collected_ns = 0
        #: Runs the queue calls the loop found the lock busy for, one at a time, in order.
        self._queue_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue")

    # -- lifecycle (called from the app's lifespan) ----------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.queue.results_fd(), self._on_results)
        self._reading = True
        self._on_results()  # arms the wake-up (and takes anything already done)
        if self.batch_max_wait_ms > 0:
            self._promoting = loop.create_task(self.promote_loop())

    def stop(self) -> None:
        if self._promoting is not None:
            self._promoting.cancel()
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.queue.results_fd())  # type: ignore[union-attr]
        self._queue_thread.shutdown(wait=True)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(FleetError("daemon shutting down"))
        self._waiting.clear()

    def fail_waiting(self, exc: FleetError) -> int:
        """Answer every waiting request with `exc` now (the shutdown bound): items not
        yet claimed leave their lanes, so no worker runs them; claimed ones finish and
        their results are dropped on arrival. Returns the requests answered."""
        failed = 0
        for request_id, fut in list(self._waiting.items()):
            item = self._items.get(request_id)
            if item is not None:
                self.cancel(*item)
            if not fut.done():
                fut.set_exception(exc)
                failed += 1
        return failed

    @property
    def running(self) -> bool:
        return self._reading

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    # -- the queue lock, from the loop -------------------------------------------

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` (a queue call) now if the queue lock is free, else on
        the queue thread: the loop itself never waits for the lock."""
        try:
            with self.queue.no_wait():
                return fn(*args, **kwargs)
        except LockBusy:
            return await self._loop.run_in_executor(  # type: ignore[union-attr]
                self._queue_thread, functools.partial(fn, *args, **kwargs))

    def cancel(self, item_id: int, lane: str) -> None:
        """Withdraw a queue item of `lane`, now or soon (on the queue thread when the lock
        is busy), and tell `on_withdrawn`."""
        try:
            with self.queue.no_wait():
                self._withdrawn(lane, self.queue.cancel(item_id))
        except LockBusy:
            self._queue_thread.submit(self.queue.cancel, item_id).add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None
                or self._loop.call_soon_threadsafe(self._withdrawn, lane, f.result()))  # type: ignore[union-attr]

    def _withdrawn(self, lane: str, unrun: bool) -> None:
        if self.on_withdrawn is not None:
            self.on_withdrawn(lane, unrun)

    async def read(self, fn: Callable[[], object]) -> bool:
        """Run `fn` (reads of the queue that must stay on the loop, like the gauges'
        bookkeeping) as soon as the lock is free, retrying each READ_RETRY_S; False
        if it stayed busy for READ_GIVE_UP_S (the next read catches up)."""
        for _ in range(int(READ_GIVE_UP_S / READ_RETRY_S)):
            try:
                with self.queue.no_wait():
                    fn()
                return True
            except LockBusy:
                await asyncio.sleep(READ_RETRY_S)
        return False

    # -- request path -----------------------------------------------------------

    async def lane(self, model: str) -> int:
        lane = self._lanes.get(model)
        if lane is None:
            try:
                lane = self._lanes[model] = await self.call(self.queue.lane_id, model)
            except QueueFull as exc:
                raise Overloaded(f"no free lane for {model!r}: {exc}") from None
        return lane

    async def submit(self, model: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                     on_partial: Callable[[Done], None] | None = None, batch: bool = False, flow: int = 0) -> Answer:
        """Queue one work item and wait for its result (or raise its error)."""
        return self.answer(model, await self.run(model, payload, tokens=tokens, timeout_s=timeout_s,
                                                 on_partial=on_partial, batch=batch, flow=flow))

    async def run(self, model: str, payload: bytes | memoryview, *, tokens: int, timeout_s: float,
                  on_partial: Callable[[Done], None] | None = None, batch: bool = False, flow: int = 0) -> Done:
        """Queue one work item and wait for its raw result, as the worker wrote it.
        Raises only for what happened on this box's side (queue full, no answer in time);
        the NATS bridge forwards the `Done` to the requesting box as it is.
        `on_partial` gets the item's partial results (STATUS_PARTIAL), on the loop,
        in order, all of them before the final result resolves. `batch`: the item is
        batch work (local_queue invariant 2: behind its lane's interactive work),
        promoted to interactive once queued `batch_max_wait_ms` (`promote_loop`).
        `flow`: the client it comes from (daemon.clients), its fair share of the lane."""
        if self.queue.depth() >= self.max_depth:
            raise Overloaded(f"queue is full ({self.max_depth} items waiting); retry shortly", retry_after_s=1.0)
        lane = await self.lane(model)
        request_id = next(self._ids)
        deadline_ns = time.monotonic_ns() + int(timeout_s * 1e9)
        fut: asyncio.Future[Done] = self._loop.create_future()  # type: ignore[union-attr]
        self._waiting[request_id] = fut
        if on_partial is not None:
            self._partials[request_id] = on_partial
        try:
            item_id = await self.put(model, lane, payload, tokens=tokens, request_id=request_id,
                                     deadline_ns=deadline_ns, batch=batch, flow=flow)
        except BaseException as exc:
            del self._waiting[request_id]
            self._partials.pop(request_id, None)
            if isinstance(exc, ItemTooLarge):
                raise PayloadTooLarge(exc.message) from None
            if isinstance(exc, QueueError):
                raise Overloaded(f"queue memory is full: {exc}; retry shortly", retry_after_s=1.0) from None
            raise
        self._items[request_id] = (item_id, model)
        if batch:
            self._batch_items[request_id] = (item_id, time.monotonic_ns())
        if (stamps := STAMPS.get()) is not None:  # (daemon.timeline)
            stamps.append(("put", time.monotonic_ns()))
        try:
            done = await asyncio.wait_for(fut, timeout_s)
            if stamps is not None:
                stamps += (("collected", self.collected_ns), ("resumed", time.monotonic_ns()))
        except TimeoutError:
            # Not started yet: drop it from its lane. Started: its worker stops at its next
            # step (a generation) or finishes, and the result is dropped on arrival.
            self.cancel(item_id, model)
            raise Timeout(f"{model}: no answer within {timeout_s * 1000:.0f} ms") from None
        except asyncio.CancelledError:
            self.cancel(item_id, model)  # the client went away (daemon.departures): the same
            raise
        finally:
            self._waiting.pop(request_id, None)
            self._partials.pop(request_id, None)
            self._items.pop(request_id, None)
            self._batch_items.pop(request_id, None)
        return done

    async def put(self, model: str, lane: int, payload: bytes | memoryview, **kwargs) -> int:
        """`LocalQueue.put` as `call` makes it. Cancelled while the queue thread puts (the
        client left meanwhile): the item, once put, is withdrawn, so it never runs unwanted."""
        try:
            return self.queue.put(lane, payload, wait=False, **kwargs)
        except LockBusy:
            pass
        fut = self._loop.run_in_executor(  # type: ignore[union-attr]
            self._queue_thread, functools.partial(self.queue.put, lane, payload, **kwargs))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.cancel(f.result(), model))
            raise

    async def promote_loop(self) -> None:
        """Batch work's starvation bound: every quarter of `batch_max_wait_ms`, batch
        items queued longer than that become interactive at their enqueue time
        (`LocalQueue.promote`; claimed or answered ones are skipped there), so batch
        work waits at most about 1.25 x the bound behind interactive work."""
        bound_ns = self.batch_max_wait_ms * 1_000_000
        while True:
            await asyncio.sleep(self.batch_max_wait_ms / 4000.0)
            now = time.monotonic_ns()
            due = [rid for rid, (_, at) in self._batch_items.items() if now - at > bound_ns]
            if not due:
                continue
            items = [self._batch_items.pop(rid)[0] for rid in due]
            try:
                await self.call(self.queue.promote, items)
            except Exception:  # the bound is best effort; the next round tries the rest
                log.exception("promoting %d batch items failed", len(items))

    def answer(self, model: str, done: Done) -> Answer:
        """The client's answer from a raw result (here, or from the box that ran it)."""
        if done.status == STATUS_EXPIRED:
            raise Timeout(f"{model}: the request's deadline passed before a worker took it")
        if done.status == STATUS_POISON:
            raise InferenceFailed(
                f"{model}: the request was running on a worker that died {self.max_attempts} times; "
                "it was dropped so it cannot crash more workers"
            )
        env = _envelope.decode(done.result)
        if (stamps := STAMPS.get()) is not None:  # the worker's stamps (zeros: stages it did not stamp)
            stamps += ((stage, ns) for stage, ns in zip(WORKER_STAGES, env.stamps) if ns)
        if done.status != STATUS_OK:
            err = _work_error.decode(env.body)
            raise from_code(err.code, err.message)
        return Answer(env.body, env.queue_ms, env.inference_ms, env.served_by, env.batch_items, env.batch_tokens,
                      env.loras, env.batch_estimate)

    # -- results ------------------------------------------------------------------

    def _on_results(self) -> None:
        """The results descriptor woke (or the broker starts): collect on the loop when
        the queue lock is free, else on the queue thread (one at a time; a wake-up
        meanwhile collects again after it)."""
        if self._collecting is not None:
            self._again = True
            return
        try:
            done = self.queue.collect(wait=False)
        except LockBusy:
            self._collecting = self._loop.run_in_executor(self._queue_thread, self.queue.collect)  # type: ignore[union-attr]
            self._collecting.add_done_callback(self._collected)
            return
        except Exception:
            self._collect_failed()
            return
        if done:
            self._resolve(done, time.monotonic_ns())

    def _collected(self, fut: asyncio.Future) -> None:
        self._collecting = None
        again, self._again = self._again, False
        if fut.cancelled() or fut.exception() is not None:
            self._collect_failed(fut.exception() if not fut.cancelled() else None)
            return
        if done := fut.result():
            self._resolve(done, time.monotonic_ns())
        if again and self._reading:
            self._on_results()

    def _collect_failed(self, exc: BaseException | None = None) -> None:
        """A collect that raised may not have armed the wake-up: try again shortly."""
        log.error("collecting results failed; retrying", exc_info=exc or True)
        if self._reading:
            self._loop.call_later(RETRY_COLLECT_S, self._on_results)  # type: ignore[union-attr]

    def _resolve(self, done: list[Done], collected_ns: int) -> None:
        self.collected_ns = collected_ns  # a lone request's `collected` stamp (daemon.timeline)
        for d in done:
            if d.status == STATUS_PARTIAL:
                sink = self._partials.get(d.request_id)
                if sink is not None:
                    sink(d)
                continue
            fut = self._waiting.pop(d.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(d)
