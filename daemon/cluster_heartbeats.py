"""Several boxes: what each box says about itself, and what it hears of the others.

Two signals, on two clocks, for two readers:
- Alive (`Liveness`): every `nats_ack_wait_ms / ALIVE_SHARE` each box publishes an
  empty core-NATS message on `fleet.alive.<box>.<instance>`. A requester whose
  request's holder has been quiet for LAPSE_PERIODS of them queues the request again
  (the requester decides; this room only says who is quiet), long before JetStream
  would redeliver it after the ack wait.
- Heartbeat (`Heartbeats`): every `nats_heartbeat_ms` each box puts its JSON entry
  (models, capacity, counters) in the KV bucket `fleet_boxes` (TTL 3 periods) and
  reads everyone's: `GET /v1/cluster`, and whether some live box stores a model this
  one does not (and, for a LoRA adapter, of which base: its `bases`). The beat also follows this box's store (the puller binds a consumer
  per stored model) and reads each model's JetStream backlog for `/metrics`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.decisions import SHARED_DECIDERS
from fleet.errors import BadRequest, ModelNotFound
from fleet.store import Store

from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import (ALIVE_PREFIX, ALIVE_SHARE, BOXES_BUCKET, LAPSE_PERIODS, STREAM, consumer_name,
                                        json_decode, json_encode, log, nats_trouble)


class Liveness:
    """Holders' alive signals, as this box hears them, and its own.

    `alive` maps a holder id to its last sign of life (monotonic s); `listening_since`
    is since when this box has been listening (inf while it is away: nothing heard
    during a blip means no box is gone, so no lapse is judged then)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.alive: dict[str, float] = {}
        self.quiet: set[str] = set()
        self.listening_since = time.monotonic()

    @property
    def period_s(self) -> float:
        return self.link.settings.nats_ack_wait_ms / 1000.0 / ALIVE_SHARE

    def heard(self, holder: str) -> None:
        self.alive[holder] = time.monotonic()

    async def on_alive(self, msg: Any) -> None:
        self.heard(msg.subject[len(ALIVE_PREFIX):])

    def judge(self, now: float) -> tuple[set[str], set[str]]:
        """Holders quiet for LAPSE_PERIODS periods of this box's own listening, and which
        of them went quiet since the last judgement."""
        lapse = LAPSE_PERIODS * self.period_s
        quiet = {h for h, at in self.alive.items() if now - max(at, self.listening_since) >= lapse}
        newly_quiet, self.quiet = quiet - self.quiet, quiet
        return quiet, newly_quiet

    async def say_alive(self) -> None:
        """This box's own signal (core NATS, no payload), while connected."""
        if not self.link.nc.is_connected:
            return
        try:
            await self.link.nc.publish(ALIVE_PREFIX + self.link.holder_id, b"")
        except nats_trouble() as exc:
            self.link.log_error(f"alive signal failed: {exc}")

    def stop_listening(self) -> None:
        self.listening_since = math.inf

    def listen(self, now: float) -> None:
        self.listening_since = now

    def forget(self, before: float) -> None:
        """Drop holders not heard from since `before` (monotonic s)."""
        for holder in [h for h, at in self.alive.items() if at < before]:
            del self.alive[holder]


class Heartbeats:
    """This box's entry in `fleet_boxes`, and everyone's as last read.

    `entry` builds this box's entry (the bridge's counters live in its rooms);
    `follow` gets the store's models (name -> task) and its LoRA adapters' bases
    (adapter -> base) at every beat (the puller binds their consumers and runs an
    adapter's work in its base's lane); `on_lag` gets (model, pending, unacked) of each model's work
    consumer (the daemon's `fleet_nats_*_messages` gauges)."""

    def __init__(self, link: Link, store: Store, *, entry: Callable[[], Awaitable[dict[str, Any]]],
                 follow: Callable[[dict[str, str], dict[str, str]], None],
                 on_lag: Callable[[str, int, int], None] | None = None) -> None:
        self.link = link
        self.store = store
        self._entry = entry
        self._follow = follow
        self._on_lag = on_lag
        #: The bucket's handle, bound at the join.
        self.kv: Any = None
        self._boxes: dict[str, dict[str, Any]] = {}
        #: Stored models of another task that answer decisions too (a transformers
        #: generator: fleet.decisions.SHARED_DECIDERS), as the last beat read them; the
        #: entry's `decides`, so a box that does not store one routes decisions to it.
        #: A LoRA adapter of one answers them too, from its base's lane.
        self.decides: list[str] = []

    async def loop(self, wake: Callable[[], None]) -> None:
        """Beat every `nats_heartbeat_ms`; `wake` first (fetch credit: workers that came
        up since add room without anything given back)."""
        while True:
            await asyncio.sleep(self.link.settings.nats_heartbeat_ms / 1000.0)
            wake()
            try:
                await self.beat()
            # Blind on purpose: a beat reads the store and the workers as well as NATS, and
            # this loop must outlive any one failure (a box that stops beating drops out of
            # every cluster view and stops following its store).
            except Exception as exc:
                self.link.log_error(f"heartbeat failed: {exc}")

    async def beat(self) -> None:
        """Publish this box's entry, read everyone's, follow this box's store."""
        from nats.js.errors import NoKeysError

        stored = await asyncio.to_thread(self.store.list)
        models = {m.name: m.task for m in stored}
        bases = {m.name: m.base for m in stored if m.base}
        deciders = {m.name for m in stored if (m.task, m.runtime) in SHARED_DECIDERS}
        self.decides = sorted(deciders | {name for name, base in bases.items() if base in deciders})
        self._follow(models, bases)
        await self._read_lag(models)
        await self.kv.put(self.link.key, json_encode(await self._entry()))
        self.link.jetstream_ok_at = time.monotonic()
        boxes: dict[str, dict[str, Any]] = {}
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            keys = []
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except nats_trouble():  # expired between keys() and get()
                continue
            if entry.value:
                boxes[key] = json_decode(entry.value)
        self._boxes = boxes

    async def _read_lag(self, models: dict[str, str]) -> None:
        """Each stored model's work in JetStream: not yet delivered to any box (pending) and
        delivered but not answered (unacked), from its consumer, for `on_lag`."""
        if self._on_lag is None:
            return
        for model in models:
            try:
                info = await self.link.js.consumer_info(STREAM, consumer_name(model))
            except nats_trouble():  # not bound yet, or JetStream busy: the next heartbeat reads it
                continue
            self._on_lag(model, info.num_pending, info.num_ack_pending)

    async def withdraw(self) -> None:
        """Remove this box's entry (leaving): others stop counting it at once."""
        if self.kv is None:  # left before the join bound the bucket: no entry was put
            return
        try:
            await self.kv.delete(self.link.key)
        except nats_trouble() as exc:
            log.warning("could not remove this box from %s: %s", BOXES_BUCKET, exc)

    def boxes(self) -> list[dict[str, Any]]:
        """Live boxes (heartbeat within 3 periods), this one first, then by name."""
        stale_s = 3 * self.link.settings.nats_heartbeat_ms / 1000.0
        now = time.time()
        live = [{**b, "age_s": round(now - b["at"], 1)} for b in self._boxes.values() if now - b["at"] < stale_s]
        return sorted(live, key=lambda b: (b["instance"] != self.link.instance, b["box"]))

    def base_of(self, adapter: str) -> str | None:
        """The base a live box stores LoRA adapter `adapter` of (None: no box stores it as one)."""
        return next((b["bases"][adapter] for b in self.boxes() if adapter in b.get("bases", {})), None)

    def check_model(self, model: str, task: str) -> None:
        """For a model this box does not store: some live box must, for `task`."""
        boxes = self.boxes()
        tasks = {b["models"][model] for b in boxes if model in b["models"]}
        if not tasks:
            raise ModelNotFound(f"unknown model {model!r}: no box in the cluster has it")
        if task == "decide" and any(model in b.get("decides", ()) for b in boxes):
            return  # a generator that answers decisions from its own lane
        if task not in tasks:
            raise BadRequest(f"model {model!r} serves task {sorted(tasks)[0]!r}, not {task!r}")
