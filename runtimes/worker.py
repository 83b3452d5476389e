"""The worker core: choose a lane, claim a batch, run it, ack.

`WorkerCore.step()` does one scheduling round and is testable in-process with
a real queue and a tiny model; `runtimes.process` adds only the process
wiring (signals, heartbeat thread). The core owns its device and every adapter
loaded on it (STYLE.md 5): nothing else loads or frees models on this device.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from fleet.control import (
    CONTROL_BATCH, EVICT, LOAD, OPS, PIN, UNLOAD, UNPIN, Command, CommandDone, control_lane, is_control_lane,
)
from fleet.control import decode_command as _decode_command
from fleet.errors import BadRequest, FleetError, ModelLoadFailed, ModelTooLarge
from fleet.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from local_queue import QueueFull
from local_queue.queue import INFO_BYTES
from runtimes.base import Adapter, ModelSpec
from runtimes.continuous import abort_in_flight, busy_continuous, serve_continuous
from runtimes.memory import (
    IDLE_NAP_S, PEER_STALE_NS, RUNTIME_LIBRARIES, DeviceMemory, Estimates, Footprint, LoadLock, NotNow, ResidentView,
    estimate_footprint, is_out_of_memory, load_error, return_freed_heap, run_split_on_oom, used_bytes,
)
from runtimes.placement import ASK_PEERS, ELSEWHERE, TOO_LARGE, DeviceSnapshot, LaneDemand, decide_load
from runtimes.placement import LOAD as PLACE_LOAD
from runtimes.policy import (
    MIN_SAMPLES, CostModel, LastRun, LinearCost, batch_token_cap, choose_lane, find_copies, form_batch,
    linger_left_ms, linger_window, padded_tokens, stall_bound_ms,
)
from runtimes.registry import adapter_class
from runtimes.state import BATCH_RING, BatchStats, NotNowMemo, Progress, Resident

#: Heap trims (trim_if_due) at most this often: one costs a few ms on a large heap.
TRIM_EVERY_NS = 1_000_000_000

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode
_decode_info = msgspec.msgpack.Decoder().decode

#: Out-of-memory failures in a row while loading one model before its requests are
#: answered `model_too_large` (until then the memory is taken "for now": they wait).
MAX_LOAD_OOMS = 3
#: A worker asks a peer to evict one model at most once per this many seconds.
PEER_ASK_S = 1.0
#: How long an explicit load waits for asked peers to drop their idle models.
PEER_EVICT_WAIT_S = 2.0


class PeersAsked(NotNow):
    """Idle models of other workers of this device hold the room; their holders were asked to evict them."""

    def __init__(self, message: str, victims: tuple[tuple[int, str], ...]) -> None:
        super().__init__(message)
        self.victims = victims


def footprint_from_headers(spec: ModelSpec) -> Footprint:
    """A model's footprint before loading it: its safetensors headers and configs."""
    return estimate_footprint(
        spec.path, spec.runtime, dtype=spec.profile.dtype, max_batch_tokens=spec.profile.max_batch_tokens,
        micro_batch_items=spec.profile.micro_batch_items, max_seq_len=spec.max_seq_len,
    )


@dataclass
class WorkerCore:
    queue: object  # local_queue.LocalQueue
    worker_id: int
    device: str
    resolve: Callable[[str], ModelSpec]
    #: (task, runtime) -> adapter class; the registry in production, fakes in tests.
    adapter_for: Callable[[str, str], type[Adapter]] = adapter_class
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
    load_timeout_ms: float = 300_000.0
    #: The batch or load running now and its bound, for the heartbeat thread (runtimes.process).
    progress: Progress = field(default_factory=Progress)
    clock_ns: Callable[[], int] = time.monotonic_ns
    #: Returns freed heap to the system; run when the queue is empty after batches,
    #: at most every TRIM_EVERY_NS (issue 16: worker RSS kept climbing under mixed load).
    trim_heap: Callable[[], None] = return_freed_heap
    trimmed_at: tuple[int, int] = (0, 0)  # (batch_seq, clock_ns) of the last trim
    models: dict[str, Resident] = field(default_factory=dict)
    last_batch: BatchStats = field(default_factory=BatchStats)
    #: Fitted batch cost per model on this device (kept across unloads: same model, same device).
    costs: dict[str, CostModel] = field(default_factory=dict)
    #: Each model's last batch here: when it was acked, its items and time (the linger rule, `linger_window`).
    last_runs: dict[str, LastRun] = field(default_factory=dict)
    _decoders: dict[type, msgspec.msgpack.Decoder] = field(default_factory=dict)
    #: Device budget and live free memory (runtimes.memory.device_budget); unlimited in bare tests.
    memory: DeviceMemory = field(default_factory=DeviceMemory.unlimited)
    #: One load at a time per device, across this daemon's workers.
    load_lock: LoadLock = field(default_factory=lambda: LoadLock(None))
    estimates: Estimates = field(default_factory=Estimates)
    #: Models this worker keeps resident whatever the pressure (pins, preloads).
    pinned: set[str] = field(default_factory=set)
    #: A model's footprint before it loads (headers; injected: the simulation sizes models itself).
    estimate_footprint: Callable[[ModelSpec], Footprint] = footprint_from_headers
    #: Models whose last load attempt here said "not here, now", while that holds (`remember`).
    not_now: dict[str, NotNowMemo] = field(default_factory=dict)
    #: Out-of-memory load failures in a row, per model.
    load_ooms: dict[str, int] = field(default_factory=dict)
    #: (worker, model) -> when this worker last asked that peer to evict it (clock_ns).
    asked: dict[tuple[int, str], int] = field(default_factory=dict)
    #: The model being loaded now ("" when none), published so peers do not load it too.
    loading: str = ""
    #: When `loading` was announced (monotonic ns): of two workers announcing one load, the earlier goes ahead.
    loading_since_ns: int = 0
    #: Lanes the last `servable` left to the other workers holding their model (the herd rule).
    declined: list = field(default_factory=list)
    #: Cumulative counters for the daemon's metrics (published in the info blob; the
    #: daemon diffs them, so no event between two reads is missed): loads per model,
    #: evictions per model and reason, batches run (sequence) and the last BATCH_RING
    #: of them as (model, items, tokens).
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, dict[str, int]] = field(default_factory=dict)
    batch_seq: int = 0
    batch_ring: deque = field(default_factory=lambda: deque(maxlen=BATCH_RING))

    @property
    def control(self) -> str:
        """This worker's control lane (fleet.control)."""
        return control_lane(self.worker_id)

    # -- residency: budget, lazy load, eviction, pins, control ---------------
    #
    # Lock order: the device's LoadLock, then the queue lock (taken inside
    # queue calls). Under the LoadLock a worker takes its snapshot of the
    # device, decides once (runtimes.placement.decide_load), evicts, loads and
    # publishes its new info before releasing, so the next worker of the
    # device decides on what is really resident.

    def load(self, name: str, *, pin: bool = False, explicit: bool = False,
             evicted: list[str] | None = None) -> Resident:
        """Make `name` resident on this worker: a lazy load for a waiting lane,
        or an explicit one (control path, `explicit=True`, which may evict
        busy unpinned models because an operator asked).

        One attempt: size the model up (outside the device lock), then under the
        lock take one `snapshot` and apply the one verdict `decide_load` gives.
        Raises `ModelTooLarge` for TOO_LARGE; `NotNow` for every "not here, now"
        verdict (its requests stay queued), remembered for `servable`; a lazy
        attempt that finds another load holding the device lock is NotNow too.
        """
        resident = self.models.get(name)
        if resident is not None:
            if pin and name not in self.pinned:
                self.pinned.add(name)
                self.publish_info()
            return resident
        spec, header = self.size_up(name)
        estimate = self.estimates.estimate(name, spec.runtime, header)
        library = RUNTIME_LIBRARIES.get(spec.runtime)
        if library is not None:
            # Outside the device lock, and before deciding: a worker that was told "not
            # here" has the library ready when it takes the model over from a peer that
            # died (a load then costs the weights only; load_ms stays what a reload costs).
            importlib.import_module(library)
        with self.load_lock.held(blocking=explicit) as locked:
            if not locked:
                raise self.remember(name, NotNow(f"another load holds {self.device}; {name} waits its turn"))
            snap = self.snapshot(self.queue.lane_stats())
            verdict = decide_load(snap, name, estimate, explicit=explicit)
            if verdict.kind == TOO_LARGE:
                raise ModelTooLarge(verdict.reason, hint="unpin or unload a model, or raise the device budget")
            if verdict.kind == ASK_PEERS:
                self.ask_peers_to_evict(verdict.evict_peers)
                raise self.remember(name, PeersAsked(verdict.reason, verdict.evict_peers))
            if verdict.kind != PLACE_LOAD:
                raise self.remember(name, NotNow(verdict.reason), left_to_holders=verdict.kind == ELSEWHERE)
            self.announce_load(name, snap, look=not explicit)
            for victim in verdict.evict:
                log.info("evicting %s from %s to make room for %s", victim, self.device, name)
                self.unload(victim, reason="lru")
                if evicted is not None:
                    evicted.append(victim)
            resident = self.load_adapter(spec, header, estimate)
        self.not_now.pop(name, None)
        if pin:
            self.pinned.add(name)
            self.publish_info()
        return resident

    def size_up(self, name: str) -> tuple[ModelSpec, Footprint]:
        """Resolve `name` (re-hashes its files) and read its footprint from its headers."""
        try:
            spec = self.resolve(name)
            return spec, self.estimate_footprint(spec)
        except Exception as exc:  # unreadable headers are bad weights: a load error, not a crash
            raise load_error(name, self.device, exc) from exc

    def announce_load(self, name: str, snap: DeviceSnapshot, *, look: bool) -> None:
        """Publish the load before paying for it (peers on every device then count this
        worker as a holder); a lazy load then looks once more: two workers of different
        devices decide without a common lock, and of two that announce the same load the
        later one finds the earlier (find_copies `announced`) and yields (NotNow)."""
        self.loading, self.loading_since_ns = name, time.monotonic_ns()
        self.publish_info()
        if not look:
            return
        mine = (self.loading_since_ns, self.worker_id)
        if find_copies(self._peer_infos(), name, announced=mine).holders > find_copies(snap.infos, name).holders:
            self.loading, self.loading_since_ns = "", 0
            self.publish_info()
            raise self.remember(name, NotNow(f"another worker announced {name} first; it loads it"))

    def load_adapter(self, spec: ModelSpec, header: Footprint, estimate: Footprint) -> Resident:
        """The load itself (`loading` published), then measure, correct the estimate
        and publish. Out of memory while loading is "not here, now" (the memory was
        taken meanwhile: the lane waits and the next attempt decides again) until
        MAX_LOAD_OOMS in a row; other failures are the model's (`load_error`)."""
        name = spec.name
        t0 = time.perf_counter()
        try:
            with self.progress.running(f"loading {name}", self.load_timeout_ms):
                adapter = self.adapter_for(spec.task, spec.runtime)(spec, self.device)
                adapter.load()
        except Exception as exc:
            # Drop every reference to the half-loaded model (the traceback's frames
            # hold it too) so its memory is free before the next decision.
            adapter = None
            traceback.clear_frames(exc.__traceback__)
            self.release_memory()
            if is_out_of_memory(exc):
                self.load_ooms[name] = self.load_ooms.get(name, 0) + 1
                if self.load_ooms[name] < MAX_LOAD_OOMS:
                    log.warning("out of memory loading %s on %s (%d in a row); its requests wait", name,
                                self.device, self.load_ooms[name])
                    raise self.remember(name, NotNow(f"out of memory loading {name} on {self.device}")) from None
            self.load_ooms.pop(name, None)
            raise load_error(name, self.device, exc) from exc
        finally:
            self.loading, self.loading_since_ns = "", 0
        self.load_ooms.pop(name, None)
        measured = adapter.footprint_bytes()
        self.estimates.record(name, spec.runtime, header, measured)
        now = time.time()
        resident = Resident(adapter, loaded_at=now, last_used=now, load_ms=(time.perf_counter() - t0) * 1e3,
                            footprint=Footprint(measured, estimate.activation_bytes))
        self.models[name] = resident
        self.loads[name] = self.loads.get(name, 0) + 1
        log.info("loaded %s on %s as %s in %.0f ms: %d bytes (estimated %d)", name, self.device, adapter.dtype,
                 resident.load_ms, measured, estimate.weights_bytes)
        self.publish_info()
        return resident

    def remember(self, name: str, exc: NotNow, *, left_to_holders: bool = False) -> NotNow:
        """Keep a "not here, now" verdict for an IDLE_NAP_S, so that the next rounds skip
        the lane without deciding again (a verdict left to the model's holders also lets
        `wait_for_work` block until new work comes or that lane would starve)."""
        self.not_now[name] = NotNowMemo(self.clock_ns() + int(IDLE_NAP_S * 1e9), left_to_holders)
        return exc

    def ask_peers_to_evict(self, victims: tuple[tuple[int, str], ...]) -> None:
        """Put an `evict` command into each holder's control lane (fleet.control): the
        holder drops the model only if it is still idle and unpinned. Asked at most once
        per PEER_ASK_S for one (worker, model); the reply goes to request id 0, which no
        caller waits on."""
        now = self.clock_ns()
        for wid, model in victims:
            if now - self.asked.get((wid, model), -(1 << 62)) < PEER_ASK_S * 1e9:
                continue
            self.asked[(wid, model)] = now
            log.info("asking worker %d of %s to evict idle %s", wid, self.device, model)
            try:
                self.queue.put(self.queue.lane_id(control_lane(wid)), _encode(Command(EVICT, model)), tokens=1,
                               request_id=0)
            except QueueFull as exc:  # asked again on a later attempt; the lane waits meanwhile
                log.warning("cannot ask worker %d to evict %s: %s", wid, model, exc.message)

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
        abort_in_flight(self, resident.adapter, WorkError("overloaded", f"{name} was unloaded from {self.device} "
                                                          "while generating; retry"))
        resident.adapter.unload()
        del resident
        self.release_memory()
        self.publish_info()
        return True

    def release_memory(self) -> None:
        """Give freed model memory back now, so the next decision reads it as free:
        models hold reference cycles (gc), and torch caches freed CUDA blocks."""
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def restore(self, names: list[str]) -> None:
        """Load and pin what this worker must keep (preloads, persisted pins of its
        device). A model another worker of the device holds is left to it; one that
        fails is logged, and requests for it get the error when they come."""
        for name in dict.fromkeys(names):
            try:
                self.load(name, pin=True, explicit=True)
            except NotNow as exc:
                log.info("not loading %s here: %s", name, exc)
            except Exception as exc:
                log.error("cannot keep %s resident on %s: %s", name, self.device, exc)

    def used_bytes(self) -> int:
        return used_bytes(self._own_views({}))

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
        peers: list[ResidentView] = []
        loading: dict[str, int] = {}
        infos: list[tuple[int, dict]] = []
        budget: dict[str, int] = {}
        used: dict[str, int] = {}
        now = time.monotonic_ns()
        for w in self.queue.workers():
            if w.wid == self.worker_id or not w.info or now - w.last_heartbeat_ns > PEER_STALE_NS:
                continue
            info = _decode_info(w.info)
            infos.append((w.wid, info))
            if w.device != self.device:
                budget[w.device] = max(budget.get(w.device, 0), int(info.get("budget_bytes", 0)))
                used[w.device] = used.get(w.device, 0) + int(info.get("used_bytes", 0))
                continue
            act = int(info.get("activation_bytes", 0))
            for n, m in info.get("models", {}).items():
                peers.append(ResidentView(n, w.wid, Footprint(int(m.get("bytes", 0)), act), bool(m.get("pinned")),
                                          float(m.get("last_used", 0.0)), float(m.get("load_ms", 0.0)) / 1e3,
                                          waiting.get(n, 0), float(m.get("loaded_at", 0.0))))
            if info.get("loading"):
                loading[info["loading"]] = w.wid
        own_costs = {n: LinearCost(*c.fit()) for n, c in self.costs.items() if c.samples >= MIN_SAMPLES}
        return DeviceSnapshot(
            self.worker_id, self.device, self.memory.budget_bytes, self.memory.free_now(),
            tuple(self._own_views(waiting)), tuple(peers), loading, tuple(infos),
            {d: budget[d] - used[d] for d in budget}, demand, own_costs,
            self.clock_ns(), time.time(), self.max_wait_ms * 1_000_000,
        )

    def _peer_infos(self) -> list[tuple[int, dict]]:
        """(wid, decoded info) of the other live workers, every device."""
        now = time.monotonic_ns()
        return [(w.wid, _decode_info(w.info)) for w in self.queue.workers()
                if w.wid != self.worker_id and w.info and now - w.last_heartbeat_ns <= PEER_STALE_NS]

    def servable(self, stats: list) -> list:
        """The lanes this worker may serve now, from `lane_stats()`: no control lanes,
        and no lane whose last load attempt here said "not here, now" in the last
        IDLE_NAP_S (`remember`). Lanes left to the workers holding their model are also kept
        in `self.declined` (their holders are woken by new work)."""
        out, self.declined = [], []
        now = self.clock_ns()
        for s in stats:
            if is_control_lane(s.model):
                continue
            memo = self.not_now.get(s.model)
            if s.depth and s.model not in self.models and memo is not None and now < memo.until_ns:
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

    def serve_control(self, stats: list) -> int:
        """Handle the commands queued in this worker's control lane (protocol:
        fleet.control), each acked as soon as it is done. Returns items answered."""
        lane = next((s.lane for s in stats if s.model == self.control and s.depth), None)
        if lane is None:
            return 0
        claims = self.queue.claim(lane, worker=self.worker_id, max_items=CONTROL_BATCH, max_tokens=1 << 30,
                                  lease_ms=self.lease_ms)
        for c in claims:
            try:
                body = self.command(_decode_command(c.payload))
                status = STATUS_OK
            except FleetError as exc:
                body, status = WorkError(exc.code, exc.message), STATUS_ERROR
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                body, status = WorkError("bad_request", f"undecodable control command: {exc}"), STATUS_ERROR
            except NotNow as exc:
                body, status = WorkError("overloaded", f"{exc}; retry shortly"), STATUS_ERROR
            except Exception as exc:  # the worker stays up; the caller learns why
                log.exception("control command failed")
                body, status = WorkError("internal", f"{type(exc).__name__}: {exc}"), STATUS_ERROR
            self.queue.ack_many([(c.item_id, _encode(Envelope(0.0, 0.0, self.served_by, body)), status)])
        return len(claims)

    def command(self, cmd: Command) -> CommandDone:
        """Apply one control command to this worker's models."""
        name, op = cmd.model, cmd.op
        if op in (LOAD, PIN):
            was = name in self.models
            evicted: list[str] = []
            t0 = time.perf_counter()
            try:
                resident = self.load(name, pin=op == PIN, explicit=True, evicted=evicted)
            except PeersAsked as asked:
                # An operator is waiting: give the peers a moment to drop their idle
                # models (they serve their control lanes every step), then try once more.
                self.await_peer_evictions(asked.victims)
                resident = self.load(name, pin=op == PIN, explicit=True, evicted=evicted)
            ms = 0.0 if was else (time.perf_counter() - t0) * 1e3
            return CommandDone(op, name, self.device, True, name in self.pinned, resident.footprint.weights_bytes,
                               round(ms, 1), evicted, was)
        if op == UNLOAD:
            if name in self.pinned:
                raise BadRequest(f"{name} is pinned on {self.device}; unpin it first (fleetctl unpin {name})")
            return CommandDone(op, name, self.device, False, already=not self.unload(name))
        if op == EVICT:
            return self.evict_if_idle(name)
        if op == UNPIN:
            was = name in self.pinned
            self.pinned.discard(name)
            self.publish_info()
            resident = self.models.get(name)
            return CommandDone(op, name, self.device, resident is not None, False,
                               resident.footprint.weights_bytes if resident else 0, already=not was)
        raise BadRequest(f"unknown control op {op!r} (known: {', '.join(OPS)})")

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
        """Wait up to PEER_EVICT_WAIT_S for the asked peers to publish their models gone."""
        deadline = time.monotonic() + PEER_EVICT_WAIT_S
        while time.monotonic() < deadline:
            infos = dict(self._peer_infos())
            if not any(m in infos.get(w, {}).get("models", {}) for w, m in victims):
                return
            time.sleep(IDLE_NAP_S)

    def info(self) -> dict:
        return {
            "device": self.device,
            "budget_bytes": self.memory.budget_bytes,
            "used_bytes": self.used_bytes(),
            "activation_bytes": max((r.footprint.activation_bytes for r in self.models.values()), default=0),
            "loading": self.loading,
            "loading_since_ns": self.loading_since_ns,
            "models": {
                name: {
                    "task": r.adapter.spec.task,
                    "dtype": r.adapter.dtype,
                    "profile": r.adapter.spec.extra.get("profile", "default"),  # tuned device class or "default"
                    "bytes": r.weights_shown() + r.adapter.reserved_bytes(),  # cache reserve included
                    "loaded_at": r.loaded_at,
                    "last_used": r.last_used,
                    "served": r.served,
                    "load_ms": round(r.load_ms, 1),
                    "pinned": name in self.pinned,
                    "cost": self._cost_info(name),
                    "loras": r.adapter.attached_loras(),  # LoRA adapters attached to it (generation)
                }
                for name, r in self.models.items()
            },
            "last_batch": {
                "model": self.last_batch.model,
                "items": self.last_batch.items,
                "tokens": self.last_batch.tokens,
                "padded": self.last_batch.padded,
                "ms": round(self.last_batch.ms, 2),
                "at": self.last_batch.at,
                "returned": self.last_batch.returned,
            },
            "loads": self.loads,
            "evictions": self.evictions,
            "batches": self._batches_info(),
        }

    def _batches_info(self) -> dict:
        """The batch ring, compact (the whole blob must fit INFO_BYTES): model names
        once, then flat [model index, items, tokens] triples, oldest first; `seq` is
        the number of batches run so far (the last entry's sequence)."""
        names: dict[str, int] = {}
        flat: list[int] = []
        for model, items, tokens in self.batch_ring:
            flat += (names.setdefault(model, len(names)), items, tokens)
        return {"seq": self.batch_seq, "models": list(names), "ring": flat}

    def _cost_info(self, name: str) -> dict:
        cost = self.costs.get(name)
        if cost is None:
            return {"a_ms": 0.0, "b_ms_per_1k_tokens": 0.0, "samples": 0}
        a, b = cost.fit()
        return {"a_ms": round(a, 3), "b_ms_per_1k_tokens": round(b * 1e3, 3), "samples": cost.samples}

    def publish_info(self) -> None:
        info = self.info()
        blob = _encode(info)
        if len(blob) > INFO_BYTES:
            # Too many resident models for the worker record: publish names only,
            # most recently used first, as many as fit (the batch must not fail).
            names = sorted(self.models, key=lambda n: self.models[n].last_used, reverse=True)
            while True:
                info["models"] = {name: {} for name in names}
                blob = _encode(info)
                if len(blob) <= INFO_BYTES:
                    break
                names.pop()
        self.queue.set_worker_info(self.worker_id, blob)

    # -- one scheduling round ------------------------------------------------

    def step(self, timeout_s: float = 0.5) -> int:
        """Serve one batch if work waits (blocking up to `timeout_s` for it). Returns items answered."""
        woke_ns = time.monotonic_ns()  # the request timeline's stamps (fleet.messages.WORKER_STAGES)
        # 1. Control commands first; then choose a lane among those this worker
        #    may serve: starving first, then models held here, then oldest.
        since = self.queue.work_generation()  # before lane_stats: work put after it ends the wait below
        stats = self.queue.lane_stats()
        if done := self.serve_control(stats):
            return done
        servable = self.servable(stats)
        # Generation (continuous adapters) in flight steps first (runtimes.continuous).
        if (busy := busy_continuous(self, servable)) is not None:
            return serve_continuous(self, busy, stats)
        # 2. Make sure the model is here before claiming: while it loads, its requests
        #    stay queued (and can time out or be cancelled there). A lane whose load
        #    attempt says "not here, now" is skipped (remembered) and another is chosen.
        tried: set[str] = set()
        while True:
            lane = choose_lane(servable, set(self.models), self.clock_ns(), self.max_wait_ms * 1_000_000)
            if lane is None:
                self.wait_for_work(stats, timeout_s, since=since)
                return 0
            try:
                resident = self.load(lane.model)
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
            return serve_continuous(self, resident, stats)
        profile = adapter.spec.profile
        cost = self.costs.setdefault(lane.model, CostModel())
        cap = batch_token_cap(cost, self.target_ms, profile.max_batch_tokens)
        # 3. Claim up to the budget (a sum of tokens: the padded cap bounds it),
        #    linger for more while the lane is drained, keep what fits, return the rest.
        claims = self.claim_batch(lane.lane, profile.max_batch_items, cap, queued=lane.depth)
        if not claims:
            return 0  # another worker took them first, or they all expired
        claimed_ns = time.monotonic_ns()
        linger_ms, since_ns = self.linger_window_for(lane.model, profile, claims[0])
        claims = self.linger_for_more(lane.lane, claims, linger_ms, since_ns, profile.max_batch_items, cap,
                                      answered=self.last_runs.get(lane.model))
        lingered_ns = time.monotonic_ns()
        keep = form_batch([c.tokens for c in claims], [c.attempts for c in claims], profile.max_batch_items, cap)
        claims, returned = self.return_overpull(claims, keep)
        # 4. Claimed items whose deadline passed were already answered `timeout`
        #    by the daemon: drop them unrun (their ack is then discarded there).
        now = self.clock_ns()
        late = [c for c in claims if c.deadline_ns and c.deadline_ns <= now]
        if late:
            claims = [c for c in claims if not (c.deadline_ns and c.deadline_ns <= now)]
            self._ack_errors(late, WorkError("timeout", "the request's deadline passed before it ran"))
        if not claims:
            return len(late)
        # 5. Decode (after returning: a returned payload is no longer ours), run, ack
        #    in one `ack_many` (one lock and one wake-up for the whole batch).
        decoder = self._decoder(adapter.request_type)
        runnable, acks = [], []
        for c in claims:
            try:
                runnable.append((c, decoder.decode(c.payload)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = WorkError("bad_request", f"undecodable work item: {exc}")
                acks.append((c.item_id, _encode(Envelope(0.0, 0.0, self.served_by, error)), STATUS_ERROR))
        requests = [r for _, r in runnable]
        tokens = [c.tokens for c, _ in runnable]
        padded = padded_tokens(tokens)
        adapter.marks = (0, 0, 0)
        t0 = time.perf_counter()
        decoded_ns = time.monotonic_ns()
        try:
            # Leases are renewed only within the batch's bound (a hung forward loses them).
            with self.progress.running(f"a batch of {len(requests)} on {lane.model}", stall_bound_ms(cost, padded)):
                results = run_split_on_oom(adapter.run_batch, requests, self.release_memory) if requests else []
        except FleetError as exc:
            results = [WorkError(exc.code, exc.message)] * len(requests)
        except Exception as exc:  # a model failure answers this batch; the worker stays up
            log.exception("batch failed on %s", lane.model)
            results = [WorkError("inference_failed", f"{lane.model}: {type(exc).__name__}: {exc}")] * len(requests)
        ms = (time.perf_counter() - t0) * 1e3
        start_ns = self.clock_ns() - int(ms * 1e6)
        stamps = (woke_ns, claimed_ns, lingered_ns, decoded_ns, *adapter.marks, time.monotonic_ns())
        acks += [
            (
                c.item_id,
                _encode(Envelope((start_ns - c.enqueue_ns) / 1e6, ms, self.served_by, r, stamps)),
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
            log.error("results of %d items on %s do not fit the queue: %s", len(acks), lane.model, exc.message)
            self._ack_errors(claims, WorkError("overloaded", f"queue memory is full for results: {exc.message}"))
        # 6. Learn from this batch: its padded size and measured time refine the cost model.
        if requests:
            cost.observe(padded, ms)
        resident.last_used = time.time()
        resident.served += len(claims)
        self.last_batch = BatchStats(lane.model, len(claims), sum(tokens), padded, ms, time.time(), returned)
        self.last_runs[lane.model] = LastRun(acked_ns, len(claims), ms)
        self.batch_seq += 1
        self.batch_ring.append((lane.model, len(claims), sum(tokens)))
        self.publish_info()
        return len(claims) + len(late)

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

    def _ack_errors(self, claims: list, error: WorkError) -> None:
        payload = _encode(Envelope(0.0, 0.0, self.served_by, error))
        self.queue.ack_many([(c.item_id, payload, STATUS_ERROR) for c in claims])

    def _fail_lane(self, lane: int, exc: FleetError) -> int:
        """A model that cannot load answers what waits for it, and the worker goes on."""
        log.error("cannot serve lane %s: %s", self.queue.lane_name(lane), exc.message)
        claims = self.queue.claim(lane, worker=self.worker_id, max_items=1024, max_tokens=1 << 30, lease_ms=self.lease_ms)
        self._ack_errors(claims, WorkError(exc.code, exc.message))
        return len(claims)

    def _decoder(self, request_type: type) -> msgspec.msgpack.Decoder:
        decoder = self._decoders.get(request_type)
        if decoder is None:
            decoder = self._decoders[request_type] = msgspec.msgpack.Decoder(request_type)
        return decoder
