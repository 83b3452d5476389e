"""With `--nats`, the aliases' history and the promotion packages reach every box.

The alias table is shared through `fleet_aliases` (daemon.alias_kv); what it records
is shared through two more JetStream KV buckets, made by the first box that needs them:

- `fleet_alias_history`: one key per alias (its name in hex, as in `fleet_aliases`),
  the value its events as JSON lines, oldest first (fleet.aliases.Event). An event is
  appended by compare-and-set (read, append, `update` naming the revision read; a box
  that lost to another's append reads again), so the events of changes made on several
  boxes at once are all kept, in the order they landed. The last HISTORY_KEPT events
  and HISTORY_MAX_BYTES are kept (the oldest go first).
- `fleet_promotions`: one key per package id, the package as written in the store
  (fleet.promotions). Packages never change, so a plain `put`.

The box that makes a change still writes both into its own store too (its record if
NATS is lost); any box answers `fleetctl history` and `GET /v1/promotions/{id}` from the
buckets. A bucket that cannot be read is 503 `unavailable`, never a shorter history.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fleet.aliases import HISTORY_KEPT, Event
from fleet.errors import Unavailable
from fleet.promotions import Package

HISTORY_BUCKET = "fleet_alias_history"
PACKAGES_BUCKET = "fleet_promotions"
#: Bytes of one alias's history in its bucket entry (below NATS's 1 MiB message limit).
HISTORY_MAX_BYTES = 512 * 1024

#: Compare-and-set attempts of one append (each lost to another box's append).
APPEND_ATTEMPTS = 8

_event_decoder = msgspec.json.Decoder(Event)
_package_decoder = msgspec.json.Decoder(Package)
_encoder = msgspec.json.Encoder()


def history_key(alias: str) -> str:
    """The alias's name in hex, as `fleet_aliases` keys it (KV keys take fewer characters)."""
    return alias.encode().hex()


def appended(value: bytes | None, event: Event) -> bytes:
    """An alias's history lines with `event` after them, trimmed from the oldest to the
    last HISTORY_KEPT events and HISTORY_MAX_BYTES (pure)."""
    lines = (value or b"").splitlines()[-(HISTORY_KEPT - 1):] + [_encoder.encode(event)]
    while len(lines) > 1 and sum(len(x) + 1 for x in lines) > HISTORY_MAX_BYTES:
        lines.pop(0)
    return b"\n".join(lines) + b"\n"


def events_of(value: bytes | None) -> list[Event]:
    """The events in a history value; a line that does not read is skipped (as in the store's file)."""
    out = []
    for line in (value or b"").splitlines():
        try:
            out.append(_event_decoder.decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out


class SharedRecords:
    """This box's side of the two buckets (module doc), bound by daemon.alias_kv when it
    joins the alias table."""

    def __init__(self, history: Any, packages: Any) -> None:
        self.history_kv, self.packages_kv = history, packages

    @classmethod
    async def bind(cls, cluster: Any) -> SharedRecords:
        from nats.js.api import StorageType
        from nats.js.errors import BucketNotFoundError

        async def bucket(name: str) -> Any:
            try:
                return await cluster.js.key_value(name)
            except BucketNotFoundError:
                return await cluster.js.create_key_value(bucket=name, history=1, storage=StorageType.FILE,
                                                         replicas=cluster.replicas)

        return cls(await bucket(HISTORY_BUCKET), await bucket(PACKAGES_BUCKET))

    async def record(self, event: Event) -> None:
        """Append `event` to its alias's shared history (compare-and-set; module doc)."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

        key = history_key(event.alias)
        for _ in range(APPEND_ATTEMPTS):
            try:
                entry = await self.history_kv.get(key)
                value, revision = entry.value, entry.revision
            except (KeyDeletedError, KeyNotFoundError):
                value, revision = None, None
            try:
                if revision is None:
                    await self.history_kv.create(key, appended(value, event))
                else:
                    await self.history_kv.update(key, appended(value, event), last=revision)
                return
            except KeyWrongLastSequenceError:
                continue
        raise Unavailable(f"the history of {event.alias!r} kept changing under this record ({APPEND_ATTEMPTS} tries)")

    async def history(self, alias: str) -> list[Event]:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            return events_of((await self.history_kv.get(history_key(alias))).value)
        except (KeyDeletedError, KeyNotFoundError):
            return []
        except Exception as exc:
            raise Unavailable(f"the aliases' history lives in NATS, which did not answer: {exc}") from None

    async def write_package(self, package: Package) -> None:
        await self.packages_kv.put(package.id, _encoder.encode(package))

    async def read_package(self, package_id: str) -> Package | None:
        """The package, or None when no box wrote it."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            return _package_decoder.decode((await self.packages_kv.get(package_id)).value)
        except (KeyDeletedError, KeyNotFoundError):
            return None
        except Exception as exc:
            raise Unavailable(f"the promotion packages live in NATS, which did not answer: {exc}") from None
