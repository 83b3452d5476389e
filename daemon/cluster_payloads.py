"""Several boxes: bodies too large for one NATS message, in the object store.

A request body over `nats_large_payload_bytes` (or the server's max_payload) and a
reply over max_payload travel through the object store `fleet_payloads`, named by
request id (`<id>.reply` for a reply): the work or reply message carries only its
annotation and the object's name. The requester puts a body and deletes it once
answered; the puller reads it. A body whose request may wait past the bucket's TTL (a
batch line) is put again by its requester (`keep`). The object store has no
per-object TTL or touch, which is why keeping is a re-put and why a read is bounded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleet.errors import Timeout

from fleet.daemon.cluster_link import Link
from fleet.daemon.cluster_names import KEEP_EVERY, OBJECT_READ_S, PAYLOAD_TTL_S, log, nats_trouble


class Payloads:
    """The object store `fleet_payloads` as the requester and the puller use it."""

    def __init__(self, link: Link) -> None:
        self.link = link
        #: The bucket's handle, bound at the join.
        self.obj: Any = None
        #: The bucket's TTL (s) as JetStream keeps it (read at the join: a bucket keeps
        #: the config of the box that created it); 0: objects never expire.
        self.ttl_s = PAYLOAD_TTL_S
        #: Bodies put again so they outlive the TTL (`keep`).
        self.refreshed = 0

    async def bind(self, obj: Any) -> None:
        self.obj = obj
        self.ttl_s = (await obj.status()).ttl or 0.0

    async def put(self, name: str, body: bytes, deadline: float) -> None:
        try:
            await asyncio.wait_for(self.obj.put(name, body), max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            raise Timeout("could not store a body in the JetStream object store in time") from None

    async def read(self, name: str) -> bytes:
        """A reply's body (the requester reads it while its request waits for it)."""
        return (await self.obj.get(name)).data

    async def read_body(self, name: str) -> bytes:
        """A request's body, for the puller: at most OBJECT_READ_S, since nats.py's `get`
        waits forever for chunks purged under it (its requester put the body again, or
        deleted it, meanwhile)."""
        return (await asyncio.wait_for(self.obj.get(name), OBJECT_READ_S)).data

    async def delete(self, name: str) -> None:
        try:
            await self.obj.delete(name)
        except nats_trouble() as exc:  # the bucket's TTL removes it anyway
            log.warning("could not delete payload object %s: %s", name, exc)

    async def keep(self, rid: str, body: bytes, deadline: float) -> None:
        """Keep request `rid`'s body in the object store until the request is answered
        (this task is cancelled then), though its deadline (monotonic s) is past the
        bucket's TTL.

        JetStream expires every chunk of an object by its age, and the object store has
        no per-object TTL or touch: the body is put again under the same name (new
        chunks, then the meta, then the old chunks purged) every KEEP_EVERY of the TTL,
        timed from the start of the last put, also while a box holds the request (it
        may hand it back: `nak`, or die). A puller reading it just then reads purged
        chunks: its read is bounded (OBJECT_READ_S) and the message read again. If this
        box dies, nobody puts the body again: an orphan lives at most one TTL."""
        ttl = self.ttl_s
        put_at = time.monotonic()  # the first put ended just before: an upper bound of its start
        while deadline > put_at + ttl:  # else the body outlives the request as it is
            await asyncio.sleep(max(0.0, put_at + ttl * KEEP_EVERY - time.monotonic()))
            started = time.monotonic()
            try:
                await self.obj.put(rid, body)
            except nats_trouble() as exc:  # NATS away: again soon, within the two thirds of the TTL left
                self.link.log_error(f"could not put the body of {rid} again: {type(exc).__name__}: {exc}")
                await asyncio.sleep(ttl / 16)
                continue
            put_at = started
            self.refreshed += 1
