"""The models on this worker's device: load, evict, pin, give memory back.

A `Residency` owns every adapter loaded on its worker's device (STYLE.md 5):
nothing else loads or frees models here. The step loop (runtimes.worker) asks
`ensure` for the model of the lane it chose and learns "not here, now"
(`NotNow`, `PeersAsked`: its requests stay queued) or "never here"
(`ModelTooLarge`); control commands (runtimes.commands) pin, unload and evict
through it. What it needs from the worker is passed in: a `publish` hook
(the worker's info blob, which peers read to decide their own loads) and an
`on_unload` hook (continuous batching answers the generation in flight).

Its neighbours: runtimes.hosting (the effects it is built with: sizing, the weights
check, giving memory back), runtimes.peers (reading the other workers' info blobs,
asking them to evict), runtimes.placement (the one decision each load attempt applies).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fleet.control import EVICT, CommandDone, control_lane
from fleet.errors import FleetError, ModelLoadFailed, ModelTooLarge
from fleet.runtimes.base import Adapter, ModelSpec, Profile
from fleet.runtimes.device_memory import DeviceMemory, LoadLock
from fleet.runtimes.footprint import Estimates, Footprint
from fleet.runtimes.heap import return_freed_heap
from fleet.runtimes.hosting import footprint_from_headers, refuse_mismatched_weights, return_freed_memory
from fleet.runtimes.loading import LoadRuns, PendingLoad
from fleet.runtimes.memory import (
    IDLE_NAP_S, RUNTIME_LIBRARIES, NotNow, ResidentView, is_out_of_memory, load_error, used_bytes,
)
from fleet.runtimes.peers import (
    PeersAsked, ask_peers_to_evict, await_peer_evictions, peer_infos, peers_used_bytes, read_peers,
)
from fleet.runtimes.placement import ASK_PEERS, ELSEWHERE, TOO_LARGE, DeviceSnapshot, LaneDemand, decide_load
from fleet.runtimes.placement import LOAD as PLACE_LOAD
from fleet.runtimes.policy import MIN_SAMPLES, CostModel, LinearCost, behind, find_copies
from fleet.runtimes.state import NotNowMemo, Progress, Resident

log = logging.getLogger("fleet.worker")

#: Out-of-memory failures in a row while loading one model before its requests are
#: answered `model_too_large` (until then the memory is taken "for now": they wait).
MAX_LOAD_OOMS = 3
#: Characters of the reason an unservable pin is published with (the info blob is small).
UNSERVABLE_CHARS = 200
#: Two looks at a lane further apart than this say nothing about the time between them
#: (`Residency.track_behind`): a worker left a lane to its holders looks at least once
#: per step (0.5 s) while work waits, and after IDLE_NAP_S when new work comes.
BEHIND_LOOK_GAP_NS = 1_000_000_000
#: A model's sizing (resolve: every file re-hashed, its headers read) serves the load
#: decisions of this long; the load itself always sizes it afresh.
SIZED_KEEP_NS = 10_000_000_000
#: A lazy load that failed beside serving answers its lane at the lane's next turn within
#: this long (the step loop looks at the lanes every step); later requests load again.
FAILED_KEEP_NS = 1_000_000_000


@dataclass(kw_only=True)
class Residency:
    queue: object  # local_queue.LocalQueue
    worker_id: int
    device: str
    resolve: Callable[[str], ModelSpec]
    #: (task, runtime) -> adapter class; the registry in production, fakes in tests.
    adapter_for: Callable[[str, str], type[Adapter]]
    #: Publishes the worker's info blob (peers decide their loads on it).
    publish: Callable[[], None]
    #: Called with a model about to be unloaded, before its adapter lets go (generation in flight is answered).
    on_unload: Callable[[str, Adapter], None]
    #: The worker's progress record: a load runs within `load_timeout_ms` (runtimes.process heartbeat).
    progress: Progress
    #: The worker's fitted batch costs (read: a load decision weighs them; the step loop fits them).
    costs: dict[str, CostModel]
    clock_ns: Callable[[], int]
    #: Starvation bound for lane choice (Settings.lane_max_wait_ms).
    max_wait_ms: int
    #: The batch target (Settings.batch_target_ms): a lane whose interactive head waited
    #: longer is behind (`runtimes.policy.behind`; 0: never), which a load decision weighs.
    behind_ms: float = 0.0
    #: How long one model load may take before this worker counts as stuck (Settings.load_timeout_ms).
    load_timeout_ms: float = 300_000.0
    #: Device budget and live free memory (runtimes.device_memory.device_budget); unlimited in bare tests.
    memory: DeviceMemory = field(default_factory=DeviceMemory.unlimited)
    #: One load at a time per device, across this daemon's workers.
    load_lock: LoadLock = field(default_factory=lambda: LoadLock(None))
    #: A model's footprint before it loads (headers; injected: the simulation sizes models itself).
    estimate_footprint: Callable[[ModelSpec], Footprint] = footprint_from_headers
    #: Gives freed memory of the device back (injected: a simulated device has no allocator).
    return_freed: Callable[[str], None] = return_freed_memory
    #: Refuses weights that do not fit their architecture, before each load.
    check_weights: Callable[[ModelSpec], None] = refuse_mismatched_weights
    #: A model's profile as the catalog names it now (runtimes.resolve.store_profiles): a
    #: SIGHUP's `profile` command applies it to resident models. None: not re-read (bare tests).
    profile_of: Callable[[str], tuple[Profile, str, dict[str, str], dict[str, Any]]] | None = None
    models: dict[str, Resident] = field(default_factory=dict)
    estimates: Estimates = field(default_factory=Estimates)
    #: Models this worker keeps resident whatever the pressure (pins, preloads).
    pinned: set[str] = field(default_factory=set)
    #: Models this worker was to keep (`restore`: preloads, persisted pins) and cannot:
    #: name -> why (`code: message`). Published: readiness names them instead of
    #: waiting for them (daemon.core.Daemon.readiness).
    unservable: dict[str, str] = field(default_factory=dict)
    #: Models whose last load attempt here said "not here, now", while that holds (`remember`).
    not_now: dict[str, NotNowMemo] = field(default_factory=dict)
    #: Out-of-memory load failures in a row, per model.
    load_ooms: dict[str, int] = field(default_factory=dict)
    #: (worker, model) -> when this worker last asked that peer to evict it (clock_ns).
    asked: dict[tuple[int, str], int] = field(default_factory=dict)
    #: model -> (since, last seen) (clock_ns): its lane was behind at every look since.
    behind_seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Name -> spec without re-hashing its files (runtimes.resolve.store_resolver with
    #: verify=False): what a load decision that may not load sizes from. None: `resolve`.
    peek: Callable[[str], ModelSpec] | None = None
    #: model -> (spec, header footprint, when sized (clock_ns)): what a load decision
    #: that does not load reuses (`ensure`).
    sized: dict[str, tuple[ModelSpec, Footprint, int]] = field(default_factory=dict)
    #: The load running beside serving (runtimes.loading), until the step loop settles it.
    pending: PendingLoad | None = None
    #: Loads settled with control commands still to answer (runtimes.commands.settle).
    settled: list[PendingLoad] = field(default_factory=list)
    #: model -> (why its lazy load failed, when (clock_ns)): its lane's next `ensure` is answered so.
    failed: dict[str, tuple[FleetError, int]] = field(default_factory=dict)
    #: The model being loaded now ("" when none), published so peers do not load it too.
    loading: str = ""
    #: When `loading` was announced (monotonic ns): of two workers announcing one load, the earlier goes ahead.
    loading_since_ns: int = 0
    #: Cumulative counters for the daemon's metrics (published in the info blob; the
    #: daemon diffs them, so no event between two reads is missed): loads per model,
    #: evictions per model and reason.
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, dict[str, int]] = field(default_factory=dict)

    # Lock order: the device's LoadLock, then the queue lock (taken inside
    # queue calls). Under the LoadLock a worker takes its snapshot of the
    # device, decides once (runtimes.placement.decide_load), evicts, loads and
    # publishes its new info before releasing, so the next worker of the
    # device decides on what is really resident. The load itself runs beside
    # serving (runtimes.loading): the lock is held until it settles.

    def ensure(self, name: str, *, pin: bool = False, explicit: bool = False,
               evicted: list[str] | None = None) -> Resident:
        """Make `name` resident on this worker: a lazy load for a waiting lane,
        or an explicit one (control path, `explicit=True`, which may evict
        busy unpinned models because an operator asked).

        Starts its load (`begin_load`) unless one runs here (one at a time), and
        waits for the one running (`await_load`) while no other work waits here:
        `LoadRuns` (NotNow) when some does, which the step loop serves meanwhile. A
        lazy load that failed answers its lane once (`failed`)."""
        resident = self.models.get(name)
        if resident is None:
            failed = self.failed.pop(name, None)
            if failed is not None and not explicit and self.clock_ns() - failed[1] <= FAILED_KEEP_NS:
                raise failed[0]
            if self.pending is None:
                self.begin_load(name, pin=pin, explicit=explicit)
            load = self.await_load()
            if load.name != name:  # another model's load ran first: now this one's turn
                if not explicit:  # the step loop chooses again (it prefers the model just loaded)
                    raise NotNow(f"{load.name} was loading on {self.device}; {name} waits its turn")
                return self.ensure(name, pin=pin, explicit=explicit, evicted=evicted)
            if evicted is not None:
                evicted += load.evicted
            if load.error is not None:
                self.failed.pop(name, None)
                raise load.error
            resident = self.models[name]
        if pin and name not in self.pinned:
            self.pinned.add(name)
            self.publish()
        return resident

    def begin_load(self, name: str, *, pin: bool, explicit: bool) -> None:
        """One attempt to load `name` here: size the model up (outside the device lock),
        then under the lock take one `snapshot`, apply the one verdict `decide_load`
        gives and, to load, evict and start the load (`pending`), which keeps the lock.
        Raises `ModelTooLarge` for TOO_LARGE; `NotNow` for every "not here, now"
        verdict (its requests stay queued), remembered for `not_now_for`; a lazy
        attempt that finds another load holding the device lock is NotNow too."""
        # A worker that leaves a lane to its holders decides again every IDLE_NAP_S while
        # new work comes: its decisions reuse one sizing for SIZED_KEEP_NS, and a lazy
        # attempt sizes without re-hashing the files (`peek`: the hash of a model's
        # weights, every SIZED_KEEP_NS, was the cost of a worker that never loads it).
        # A load only ever follows a sizing of its own attempt that re-hashed every
        # file: a load verdict on any other sizes afresh (outside the device lock) and
        # decides again.
        kept = None if explicit else self.sized.get(name)
        if kept is not None and self.clock_ns() - kept[2] > SIZED_KEEP_NS:
            kept = None
        verify = explicit
        while True:
            if kept is None:
                spec, header = self.size_up(name, verify=verify)
                self.sized[name] = (spec, header, self.clock_ns())
                fresh = verify or self.peek is None  # without a peek every sizing re-hashes
            else:
                spec, header, _ = kept
                fresh = False
            estimate = self.estimates.estimate(name, spec.runtime, header)
            library = RUNTIME_LIBRARIES.get(spec.runtime)
            if library is not None:
                # Outside the device lock, and before deciding: a worker that was told "not
                # here" has the library ready when it takes the model over from a peer that
                # died (a load then costs the weights only; load_ms stays what a reload costs).
                importlib.import_module(library)
            if not self.load_lock.acquire(blocking=explicit):
                raise self.remember(name, NotNow(f"another load holds {self.device}; {name} waits its turn"))
            started = False
            try:
                snap = self.snapshot(self.queue.lane_stats())
                verdict = decide_load(snap, name, estimate, explicit=explicit)
                if verdict.kind == TOO_LARGE:
                    raise ModelTooLarge(verdict.reason, hint="unpin or unload a model, or raise the device budget")
                if verdict.kind == ASK_PEERS:
                    self.ask_peers_to_evict(verdict.evict_peers)
                    raise self.remember(name, PeersAsked(verdict.reason, verdict.evict_peers))
                if verdict.kind != PLACE_LOAD:
                    raise self.remember(name, NotNow(verdict.reason), left_to_holders=verdict.kind == ELSEWHERE)
                del self.sized[name]
                if not fresh:  # every load re-hashes: a changed file is reported, never served
                    kept, verify = None, True
                    continue
                self.announce_load(name, snap, look=not explicit)
                load = PendingLoad(spec, header, estimate, pin=pin)
                for victim in verdict.evict:
                    log.info("evicting %s from %s to make room for %s", victim, self.device, name)
                    self.unload(victim, reason="lru")
                    load.evicted.append(victim)
                self.pending = load
                load.start(partial(self.build_adapter, spec), self.progress, self.load_timeout_ms)
                started = True
                return
            finally:
                if not started:  # else the load holds the lock until it settles
                    self.load_lock.release()

    def size_up(self, name: str, *, verify: bool = True) -> tuple[ModelSpec, Footprint]:
        """Resolve `name` (`verify`: re-hashing its files; else through `peek`, where set)
        and read its footprint from its headers."""
        try:
            spec = self.resolve(name) if verify or self.peek is None else self.peek(name)
            return spec, self.estimate_footprint(spec)
        except Exception as exc:  # unreadable headers are bad weights: a load error, not a crash
            raise load_error(name, self.device, exc) from exc

    def announce_load(self, name: str, snap: DeviceSnapshot, *, look: bool) -> None:
        """Publish the load before paying for it (peers on every device then count this
        worker as a holder); a lazy load then looks once more: two workers of different
        devices decide without a common lock, and of two that announce the same load the
        later one finds the earlier (find_copies `announced`) and yields (NotNow)."""
        self.loading, self.loading_since_ns = name, time.monotonic_ns()
        self.publish()
        if not look:
            return
        mine = (self.loading_since_ns, self.worker_id)
        peers = peer_infos(self.queue, self.worker_id)
        if find_copies(peers, name, announced=mine).holders > find_copies(snap.infos, name).holders:
            self.loading, self.loading_since_ns = "", 0
            self.publish()
            raise self.remember(name, NotNow(f"another worker announced {name} first; it loads it"))

    def build_adapter(self, spec: ModelSpec) -> Adapter:
        """The load itself, on its own thread (runtimes.loading): it touches nothing else here."""
        self.check_weights(spec)
        adapter = self.adapter_for(spec.task, spec.runtime)(spec, self.device)
        if spec.profile.engine not in ("auto", *adapter.engines):
            raise ModelLoadFailed(f"{spec.name}: runtime {spec.runtime!r} runs on {', '.join(adapter.engines)}; "
                                  f"the profile's engine {spec.profile.engine!r} cannot serve it")
        adapter.load()
        return adapter

    def await_load(self) -> PendingLoad:
        """Wait for the load running here and settle it; `LoadRuns` as soon as other work
        waits here (`work_beside`: the step loop serves it, the load goes on), seen within
        IDLE_NAP_S. The wait is on the load's event, not on the queue: a signal (the
        worker's SIGTERM) never interrupts it into a failed load."""
        load = self.pending
        if load is None:
            raise RuntimeError("await_load without a load running: this is a bug")
        while not load.done.is_set():
            if self.work_beside():
                raise self.remember(load.name, LoadRuns(load, self.device))
            load.done.wait(IDLE_NAP_S)
        self.settle_load()
        return load

    def work_beside(self) -> bool:
        """Is there work this worker serves while its load runs: requests for a model
        resident here, a command in its control lane, generation in flight?"""
        if any(r.adapter.continuous and r.adapter.has_active() for r in self.models.values()):
            return True
        ctl = control_lane(self.worker_id)
        return any(s.depth and (s.model in self.models or s.model == ctl) for s in self.queue.lane_stats())

    def settle_load(self) -> PendingLoad | None:
        """The load that ran beside serving once its thread is done (else None): installed
        or its failure kept, the info published, then the device lock released; with
        control commands waiting, kept in `settled` (runtimes.commands answers them)."""
        load = self.pending
        if load is None or not load.done.is_set():
            return None
        self.pending = None
        try:
            if load.error is None:
                self.install(load)
                return_freed_heap()  # the load's scratch (dtype check copies, probes) leaves the RSS now
            else:
                load.error = self.load_failed(load)
        finally:
            self.loading, self.loading_since_ns = "", 0
            try:
                self.publish()
            finally:
                self.load_lock.release()
        if load.waiters:
            self.settled.append(load)
        return load

    def install(self, load: PendingLoad) -> Resident:
        """Measure the loaded adapter, correct the estimate, make it resident."""
        name, adapter = load.name, load.adapter
        load.adapter = None
        self.load_ooms.pop(name, None)
        measured = adapter.footprint_bytes()
        self.estimates.record(name, load.spec.runtime, load.header, measured)
        now = time.time()
        resident = Resident(adapter, loaded_at=now, last_used=now, load_ms=load.load_ms,
                            footprint=Footprint(measured, load.estimate.activation_bytes))
        self.models[name] = resident
        self.loads[name] = self.loads.get(name, 0) + 1
        self.not_now.pop(name, None)
        self.unservable.pop(name, None)
        if load.pin:
            self.pinned.add(name)
        log.info("loaded %s on %s as %s in %.0f ms: %d bytes (estimated %d)", name, self.device, adapter.dtype,
                 resident.load_ms, measured, load.estimate.weights_bytes)
        return resident

    def load_failed(self, load: PendingLoad) -> Exception:
        """What a failed load answers: out of memory is "not here, now" (the memory was
        taken meanwhile: the lane waits and the next attempt decides again) until
        MAX_LOAD_OOMS in a row; other failures are the model's (`load_error`), kept
        for its lane (`failed`) and, for a model to keep, published as unservable."""
        name, exc = load.name, load.error
        self.release_memory()  # the half-loaded model's memory is free before the next decision
        if is_out_of_memory(exc):
            self.load_ooms[name] = self.load_ooms.get(name, 0) + 1
            if self.load_ooms[name] < MAX_LOAD_OOMS:
                log.warning("out of memory loading %s on %s (%d in a row); its requests wait", name,
                            self.device, self.load_ooms[name])
                return self.remember(name, NotNow(f"out of memory loading {name} on {self.device}"))
        self.load_ooms.pop(name, None)
        error = load_error(name, self.device, exc)
        if error is not exc:
            error.__cause__ = exc
        if isinstance(error, FleetError):
            self.failed[name] = (error, self.clock_ns())
            if load.pin:
                self.unservable[name] = f"{error.code}: {error.message}"[:UNSERVABLE_CHARS]
        return error

    def remember(self, name: str, exc: NotNow, *, left_to_holders: bool = False) -> NotNow:
        """Keep a "not here, now" verdict for an IDLE_NAP_S, so that the next rounds skip
        the lane without deciding again (a verdict left to the model's holders also lets
        `wait_for_work` block until new work comes or that lane would starve)."""
        self.not_now[name] = NotNowMemo(self.clock_ns() + int(IDLE_NAP_S * 1e9), left_to_holders)
        return exc

    def left_until(self, names) -> int:
        """When the first of the "not here, now" verdicts on `names` lapses (clock ns)."""
        return min((m.until_ns for n in names if (m := self.not_now.get(n)) is not None), default=0)

    def not_now_for(self, name: str, now_ns: int) -> NotNowMemo | None:
        """The remembered "not here, now" verdict for `name` while it holds and the
        model is not resident here, else None (the lane may be served)."""
        memo = self.not_now.get(name)
        if name in self.models or memo is None or now_ns >= memo.until_ns:
            return None
        return memo

    def ask_peers_to_evict(self, victims: tuple[tuple[int, str], ...]) -> None:
        """Ask each holder to evict its idle model (runtimes.peers: at most once per PEER_ASK_S)."""
        ask_peers_to_evict(self.queue, self.asked, victims, now_ns=self.clock_ns(), device=self.device)

    def unload(self, name: str, reason: str = "unload") -> bool:
        """Take `name` off this worker; `reason` (lru: room for another, unload: asked)
        is counted for the daemon's eviction metrics."""
        resident = self.models.pop(name, None)
        if resident is None:
            return False
        by_reason = self.evictions.setdefault(name, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self.pinned.discard(name)
        # Generation in flight on it is answered now, not left leased (runtimes.continuous).
        self.on_unload(name, resident.adapter)
        resident.adapter.unload()
        del resident
        self.release_memory()
        self.publish()
        return True

    def unpin(self, name: str) -> bool:
        """Let `name` be evicted again (it stays resident). Returns whether it was pinned."""
        was = name in self.pinned
        self.pinned.discard(name)
        self.unservable.pop(name, None)
        self.publish()
        return was

    def release_memory(self) -> None:
        """Give freed model memory back now, so the next decision reads it as free."""
        self.return_freed(self.device)

    def restore(self, names: list[str]) -> None:
        """Load and pin what this worker must keep (preloads, persisted pins of its
        device). A model another worker of the device holds is left to it; one that
        fails (too large for the device, damaged, gone from the store) is logged and
        published as unservable, and requests for it get the error when they come."""
        for name in dict.fromkeys(names):
            try:
                self.ensure(name, pin=True, explicit=True)
            except NotNow as exc:
                log.info("not loading %s here: %s", name, exc)
            except Exception as exc:
                log.error("cannot keep %s resident on %s: %s", name, self.device, exc)
                why = f"{exc.code}: {exc.message}" if isinstance(exc, FleetError) else f"{type(exc).__name__}: {exc}"
                self.unservable[name] = why[:UNSERVABLE_CHARS]
        if self.unservable:
            self.publish()

    def evict_if_idle(self, name: str) -> CommandDone:
        """A peer of this device asks for room (`ask_peers_to_evict`): drop `name` if it
        is still unpinned, nothing waits for it and it generates nothing; else keep it
        (the asker decides again on its next attempt)."""
        resident = self.models.get(name)
        if resident is None:
            return CommandDone(EVICT, name, self.device, False, already=True)
        busy = (name in self.pinned or (resident.adapter.continuous and resident.adapter.has_active())
                or any(s.model == name and s.depth for s in self.queue.lane_stats()))
        if busy:
            return CommandDone(EVICT, name, self.device, True, name in self.pinned, resident.footprint.weights_bytes)
        log.info("evicting idle %s from %s: a peer of the device needs the room", name, self.device)
        self.unload(name, reason="lru")
        return CommandDone(EVICT, name, self.device, False)

    def await_peer_evictions(self, victims: tuple[tuple[int, str], ...]) -> None:
        """Wait up to PEER_EVICT_WAIT_S for the asked peers to publish their models gone (runtimes.peers)."""
        await_peer_evictions(self.queue, self.worker_id, victims)

    # -- what the device holds: own views, peers' blobs, one snapshot ----------

    def used_bytes(self) -> int:
        """What this worker holds, the weights of the load running here included."""
        loading = self.pending.estimate.weights_bytes if self.pending is not None else 0
        return used_bytes(self._own_views({})) + loading

    def kv_limit_bytes(self, adapter: Adapter) -> int:
        """The most `adapter`'s requests may reserve now: the device budget less what
        this worker holds besides them and what the other live workers of the device
        publish as used (their reserves included)."""
        peers = peers_used_bytes(self.queue, self.worker_id, self.device)
        return self.memory.budget_bytes - peers - self.used_bytes() + adapter.reserved_bytes()

    def _own_views(self, waiting: dict[str, int]) -> list[ResidentView]:
        return [
            # A generator's cache reserve counts as its own (its requests hold it).
            ResidentView(n, self.worker_id, Footprint(r.footprint.weights_bytes + r.adapter.reserved_bytes(),
                                                      r.footprint.activation_bytes),
                         n in self.pinned, r.last_used, r.load_ms / 1e3, waiting.get(n, 0))
            for n, r in self.models.items()
        ]

    def snapshot(self, stats: list) -> DeviceSnapshot:
        """One look at what a load decision reads: this worker's models, the other live
        workers' info blobs (one read of the worker table), free memory, the lanes."""
        demand = {s.model: LaneDemand(s.depth, s.tokens, s.oldest_enqueue_ns) for s in stats if s.depth}
        waiting = {m: d.depth for m, d in demand.items()}
        peers = read_peers(self.queue, self.worker_id, self.device, waiting)
        own_costs = {n: LinearCost(*c.fit()) for n, c in self.costs.items() if c.samples >= MIN_SAMPLES}
        now_ns = self.clock_ns()
        return DeviceSnapshot(
            self.worker_id, self.device, self.memory.budget_bytes, self.memory.free_now(),
            tuple(self._own_views(waiting)), peers.residents, peers.loading, peers.infos, peers.room, demand, own_costs,
            now_ns, time.time(), self.max_wait_ms * 1_000_000,
            {m: since for m, (since, _) in self.track_behind(stats, now_ns).items()},
        )

    def track_behind(self, stats: list, now_ns: int) -> dict[str, tuple[int, int]]:
        """Look at the lanes (`lane_stats()`; the worker does at every step): since when
        each has been behind at every look, `behind_seen` (model -> (since, last look),
        clock_ns). A look that finds a lane not behind, or none for BEHIND_LOOK_GAP_NS
        (what happened between is unknown), starts its clock again."""
        seen = self.behind_seen
        for s in stats:
            if not behind(s, now_ns, self.behind_ms):
                seen.pop(s.model, None)
                continue
            since, last = seen.get(s.model, (now_ns, now_ns))
            seen[s.model] = (since if now_ns - last <= BEHIND_LOOK_GAP_NS else now_ns, now_ns)
        for model in [m for m, (_, last) in seen.items() if last != now_ns]:  # lanes gone from the stats
            del seen[model]
        return seen
