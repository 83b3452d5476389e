"""Pull: the real `local_queue` and the real worker policy, on simulated GPUs.

One lane per model in a real shared-memory `LocalQueue`; the arrival thread
`put`s each request into its model's lane. Each simulated GPU is a worker
thread registered with the queue that runs the same round as
`runtimes.worker.WorkerCore.step`: `choose_lane` over the servable lanes of
`lane_stats` (WorkerCore.servable: `runtimes.memory.plan_load` must not say
WAIT), nap IDLE_NAP_S when only unservable work waits, load the model if it
must (its requests stay queued meanwhile), `claim` within the
token cap that `batch_token_cap` derives from the worker's own `CostModel`,
`form_batch` and `return_items` for over-pull, run, `ack_many`, feed the cost
model. (Linger is left out: its default, `Settings.linger_ms`, is 0.) A
collector thread drains `wait_results`, as the daemon does. The result of an
item is its batch's device end time (int64 ns), so latency is measured the
same way on both sides.

The herd rule is the committed one (`runtimes.policy.find_copies` and
`should_load_copy`, as `WorkerCore.servable` and `WorkerCore.load` apply
them): a worker does not load a model that another worker holds or is
loading (read from the workers' published info, in `WorkerCore.info`'s shape:
`models` with their fitted `cost` and `load_ms`, `loading`,
`loading_since_ns`) unless the work queued in that lane would keep each
holder busy longer than a load takes; starving lanes stay eligible. A
worker announces a load before it starts it and looks again after
announcing (the earlier announcer goes ahead). When every waiting lane is
declined that way it blocks on the queue's wake-ups (`wait_for_work(since=)`;
new work wakes every waiter) until new work comes or the oldest declined
lane would starve, as `WorkerCore.wait_for_work` does.

`loading="holders"` is the earlier proposal this rule came from, kept for
comparison: the same rule decided with the simulation's true batch and
swap costs (`should_load`) instead of the published fits, and idle workers
re-checking every NAP_MS instead of blocking on the wake-ups.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import Counter

import msgspec

from bench.sim.device import SimDevice
from bench.sim.traffic import SimModel
from local_queue import LocalQueue, QueueFull
from runtimes.memory import IDLE_NAP_S, WAIT
from runtimes.policy import (
    MIN_SAMPLES, CostModel, batch_token_cap, choose_lane, find_copies, form_batch, padded_tokens, should_load_copy,
)

_END = struct.Struct("<q")
_encode_info = msgspec.msgpack.Encoder().encode
_decode_info = msgspec.msgpack.Decoder().decode
CORE, HOLDERS = "core", "holders"
#: How long a worker naps when the only waiting work is for models others hold (device ms).
NAP_MS = 2.0


def should_load(holders_elsewhere: int, backlog_ms: float, swap_ms: float) -> bool:
    """Load a model this worker does not hold only if no other worker holds (or is
    loading) it, or the work queued for it would keep each of its holders busy
    for longer than a load takes: only then does another copy pay for itself."""
    return holders_elsewhere == 0 or backlog_ms > holders_elsewhere * swap_ms


class PullSystem:

    def __init__(self, models: list[SimModel], workers: int, slots: int, recorder, *, time_scale: float = 1.0,
                 max_wait_ms: float = 2000.0, target_ms: float = 250.0, idle_wait_s: float = 0.25,
                 lease_ms: int = 60_000, queue_slots: int = 1 << 16, loading: str = CORE) -> None:
        if loading not in (CORE, HOLDERS):
            raise ValueError(f"loading must be {CORE!r} or {HOLDERS!r}")
        self.loading = loading
        self.name = "pull" if loading == CORE else "pull+holders"
        self.models = models
        self.by_name = {m.name: m for m in models}
        self.recorder = recorder
        self.time_scale = time_scale
        # The daemon's defaults (Settings.lane_max_wait_ms, batch_target_ms; the worker
        # process loop's 0.25 s wait). Waits are wall time; the cost model sees device ms.
        self.max_wait_ns = int(max_wait_ms * time_scale * 1e6)
        self.target_ms = target_ms
        self.idle_wait_s = idle_wait_s * time_scale
        # WorkerCore naps IDLE_NAP_S when only work it may not serve waits; the holder
        # mode re-checks more often (see the module docstring).
        self.nap_s = (IDLE_NAP_S if loading == CORE else NAP_MS / 1e3) * time_scale
        self.lease_ms = lease_ms
        self.queue = LocalQueue.create(slots=queue_slots, slab_bytes=256 << 20,
                                       max_lanes=max(256, len(models)), max_workers=max(64, workers))
        self.lanes = [self.queue.lane_id(m.name) for m in models]
        self.devices = [SimDevice(slots, time_scale) for _ in range(workers)]
        #: Set by the step runner while this system's step runs: between its steps the
        #: holder mode's polling must not take CPU from the other side's step.
        self.measuring = False
        self._put_ids: dict[int, int] = {}  # request id -> put id, until its result is collected
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(w,), name=f"pull-gpu{w}", daemon=True)
                         for w in range(workers)]
        self._threads.append(threading.Thread(target=self._collect, name="pull-collector", daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, rid: int, model: SimModel, tokens: int, payload: memoryview) -> bool:
        """Enqueue one request; False when the queue is full (the daemon answers 429)."""
        try:
            self._put_ids[rid] = self.queue.put(self.lanes[model.index], payload, tokens=tokens, request_id=rid)
        except QueueFull:
            return False
        return True

    def cancel_waiting(self) -> int:
        """Drop every request still queued (end of a step); returns how many."""
        ids, self._put_ids = self._put_ids, {}
        return sum(self.queue.cancel(pid) for pid in ids.values())

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout=5 * self.time_scale + 5)
        self.queue.close()
        self.queue.unlink()

    # -- threads -----------------------------------------------------------------
    def _work(self, w: int) -> None:
        q, dev, models, by_name = self.queue, self.devices[w], self.models, self.by_name
        wid = q.register_worker(os.getpid(), f"sim-gpu{w}")
        pack = _END.pack
        costs: dict[int, CostModel] = {}
        publish = self._publisher(wid, dev, costs)
        publish("", 0)
        while not self._stop.is_set():
            # 1. Choose a lane among the servable ones: starving first, then models held
            #    here, then oldest. Servable (WorkerCore.servable): held here, or
            #    plan_load does not say WAIT (its room is held by busier models), and
            #    (committed policy) the herd rule does not leave it to its holders.
            gen = q.work_generation()  # before lane_stats: work put after it wakes the wait below
            stats = q.lane_stats()
            waiting = {by_name[s.model].index: s.depth for s in stats if s.depth}
            held = {models[i].name for i in dev.resident}
            servable = [s for s in stats if s.depth == 0 or s.model in held
                        or dev.plan_load(by_name[s.model], waiting).verdict != WAIT]
            now = time.monotonic_ns()
            declined = []
            if self.loading == CORE:
                infos = self._peer_infos(wid)
                declined = [s for s in servable if s.depth and s.model not in held
                            and not self._copy_wanted(s, infos, now)]
                servable = [s for s in servable if s not in declined]
            lane = choose_lane(servable, held, now, self.max_wait_ns)
            if lane is not None and self.loading == HOLDERS and lane.model not in held:
                lane = self._choose_without_needless_load(servable, held, wid, now)
            if lane is None:
                # WorkerCore.wait_for_work: when all that waits is left to its holders,
                # block until new work or until the oldest of it would starve; nap
                # when other unservable work waits (room held by busier models);
                # else block for new work.
                if waiting and self.loading == CORE and len(declined) == len(waiting):
                    starve_s = (min(s.oldest_enqueue_ns for s in declined) + self.max_wait_ns - now) / 1e9
                    q.wait_for_work(max(0.0, min(self.idle_wait_s, starve_s)), since=gen)
                elif waiting:
                    time.sleep(self.nap_s)
                else:
                    q.wait_for_work(self.idle_wait_s if self.loading == CORE or not self.measuring else self.nap_s)
                continue
            # 2. Load before claiming: while the model loads its requests stay in the lane,
            #    where any worker that already holds it can take them.
            model = by_name[lane.model]
            if not dev.holds(model.index):
                plan = dev.plan_load(model, waiting)
                if plan.verdict == WAIT:
                    continue  # NotNow: its requests stay queued
                # Announce the load before paying for it, so that other workers count
                # this one as a holder while it loads (the herd rule), then look again
                # (WorkerCore.load): of two that announced, the later one yields.
                since = time.monotonic_ns()
                publish(model.name, since)
                if self.loading == CORE and not self._copy_wanted(lane, self._peer_infos(wid), since,
                                                                  announced=(since, wid)):
                    publish("", 0)
                    continue
                dev.load(model, [int(n) for n in plan.evict])
                publish("", 0)
            # 3. Claim within the cost model's cap, give back what does not fit.
            prof = model.profile
            cost = costs.setdefault(model.index, CostModel())
            cap = batch_token_cap(cost, self.target_ms, prof.max_batch_tokens)
            claims = q.claim(lane.lane, worker=wid, max_items=prof.max_batch_items, max_tokens=cap,
                             lease_ms=self.lease_ms)
            if not claims:
                continue
            keep = form_batch([c.tokens for c in claims], [c.attempts for c in claims], prof.max_batch_items, cap)
            if len(keep) < len(claims):
                kept = set(keep)
                q.return_items([c.item_id for i, c in enumerate(claims) if i not in kept])
                claims = [claims[i] for i in keep]
            # 4. Run, ack the whole batch in one call, learn the batch's cost, publish
            #    (WorkerCore publishes its info after every batch: peers read the fit).
            tokens = [c.tokens for c in claims]
            end = dev.run(model, len(tokens), sum(tokens))
            q.ack_many([(c.item_id, pack(end), 0) for c in claims])
            del claims  # payload views into the slab
            cost.observe(padded_tokens(tokens), model.batch_ms(sum(tokens)))
            publish("", 0)
        q.unregister_worker(wid)

    def _publisher(self, wid: int, dev: SimDevice, costs: dict[int, CostModel]):
        """set_worker_info with the fields of WorkerCore.info that the herd rule reads:
        resident models with their fitted cost and measured load ms, and the load in progress."""
        models, q = self.models, self.queue

        def cost_info(i: int) -> dict:
            c = costs.get(i)
            if c is None or c.samples < MIN_SAMPLES:
                return {"a_ms": 0.0, "b_ms_per_1k_tokens": 0.0, "samples": 0 if c is None else c.samples}
            a, b = c.fit()
            return {"a_ms": a, "b_ms_per_1k_tokens": b * 1e3, "samples": c.samples}

        def publish(loading: str, since_ns: int) -> None:
            q.set_worker_info(wid, _encode_info({
                "loading": loading, "loading_since_ns": since_ns,
                "models": {models[i].name: {"load_ms": models[i].swap_ms, "cost": cost_info(i)}
                           for i in dev.resident},
            }))
        return publish

    def _peer_infos(self, wid: int) -> list[tuple[int, dict]]:
        return [(w.wid, _decode_info(w.info)) for w in self.queue.workers() if w.wid != wid and w.info]

    def _copy_wanted(self, lane, infos, now: int, *, announced: tuple[int, int] | None = None) -> bool:
        """The committed herd rule (WorkerCore.servable / load): a starving lane is
        served anyway; otherwise should_load_copy over the copies the peers publish."""
        if now - lane.oldest_enqueue_ns > self.max_wait_ns:
            return True
        copies = find_copies(infos, lane.model, announced=announced)
        return should_load_copy(lane.tokens, copies.holders, copies.cost, copies.load_ms)

    def _choose_without_needless_load(self, stats, held: set[str], wid: int, now: int):
        """choose_lane over the lanes this worker holds, those should_load allows, and
        the starving ones (choose_lane's bound on waiting still holds)."""
        holders = Counter()
        for _, info in self._peer_infos(wid):
            holders.update(set(info.get("models", {})) | ({info["loading"]} if info.get("loading") else set()))
        by_name = self.by_name
        eligible = [s for s in stats if s.depth > 0 and (
            s.model in held or now - s.oldest_enqueue_ns > self.max_wait_ns
            or should_load(holders[s.model], by_name[s.model].batch_ms(s.tokens), by_name[s.model].swap_ms))]
        return choose_lane(eligible, held, now, self.max_wait_ns)

    def _collect(self) -> None:
        unpack, done = _END.unpack, self.recorder.done
        while not self._stop.is_set():
            for d in self.queue.wait_results(0.1):
                done(d.request_id, unpack(d.result)[0])
                self._put_ids.pop(d.request_id, None)
