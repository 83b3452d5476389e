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

from fleetctl.errors import FleetError
from runtimes.base import Adapter, ModelSpec
from runtimes.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from runtimes.policy import choose_lane, form_batch
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
    ms: float = 0.0
    at: float = 0.0


@dataclass
class WorkerCore:
    queue: object  # local_queue.LocalQueue
    worker_id: int
    device: str
    resolve: Callable[[str], ModelSpec]
    #: `<box>/<worker>` written into every result (the X-Served-By header).
    served_by: str = ""
    lease_ms: int = 10_000
    max_wait_ms: int = 2_000
    clock_ns: Callable[[], int] = time.monotonic_ns
    models: dict[str, Resident] = field(default_factory=dict)
    last_batch: BatchStats = field(default_factory=BatchStats)
    _decoders: dict[type, msgspec.msgpack.Decoder] = field(default_factory=dict)

    # -- models ---------------------------------------------------------------

    def load(self, name: str) -> Resident:
        resident = self.models.get(name)
        if resident is not None:
            return resident
        t0 = time.perf_counter()
        spec = self.resolve(name)
        adapter = adapter_class(spec.task, spec.runtime)(spec, self.device)
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
                }
                for name, r in self.models.items()
            },
            "last_batch": {
                "model": self.last_batch.model,
                "items": self.last_batch.items,
                "tokens": self.last_batch.tokens,
                "ms": round(self.last_batch.ms, 2),
                "at": self.last_batch.at,
            },
        }

    def publish_info(self) -> None:
        self.queue.set_worker_info(self.worker_id, _encode(self.info()))

    # -- one scheduling round ------------------------------------------------

    def step(self, timeout_s: float = 0.5) -> int:
        """Serve one batch if work waits (blocking up to `timeout_s` for it). Returns items acked."""
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
        adapter = resident.adapter
        profile = adapter.spec.profile
        # 3. Claim up to the batch budget, return what does not fit.
        claims = self.queue.claim(
            lane.lane, worker=self.worker_id, max_items=profile.max_batch_items,
            max_tokens=profile.max_batch_tokens, lease_ms=self.lease_ms,
        )
        if not claims:
            return 0
        keep = form_batch([c.tokens for c in claims], profile.max_batch_items, profile.max_batch_tokens)
        if keep < len(claims):
            self.queue.return_items([c.item_id for c in claims[keep:]])
            claims = claims[:keep]
        # 4. Decode, run, ack (one lock and one wake-up for the whole batch).
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
        self.queue.ack_many(acks)
        resident.last_used = time.time()
        resident.served += len(claims)
        self.last_batch = BatchStats(lane.model, len(claims), sum(c.tokens for c in claims), ms, time.time())
        self.publish_info()
        return len(claims)

    def _fail_lane(self, lane: int, exc: FleetError) -> int:
        """A model that cannot load answers what waits for it, and the worker goes on."""
        log.error("cannot serve lane %s: %s", self.queue.lane_name(lane), exc.message)
        claims = self.queue.claim(lane, worker=self.worker_id, max_items=1024, max_tokens=1 << 30, lease_ms=self.lease_ms)
        payload = _encode(Envelope(0.0, 0.0, self.served_by, WorkError(exc.code, exc.message)))
        self.queue.ack_many([(c.item_id, payload, STATUS_ERROR) for c in claims])
        return len(claims)

    def _decoder(self, request_type: type) -> msgspec.msgpack.Decoder:
        decoder = self._decoders.get(request_type)
        if decoder is None:
            decoder = self._decoders[request_type] = msgspec.msgpack.Decoder(request_type)
        return decoder
