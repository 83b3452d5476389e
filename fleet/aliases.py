"""Aliases: stable names clients use, each pointing at one stored model or adapter version.

A client asks for `support-tone` (or `support-tone@prod`, or a name it hard-codes such
as `text-embedding-3-small`); the daemon runs the version the alias names now, and
says which in `X-Fleet-Model-Version`. Switching an alias is one replace of one small
file: requests already admitted keep the version they were admitted with
(daemon.aliases), so a switch loses none.

Files, in the store (`FLEET_HOME/models`; names starting with `.` are never models):
- `.aliases.json` = `{"format": 1, "aliases": {name: Alias}}`. Writers hold an flock on
  `.aliases.json.lock` and replace the file whole (fleet.files: temp file, fsync,
  rename), so a reader sees the old table or the new one, never a torn one.
- `.history/<alias>.jsonl`: one `Event` a line, appended under the same flock and
  fsynced: every set, promotion, canary, rollback and removal of the alias. A torn
  last line (power lost mid-append) is skipped by readers.
- `.promotions/<id>.json`: one promotion package each (fleet.promotions), written whole.

With NATS the table lives in a JetStream KV bucket instead (daemon.alias_kv); the
records are the same `Alias` Structs.

Light imports only: the API process and the CLI read this.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from fleet.errors import BadRequest
from fleet.files import replace_file

ALIASES_FILE = ".aliases.json"
HISTORY_DIR = ".history"
ALIASES_FORMAT = 1
#: An alias: a model name, optionally `@` and a tag (`support-tone@prod`).
ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(@[a-z0-9][a-z0-9._-]{0,63})?\Z")
#: Events `history` returns at most, newest last.
HISTORY_KEPT = 1000
#: Canary shares are whole basis points (0.01 %) of the clients.
BASIS_POINTS = 10_000


class Alias(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One alias as it is now."""

    name: str
    #: The stored model or adapter that serves the alias.
    version: str
    #: What `rollback` goes back to: the version before the last change (None: none yet).
    previous: str | None = None
    #: A candidate serving `canary_percent` % of the alias's clients (by client, stably).
    canary: str | None = None
    canary_percent: float = 0.0
    #: UTC, ISO 8601, of the last change; who made it (the owner named, else "operator").
    at: str = ""
    by: str = ""
    #: Changes so far (1 for a new alias): a compare-and-set writer names the one it read.
    change: int = 1


class AliasesFile(msgspec.Struct):
    format: int = ALIASES_FORMAT
    aliases: dict[str, Alias] = {}


class Event(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One change of an alias, as `fleetctl history` shows it."""

    alias: str
    #: set | promote | canary | rollback | remove
    kind: str
    at: str
    by: str = ""
    #: The version before and after the change (after: None for a removal).
    previous: str | None = None
    version: str | None = None
    canary: str | None = None
    canary_percent: float = 0.0
    reason: str = ""
    #: The promotion package this change recorded (fleet.promotions), if any.
    package: str | None = None
    #: Seconds the switch took in the daemon (the table's write and swap).
    seconds: float | None = None


_file_decoder = msgspec.json.Decoder(AliasesFile)
_event_decoder = msgspec.json.Decoder(Event)
_encoder = msgspec.json.Encoder()


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def validate_alias(name: str) -> str:
    if not isinstance(name, str) or not ALIAS_RE.match(name) or ".." in name:
        raise BadRequest(f"invalid alias {name!r}: use a model name (1-128 lowercase letters, digits, '.', '_' "
                         "or '-'), optionally followed by '@' and a tag, e.g. support-tone@prod", param="name")
    return name


def check_percent(percent: float) -> float:
    if not 0.0 <= percent <= 100.0:
        raise BadRequest(f"a canary share is a percentage between 0 and 100, got {percent:g}",
                         param="canary_percent")
    return percent


def parse_percent(text: str) -> float:
    """`10%`, `10` or `2.5%` -> 10.0, 10.0, 2.5 (the CLI's `--canary`)."""
    try:
        return check_percent(float(text.strip().removesuffix("%")))
    except ValueError:
        raise BadRequest(f"--canary takes a share such as 10%, got {text!r}") from None


def client_bucket(alias: str, client: str) -> int:
    """Where `client` falls among the alias's clients, 0..BASIS_POINTS-1: a hash, so one
    client sees one version while the share stays (across restarts and boxes too: no
    per-process salt), and each alias splits its clients its own way."""
    digest = hashlib.blake2b(f"{alias}\x00{client}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BASIS_POINTS


def choose_version(alias: Alias, client: str) -> str:
    """The version `client`'s requests for `alias` run on: the canary for its share of
    clients, the alias's version for the rest."""
    if alias.canary and alias.canary_percent > 0.0:
        if client_bucket(alias.name, client) < round(alias.canary_percent * BASIS_POINTS / 100):
            return alias.canary
    return alias.version


def encode_alias(alias: Alias) -> bytes:
    return _encoder.encode(alias)


def decode_alias(data: bytes) -> Alias:
    return msgspec.json.decode(data, type=Alias)


class AliasStore:
    """The alias table and history in a store root (module doc)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / ALIASES_FILE

    # ---- the table ---------------------------------------------------------------

    def load(self) -> dict[str, Alias]:
        """The aliases on disk ({} without a file). A file that does not read is an error
        naming it: aliases route clients, so none is dropped in silence."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            table = _file_decoder.decode(data).aliases
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f"the alias table {ALIASES_FILE} in the store does not read: {exc}",
                             hint="fix the file by hand, or restore it from the history files") from None
        for name, alias in table.items():
            validate_alias(name)
            if alias.name != name:
                raise BadRequest(f"the alias table names {alias.name!r} under {name!r}")
        return table

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Alias]]:
        """The table under the writers' flock; changes to the dict are saved on a clean exit."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            table = self.load()
            before = dict(table)
            yield table
            if table != before:
                self.save(table)
        finally:
            os.close(fd)  # closing drops the flock

    def save(self, table: dict[str, Alias]) -> None:
        """Replace the table whole (the caller holds `locked`)."""
        replace_file(self.path, _encoder.encode(AliasesFile(ALIASES_FORMAT, dict(sorted(table.items())))),
                     what="the alias table")

    # ---- history -----------------------------------------------------------------

    def history_path(self, alias: str) -> Path:
        return self.root / HISTORY_DIR / f"{validate_alias(alias)}.jsonl"

    def record(self, event: Event) -> None:
        """Append `event` to its alias's history (fsynced: a recorded change is kept)."""
        path = self.history_path(event.alias)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        try:
            os.write(fd, _encoder.encode(event) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    def history(self, alias: str) -> list[Event]:
        """The alias's events, oldest first (the last HISTORY_KEPT); a torn line is skipped."""
        try:
            lines = self.history_path(alias).read_bytes().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines[-HISTORY_KEPT:]:
            try:
                out.append(_event_decoder.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        return out
