"""The worker core: choose a lane, claim a batch, run it, ack.

`WorkerCore.step()` does one scheduling round and is testable in-process with
a real queue and a tiny model; `runtimes.process` adds only the process
wiring (signals, heartbeat thread). The models on the worker's device are its
`Residency` (runtimes.residency: load, evict, pin), which the core builds and
asks for the model of the lane it chose; generation runs in rounds of
runtimes.continuous, handed a `Round` of what they need from the core; control
commands are served by runtimes.commands, the info blob is written by
runtimes.info.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import msgspec

from fleet.control import control_lane, is_control_lane
from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from local_queue import Claim, QueueFull
from runtimes.base import Adapter, ModelSpec, NotWanted
from runtimes.commands import serve_control
from runtimes.continuous import Round, abort_in_flight, busy_continuous, serve_continuous
from runtimes.info import encode_info, worker_info
from runtimes.lora import attach_batch
from runtimes.memory import IDLE_NAP_S, DeviceMemory, Footprint, LoadLock, NotNow, return_freed_heap, run_split_on_oom
from runtimes.policy import (
    BEHIND_TARGETS, CONTENDED_SHARE, FLOW_QUIET_NS, INTERACTIVE_QUIET_NS, INTERJECT_LOOK, MICRO_SHARE, MIN_SAMPLES,
    CostModel, LastRun,
    batch_fill_cap, batch_token_cap, behind, choose_lane, contended, fill_flags, form_batch, lighter_client,
    linger_left_ms, linger_window, micro_items_cap, padded_tokens, runs_first, stall_bound_ms,
)
from runtimes.registry import adapter_class
from runtimes.residency import Residency, footprint_from_headers, return_freed_memory
from runtimes.state import BATCH_RING, BatchStats, Progress, Resident

#: Heap trims (trim_if_due) at most this often: one costs a few ms on a large heap.
TRIM_EVERY_NS = 1_000_000_000

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode


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
    #: How long one model load may take before this worker counts as stuck (Settings.load_timeout_ms).
    load_timeout_ms: InitVar[float] = 300_000.0
    #: The batch or load running now and its bound, for the heartbeat thread (runtimes.process).
    progress: Progress = field(default_factory=Progress)
    clock_ns: Callable[[], int] = time.monotonic_ns
    #: Returns freed heap to the system; run when the queue is empty after batches,
    #: at most every TRIM_EVERY_NS (issue 16: worker RSS kept climbing under mixed load).
    trim_heap: Callable[[], None] = return_freed_heap
    trimmed_at: tuple[int, int] = (0, 0)  # (batch_seq, clock_ns) of the last trim
    last_batch: BatchStats = field(default_factory=BatchStats)
    #: Fitted batch cost per model on this device (kept across unloads: same model, same device).
    costs: dict[str, CostModel] = field(default_factory=dict)
    #: Each model's last batch here: when it was acked, its items and time (the linger rule, `linger_window`).
    last_runs: dict[str, LastRun] = field(default_factory=dict)
    #: Each model's last batch here with interactive items: (acked at, their padded tokens)
    #: (how much batch work may fill its batches: `batch_fill_cap`).
    recent_interactive: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Per model, the clients (queue flows) of its recent interactive batches here:
    #: flow -> acked at (whether the model is shared now: `contended`).
    recent_flows: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Per model, flow -> the fewest tokens of an item of its last batch here (`lighter_client`).
    flow_tokens: dict[str, dict[int, int]] = field(default_factory=dict)
    #: ms of other clients' batches run between the micro-batches of the batch running
    #: now (`interject`): left out of its time where the cost model learns from it.
    interjected_ms: float = 0.0
    #: Per lane, the clients (queue flows) of the last batch run on it, interjected ones
    #: included: a batch of the same clients checks for another's request before its
    #: micro-batch 0 too (`still_wanted`).
    last_flows: dict[int, set[int]] = field(default_factory=dict)
    _decoders: dict[type, msgspec.msgpack.Decoder] = field(default_factory=dict)
    #: Device budget and live free memory (runtimes.memory.device_budget); unlimited when None (bare tests).
    memory: InitVar[DeviceMemory | None] = None
    #: One load at a time per device, across this daemon's workers (none when None: bare tests).
    load_lock: InitVar[LoadLock | None] = None
    #: A model's footprint before it loads (headers; injected: the simulation sizes models itself).
    estimate_footprint: InitVar[Callable[[ModelSpec], Footprint]] = footprint_from_headers
    #: Gives freed device memory back (injected: a simulated device has no allocator).
    return_freed: InitVar[Callable[[str], None]] = return_freed_memory
    #: Lanes the last `servable` left to the other workers holding their model (the herd rule).
    declined: list = field(default_factory=list)
    #: Cumulative counters for the daemon's metrics (published in the info blob; the
    #: daemon diffs them, so no event between two reads is missed): batches run
    #: (sequence) and the last BATCH_RING of them as (model, items, tokens).
    batch_seq: int = 0
    batch_ring: deque = field(default_factory=lambda: deque(maxlen=BATCH_RING))
    residency: Residency = field(init=False)
    #: What a generation round needs from this worker (runtimes.continuous).
    round: Round = field(init=False)

    def __post_init__(self, resolve, adapter_for, load_timeout_ms, memory, load_lock, estimate_footprint,
                      return_freed) -> None:
        self.residency = Residency(
            queue=self.queue, worker_id=self.worker_id, device=self.device, resolve=resolve, adapter_for=adapter_for,
            publish=self.publish_info, on_unload=self.abort_generation, progress=self.progress, costs=self.costs,
            clock_ns=self.clock_ns, max_wait_ms=self.max_wait_ms, behind_ms=self.target_ms,
            load_timeout_ms=load_timeout_ms,
            memory=memory or DeviceMemory.unlimited(), load_lock=load_lock or LoadLock(None),
            estimate_footprint=estimate_footprint, return_freed=return_freed,
        )
        self.round = Round(self.queue, self.residency, self.served_by, self.lease_ms, self.max_wait_ms, self.clock_ns,
                           self.decoder_for, self.progress, self.publish_info, self.record_batch)

    @property
    def control(self) -> str:
        """This worker's control lane (fleet.control)."""
        return control_lane(self.worker_id)

    def abort_generation(self, name: str, adapter: Adapter) -> None:
        """`name` is being unloaded: generation in flight on it is answered now, not left leased."""
        abort_in_flight(self.round, adapter, WorkError("overloaded", f"{name} was unloaded from {self.device} "
                                                       "while generating; retry"))

    def record_batch(self, stats: BatchStats) -> None:
        self.last_batch = stats

    def servable(self, stats: list) -> list:
        """The lanes this worker may serve now, from `lane_stats()`: no control lanes,
        and no lane whose last load attempt here said "not here, now" in the last
        IDLE_NAP_S (`Residency.not_now_for`). Lanes left to the workers holding their model are
        also kept in `self.declined` (their holders are woken by new work). Every call is
        a look at which lanes are behind (`Residency.track_behind`)."""
        out, self.declined = [], []
        now = self.clock_ns()
        self.residency.track_behind(stats, now)
        for s in stats:
            if is_control_lane(s.model):
                continue
            if s.depth and (memo := self.residency.not_now_for(s.model, now)) is not None:
                if memo.left_to_holders:
                    self.declined.append(s)
                continue
            out.append(s)
        return out

    def wait_for_work(self, stats: list, timeout_s: float, *, since: int | None = None) -> None:
        """Nothing to serve here: block for new work; or, when all that waits was
        left to the workers holding its models (`self.declined`), block until new
        work comes after `since` (a `work_generation()` read before `stats`: every
        waiter wakes on new work, the holders too) or until the oldest declined
        lane would starve (then it is decided again here; a lane that starves and is
        still left to its holders is looked at again after a nap); or, when other work
        waits that is not ours now (room held by busier models), nap briefly instead
        of spinning."""
        waiting = sum(1 for s in stats if s.depth)
        if waiting and since is not None and len(self.declined) == waiting:
            oldest = min(s.oldest_enqueue_ns for s in self.declined)
            starve_s = (oldest + self.max_wait_ms * 1_000_000 - self.clock_ns()) / 1e9
            self.queue.wait_for_work(min(timeout_s, max(IDLE_NAP_S, starve_s)), since=since)
        elif waiting:
            time.sleep(min(timeout_s, IDLE_NAP_S))
        else:
            self.trim_if_due()
            self.queue.wait_for_work(timeout_s)

    def trim_if_due(self) -> None:
        """Nothing waits: return the heap freed by the batches run since the last trim."""
        seq, at = self.trimmed_at
        now = self.clock_ns()
        if self.batch_seq != seq and now - at >= TRIM_EVERY_NS:
            self.trim_heap()
            self.trimmed_at = (self.batch_seq, now)

    def publish_info(self) -> None:
        """Write this worker's info blob (runtimes.info): the daemon and the peers read it."""
        info = worker_info(self.residency, self.costs, self.last_batch, self.batch_seq, self.batch_ring)
        self.queue.set_worker_info(self.worker_id, encode_info(info, self.residency))

    # -- one scheduling round ------------------------------------------------

    def step(self, timeout_s: float = 0.5) -> int:
        """Serve one batch if work waits (blocking up to `timeout_s` for it). Returns items answered."""
        woke_ns = time.monotonic_ns()  # the request timeline's stamps (fleet.messages.WORKER_STAGES)
        # 1. Control commands first; then choose a lane among those this worker
        #    may serve: starving first, then models held here, then oldest.
        since = self.queue.work_generation()  # before lane_stats: work put after it ends the wait below
        stats = self.queue.lane_stats()
        control = next((s.lane for s in stats if s.model == self.control and s.depth), None)
        if control is not None and (done := serve_control(self.queue, control, self.residency, lease_ms=self.lease_ms,
                                                          served_by=self.served_by)):
            return done
        servable = self.servable(stats)
        # Generation (continuous adapters) in flight steps first (runtimes.continuous).
        if (busy := busy_continuous(self.round, servable, self.last_batch.model)) is not None:
            return serve_continuous(self.round, busy, stats)
        # 2. Make sure the model is here before claiming: while it loads, its requests
        #    stay queued (and can time out or be cancelled there). A lane whose load
        #    attempt says "not here, now" is skipped (remembered) and another is chosen.
        tried: set[str] = set()
        while True:
            lane = choose_lane(servable, set(self.residency.models), self.clock_ns(), self.max_wait_ms * 1_000_000)
            if lane is None:
                self.wait_for_work(stats, timeout_s, since=since)
                return 0
            try:
                resident = self.residency.ensure(lane.model)
                break
            except NotNow:  # decided once per round: the next round asks again if the verdict lapsed
                tried.add(lane.model)
                servable = [s for s in self.servable(stats) if s.model not in tried]
            except FleetError as exc:
                return self._fail_lane(lane.lane, exc)
            except Exception as exc:  # a load that fails unexpectedly answers its lane; the worker stays up
                log.exception("loading %s failed", lane.model)
                return self._fail_lane(lane.lane, ModelLoadFailed(
                    f"cannot load {lane.model!r}: {type(exc).__name__}: {exc}"))
        adapter = resident.adapter
        if adapter.continuous:
            return serve_continuous(self.round, resident, stats)
        profile = adapter.spec.profile
        cost = self.costs.setdefault(lane.model, CostModel())
        # 3. Claim up to the budget (a sum of tokens: the padded cap bounds it; a lane
        #    of batch work only, to what batch work may take while interactive work is
        #    current), linger for more while the lane is drained, keep what fits
        #    (interactive work first, batch work filling the rest), return the rest.
        fit = cost.fit() if cost.samples >= MIN_SAMPLES else None
        recent = self.recent_interactive_padded(lane.model)
        now = self.clock_ns()
        shared = contended(self.recent_flows.get(lane.model, {}), now)
        cap = self.batch_cap(cost, profile.max_batch_tokens, shared, behind=behind(lane, now, self.target_ms))
        claim_cap = batch_fill_cap(cap, 0, recent, fit) if lane.head_batch else cap
        claims = self.claim_batch(lane.lane, profile.max_batch_items, claim_cap, queued=lane.depth)
        if not claims:
            return 0  # another worker took them first, or they all expired
        claimed_ns = time.monotonic_ns()
        linger_ms, since_ns = self.linger_window_for(lane.model, profile, claims[0])
        claims = self.linger_for_more(lane.lane, claims, linger_ms, since_ns, profile.max_batch_items, cap,
                                      answered=self.last_runs.get(lane.model))
        lingered_ns = time.monotonic_ns()
        fills = fill_flags([c.flow for c in claims], [c.batch for c in claims])
        fill = batch_fill_cap(cap, padded_tokens([c.tokens for c, f in zip(claims, fills) if not f]), recent, fit)
        keep = form_batch([c.tokens for c in claims], [c.attempts for c in claims], profile.max_batch_items, cap,
                          batch=fills, max_fill_tokens=fill)
        claims, returned = self.return_overpull(claims, keep)
        # 4. Claimed items whose deadline passed were already answered `timeout`
        #    by the daemon: drop them unrun (their ack is then discarded there).
        claims, late = self._drop_late(claims)
        if not claims:
            return late
        return self.run_claims(lane.lane, resident, cost, claims, returned, (woke_ns, claimed_ns, lingered_ns),
                               shared=shared) + late

    def run_claims(self, lane: int, resident: Resident, cost: CostModel, claims: list[Claim], returned: int,
                   stamps: tuple[int, int, int], *, shared: bool, outer: set[int] | None = None) -> int:
        """Decode, run and ack a batch of `claims` of `lane`, and learn from it; returns
        the items answered (those of batches run between its micro-batches included).
        Between two micro-batches a request of another client waiting at the head of
        the lane is run first (`interject`): a client arriving while one client's
        batch runs (up to BEHIND_TARGETS targets when its lane is behind) waits for
        one micro-batch. `shared` (clients share the model now) and one of them sends
        shorter requests (`lighter_client`): micro-batches aim for MICRO_SHARE of the
        target (`micro_items_cap`). `outer`: the flows
        of the batch this one interrupts (it interrupts nothing itself)."""
        adapter, model = resident.adapter, resident.adapter.spec.name
        woke_ns, claimed_ns, lingered_ns = stamps
        # 5. Decode (after returning: a returned payload is no longer ours), run, ack
        #    in one `ack_many` (one lock and one wake-up for the whole batch).
        decoder = self.decoder_for(adapter.request_type)
        runnable, acks = [], []
        for c in claims:
            try:
                runnable.append((c, decoder.decode(c.payload)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = WorkError("bad_request", f"undecodable work item: {exc}")
                acks.append((c.item_id, _encode(Envelope(0.0, 0.0, self.served_by, error)), STATUS_ERROR))
        # The LoRA adapters the batch names are attached first (runtimes.lora); a
        # request whose adapter cannot be fails alone.
        if failed := attach_batch(adapter, [r for _, r in runnable], self.residency.resolve):
            acks += [(runnable[i][0].item_id, _encode(Envelope(0.0, 0.0, self.served_by, e)), STATUS_ERROR)
                     for i, e in failed.items()]
            runnable = [x for i, x in enumerate(runnable) if i not in failed]
        requests = [r for _, r in runnable]
        tokens = [c.tokens for c, _ in runnable]
        padded = padded_tokens(tokens)
        loras = batch_loras(adapter, requests)
        adapter.marks = (0, 0, 0)
        per_flow: dict[int, int] = {}  # interactive tokens of the batch, client by client
        for c, _ in runnable:
            if not c.batch:
                per_flow[c.flow] = per_flow.get(c.flow, 0) + c.tokens
        flows = set(per_flow)
        may_interject = outer is None and not loras and self.target_ms > 0
        # Micro-batches of MICRO_SHARE of the target while a client of shorter requests
        # shares the model, of a target otherwise: a batch that runs longer (up to
        # BEHIND_TARGETS targets behind) still ends a micro-batch about every target,
        # where a client arriving meanwhile is run (`still_wanted`).
        cut = shared and may_interject and lighter_client(
            self.recent_flows.get(model, {}), self.flow_tokens.get(model, {}), flows, sum(tokens), self.clock_ns())
        micro_cap = (micro_items_cap(cost, self.target_ms, sum(tokens), rows_of(requests), adapter.fixed_tokens,
                                     share=MICRO_SHARE if cut else 1.0)
                     if may_interject else None)
        adapter.micro_cap = micro_cap
        adapter.wanted = self.still_wanted([c for c, _ in runnable], resident,
                                           (lane, flows, cost, max(per_flow.values())) if may_interject and flows
                                           else None)
        self.interjected_ms, interjected = 0.0, resident.interjected
        dropped = False
        t0 = time.perf_counter()
        decoded_ns = time.monotonic_ns()
        try:
            # Leases are renewed only within the batch's bound (a hung forward loses them).
            with self.progress.running(f"a batch of {len(requests)} on {model}", stall_bound_ms(cost, padded)):
                release = self.residency.release_memory
                results = run_split_on_oom(adapter.run_batch, requests, release) if requests else []
        except NotWanted:  # between micro-batches: every item's deadline passed or it was withdrawn
            dropped = True
            resident.dropped += len(requests)
            results = [WorkError("timeout", "the request's deadline passed while it ran")] * len(requests)
        except FleetError as exc:
            results = [WorkError(exc.code, exc.message)] * len(requests)
        except Exception as exc:  # a model failure answers this batch; the worker stays up
            log.exception("batch failed on %s", model)
            results = [WorkError("inference_failed", f"{model}: {type(exc).__name__}: {exc}")] * len(requests)
        finally:
            adapter.wanted, adapter.micro_cap = None, None
        ms = (time.perf_counter() - t0) * 1e3
        # Other clients' batches run between its micro-batches are not this batch's time:
        # its items waited meanwhile (queue_ms, X-Queue-Ms), and its inference time
        # (X-Inference-Ms, the rate `daemon.pieces` sizes pieces by) is its own.
        own_ms = ms - self.interjected_ms
        start_ns = self.clock_ns() - int(own_ms * 1e6)
        stamps = (woke_ns, claimed_ns, lingered_ns, decoded_ns, *adapter.marks, time.monotonic_ns())
        batch_tokens = sum(tokens)
        acks += [
            (
                c.item_id,
                _encode(Envelope((start_ns - c.enqueue_ns) / 1e6, own_ms, self.served_by, r, stamps, len(requests),
                                 batch_tokens, loras)),
                STATUS_ERROR if isinstance(r, WorkError) else STATUS_OK,
            )
            for (c, _), r in zip(runnable, results)
        ]
        acked_ns = self.clock_ns()  # before the ack: no answer of this batch is out yet (linger_window 1)
        try:
            self.queue.ack_many(acks)
        except QueueFull as exc:
            # No slab room for some results right now: those items are still ours;
            # answer them with a short error (acks already done are skipped there).
            log.error("results of %d items on %s do not fit the queue: %s", len(acks), model, exc.message)
            self._ack_errors(claims, WorkError("overloaded", f"queue memory is full for results: {exc.message}"))
        # 6. Learn from this batch: its padded size and measured time refine the cost model
        #    (not from a batch cut short: its time is not its size's; nor from one run in
        #    the contended share's micro-batches, far shorter than the profile's: slower
        #    a token, it would shorten the next ones more, `micro_items_cap`; a target's
        #    worth a micro-batch costs a forward's fixed cost in a few hundred tokens).
        if requests and not dropped and (micro_cap is None or not cut):
            cost.observe(padded, own_ms)
        resident.last_used = time.time()
        resident.served += len(claims)
        resident.tokens += batch_tokens
        self.last_batch = BatchStats(model, len(claims), batch_tokens, padded, ms, time.time(), returned, loras)
        self.last_runs[model] = LastRun(acked_ns, len(claims), ms)
        self.last_flows[lane] = flows
        if interactive := [c.tokens for c in claims if not c.batch]:
            self.recent_interactive[model] = (acked_ns, padded_tokens(interactive))
            self.saw_flows(model, [c for c in claims if not c.batch], acked_ns)
        self.batch_seq += 1
        self.batch_ring.append((model, len(claims), batch_tokens))
        self.publish_info()
        return len(claims) + resident.interjected - interjected

    def still_wanted(self, claims: list[Claim], resident: Resident,
                     interject: tuple[int, set[int], CostModel, int] | None = None) -> Callable[[int], bool]:
        """The batch's `Adapter.wanted`: before micro-batch k > 0, is any of `claims`
        still wanted (its deadline not passed, not withdrawn: `LocalQueue.cancel`
        sets a claimed item's deadline to 1)? Lock-free reads of the claims'
        deadlines (`LocalQueue.deadlines`), a few µs; micro-batch 0 follows the
        deadline check of step 4 and reads nothing. With `interject` = (lane, the
        batch's flows, cost, its heaviest client's tokens): then, when the lane's
        head is another client's interactive request shorter than that client's
        part (`runs_first`; `LocalQueue.head_flow`, one lock-free read), it runs
        first (`interject`): a light client's request does not wait for a flood's
        batch, and a flood's does not stretch a light client's batch. So does such
        a request behind the head when only the next
        requests of this batch's own clients are ahead of it, up to INTERJECT_LOOK
        places (`LocalQueue.first_other_flow`, lock-free reads): the lane's fair
        order (start-time fair queueing, by tokens) puts a client served lately
        behind one or two requests of the flood, which would run only after the
        batch running now, itself the flood's. Measured (bench/README, issue 25):
        one light request in three or four then waited for most of a flood request.
        The flood still gets a micro-batch between two of them."""
        ids = [c.item_id for c in claims]
        deadlines, clock, first_other = self.queue.deadlines, self.clock_ns, self.queue.first_other_flow
        # Before micro-batch 0 as well when this batch's clients had the lane's last
        # forward too: a flood's next request, ahead of a light client's by the fair
        # order, then runs one micro-batch before it, not two (the last of the flood's
        # batch and the first of the next: issue 25's p95). The flood still gets a
        # forward between two of another client's.
        again = interject is not None and self.last_flows.get(interject[0], set()) <= interject[1]

        def wanted(k: int) -> bool:
            if k:
                now = clock()
                if not any(not d or d > now for d in deadlines(ids)):
                    return False
            if (k or again) and interject is not None \
                    and (other := first_other(interject[0], interject[1], INTERJECT_LOOK)) is not None \
                    and runs_first(other[2], interject[3]):
                self.interject(*interject, resident=resident, behind=other[0])
            resident.micro_batches += 1
            return True

        return wanted

    def interject(self, lane: int, outer: set[int], cost: CostModel, outer_tokens: int, *, resident: Resident,
                  behind: int = 0) -> int:
        """Between two micro-batches of a batch for the clients `outer`, the
        heaviest of them with `outer_tokens` in it, run the requests of other
        clients waiting at the head of `lane` as a batch of their own (as long as
        the head is one of theirs, within the contended budget and fewer tokens
        than `outer_tokens`: `runs_first`), so a light client waits for one
        micro-batch of a flood, not for its batch. The batch interrupted keeps its claims (leases are renewed by the heartbeat); its
        adapter state and progress bound are put back, the bound moved by the time
        taken here. `behind`: the other client's request waits behind that many
        requests of `outer`'s clients: all are claimed, those go back to their
        places, it runs. Returns the items answered."""
        started = time.perf_counter()
        woke_ns = time.monotonic_ns()
        adapter, profile = resident.adapter, resident.adapter.spec.profile
        cap = self.batch_cap(cost, profile.max_batch_tokens, True)
        claims: list[Claim] = []
        budget, taken = min(cap, outer_tokens - 1), 0
        if behind:
            got = self.queue.claim(lane, worker=self.worker_id, max_items=behind + 1, max_tokens=1 << 40,
                                   lease_ms=self.lease_ms)
            if (len(got) == behind + 1 and all(c.flow in outer for c in got[:-1]) and not got[-1].batch
                    and got[-1].flow not in outer):
                self.queue.return_items([c.item_id for c in got[:-1]])
                claims, taken = [got[-1]], got[-1].tokens
            elif got:  # the lane changed since it was read (another worker, an expiry)
                self.queue.return_items([c.item_id for c in got])
        while len(claims) < profile.max_batch_items:
            head = self.queue.head_flow(lane)
            if head is None or head[0] in outer or (claims and taken + head[1] > budget):
                break
            got = self.queue.claim(lane, worker=self.worker_id, max_items=1, max_tokens=cap, lease_ms=self.lease_ms)
            if not got:
                break
            if got[0].batch or got[0].flow in outer:  # the head changed since it was read (another worker)
                self.queue.return_items([got[0].item_id])
                break
            claims += got
            taken += got[0].tokens
        claims, late = self._drop_late(claims)
        if not claims:
            return late
        saved = (adapter.marks, adapter.wanted, adapter.micro_cap, self.progress.busy, self.interjected_ms)
        claimed_ns = time.monotonic_ns()
        try:
            done = self.run_claims(lane, resident, cost, claims, 0, (woke_ns, claimed_ns, claimed_ns), shared=True,
                                   outer=outer)
        finally:
            took = time.perf_counter() - started
            adapter.marks, adapter.wanted, adapter.micro_cap, busy, self.interjected_ms = saved
            if busy is not None:  # the interrupted batch's bound moves by the time taken here
                busy = (busy[0], busy[1], busy[2] + int(took * 1e9), busy[3])
            self.progress.busy = busy
            self.interjected_ms += took * 1e3
            resident.interjected += len(claims)
        return done + late

    def batch_cap(self, cost: CostModel, max_batch_tokens: int, shared: bool, *, behind: bool = False) -> int:
        """Tokens a batch of a model may take: what the batch target allows by its cost
        (at most the profile's `max_batch_tokens`), a contended share of that while
        clients share the model (`contended`), BEHIND_TARGETS targets' worth while
        one client has it and its lane is behind (`behind`)."""
        if shared:
            cap = batch_token_cap(cost, self.target_ms, max_batch_tokens)
            return batch_token_cap(cost, self.target_ms * CONTENDED_SHARE, cap)
        return batch_token_cap(cost, self.target_ms * (BEHIND_TARGETS if behind else 1), max_batch_tokens)

    def saw_flows(self, model: str, claims: list[Claim], at_ns: int) -> None:
        """The clients of a batch of `model` (its interactive `claims`' queue flows) were
        served at `at_ns`, each with its fewest tokens an item; those not seen for
        FLOW_QUIET_NS are forgotten (`contended`, `lighter_client`)."""
        seen, sizes = self.recent_flows.setdefault(model, {}), self.flow_tokens.setdefault(model, {})
        fewest: dict[int, int] = {}
        for c in claims:
            fewest[c.flow] = min(c.tokens, fewest.get(c.flow, c.tokens))
        seen.update(dict.fromkeys(fewest, at_ns))
        sizes.update(fewest)
        if len(seen) > 1:
            for flow in [f for f, at in seen.items() if at_ns - at >= FLOW_QUIET_NS]:
                del seen[flow]
                sizes.pop(flow, None)

    def recent_interactive_padded(self, model: str) -> int:
        """Padded tokens of the interactive part of `model`'s last batch here with
        interactive work in it, if that was within INTERACTIVE_QUIET_NS; else 0
        (`batch_fill_cap`: batch work alone fills whole budgets)."""
        at, padded = self.recent_interactive.get(model, (0, 0))
        return padded if padded and self.clock_ns() - at < INTERACTIVE_QUIET_NS else 0

    def claim_batch(self, lane: int, max_items: int, cap: int, *, queued: int | None = None) -> list:
        """Claim the head, then at most as many items as a batch as wide as the head
        can hold (cap // head tokens): a long head must not pull a lane's worth of
        short items only to return them (each return re-inserts by seq under the lock).
        `queued` (the lane's depth when it was chosen) bounds the second claim: a lone
        request skips it (one lock round less on the latency path); items that came
        since are claimed by the linger or the next round."""
        claims = self.queue.claim(lane, worker=self.worker_id, max_items=1, max_tokens=cap, lease_ms=self.lease_ms)
        if not claims:
            return claims
        room = min(max_items, cap // max(1, claims[0].tokens), max_items if queued is None else queued) - 1
        if room > 0:
            claims += self.queue.claim(lane, worker=self.worker_id, max_items=room,
                                       max_tokens=max(1, cap - claims[0].tokens), lease_ms=self.lease_ms)
        return claims

    def linger_window_for(self, model: str, profile, head) -> tuple[float, int]:
        """How long a batch of `model` headed by the claim `head` may linger for
        company, and from when (`runtimes.policy.linger_window`): not at all for a
        lone sequential client (each of its requests paid ~0.9 ms of a 1 ms linger,
        bench/timeline.py); while requests overlap, the profile's (else the daemon's)
        linger, or longer where the fitted cost says one more item pays for it."""
        cost = self.costs.get(model)
        fit = cost.fit() if cost is not None and cost.samples >= MIN_SAMPLES else (0.0, 0.0)
        return linger_window(profile.linger_ms or self.linger_ms, self.last_runs.get(model), head.enqueue_ns,
                             head.tokens, fit)

    def linger_for_more(self, lane: int, claims: list, linger_ms: float, since_ns: int, max_items: int, cap: int,
                        *, answered: LastRun | None = None) -> list:
        """While the lane is drained and the batch short, wait (on the queue's wake-ups)
        up to `linger_ms` from `since_ns` and claim what arrives in this lane. The wait
        ends early once as many items came after the `answered` batch's ack as it held:
        clients that each wait for their answer send again one each, and are all back."""
        back = 0 if answered is None else sum(c.enqueue_ns >= answered.acked_ns for c in claims)
        while answered is None or back < answered.items:
            left = linger_left_ms(
                self.clock_ns(), since_ns, linger_ms, items=len(claims), max_items=max_items,
                padded_tokens=padded_tokens([c.tokens for c in claims]), max_padded_tokens=cap,
                lane_drained=not any(s.lane == lane and s.depth for s in self.queue.lane_stats()),
            ) if linger_ms > 0 else 0.0
            if left <= 0 or not self.queue.wait_for_work(left / 1e3):
                return claims
            room = cap - sum(c.tokens for c in claims)
            more = self.queue.claim(lane, worker=self.worker_id, max_items=max_items - len(claims),
                                    max_tokens=max(1, room), lease_ms=self.lease_ms)
            if not more:
                return claims  # the wake-up was for another lane: run now rather than hold this batch
            claims = claims + more
            if answered is not None:
                back += sum(c.enqueue_ns >= answered.acked_ns for c in more)
        return claims

    def return_overpull(self, claims: list, keep: list[int]) -> tuple[list, int]:
        """Give back, at once, the claimed items this batch will not run (the queue puts
        them back at their places in lane order). Returns (kept claims, items returned)."""
        if len(keep) == len(claims):
            return claims, 0
        kept = set(keep)
        returned = self.queue.return_items([c.item_id for i, c in enumerate(claims) if i not in kept])
        return [claims[i] for i in keep], returned

    def _drop_late(self, claims: list[Claim]) -> tuple[list[Claim], int]:
        """(the claims still in time, how many were late): a late one is acked
        `timeout` unrun (the daemon has answered it already and discards the ack)."""
        now = self.clock_ns()
        late = [c for c in claims if c.deadline_ns and c.deadline_ns <= now]
        if not late:
            return claims, 0
        self._ack_errors(late, WorkError("timeout", "the request's deadline passed before it ran"))
        return [c for c in claims if not (c.deadline_ns and c.deadline_ns <= now)], len(late)

    def _ack_errors(self, claims: list, error: WorkError) -> None:
        payload = _encode(Envelope(0.0, 0.0, self.served_by, error))
        self.queue.ack_many([(c.item_id, payload, STATUS_ERROR) for c in claims])

    def _fail_lane(self, lane: int, exc: FleetError) -> int:
        """A model that cannot load answers what waits for it, and the worker goes on."""
        log.error("cannot serve lane %s: %s", self.queue.lane_name(lane), exc.message)
        claims = self.queue.claim(lane, worker=self.worker_id, max_items=1024, max_tokens=1 << 30, lease_ms=self.lease_ms)
        self._ack_errors(claims, WorkError(exc.code, exc.message))
        return len(claims)

    def decoder_for(self, request_type: type) -> msgspec.msgpack.Decoder:
        decoder = self._decoders.get(request_type)
        if decoder is None:
            decoder = self._decoders[request_type] = msgspec.msgpack.Decoder(request_type)
        return decoder


def rows_of(requests: list) -> int:
    """Inputs a batch's requests carry (texts; a rerank's documents, `RerankRequest.docs`),
    0 when their type names none (`micro_items_cap` then leaves micro-batches as the
    profile says)."""
    rows = 0
    for r in requests:
        inputs = getattr(r, "inputs", None)
        if inputs is None:
            inputs = getattr(r, "docs", None)
        if inputs is None:
            return 0
        rows += len(inputs)
    return rows


def batch_loras(adapter: Adapter, requests: list) -> tuple[str, ...]:
    """The LoRA adapters a batch mixes (store names, sorted): its replies' `X-Batch-Adapters`."""
    return tuple(sorted({lora for r in requests if (lora := adapter.lora_of(r)) is not None}))
