"""Derived files of a stored model: what a worker makes from the model's own files
(an OpenVINO graph converted from its weights) and what it measured about them,
kept beside the model in the store.

`FLEET_HOME/models/<name>/.fleet-derived/<kind>/` holds the made files and
`derived.json` (`Derived`): the model files they were made from with their
sha256 (`sources`), the versions of what made them, and each made file with its
size and sha256. The store's rules apply:

* Made into `.tmp-<kind>-<8 hex>/` beside the final folder, `derived.json` last,
  and renamed into place, under the model's store lock (`Store.lock`): a pull or
  a removal of the model never interleaves with it, and two workers loading the
  same model make it once (the second finds it made).
* Every read re-hashes the files against `derived.json`. A folder whose sources
  or versions differ from the model's files and the running libraries, or whose
  files do not match, is made again: it is derived, nothing is lost by that.
* Never pickle: makers write plain formats (OpenVINO IR: XML + raw weights).
* A re-pull replaces the model's folder, derived files included; `fleetctl rm`
  removes them with it.

Small JSON notes (`read_note` / `write_note`: a load-time measurement's verdict)
live in the same folder, written whole by rename, keyed by what they depend on.

A model folder that is not in a store (no `manifest.json`: a test's folder, a
package's) is never written into: its derived files live under the temp
directory, with the hashes of its files (hashed at each load) as their sources.

No heavy imports here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from fleet.errors import IntegrityError
from fleet.store import (
    DIR_MODE, FILE_MODE, MANIFEST, FileEntry, Store, hash_file, needed_by_runtime, safe_relpath, utc_now,
)

log = logging.getLogger("fleet.store")

DERIVED_DIR = ".fleet-derived"
DERIVED = "derived.json"
DERIVED_FORMAT = 1


class Derived(msgspec.Struct, kw_only=True):
    format: int = DERIVED_FORMAT
    kind: str
    #: Model file (relative path) -> sha256, as the manifest listed them when made.
    sources: dict[str, str]
    #: What made the files (library versions, the graph's shape): a change makes them again.
    versions: dict[str, str]
    files: list[FileEntry]
    created_at: str


_encode = msgspec.json.Encoder().encode
_decode_derived = msgspec.json.Decoder(Derived).decode


def model_sources(model_dir: Path) -> dict[str, str] | None:
    """File -> sha256 of a stored model (its manifest), or None outside a store."""
    if not (model_dir / MANIFEST).is_file():
        return None
    manifest = Store(model_dir.parent).get(model_dir.name)
    return {f.path: f.sha256 for f in manifest.files}


def sources_digest(sources: dict[str, str]) -> str:
    """One sha256 over a model's files (path and hash of each), for keys."""
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(f"{path}\0{sources[path]}\n".encode())
    return h.hexdigest()


def _check(folder: Path, sources: dict[str, str], versions: dict[str, str]) -> str | None:
    """None when `folder` holds intact files made from `sources` by `versions`, else why not."""
    try:
        info = _decode_derived((folder / DERIVED).read_bytes())
    except FileNotFoundError:
        return "not made yet"
    except (OSError, msgspec.DecodeError) as exc:
        return f"unreadable {DERIVED}: {exc}"
    if info.sources != sources:
        return "the model's files changed"
    if info.versions != versions:
        changed = sorted(k for k in info.versions.keys() | versions.keys() if info.versions.get(k) != versions.get(k))
        return f"made by other versions ({', '.join(changed)})"
    for f in info.files:
        path = folder / safe_relpath(f.path)
        try:
            size, digest = hash_file(path)
        except FileNotFoundError:
            return f"{f.path} is missing"
        if (size, digest) != (f.size, f.sha256):
            return f"{f.path} does not match its sha256"
    return None


def folder_sources(model_dir: Path) -> dict[str, str]:
    """File -> sha256 of what a runtime reads in a folder outside the store (hashed now)."""
    return {p.relative_to(model_dir).as_posix(): hash_file(p)[1]
            for p in sorted(model_dir.rglob("*"))
            if p.is_file() and DERIVED_DIR not in p.parts and needed_by_runtime(p.name)}


@contextlib.contextmanager
def _folder_lock(root: Path) -> Iterator[None]:
    root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    with open(root / ".lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def derived(model_dir: Path, kind: str, versions: dict[str, str], make: Callable[[Path], None]) -> Path:
    """The folder holding `kind`'s files made from the model in `model_dir`: checked
    (re-hashed) when made before, else made now by `make(folder)` (which writes its
    files into the empty folder it is given) and recorded.

    Outside a store (no manifest: a test's or a package's folder, which fleet does
    not write into) the files live under the temp directory, keyed by the folder's
    path, with the hashes of its files as their sources and a lock file of their own."""
    sources = model_sources(model_dir)
    if sources is None:
        root = Path(tempfile.gettempdir()) / f"fleet-derived-{hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]}"
        current: Callable[[], dict[str, str]] = lambda: folder_sources(model_dir)
        locked: Callable[[], Any] = lambda: _folder_lock(root)
        sources = current()
    else:
        root = model_dir / DERIVED_DIR
        current = lambda: model_sources(model_dir) or {}
        locked = lambda: Store(model_dir.parent).lock(model_dir.name)
    final = root / safe_relpath(kind)
    if _check(final, sources, versions) is None:
        return final
    with locked():
        # Another worker may have made it while this one waited for the lock, or a
        # pull replaced the model (its new files are the sources now).
        sources = current()
        why = _check(final, sources, versions)
        if why is None:
            return final
        log.info("making %s of %s (%s)", kind, model_dir.name, why)
        root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        tmp = root / f".tmp-{kind}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=DIR_MODE)
        try:
            make(tmp)
            files = []
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                os.chmod(path, FILE_MODE)
                size, digest = hash_file(path)
                files.append(FileEntry(path=path.relative_to(tmp).as_posix(), size=size, sha256=digest))
            info = Derived(kind=kind, sources=sources, versions=versions, files=files, created_at=utc_now())
            _write_whole(tmp / DERIVED, msgspec.json.format(_encode(info), indent=2) + b"\n")
            if final.exists():
                old = root / f".old-{kind}-{secrets.token_hex(4)}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        why = _check(final, sources, versions)
    if why is not None:
        raise IntegrityError(f"model {model_dir.name!r}: {kind} made just now does not check ({why}); this is a bug")
    return final


def read_note(model_dir: Path, note: str, key: dict[str, str]) -> dict | None:
    """The note `note` of a stored model when it was written under `key`, else None."""
    path = model_dir / DERIVED_DIR / safe_relpath(f"{note}.json")
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    return doc.get("value")


def write_note(model_dir: Path, note: str, key: dict[str, str], value: dict) -> bool:
    """Keep `value` as note `note` of a stored model under `key` (replaced whole).
    False outside a store (nothing is kept)."""
    if not (model_dir / MANIFEST).is_file():
        return False
    folder = model_dir / DERIVED_DIR
    folder.mkdir(mode=DIR_MODE, exist_ok=True)
    _write_whole(folder / safe_relpath(f"{note}.json"), _encode({"key": key, "value": value}))
    return True


def _write_whole(path: Path, data: bytes) -> None:
    """`path` replaced by a file holding `data` (temp file + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
