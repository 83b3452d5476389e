"""Several boxes: the streams, KV bucket and object store every box shares, declared
at the join with as many copies as the NATS cluster can keep.

Declaring is idempotent and every box does it, so the last box to join sets the
limits; copies are only ever raised by fleet (lowered only by an explicit
`nats_replicas`). No API outside the system account counts a cluster's JetStream
servers, so JetStream's own placement answers how many copies fit: three are asked
first, and "cannot place" falls back to one (daemon/cluster.py and docs/architecture.md
say when it warns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import (BOXES_BUCKET, CLUSTER_REPLICAS, DEDUP_WINDOW_S, ERR_CANNOT_PLACE,
                                        ERR_NOT_CLUSTERED, ERR_STREAM_EXISTS, PAYLOAD_TTL_S, PAYLOADS_BUCKET,
                                        REPLY_PREFIX, REPLY_STREAM, REPLY_STREAM_BYTES, REPLY_TTL_S, STREAM,
                                        WORK_PREFIX, log)


def choose_replicas(setting: int, wanted: int, have: int) -> int:
    """Replicas for a shared stream that exists with `have`: the setting when set (raised or
    lowered to it); else what this cluster takes (`wanted`), never fewer than it has (an
    operator may have raised it by hand)."""
    return setting or max(wanted, have)


class Streams:
    """Declares the shared names through the link's JetStream context; `replicas` is the
    number of copies they were declared with (in this box's cluster entry)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.settings = link.settings
        self.replicas = 1

    @property
    def js(self) -> Any:
        return self.link.js

    async def declare(self) -> tuple[Any, Any]:
        """The streams, KV bucket and object store every box shares, `self.replicas`
        copies each; returns the KV bucket's and the object store's handles. Declaring is
        idempotent; a box with other limits updates them (the last one wins), and raises a
        stream with fewer replicas in place (one log line)."""
        from nats.js.api import DiscardPolicy, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
        from nats.js.client import KV_STREAM_TEMPLATE, OBJ_STREAM_TEMPLATE

        def work(replicas: int) -> StreamConfig:
            return StreamConfig(
                name=STREAM, subjects=[WORK_PREFIX + ">"], retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE, discard=DiscardPolicy.NEW, max_msgs=self.settings.nats_max_queued,
                duplicate_window=DEDUP_WINDOW_S, num_replicas=replicas,
            )

        def replies(replicas: int) -> StreamConfig:
            # Final replies only (<box>.<instance>.<n>): pieces (one token more) are not kept.
            return StreamConfig(
                name=REPLY_STREAM, subjects=[REPLY_PREFIX + "*.*.*"], retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=REPLY_TTL_S,
                max_bytes=REPLY_STREAM_BYTES, duplicate_window=DEDUP_WINDOW_S, num_replicas=replicas,
            )

        def boxes(replicas: int) -> Awaitable[Any]:
            return self.js.create_key_value(bucket=BOXES_BUCKET, ttl=3 * self.settings.nats_heartbeat_ms / 1000.0,
                                            history=1, storage=StorageType.FILE, replicas=replicas)

        def payloads(replicas: int) -> Awaitable[Any]:
            return self.js.create_object_store(PAYLOADS_BUCKET, ObjectStoreConfig(
                ttl=PAYLOAD_TTL_S, storage=StorageType.FILE, replicas=replicas))

        self.replicas = self.settings.nats_replicas or CLUSTER_REPLICAS
        changed: list[str] = []
        for config in (work, replies):
            await self._put_stream(STREAM if config is work else REPLY_STREAM,
                                   lambda r, c=config: self.js.add_stream(c(r)), changed,
                                   update=lambda r, c=config: self.js.update_stream(c(r)))
        kv = await self._put_stream(KV_STREAM_TEMPLATE.format(bucket=BOXES_BUCKET), boxes, changed,
                                    bind=lambda: self.js.key_value(BOXES_BUCKET))
        obj = await self._put_stream(OBJ_STREAM_TEMPLATE.format(bucket=PAYLOADS_BUCKET), payloads, changed,
                                     bind=lambda: self.js.object_store(PAYLOADS_BUCKET))
        if changed:
            log.info("replicas changed in place to %d: %s", self.replicas, ", ".join(changed))
        return kv, obj

    async def _put_stream(self, name: str, create: Callable[[int], Awaitable[Any]], changed: list[str], *,
                          update: Callable[[int], Awaitable[Any]] | None = None,
                          bind: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Create stream `name` (`create(replicas)`), or, when it exists, `update` it to
        this box's config (a bucket keeps its own) with `choose_replicas` copies; then
        `bind` to it (a bucket's handle).

        Where JetStream cannot place the copies and the setting left the number to
        fleet: on a single server one copy, silently; on a cluster with fewer than three
        JetStream servers up (or out of storage), one copy and a warning; the next box to
        join raises it. `self.replicas` follows, so the next streams skip the try.
        Consumers keep `num_replicas` 0 and so follow their stream's replicas."""
        from nats.js.errors import APIError

        try:
            try:
                created = await create(self.replicas)
            except APIError as exc:
                if not self._may_place_fewer(exc):
                    raise
                self._cannot_place(name, self.replicas, exc)
                self.replicas = 1
                created = await create(1)
            return created if bind is None else await bind()
        except APIError as exc:
            if exc.err_code != ERR_STREAM_EXISTS:
                raise
        info = await self.js.stream_info(name)
        have = info.config.num_replicas or 1
        want = choose_replicas(self.settings.nats_replicas, self.replicas, have)
        if update is None:  # a bucket: only its replicas change
            async def update(replicas: int) -> None:
                await self.js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))

            if want == have:
                return await bind()
        try:
            await update(want)
        except APIError as exc:
            if not self._may_place_fewer(exc):
                raise
            self._cannot_place(name, want, exc)
            want = have
            await update(have)
        if want != have:
            changed.append(f"{name} (had {have})")
        return None if bind is None else await bind()

    def _may_place_fewer(self, exc: Any) -> bool:
        """JetStream could not place the copies, and the number was fleet's to choose."""
        return not self.settings.nats_replicas and self.replicas > 1 and \
            exc.err_code in ERR_CANNOT_PLACE

    def _cannot_place(self, name: str, replicas: int, exc: Any) -> None:
        if exc.err_code != ERR_NOT_CLUSTERED:  # a single server has one copy by nature: nothing to say
            log.warning("%s: the NATS cluster cannot place %d replicas now (%s: fewer than three JetStream "
                        "servers up, or out of storage); keeping 1, raised when a box joins and it can",
                        name, replicas, exc.description)
