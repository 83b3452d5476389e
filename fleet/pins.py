"""Pinned models, persisted under FLEET_HOME so they survive a daemon restart.

File: `FLEET_HOME/pins.json` = `{"format": 1, "pins": {name: {"device", "at"}}}`.
`device` is where the pin was honoured (`cpu`, `cuda:K`): after a restart the
worker(s) of that device load it before serving (`runtimes.process`).

Writers are the daemon's admin calls only, under an flock on
`FLEET_HOME/pins.json.lock`; a write goes to a temporary file, is fsynced and
renamed over the old one, so a reader (a starting worker) sees the old or the
new file, never a torn one; on a full disk it is `insufficient_storage` and
the old file stays (fleet.files). Names are validated on the way in and out: a
hand-edited file with a bad name is never used as a path.

A damaged file (not this format, or a bad name) is not an error for anyone
reading it (a readiness probe, a starting worker, `/v1/models`): the first
reader that finds it renames it, under the flock, to
`pins.json.damaged-<UTC time>` and logs that once; the daemon goes on with no
persisted pins and the operator keeps the file to repair and put back.

Light imports only: the API process and the workers both read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from fleet.catalog import validate_name
from fleet.errors import BadRequest
from fleet.files import replace_file

log = logging.getLogger("fleet.pins")

PINS_FILE = "pins.json"
PINS_FORMAT = 1


class Pin(msgspec.Struct, frozen=True):
    device: str
    #: UTC, ISO 8601, when it was pinned.
    at: str


class PinsFile(msgspec.Struct):
    format: int = PINS_FORMAT
    pins: dict[str, Pin] = {}


_decoder = msgspec.json.Decoder(PinsFile)
_encoder = msgspec.json.Encoder()


class PinStore:
    def __init__(self, home: str | Path) -> None:
        self.path = Path(home) / PINS_FILE

    def load(self) -> dict[str, Pin]:
        """The pins on disk ({} when there is no file, or when it was damaged and is now set aside)."""
        pins, _ = self._read()
        if pins is not None:
            return pins
        with self._locked():
            return self._load_locked()

    def _load_locked(self) -> dict[str, Pin]:
        # Read again under the lock: another reader may have set the file aside
        # already, or a writer replaced it with a good one.
        pins, damage = self._read()
        if pins is None:
            self._set_aside(damage)
            return {}
        return pins

    def _read(self) -> tuple[dict[str, Pin] | None, str]:
        """(the pins, "") with {} for no file; (None, what is wrong) for a damaged file."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}, ""
        try:
            pins = _decoder.decode(data).pins
            for name in pins:
                validate_name(name)
        except (msgspec.DecodeError, msgspec.ValidationError, BadRequest) as exc:
            return None, str(exc)
        return pins, ""

    def _set_aside(self, damage: str) -> None:
        """Rename the damaged file out of the way (caller holds the flock), keeping every earlier one."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{PINS_FILE}.damaged-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{PINS_FILE}.damaged-{stamp}-{n}")
        os.rename(self.path, aside)
        log.error("%s is damaged (%s): set aside as %s; no persisted pins until it is repaired and put back",
                  self.path, damage, aside.name)

    def for_device(self, device: str) -> list[str]:
        return sorted(name for name, pin in self.load().items() if pin.device == device)

    def add(self, name: str, device: str) -> None:
        validate_name(name)
        with self._locked():
            pins = self._load_locked()
            pins[name] = Pin(device, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self._write(pins, f"the pin of {name!r}")

    def remove(self, name: str) -> Pin | None:
        validate_name(name)
        with self._locked():
            pins = self._load_locked()
            pin = pins.pop(name, None)
            if pin is not None:
                self._write(pins, f"the removal of the pin of {name!r}")
            return pin

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def _write(self, pins: dict[str, Pin], what: str) -> None:
        # A full disk: InsufficientStorage, the temporary file removed, the old file kept (fleet.files).
        replace_file(self.path, _encoder.encode(PinsFile(PINS_FORMAT, dict(sorted(pins.items())))), what=what)
