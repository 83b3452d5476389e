"""The worker's round for continuous adapters (generation): admit, step, stream, ack.

A continuous adapter keeps requests across worker steps (runtimes.base). While
it has requests in flight, `WorkerCore.step` serves it before choosing another
lane (`busy_continuous`), taking turns with the other lanes; each round
(`serve_continuous`) claims what waits in its lane up to its free slots, admits
it, advances every sequence once, publishes partial results of streaming
requests (`LocalQueue.emit_many`: the daemon streams them while the item stays
claimed) and acks the requests that finished. Claims stay leased meanwhile:
the worker's heartbeat thread renews every lease it holds while each step
stays within its bound (runtimes.state.Progress).

A LoRA adapter's requests wait in its base model's lane (the daemon queues
them there), so one claim brings a mixed-adapter batch; an adapter not yet
attached is resolved from the store and attached here, before admit.

Memory: before admitting, the adapter is told how much it may reserve
(`Residency.kv_limit_bytes`: the device budget less what every worker of the
device holds); a request that does not fit goes back to its lane, with the
claims after it, and waits there.

What a round needs from its worker comes in a `Round` (built once by
runtimes.worker): this module does not import the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from fleet.errors import FleetError
from fleet.local_queue import Claim, QueueFull
from fleet.messages import STATUS_ERROR, STATUS_OK, STATUS_PARTIAL, Envelope, GenerateResult, WorkError
from fleet.runtimes.base import BatchContext, run_through
from fleet.runtimes.claiming import ack_all
from fleet.runtimes.lora import attach_lora
from fleet.runtimes.memory import NotNow
from fleet.runtimes.policy import WARMUP_STALL_MS
from fleet.runtimes.residency import Residency
from fleet.runtimes.state import BatchStats, Progress, Resident

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode

#: Longest pause of generation for another lane's round (seconds): bounds the
#: stall when the lane given the round turns out to run nothing (raced, loading).
YIELD_MAX_S = 0.05


@dataclass(frozen=True, slots=True)
class Round:
    """What continuous batching needs from its worker, built once by it (the
    worker's settings do not change after it starts)."""

    queue: object  # local_queue.LocalQueue
    residency: Residency
    #: `<box>/<worker>` written into every result (the X-Served-By header).
    served_by: str
    lease_ms: int
    #: Starvation bound for lane choice (Settings.lane_max_wait_ms): turns between generation and other lanes.
    max_wait_ms: int
    clock_ns: Callable[[], int]
    #: The msgpack decoder of a request type (the worker's, cached).
    decoder: Callable[[type], msgspec.msgpack.Decoder]
    #: The worker's progress record: a step runs within its bound (runtimes.process heartbeat).
    progress: Progress
    #: Publishes the worker's info blob (the device's other workers count the cache reserve).
    publish: Callable[[], None]
    #: Records a generation step as the worker's last batch (`/v1/ps`, the turn rule of `busy_continuous`).
    record: Callable[[BatchStats], None]


@dataclass(slots=True)
class InFlight:
    """The key a continuous adapter carries for one admitted item."""

    item_id: int  # claim id: emit / ack with it
    enqueue_ns: int
    admitted_ns: int
    deadline_ns: int  # 0 = none; past it the daemon has answered `timeout`
    lora: str | None = None  # the LoRA adapter it runs with (store name)


def busy_continuous(rnd: Round, servable: list, last_model: str) -> Resident | None:
    """The resident continuous adapter with requests in flight, unless another lane
    gets this round: generation and the other models of this worker take turns
    (a lane of a model resident here, or one starving, is served between two
    decode steps, never twice in a row), so neither starves the other. `last_model`:
    the model of the worker's last batch."""
    models = rnd.residency.models
    busy = next((r for r in models.values() if r.adapter.continuous and r.adapter.has_active()), None)
    if busy is None:
        return None
    name = busy.adapter.spec.name
    if last_model != name or time.time() - busy.last_used > YIELD_MAX_S:
        return busy  # another lane had the last round (or was chosen and ran nothing)
    now, bound = rnd.clock_ns(), rnd.max_wait_ms * 1_000_000
    if any(s.depth and s.model != name and (s.model in models or now - s.oldest_enqueue_ns > bound)
           for s in servable):
        return None
    return busy


def serve_continuous(rnd: Round, resident: Resident, stats: list) -> int:
    """One round for a continuous adapter. Returns items answered."""
    adapter = resident.adapter
    name = adapter.spec.name
    answered = 0
    # 1. New work, up to the free slots (token budgets do not apply: a sequence
    #    costs its KV cache, which grows as it decodes).
    lane = next((s.lane for s in stats if s.model == name and s.depth), None)
    free = adapter.free_slots()
    if lane is not None and free:
        adapter.kv_limit_bytes = rnd.residency.kv_limit_bytes(adapter)
        reserved = adapter.reserved_bytes()
        answered += admit_claims(rnd, resident, lane, free)
        if adapter.reserved_bytes() != reserved:
            rnd.publish()  # the other workers of the device count the new reserve
    # 2. Requests whose deadline passed were answered `timeout` by the daemon, and
    #    withdrawn ones (the client went away: `cancel` moved the deadline to 1 ns)
    #    have nobody waiting: stop generating for them (their ack frees the claim;
    #    the daemon drops it). One lock-free read of every deadline in flight.
    keys = adapter.in_flight()
    for k, deadline in zip(keys, rnd.queue.deadlines([k.item_id for k in keys])):
        k.deadline_ns = deadline
    now = rnd.clock_ns()
    late = adapter.cancel(lambda k: not k.deadline_ns or k.deadline_ns > now)
    if late:
        payload = _encode(Envelope(0.0, 0.0, rnd.served_by,
                                   WorkError("timeout", "the request's deadline passed, or its client went away, "
                                                        "while it was generating")))
        rnd.queue.ack_many([(k.item_id, payload, STATUS_ERROR) for k in late])
        answered += len(late)
        rnd.publish()  # their cache reserve is free
    if not adapter.has_active():
        return answered
    # 3. One step for every sequence in flight. An open-ended answer about to outgrow
    #    its cache reserve is checked against the room the device has now.
    reserved = adapter.reserved_bytes()
    if adapter.needs_room():
        adapter.kv_limit_bytes = rnd.residency.kv_limit_bytes(adapter)
    t0 = time.perf_counter()
    try:
        # A step past its bound renews no lease (runtimes.state.Progress): a hung decode loses them.
        with rnd.progress.running(f"a generation step of {name}", WARMUP_STALL_MS):
            partials, finished = adapter.step()
    except Exception as exc:  # the batch is lost; every request in it is answered, the worker stays up
        log.exception("generation step failed on %s", name)
        error = WorkError(exc.code, exc.message) if isinstance(exc, FleetError) else \
            WorkError("inference_failed", f"{name}: {type(exc).__name__}: {exc}")
        answered += abort_in_flight(rnd, adapter, error)
        rnd.residency.release_memory()
        return answered
    now = rnd.clock_ns()
    # 4. Stream what is safe to send; ack what finished (one queue call each), each
    #    result naming the step's batch: its sequences, their prompt and generated
    #    tokens, the LoRA adapters among them.
    if partials:
        try:
            rnd.queue.emit_many([(k.item_id, _encode(chunk), STATUS_PARTIAL) for k, chunk in partials])
        except QueueFull as exc:  # the final result carries the whole text: a skipped chunk is caught up there
            log.warning("partial results on %s skipped: %s", name, exc.message)
    prompt, generated = adapter.round_tokens()
    done = [r for _, r in finished if isinstance(r, GenerateResult)]
    prompt += sum(r.input_tokens for r in done)
    generated += sum(r.output_tokens for r in done)
    items = adapter.active_count() + len(finished)
    loras = tuple(sorted({lora for k in (*adapter.in_flight(), *(k for k, _ in finished))
                          if (lora := getattr(k, "lora", None))}))
    if finished:
        acks = [
            (k.item_id,
             _encode(Envelope((k.admitted_ns - k.enqueue_ns) / 1e6, (now - k.admitted_ns) / 1e6, rnd.served_by, r,
                              (), items, prompt + generated, loras)),
             STATUS_ERROR if isinstance(r, WorkError) else STATUS_OK)
            for k, r in finished
        ]
        ack_all(rnd.queue, acks, [k.item_id for k, _ in finished], rnd.served_by, name)
        resident.served += len(finished)
        resident.tokens += sum(r.input_tokens + r.output_tokens for r in done)
        answered += len(finished)
    resident.last_used = time.time()
    ms = (time.perf_counter() - t0) * 1e3
    rnd.record(BatchStats(name, items, prompt + generated, 0, ms, time.time(), 0, loras, prompt, generated))
    if finished or adapter.reserved_bytes() != reserved:
        rnd.publish()  # the other workers of the device count the new reserve
    return answered


def abort_in_flight(rnd: Round, adapter, error: WorkError) -> int:
    """Answer every request a continuous adapter holds with `error` (it is being
    unloaded, or its step failed), so no claim stays leased with nobody on it."""
    keys = adapter.abort() if adapter.continuous else []
    if keys:
        payload = _encode(Envelope(0.0, 0.0, rnd.served_by, error))
        rnd.queue.ack_many([(k.item_id, payload, STATUS_ERROR) for k in keys if k is not None])
    return len(keys)


def admit_claims(rnd: Round, resident: Resident, lane: int, free: int) -> int:
    """Claim up to `free` items of `lane`, attach the LoRA adapters they name, admit
    them; from the first one that must wait for room on, the claims go back to the
    lane (in order). Items of the adapter's `side_type` (a generator's decisions) run
    at once, as one batch (`run_side`). Returns items answered here (late,
    undecodable, refused and side ones)."""
    adapter = resident.adapter
    claims = rnd.queue.claim(lane, worker=rnd.residency.worker_id, max_items=free, max_tokens=1 << 40,
                             lease_ms=rnd.lease_ms)
    if not claims:
        return 0
    decoder = rnd.decoder(adapter.request_type)
    now = rnd.clock_ns()
    errors: list[tuple[int, WorkError]] = []
    failed_loras: dict[str, WorkError] = {}
    side: list[tuple[Claim, Any]] = []
    for n, c in enumerate(claims):
        if c.deadline_ns and c.deadline_ns <= now:
            errors.append((c.item_id, WorkError("timeout", "the request's deadline passed before it ran")))
            continue
        try:
            request = decoder.decode(c.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            request = side_request(rnd, adapter, c.payload)
            if request is None:
                errors.append((c.item_id, WorkError("bad_request", f"undecodable work item: {exc}")))
                continue
        lora = adapter.lora_of(request)
        if lora is not None and not adapter.hosts(lora):
            # The side batch's adapters stay attached until it has run.
            keep = {x for _, r in side if (x := adapter.lora_of(r)) is not None}
            error = failed_loras.get(lora) or attach_lora(adapter, lora, rnd.residency.resolve, keep)
            if error is not None:
                failed_loras[lora] = error
                errors.append((c.item_id, error))
                continue
        if not isinstance(request, adapter.request_type):
            side.append((c, request))
            continue
        try:
            error = adapter.admit(InFlight(c.item_id, c.enqueue_ns, now, c.deadline_ns, lora), request)
        except NotNow as exc:
            log.info("%s; %d requests wait in the lane", exc, len(claims) - n)
            rnd.queue.return_items([x.item_id for x in claims[n:]])
            break
        except Exception as exc:  # a request the adapter chokes on fails alone; the worker stays up
            log.exception("admitting a request to %s failed", adapter.spec.name)
            error = WorkError("inference_failed", f"{adapter.spec.name}: {type(exc).__name__}: {exc}")
        if error is not None:
            errors.append((c.item_id, error))
    if errors:
        rnd.queue.ack_many([(i, _encode(Envelope(0.0, 0.0, rnd.served_by, e)), STATUS_ERROR) for i, e in errors])
    return len(errors) + (run_side(rnd, resident, side) if side else 0)


def side_request(rnd: Round, adapter, payload: memoryview) -> Any:
    """`payload` as the adapter's `side_type`, or None (no side type, or not one).
    The two types are told apart by their fields (both refuse unknown ones)."""
    if adapter.side_type is None:
        return None
    try:
        return rnd.decoder(adapter.side_type).decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def run_side(rnd: Round, resident: Resident, side: list[tuple[Claim, Any]]) -> int:
    """Run the side requests claimed in a round (`Adapter.side_batch`: a generator's
    decisions) as one batch, between two generation steps, and ack them. A failure
    answers this batch only; the sequences in flight go on. Returns items answered."""
    adapter = resident.adapter
    name = adapter.spec.name
    requests = [r for _, r in side]
    loras = tuple(sorted({x for r in requests if (x := adapter.lora_of(r)) is not None}))
    t0 = time.perf_counter()
    start_ns = rnd.clock_ns()
    try:
        # The generation in flight waits meanwhile; the bound is a generation step's.
        with rnd.progress.running(f"a batch of {len(requests)} decisions on {name}", WARMUP_STALL_MS):
            results = run_through(adapter.side_batch(requests, BatchContext()))
    except FleetError as exc:
        results = [WorkError(exc.code, exc.message)] * len(requests)
    except Exception as exc:  # a model failure answers this batch; the worker stays up
        log.exception("decision batch failed on %s", name)
        results = [WorkError("inference_failed", f"{name}: {type(exc).__name__}: {exc}")] * len(requests)
        rnd.residency.release_memory()
    ms = (time.perf_counter() - t0) * 1e3
    read = sum(getattr(r, "input_tokens", 0) for r in results)
    acks = [(c.item_id, _encode(Envelope((start_ns - c.enqueue_ns) / 1e6, ms, rnd.served_by, r, (), len(requests),
                                         read, loras)),
             STATUS_ERROR if isinstance(r, WorkError) else STATUS_OK) for (c, _), r in zip(side, results)]
    ack_all(rnd.queue, acks, [c.item_id for c, _ in side], rnd.served_by, name)
    resident.served += len(side)
    resident.tokens += read
    resident.last_used = time.time()
    rnd.record(BatchStats(name, len(requests), read, 0, ms, time.time(), 0, loras))
    rnd.publish()  # its kept states count in the model's reserve
    return len(side)
