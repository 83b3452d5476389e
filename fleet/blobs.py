"""Uploaded blobs (Ollama's `POST /api/blobs/sha256:...`) under `FLEET_HOME/blobs`:
kept while they are of use, removed when they are not.

`ollama create` uploads each file of a LoRA folder, or a GGUF model file, as a blob,
then names them in `/api/create`; fleet pulls them into the store as a model of its
own files (copies: a blob can go without touching any model). An upload is written
as it arrives, while a quarter of the disk stays free (`check_room`). Like Ollama's
layers, a blob is kept

- while a stored model holds it (a file with its sha256): a client's
  `HEAD /api/blobs/...` then finds it and does not upload it again;
- for `blob_keep_ms` after its last use (uploaded, asked for with HEAD, used by a
  create): a client uploads, then creates.

Anything else goes: when a model is removed (`fleetctl rm`, `/api/delete`), the
blobs it held that no other model holds (`release`, as Ollama removes a deleted
model's layers); and whatever `sweep` finds unused past `blob_keep_ms` (blobs
and half-written `.part` files of an upload cut off), run by the daemon at start
and then every `sweep_period(keep)`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

from fleet.errors import InsufficientStorage
from fleet.store import Manifest, Store, disk_reserve, reserve_words

log = logging.getLogger("fleet.blobs")

DIR = "blobs"
#: A blob's file name: its sha256, as Ollama names its blob files.
NAME = re.compile(r"^sha256-(?P<hex>[0-9a-f]{64})$")
#: A sweep runs at least this often, at most every SWEEP_MIN_S.
SWEEP_MAX_S = 600.0
SWEEP_MIN_S = 1.0


def blobs_dir(home: str | Path) -> Path:
    return Path(home) / DIR


def blob_file(home: str | Path, hex_digest: str) -> Path:
    """The file of the blob whose sha256 is `hex_digest` (64 lowercase hex digits, checked by the caller)."""
    return blobs_dir(home) / f"sha256-{hex_digest}"


def touch(path: Path) -> None:
    """A blob is used now (asked for, or made into a model): its keep time starts again."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


def held(store: Store) -> set[str]:
    """The sha256 of every file of every stored model."""
    return {f.sha256 for m in store.list() for f in m.files}


def remove(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def release(home: str | Path, store: Store, removed: Manifest | None) -> list[str]:
    """After `removed` left the store: the blobs it held that no stored model holds
    are removed. Returns their file names."""
    folder = blobs_dir(home)
    if removed is None or not folder.is_dir():
        return []
    still = held(store)
    gone = [f"sha256-{f.sha256}" for f in removed.files if f.sha256 not in still]
    return [name for name in dict.fromkeys(gone) if remove(folder / name)]


def sweep(home: str | Path, store: Store, keep_s: float, now: float | None = None) -> list[str]:
    """Remove the blobs no stored model holds that were last used more than `keep_s`
    ago, and partial uploads older than that. Returns the file names removed."""
    folder = blobs_dir(home)
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    entries = [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    old = [e for e in entries if now - e.stat(follow_symlinks=False).st_mtime > keep_s]
    if not old:
        return []
    in_use = held(store)
    out = []
    for e in old:
        m = NAME.match(e.name)
        unused = m.group("hex") not in in_use if m else e.name.endswith(".part")
        if unused and remove(Path(e.path)):
            out.append(e.name)
    if out:
        log.info("removed %d unused blob file(s) from %s", len(out), folder)
    return out


def sweep_period(keep_s: float) -> float:
    """Seconds between sweeps: half the keep time, within [SWEEP_MIN_S, SWEEP_MAX_S]
    (an unused blob goes at most one period after its keep time)."""
    return min(SWEEP_MAX_S, max(SWEEP_MIN_S, keep_s / 2))


def check_room(home: str | Path, nbytes: int) -> None:
    """An upload of `nbytes` (so far, or as its Content-Length says) may go on only while a
    quarter of the disk holding the blobs (at most 8 GiB: fleet.store.disk_reserve) stays
    free: the store's own bound on what it writes for a client (`Store.clone`'s copies). A
    GGUF model is its blob (hundreds of MB to GB), so blobs are bounded by the disk, not
    by `max_body_bytes`."""
    usage = shutil.disk_usage(blobs_dir(home) if blobs_dir(home).is_dir() else home)
    if usage.free - nbytes < disk_reserve(usage.total):
        raise InsufficientStorage(f"a blob of {nbytes} bytes would leave less than {reserve_words(usage.total)} "
                                  "of the disk free",
                                  hint="free space on the disk that holds FLEET_HOME (fleetctl doctor shows it)")
