"""With `--nats`, the alias table lives in the JetStream KV bucket `fleet_aliases`, one
key per alias (its name in hex: KV keys take fewer characters than aliases do), the value
a `fleet.aliases.Alias` as JSON. Every box routes by the same table:

- A change (daemon.aliases.AliasBook.change) is a compare-and-set on the alias's key
  (`create`, or `update`/`delete` naming the revision read): two boxes changing one
  alias at once cannot both win; the loser reads again and applies its change to the
  winner's record. The box that made the change swaps it in at once.
- Every box follows the bucket two ways: a KV watch applies each change as JetStream
  delivers it (milliseconds), and every `nats_heartbeat_ms` the whole bucket is read
  again, so a box whose watch lapsed (a reconnect) is behind by one heartbeat at most.
  An entry is applied only if its revision is newer than the one this box holds.
- Until this box has joined and read the bucket, it routes by the table in its store
  file (daemon.aliases), and a change is refused `unavailable` (503): it would not
  reach the other boxes.

History (`fleetctl history`) and promotion packages reach every box through buckets of
their own (daemon.alias_records), bound here before the box follows the table.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from fleet.aliases import Alias, decode_alias, encode_alias
from fleet.errors import FleetError, Unavailable

from fleet.daemon.alias_records import SharedRecords

log = logging.getLogger("fleet.cluster")

BUCKET = "fleet_aliases"
#: Revisions kept per alias in the bucket (JetStream's own history: for an operator's eyes).
KEPT_REVISIONS = 16
#: Compare-and-set attempts of one change before it is refused (each lost to another box's).
CAS_ATTEMPTS = 8


def key_of(alias: str) -> str:
    return alias.encode().hex()


def alias_of(key: str) -> str:
    return bytes.fromhex(key).decode()


class SharedAliases:
    """This box's side of `fleet_aliases` (module doc): `AliasBook.shared` once joined."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.book = daemon.aliases
        self.kv: Any = None
        #: Revision of each alias's entry this box applied (deletes too).
        self.revisions: dict[str, int] = {}
        #: The history and packages buckets (daemon.alias_records), bound with the table's.
        self.records: Any = None
        self._tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        """Wait for the cluster, bind the bucket (made by the first box), read it, follow it."""
        cluster = self.daemon.cluster
        while not cluster.joined:
            await asyncio.sleep(0.1)
        while self.kv is None:
            try:
                self.kv = await self._bucket(cluster)
                self.records = await SharedRecords.bind(cluster)
                await self.read_all()
            except Exception as exc:  # JetStream busy or restarting: the next try
                self.kv = None
                log.warning("cannot read the alias bucket %s yet: %s: %s", BUCKET, type(exc).__name__, exc)
                await asyncio.sleep(1.0)
        self.book.shared = self
        self._tasks = [asyncio.create_task(self._watch(), name="aliases-watch"),
                       asyncio.create_task(self._poll(), name="aliases-poll")]
        log.info("aliases follow the NATS bucket %s (%d alias(es))", BUCKET, len(self.book.table))

    async def _bucket(self, cluster: Any) -> Any:
        from nats.js.api import StorageType
        from nats.js.errors import BucketNotFoundError

        try:
            return await cluster.js.key_value(BUCKET)
        except BucketNotFoundError:
            return await cluster.js.create_key_value(bucket=BUCKET, history=KEPT_REVISIONS,
                                                     storage=StorageType.FILE, replicas=cluster.replicas)

    # -- following -------------------------------------------------------------------

    def _apply(self, name: str, revision: int, value: bytes | None) -> None:
        if revision <= self.revisions.get(name, 0):
            return
        self.revisions[name] = revision
        alias = None
        if value:
            try:
                alias = decode_alias(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("alias %s in %s does not read (%s): kept as it was", name, BUCKET, exc)
                return
        self.book.apply(name, alias)

    async def read_all(self) -> None:
        """Every alias in the bucket; one this box holds that the bucket no longer has goes."""
        from nats.js.errors import KeyNotFoundError, NoKeysError

        try:
            keys = await self.kv.keys()
        except NoKeysError:
            keys = []
        present = set()
        for key in keys:
            name = alias_of(key)
            present.add(name)
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:  # deleted since keys(): the watch or next poll says so
                continue
            self._apply(name, entry.revision, entry.value)
        for name in [n for n in self.book.table if n not in present]:
            self.book.apply(name, None)

    async def _watch(self) -> None:
        while True:
            try:
                watcher = await self.kv.watchall()
                async for entry in watcher:
                    if entry is None:  # the end of what was there at the start
                        continue
                    gone = entry.operation in ("DEL", "PURGE")
                    self._apply(alias_of(entry.key), entry.revision, None if gone else entry.value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lapsed consumer: the poll covers, the watch starts again
                log.debug("alias watch ended: %s", exc)
            await asyncio.sleep(1.0)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.daemon.settings.nats_heartbeat_ms / 1000.0)
            try:
                await self.read_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("alias poll failed: %s", exc)

    # -- changing --------------------------------------------------------------------

    async def change(self, name: str, change: Any) -> tuple[Alias | None, Alias | None]:
        """One compare-and-set change of alias `name` (module doc): (before, after)."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

        key = key_of(name)
        for _ in range(CAS_ATTEMPTS):
            try:
                entry = await self.kv.get(key)
                before, revision = decode_alias(entry.value), entry.revision
            except (KeyDeletedError, KeyNotFoundError):  # never set, or removed: `create` takes either
                before, revision = None, None
            after = change(before)
            try:
                if after is None:
                    await self.kv.delete(key, last=revision)
                    # The delete's own revision comes with the watch; until then nothing older applies.
                    new = (revision or 0) + 1
                elif revision is None:
                    new = await self.kv.create(key, encode_alias(after))
                else:
                    new = await self.kv.update(key, encode_alias(after), last=revision)
            except KeyWrongLastSequenceError:
                continue  # another box changed it meanwhile: apply this change to theirs
            except FleetError:
                raise
            except Exception as exc:
                raise Unavailable(f"the alias table lives in NATS, which did not take the change: {exc}") from None
            self.revisions[name] = max(self.revisions.get(name, 0), new)
            return before, after
        raise Unavailable(f"alias {name!r} kept changing under this change ({CAS_ATTEMPTS} tries); retry")

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()


def follow_aliases(daemon: Any) -> None:
    """Start following `fleet_aliases` (Daemon.start, with NATS). Changes wait for it."""
    daemon.aliases.clustered = True
    daemon.aliases.joining = daemon._loop.create_task(SharedAliases(daemon).run(), name="aliases-join")
