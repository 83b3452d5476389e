"""The worker core: choose a lane, claim a batch, run it, ack.

`WorkerCore.step()` does one scheduling round and is testable in-process with
a real queue and a tiny model; `runtimes.process` adds only the process
wiring (signals, heartbeat thread). The models on the worker's device are its
`Residency` (runtimes.residency: load, evict, pin), which the core builds and
asks for the model of the lane it chose; generation runs in rounds of
runtimes.continuous, handed a `Round` of what they need from the core; fair
sharing between clients is runtimes.flows; control commands are served by
runtimes.commands, the info blob is written by runtimes.info.

An encoder batch runs as the adapter's steps (`Adapter.batch`, a generator that
yields before each micro-batch): this loop drives them and decides at each
boundary whether the rest is still wanted and whether another client's request
runs first, as a batch of its own (`run_steps`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import msgspec

from fleet.control import control_lane, is_control_lane
from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from fleet.local_queue import Claim
from fleet.runtimes.base import Adapter, BatchContext, ModelSpec
from fleet.runtimes.claiming import Claimer
from fleet.runtimes.commands import serve_control, settle
from fleet.runtimes.continuous import Round, abort_in_flight, busy_continuous, serve_continuous
from fleet.runtimes.device_memory import DeviceMemory, LoadLock
from fleet.runtimes.flows import Flows, Interjection, claim_other, other_first
from fleet.runtimes.heap import HeapTrim
from fleet.runtimes.hosting import Hosting
from fleet.runtimes.info import encode_info, worker_info
from fleet.runtimes.linger import linger_window, still_behind
from fleet.runtimes.lora import attach_batch, batch_loras
from fleet.runtimes.memory import IDLE_NAP_S, NotNow, run_split_on_oom
from fleet.runtimes.policy import (
    BEHIND_TARGETS, CONTENDED_SHARE, MICRO_SHARE, MIN_SAMPLES, CostModel,
    batch_fill_cap, batch_token_cap, behind, choose_lane, fill_flags, form_batch, micro_items_cap, padded_tokens,
    rows_of, stall_bound_ms,
)
from fleet.runtimes.registry import adapter_class
from fleet.runtimes.residency import Residency
from fleet.runtimes.state import BatchStats, Ledger, Progress, Resident

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def decoder_for(request_type: type) -> msgspec.msgpack.Decoder:
    """The msgpack decoder of a request type, built once per process."""
    decoder = _decoders.get(request_type)
    if decoder is None:
        decoder = _decoders[request_type] = msgspec.msgpack.Decoder(request_type)
    return decoder


def tokens_read(results: list) -> int:
    """Tokens a batch's model read: the sum of its results' `input_tokens`, which each
    adapter takes from its tokenizer's own output (attention masks, token lists) and
    clients get as `usage`. One addition per request, none per input; an error read none."""
    return sum(getattr(r, "input_tokens", 0) for r in results)


class Unwanted(Exception):
    """Between two micro-batches: no request of the batch is wanted any longer (each
    passed its deadline or was withdrawn); the rest is not computed."""


@dataclass
class WorkerCore:
    queue: object  # local_queue.LocalQueue
    worker_id: int
    device: str
    # The InitVars are handed to this worker's `residency` (runtimes.residency), which
    # keeps them: `core.residency.memory`, not `core.memory`.
    resolve: InitVar[Callable[[str], ModelSpec]]
    #: (task, runtime) -> adapter class; the registry in production, fakes in tests.
    adapter_for: InitVar[Callable[[str, str], type[Adapter]]] = adapter_class
    #: `<box>/<worker>` written into every result (the X-Served-By header).
    served_by: str = ""
    lease_ms: int = 10_000
    #: Starvation bound for lane choice (Settings.lane_max_wait_ms).
    max_wait_ms: int = 2_000
    #: Batch time aimed for by the cost model (Settings.batch_target_ms; 0 = no cap).
    target_ms: float = 0.0
    #: Linger for models whose profile sets none (Settings.linger_ms).
    linger_ms: float = 0.0
    #: The batch or load running now and its bound, for the heartbeat thread (runtimes.process).
    progress: Progress = field(default_factory=Progress)
    clock_ns: Callable[[], int] = time.monotonic_ns
    #: The device's budget, load bound, load lock and effects (runtimes.hosting.Hosting).
    hosting: InitVar[Hosting] = Hosting()
    #: Returns the heap freed by batches to the system while idle.
    trim: HeapTrim = field(default_factory=HeapTrim)
    #: The batches run here (runtimes.state.Ledger): counters, the last batch, each model's last.
    ledger: Ledger = field(default_factory=Ledger)
    #: Fitted batch cost per model on this device (kept across unloads: same model, same device).
    costs: dict[str, CostModel] = field(default_factory=dict)
    #: Who shares each model and lane (runtimes.flows).
    flows: Flows = field(default_factory=Flows)
    residency: Residency = field(init=False)
    #: This worker's claims on the lanes (runtimes.claiming).
    claimer: Claimer = field(init=False)
    #: What a generation round needs from this worker (runtimes.continuous).
    round: Round = field(init=False)

    def __post_init__(self, resolve, adapter_for, hosting) -> None:
        self.residency = Residency(
            queue=self.queue, worker_id=self.worker_id, device=self.device, resolve=resolve, adapter_for=adapter_for,
            publish=self.publish_info, on_unload=self.abort_generation, progress=self.progress, costs=self.costs,
            clock_ns=self.clock_ns, max_wait_ms=self.max_wait_ms, behind_ms=self.target_ms,
            load_timeout_ms=hosting.load_timeout_ms,
            memory=hosting.memory or DeviceMemory.unlimited(), load_lock=hosting.load_lock or LoadLock(None),
            estimate_footprint=hosting.estimate_footprint, return_freed=hosting.return_freed,
        )
        self.claimer = Claimer(self.queue, self.worker_id, self.lease_ms, self.served_by, self.clock_ns)
        self.round = Round(self.queue, self.residency, self.served_by, self.lease_ms, self.max_wait_ms, self.clock_ns,
                           decoder_for, self.progress, self.publish_info, self.record_batch)

    def abort_generation(self, name: str, adapter: Adapter) -> None:
        """`name` is being unloaded: generation in flight on it is answered now, not left leased."""
        abort_in_flight(self.round, adapter, WorkError("overloaded", f"{name} was unloaded from {self.device} "
                                                       "while generating; retry"))

    def record_batch(self, stats: BatchStats) -> None:
        self.ledger.last = stats

    def servable(self, stats: list) -> tuple[list, list]:
        """(the lanes this worker may serve now, the lanes left to other workers) from
        `lane_stats()`: no control lanes, and no lane whose last load attempt here
        said "not here, now" in the last IDLE_NAP_S (`Residency.not_now_for`); of
        those, the ones left to the workers holding their model are the second list
        (their holders are woken by new work). Every call is a look at which lanes
        are behind (`Residency.track_behind`)."""
        out, declined = [], []
        now = self.clock_ns()
        self.residency.track_behind(stats, now)
        for s in stats:
            if is_control_lane(s.model):
                continue
            if s.depth and (memo := self.residency.not_now_for(s.model, now)) is not None:
                if memo.left_to_holders:
                    declined.append(s)
                continue
            out.append(s)
        return out, declined

    def wait_for_work(self, stats: list, declined: list, timeout_s: float, *, since: int | None = None) -> None:
        """Nothing to serve here: block for new work; or, when all that waits was
        left to the workers holding its models (`declined`), block until new
        work comes after `since` (a `work_generation()` read before `stats`: every
        waiter wakes on new work, the holders too) or until the oldest declined
        lane would starve (then it is decided again here; a lane that starves and is
        still left to its holders is looked at again after a nap); or, when other work
        waits that is not ours now (room held by busier models), nap briefly instead
        of spinning. Work only for the lanes left to their holders ends the wait once
        those verdicts lapse, not at every put (a step per put beside a busy holder)."""
        waiting = sum(1 for s in stats if s.depth)
        if waiting and since is not None and len(declined) == waiting:
            now = self.clock_ns()
            oldest = min(s.oldest_enqueue_ns for s in declined)
            starve_s = (oldest + self.max_wait_ms * 1_000_000 - now) / 1e9
            until = now + int(min(timeout_s, max(IDLE_NAP_S, starve_s)) * 1e9)
            left, lapse = {s.lane for s in declined}, self.residency.left_until(s.model for s in declined)
            while (wait_ns := until - self.clock_ns()) > 0 and self.queue.wait_for_work(wait_ns / 1e9, since=since):
                since = self.queue.work_generation()  # before the look: work put after it ends the next wait
                if self.clock_ns() >= lapse or any(s.depth and s.lane not in left for s in self.queue.lane_stats()):
                    return
        elif waiting:
            time.sleep(min(timeout_s, IDLE_NAP_S))
        else:
            self.trim.if_due(self.ledger.seq, self.clock_ns())
            self.queue.wait_for_work(timeout_s)

    def publish_info(self) -> None:
        """Write this worker's info blob (runtimes.info): the daemon and the peers read it."""
        info = worker_info(self.residency, self.costs, self.ledger.last, self.ledger.seq, self.ledger.ring)
        self.queue.set_worker_info(self.worker_id, encode_info(info, self.residency))

    # -- one scheduling round ------------------------------------------------

    def step(self, timeout_s: float = 0.5) -> int:
        """Serve one batch if work waits (blocking up to `timeout_s` for it). Returns items answered."""
        woke_ns = time.monotonic_ns()  # the request timeline's stamps (fleet.messages.WORKER_STAGES)
        # 1. A load that ran beside serving is installed once done (runtimes.loading);
        #    control commands first; then choose a lane among those this worker
        #    may serve: starving first, then models held here, then oldest.
        settle(self.queue, self.residency, served_by=self.served_by)
        since = self.queue.work_generation()  # before lane_stats: work put after it ends the wait below
        stats = self.queue.lane_stats()
        control = next((s.lane for s in stats if s.model == control_lane(self.worker_id) and s.depth), None)
        if control is not None and (done := serve_control(self.queue, control, self.residency, lease_ms=self.lease_ms,
                                                          served_by=self.served_by)):
            return done
        servable, declined = self.servable(stats)
        # Generation (continuous adapters) in flight steps first (runtimes.continuous).
        if (busy := busy_continuous(self.round, servable, self.ledger.last.model)) is not None:
            return serve_continuous(self.round, busy, stats)
        # 2. Make sure the model is here before claiming: while it loads, its requests
        #    stay queued (and can time out or be cancelled there), and the lanes of the
        #    models held here are served (`LoadRuns`). A lane whose load attempt says
        #    "not here, now" is skipped (remembered) and another is chosen.
        tried: set[str] = set()
        while True:
            lane = choose_lane(servable, set(self.residency.models), self.clock_ns(), self.max_wait_ms * 1_000_000)
            if lane is None:
                self.wait_for_work(stats, declined, timeout_s, since=since)
                return 0
            try:
                resident = self.residency.ensure(lane.model)
                break
            except NotNow:  # decided once per round: the next round asks again if the verdict lapsed
                tried.add(lane.model)
                servable, declined = self.servable(stats)
                servable = [s for s in servable if s.model not in tried]
            except FleetError as exc:
                return self.claimer.fail_lane(lane.lane, exc)
            except Exception as exc:  # a load that fails unexpectedly answers its lane; the worker stays up
                log.exception("loading %s failed", lane.model)
                return self.claimer.fail_lane(lane.lane, ModelLoadFailed(
                    f"cannot load {lane.model!r}: {type(exc).__name__}: {exc}"))
        if resident.adapter.continuous:
            return serve_continuous(self.round, resident, stats)
        return self.serve_lane(lane, resident, woke_ns)

    def serve_lane(self, lane, resident: Resident, woke_ns: int) -> int:
        """One batch of `lane` (a `lane_stats()` row) on its resident model: claim,
        linger, form, run. Returns items answered."""
        profile, model = resident.adapter.spec.profile, lane.model
        cost = self.costs.setdefault(model, CostModel())
        # 3. Claim up to the budget (a sum of tokens: the padded cap bounds it; a lane
        #    of batch work only, to what batch work may take while interactive work is
        #    current), linger for more while the lane is drained, keep what fits
        #    (interactive work first, batch work filling the rest), return the rest.
        fit = cost.fit() if cost.samples >= MIN_SAMPLES else None
        now = self.clock_ns()
        recent = self.flows.interactive_padded(model, now)
        shared = self.flows.shared(model, now)
        # Behind: the head waited past the target, or came back from a batch that ran
        # behind (`still_behind`: a saturated closed loop's clients, answered together).
        lagging = not shared and (behind(lane, now, self.target_ms) or still_behind(
            lane, self.ledger.runs.get(model), profile.linger_ms or self.linger_ms))
        cap = self.batch_cap(cost, profile.max_batch_tokens, shared, behind=lagging)
        claim_cap = batch_fill_cap(cap, 0, recent, fit) if lane.head_batch else cap
        claims = self.claimer.claim_batch(lane.lane, profile.max_batch_items, claim_cap, queued=lane.depth)
        if not claims:
            return 0  # another worker took them first, or they all expired
        claimed_ns = time.monotonic_ns()
        linger_ms, since_ns = self.linger_window_for(model, profile, claims[0])
        claims = self.claimer.linger_for_more(lane.lane, claims, linger_ms, since_ns, profile.max_batch_items, cap,
                                      answered=self.ledger.runs.get(model))
        lingered_ns = time.monotonic_ns()
        fills = fill_flags([c.flow for c in claims], [c.batch for c in claims])
        fill = batch_fill_cap(cap, padded_tokens([c.tokens for c, f in zip(claims, fills) if not f]), recent, fit)
        keep = form_batch([c.tokens for c in claims], [c.attempts for c in claims], profile.max_batch_items, cap,
                          batch=fills, max_fill_tokens=fill)
        claims, returned = self.claimer.return_overpull(claims, keep)
        # 4. Claimed items whose deadline passed were already answered `timeout`
        #    by the daemon: drop them unrun (their ack is then discarded there).
        claims, late = self.claimer.drop_late(claims)
        if not claims:
            return late
        return self.run_claims(lane.lane, resident, cost, claims, returned, (woke_ns, claimed_ns, lingered_ns),
                               shared=shared, behind=lagging) + late

    def run_claims(self, lane: int, resident: Resident, cost: CostModel, claims: list[Claim], returned: int,
                   stamps: tuple[int, int, int], *, shared: bool, nested: bool = False, behind: bool = False) -> int:
        """Decode, run and ack a batch of `claims` of `lane`, and learn from it; returns
        the items answered (those of batches run between its micro-batches included).
        Between two micro-batches a request of another client waiting at the head of
        the lane is run first (`run_steps`): a client arriving while one client's
        batch runs (up to BEHIND_TARGETS targets when its lane is behind) waits for
        one micro-batch. `shared` (clients share the model now) and one of them sends
        shorter requests (`Flows.lighter`): micro-batches aim for MICRO_SHARE of the
        target (`micro_items_cap`). `nested`: this batch runs between two
        micro-batches of another (it lets nothing run between its own). `behind`: it was
        claimed with the bound of a lane behind its target (the ledger keeps it for
        `linger.still_behind`)."""
        adapter, model = resident.adapter, resident.adapter.spec.name
        # 5. Decode (after returning: a returned payload is no longer ours) and attach
        #    the LoRA adapters the batch names (runtimes.lora): a request that fails
        #    either fails alone. Run, then ack in one `ack_many` (one lock and one
        #    wake-up for the whole batch).
        runnable, acks = self._decoded(adapter, claims)
        requests = [r for _, r in runnable]
        tokens = [c.tokens for c, _ in runnable]
        # `estimate`: the batch's size as the daemon estimated it before any tokenizer
        # ran (daemon.tasks.estimate_tokens): what batches are formed, timed (`padded`,
        # the cost model) and shared by, and what daemon.pieces measures its rate in.
        # What the model read is counted from the results (`tokens_read`), after the run.
        padded, estimate, rows = padded_tokens(tokens), sum(tokens), rows_of(requests)
        loras = batch_loras(adapter, requests)
        # Micro-batches of MICRO_SHARE of the target while a client of shorter requests
        # shares the model, of a target otherwise: a batch that runs longer (up to
        # BEHIND_TARGETS targets behind) still ends a micro-batch about every target,
        # where a client arriving meanwhile is run (`run_steps`).
        plan, cut, cap = None, False, None
        if not nested and not loras and self.target_ms > 0:
            plan, cut = self.flows.for_batch(lane, model, [c for c, _ in runnable], estimate, shared, self.clock_ns)
            cap = micro_items_cap(cost, self.target_ms, estimate, rows, adapter.fixed_tokens,
                                  share=MICRO_SHARE if cut else 1.0)
        ctx = BatchContext(cap)
        decoded_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        # Leases are renewed only within the batch's bound (a hung forward loses them).
        with self.progress.running(f"a batch of {len(requests)} on {model}", stall_bound_ms(cost, padded)):
            results, dropped, between = self.run_steps(resident, cost, [c for c, _ in runnable], requests, ctx, plan)
        ms = (time.perf_counter() - t0) * 1e3
        # Other clients' batches run between its micro-batches are not this batch's time:
        # its items waited meanwhile (queue_ms, X-Queue-Ms), and its inference time
        # (X-Inference-Ms, the rate `daemon.pieces` sizes pieces by) is its own.
        own_ms = ms - between[1]
        start_ns = self.clock_ns() - int(own_ms * 1e6)
        stamps = (*stamps, decoded_ns, *ctx.marks, time.monotonic_ns())
        # The batch as clients and operators see it (X-Batch-*, /metrics, `fleetctl top`):
        # its inputs, and the tokens its tokenizer gave them.
        inputs, read = rows or len(requests), tokens_read(results)
        acks += [(c.item_id, _encode(Envelope((start_ns - c.enqueue_ns) / 1e6, own_ms, self.served_by, r, stamps,
                                              inputs, read, loras, estimate)),
                  STATUS_ERROR if isinstance(r, WorkError) else STATUS_OK)
                 for (c, _), r in zip(runnable, results)]
        acked_ns = self.clock_ns()  # before the ack: no answer of this batch is out yet (linger_window 1)
        self.claimer.ack_batch(acks, claims, model)
        # 6. Learn from this batch: its padded size and measured time refine the cost model
        #    (not from a batch cut short: its time is not its size's; nor from one run in
        #    the contended share's micro-batches, far shorter than the profile's: slower
        #    a token, it would shorten the next ones more, `micro_items_cap`; a target's
        #    worth a micro-batch costs a forward's fixed cost in a few hundred tokens).
        if requests and not dropped and (ctx.micro_cap is None or not cut):
            cost.observe(padded, own_ms)
        resident.last_used = time.time()
        resident.served += len(claims)
        resident.tokens += read
        self.ledger.ran(BatchStats(model, inputs, read, padded, ms, time.time(), returned, loras,
                                   requests=len(claims), behind=behind), acked_ns)
        self.flows.served(lane, model, claims, acked_ns)
        self.publish_info()
        return len(claims) + between[0]

    def run_steps(self, resident: Resident, cost: CostModel, claims: list[Claim], requests: list,
                  ctx: BatchContext, plan: Interjection | None) -> tuple[list, bool, tuple[int, float]]:
        """Run `requests` (of `claims`) as the adapter's steps (`Adapter.batch`); returns
        (one result per request, whether it was cut short as unwanted, (items, ms) of
        other clients' batches run between its micro-batches). At each micro-batch
        boundary k > 0: if no claim is wanted any longer (its deadline passed, or it was
        withdrawn: `LocalQueue.cancel` sets a claimed item's deadline to 1; lock-free
        reads, a few us), the steps are closed and every request answered `timeout`. Then, with a `plan`, another client's
        request that runs first (`runtimes.flows.other_first`) runs as a batch of its
        own (`interject`). A model failure answers the whole batch; the worker stays up."""
        adapter, model = resident.adapter, resident.adapter.spec.name
        ids = [c.item_id for c in claims]
        between = [0, 0.0]

        def run(part: list) -> list:  # an out-of-memory split runs each half from its first step
            steps, k = adapter.batch(part, ctx), 0
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                if k and not self.claimer.any_wanted(ids):
                    steps.close()
                    raise Unwanted
                if plan is not None and (ahead := other_first(self.queue, plan, k)) is not None:
                    items, ms = self.interject(plan, resident, cost, ahead)
                    between[0] += items
                    between[1] += ms
                resident.micro_batches += 1
                k += 1

        dropped = False
        try:
            results = run_split_on_oom(run, requests, self.residency.release_memory) if requests else []
        except Unwanted:
            dropped = True
            resident.dropped += len(requests)
            results = [WorkError("timeout", "the request's deadline passed while it ran")] * len(requests)
        except FleetError as exc:
            results = [WorkError(exc.code, exc.message)] * len(requests)
        except Exception as exc:  # a model failure answers this batch; the worker stays up
            log.exception("batch failed on %s", model)
            results = [WorkError("inference_failed", f"{model}: {type(exc).__name__}: {exc}")] * len(requests)
        return results, dropped, (between[0], between[1])

    def interject(self, plan: Interjection, resident: Resident, cost: CostModel, ahead: int) -> tuple[int, float]:
        """Between two micro-batches of a batch of `plan`, run the other clients'
        requests `other_first` found (`ahead`: requests of the batch's clients in front
        of the first) as a batch of their own, within the contended budget and fewer
        tokens than the batch's heaviest client's part (`claim_other`). The batch
        interrupted keeps its claims (leases are renewed by the heartbeat) and its
        progress bound, moved by the time taken here. Returns (items answered, ms)."""
        started = time.perf_counter()
        woke_ns = time.monotonic_ns()
        profile = resident.adapter.spec.profile
        cap = self.batch_cap(cost, profile.max_batch_tokens, True)
        claims = claim_other(self.queue, self.worker_id, self.lease_ms, plan, behind=ahead,
                             budget=min(cap, plan.heaviest - 1), cap=cap, max_items=profile.max_batch_items)
        claims, late = self.claimer.drop_late(claims)
        if not claims:
            return late, (time.perf_counter() - started) * 1e3
        busy = self.progress.busy
        claimed_ns = time.monotonic_ns()
        try:
            done = self.run_claims(plan.lane, resident, cost, claims, 0, (woke_ns, claimed_ns, claimed_ns),
                                   shared=True, nested=True)
        finally:
            took = time.perf_counter() - started
            if busy is not None:  # the interrupted batch's bound moves by the time taken here
                busy = (busy[0], busy[1], busy[2] + int(took * 1e9), busy[3])
            self.progress.busy = busy
            resident.interjected += len(claims)
        return done + late, took * 1e3

    def batch_cap(self, cost: CostModel, max_batch_tokens: int, shared: bool, *, behind: bool = False) -> int:
        """Tokens a batch of a model may take: what the batch target allows by its cost
        (at most the profile's `max_batch_tokens`), a contended share of that while
        clients share the model (`Flows.shared`), BEHIND_TARGETS targets' worth while
        one client has it and its lane is behind (`behind`)."""
        if shared:
            cap = batch_token_cap(cost, self.target_ms, max_batch_tokens)
            return batch_token_cap(cost, self.target_ms * CONTENDED_SHARE, cap)
        return batch_token_cap(cost, self.target_ms * (BEHIND_TARGETS if behind else 1), max_batch_tokens)

    def linger_window_for(self, model: str, profile, head) -> tuple[float, int]:
        """How long a batch of `model` headed by the claim `head` may linger for
        company, and from when (`runtimes.linger.linger_window`): not at all for a
        lone sequential client (each of its requests paid ~0.9 ms of a 1 ms linger,
        bench/timeline.py); while requests overlap, the profile's (else the daemon's)
        linger, or longer where the fitted cost says one more item pays for it."""
        cost = self.costs.get(model)
        fit = cost.fit() if cost is not None and cost.samples >= MIN_SAMPLES else (0.0, 0.0)
        return linger_window(profile.linger_ms or self.linger_ms, self.ledger.runs.get(model), head.enqueue_ns,
                             head.tokens, fit)

    def _decoded(self, adapter: Adapter, claims: list[Claim]) -> tuple[list[tuple[Claim, object]], list]:
        """(claim, request) of the claims that decode and whose LoRA adapter attaches,
        and the error acks of the others (each fails alone)."""
        decoder = decoder_for(adapter.request_type)
        runnable, acks = [], []
        for c in claims:
            try:
                runnable.append((c, decoder.decode(c.payload)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                acks.append(self.claimer.error_ack(c.item_id, WorkError("bad_request",
                                                                        f"undecodable work item: {exc}")))
        if failed := attach_batch(adapter, [r for _, r in runnable], self.residency.resolve):
            acks += [self.claimer.error_ack(runnable[i][0].item_id, e) for i, e in failed.items()]
            runnable = [x for i, x in enumerate(runnable) if i not in failed]
        return runnable, acks
