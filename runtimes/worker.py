"""The worker core: choose a lane, claim a batch, run it, ack.

`WorkerCore.step()` does one scheduling round and is testable in-process with
a real queue and a tiny model; `runtimes.process` adds only the process
wiring (signals, heartbeat thread). The core owns its device and every adapter
loaded on it (STYLE.md 5): nothing else loads or frees models on this device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from fleetctl.errors import FleetError, ModelLoadFailed
from local_queue import QueueFull
from local_queue.queue import INFO_BYTES
from runtimes.base import Adapter, ModelSpec
from runtimes.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from runtimes.policy import (
    CostModel, batch_token_cap, choose_lane, form_batch, linger_left_ms, padded_tokens,
)
from runtimes.registry import adapter_class

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class Resident:
    adapter: Adapter
    loaded_at: float
    last_used: float
    served: int = 0
    load_ms: float = 0.0


@dataclass
class BatchStats:
    model: str = ""
    items: int = 0
    tokens: int = 0
    padded: int = 0  # items x longest (tokens)
    ms: float = 0.0
    at: float = 0.0
    returned: int = 0  # over-pulled items given back when this batch was formed


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
    clock_ns: Callable[[], int] = time.monotonic_ns
    models: dict[str, Resident] = field(default_factory=dict)
    last_batch: BatchStats = field(default_factory=BatchStats)
    #: Fitted batch cost per model on this device (kept across unloads: same model, same device).
    costs: dict[str, CostModel] = field(default_factory=dict)
    _decoders: dict[type, msgspec.msgpack.Decoder] = field(default_factory=dict)

    # -- models ---------------------------------------------------------------

    def load(self, name: str) -> Resident:
        resident = self.models.get(name)
        if resident is not None:
            return resident
        t0 = time.perf_counter()
        spec = self.resolve(name)
        adapter = self.adapter_for(spec.task, spec.runtime)(spec, self.device)
        adapter.load()
        now = time.time()
        resident = Resident(adapter, loaded_at=now, last_used=now, load_ms=(time.perf_counter() - t0) * 1e3)
        self.models[name] = resident
        log.info("loaded %s on %s as %s in %.0f ms", name, self.device, adapter.dtype, resident.load_ms)
        self.publish_info()
        return resident

    def unload(self, name: str) -> bool:
        resident = self.models.pop(name, None)
        if resident is None:
            return False
        resident.adapter.unload()
        self.publish_info()
        return True

    def info(self) -> dict:
        return {
            "device": self.device,
            "models": {
                name: {
                    "task": r.adapter.spec.task,
                    "dtype": r.adapter.dtype,
                    "bytes": r.adapter.footprint_bytes(),
                    "loaded_at": r.loaded_at,
                    "last_used": r.last_used,
                    "served": r.served,
                    "load_ms": round(r.load_ms, 1),
                    "cost": self._cost_info(name),
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
        }

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
        # 1. Choose a lane: starving first, then models held here, then oldest.
        lane = choose_lane(self.queue.lane_stats(), set(self.models), self.clock_ns(), self.max_wait_ms * 1_000_000)
        if lane is None:
            self.queue.wait_for_work(timeout_s)
            return 0
        # 2. Make sure the model is here before claiming: while it loads, its
        #    requests stay queued (and can time out or be cancelled there).
        try:
            resident = self.load(lane.model)
        except FleetError as exc:
            return self._fail_lane(lane.lane, exc)
        except Exception as exc:  # a load that fails unexpectedly answers its lane; the worker stays up
            log.exception("loading %s failed", lane.model)
            return self._fail_lane(lane.lane, ModelLoadFailed(f"cannot load {lane.model!r}: {type(exc).__name__}: {exc}"))
        adapter = resident.adapter
        profile = adapter.spec.profile
        cost = self.costs.setdefault(lane.model, CostModel())
        cap = batch_token_cap(cost, self.target_ms, profile.max_batch_tokens)
        # 3. Claim up to the budget (a sum of tokens: the padded cap bounds it),
        #    linger for more while the lane is drained, keep what fits, return the rest.
        claims = self.queue.claim(lane.lane, worker=self.worker_id, max_items=profile.max_batch_items,
                                  max_tokens=cap, lease_ms=self.lease_ms)
        if not claims:
            return 0  # another worker took them first, or they all expired
        claims = self.linger_for_more(lane.lane, claims, profile.linger_ms or self.linger_ms,
                                      profile.max_batch_items, cap)
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
        t0 = time.perf_counter()
        try:
            results = adapter.run_batch(requests) if requests else []
        except FleetError as exc:
            results = [WorkError(exc.code, exc.message)] * len(requests)
        except Exception as exc:  # a model failure answers this batch; the worker stays up
            log.exception("batch failed on %s", lane.model)
            results = [WorkError("inference_failed", f"{lane.model}: {type(exc).__name__}: {exc}")] * len(requests)
        ms = (time.perf_counter() - t0) * 1e3
        start_ns = self.clock_ns() - int(ms * 1e6)
        acks += [
            (
                c.item_id,
                _encode(Envelope((start_ns - c.enqueue_ns) / 1e6, ms, self.served_by, r)),
                STATUS_ERROR if isinstance(r, WorkError) else STATUS_OK,
            )
            for (c, _), r in zip(runnable, results)
        ]
        try:
            self.queue.ack_many(acks)
        except QueueFull as exc:
            # No slab room for some results right now: those items are still ours;
            # answer them with a short error (acks already done are skipped there).
            log.error("results of %d items on %s do not fit the queue: %s", len(acks), lane.model, exc.message)
            self._ack_errors(claims, WorkError("overloaded", f"queue memory is full for results: {exc.message}"))
        # 6. Learn from this batch: its padded size and measured time refine the cost model.
        tokens = [c.tokens for c, _ in runnable]
        padded = padded_tokens(tokens)
        if requests:
            cost.observe(padded, ms)
        resident.last_used = time.time()
        resident.served += len(claims)
        self.last_batch = BatchStats(lane.model, len(claims), sum(tokens), padded, ms, time.time(), returned)
        self.publish_info()
        return len(claims) + len(late)

    def linger_for_more(self, lane: int, claims: list, linger_ms: float, max_items: int, cap: int) -> list:
        """While the lane is drained and the batch short, wait (on the queue's wake-ups)
        up to `linger_ms` from the head's enqueue and claim what arrives in this lane."""
        while True:
            left = linger_left_ms(
                self.clock_ns(), claims[0].enqueue_ns, linger_ms, items=len(claims), max_items=max_items,
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
