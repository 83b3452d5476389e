"""What offline jobs keep across restarts: `FLEET_HOME/batches/`.

    batches/jobs.db          sqlite: the files table and the batches table
    batches/files/<id>       a file's bytes (input files; output and error files of batches)
    batches/files/.tmp-<id>  an upload or a batch's output still being written

Why sqlite (stdlib `sqlite3`): a batch's status transitions and a file's
registration are transactions (WAL journal, `synchronous=FULL`: a commit is on
disk when it returns, a killed process or box leaves the last committed state),
with no server and no dependency. Per-line progress is *not* kept here: the
output and error files are the record of which lines were answered (append-only,
one whole line per write, fsynced; daemon/batchfile.py reads them back on a
restart), so a million-line batch costs no million rows and no second write
per line. One process (the daemon, which holds `run/daemon.lock`) opens the
database; every call runs on its event loop's thread.

A damaged store (bytes overwritten, a truncated file: sqlite's "malformed" or
"not a database", or a `quick_check` that finds a broken page) stops nothing:
at open, the whole `batches/` folder (database, journal and the files it names)
is renamed to `batches.damaged-<UTC time>` next to it, that is logged once, and
the daemon starts with a fresh, empty store; `fleetctl doctor` names what was set
aside (as damaged pins are: fleet.pins). Any other failure to open it (a
permission, a full disk) is not damage and stops the start.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
from pathlib import Path

import msgspec

from fleet.batches import Batch, FileObject
from fleet.errors import NotFound

log = logging.getLogger("fleet.batches")

#: Where a damaged store goes (module doc): `FLEET_HOME/batches.damaged-<UTC time>[-n]`.
DAMAGED_PREFIX = "batches.damaged-"
#: sqlite's primary result codes that mean the file itself is damaged.
DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

#: The ids this store gives (daemon/controllers/openapi.py documents them as the path parameters' patterns).
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    doc BLOB NOT NULL,            -- fleet.batches.FileObject as JSON
    expires_at INTEGER,
    lines INTEGER NOT NULL,       -- request lines (input files)
    span INTEGER NOT NULL,        -- physical lines, blank ones included (line numbers run 1..span)
    uses BLOB NOT NULL            -- input files: [[url, model or null, first line], ...] (daemon/batchfile.py)
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    doc BLOB NOT NULL,            -- fleet.batches.Batch as JSON
    output_id TEXT NOT NULL,      -- the ids its output and error files get (written under .tmp-<id> until final)
    error_id TEXT NOT NULL,
    output_expires_s INTEGER      -- its output_expires_after.seconds, if given
);
"""

_encode = msgspec.json.Encoder().encode
_file = msgspec.json.Decoder(FileObject)
_batch = msgspec.json.Decoder(Batch)
_uses = msgspec.json.Decoder(list[tuple[str, str | None, int]])


class StoredFile(msgspec.Struct):
    file: FileObject
    lines: int
    span: int
    #: (url, model or None, first line) of each distinct pair in an input file.
    uses: list[tuple[str, str | None, int]]


class StoredBatch(msgspec.Struct):
    batch: Batch
    output_id: str
    error_id: str
    output_expires_s: int | None


def new_file_id() -> str:
    return "file-" + os.urandom(12).hex()


def new_batch_id() -> str:
    return "batch_" + os.urandom(16).hex()


class Damaged(Exception):
    """The store's database is damaged (module doc); the message says how."""


class JobStore:
    def __init__(self, home: Path) -> None:
        self.root = home / "batches"
        self.files_dir = self.root / "files"
        try:
            self.db = self._open()
        except Damaged as exc:
            set_aside(self.root, str(exc))
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.root / "jobs.db", isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            # Reads every page once (rows per file and per batch, never per line: small);
            # a page that opening did not touch may be the damaged one.
            found = [row[0] for row in db.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:
            db.close()
            if exc.sqlite_errorcode & 0xFF in DAMAGE_CODES:  # extended codes keep the primary in the low byte
                raise Damaged(str(exc)) from None
            raise
        if found != ["ok"]:
            db.close()
            raise Damaged(found[-1] if found else "quick_check answered nothing")
        return db

    def close(self) -> None:
        self.db.close()

    # -- paths -------------------------------------------------------------------------

    def path(self, file_id: str) -> Path:
        """Where a file's bytes are. Ids come from clients: only ids of our own shape make a path."""
        if not FILE_ID.fullmatch(file_id):
            raise NotFound(f"no file {file_id!r}", param="file_id")
        return self.files_dir / file_id

    def temp_path(self, file_id: str) -> Path:
        self.path(file_id)
        return self.files_dir / f".tmp-{file_id}"

    def sweep_orphans(self, keep: set[str]) -> list[str]:
        """Remove files no row names and unfinished uploads (a killed upload, a crash
        between rename and insert), except the temp files in `keep` (outputs of
        batches still running). Returns the names removed."""
        known = {row[0] for row in self.db.execute("SELECT id FROM files")}
        gone = []
        for entry in self.files_dir.iterdir():
            name = entry.name
            if name in known or name in keep:
                continue
            entry.unlink(missing_ok=True)
            gone.append(name)
        return gone

    # -- files -------------------------------------------------------------------------

    def add_file(self, f: FileObject, *, lines: int = 0, span: int = 0,
                 uses: list[tuple[str, str | None, int]] | None = None) -> None:
        self.db.execute("INSERT INTO files (id, doc, expires_at, lines, span, uses) VALUES (?, ?, ?, ?, ?, ?)",
                        (f.id, _encode(f), f.expires_at, lines, span, _encode(uses or [])))

    def files_bytes(self) -> int:
        """Bytes of every stored file (uploads and finished batches' results)."""
        return int(self.db.execute("SELECT total(json_extract(doc, '$.bytes')) FROM files").fetchone()[0])

    def get_file(self, file_id: str) -> StoredFile:
        row = self.db.execute("SELECT doc, lines, span, uses FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFound(f"no file {file_id!r}", param="file_id")
        return StoredFile(_file.decode(row[0]), row[1], row[2], _uses.decode(row[3]))

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None,
                   ) -> tuple[list[FileObject], bool]:
        """A page of files, newest first (`order` "desc") or oldest first, after the file `after`."""
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        sql, args = "SELECT doc FROM files WHERE 1", []
        if after is not None:
            seq = self._seq("files", after)
            sql += f" AND seq {op} ?"
            args.append(seq)
        if purpose is not None:
            sql += " AND json_extract(doc, '$.purpose') = ?"
            args.append(purpose)
        rows = self.db.execute(sql + f" ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)).fetchall()
        return [_file.decode(r[0]) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        deleted = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        try:
            self.path(file_id).unlink()
        except FileNotFoundError:
            pass
        return bool(deleted)

    def expired_files(self, now: int) -> list[str]:
        return [r[0] for r in self.db.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]

    # -- batches -----------------------------------------------------------------------

    def add_batch(self, b: Batch, *, output_id: str, error_id: str, output_expires_s: int | None) -> None:
        self.db.execute("INSERT INTO batches (id, status, doc, output_id, error_id, output_expires_s) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (b.id, b.status, _encode(b), output_id, error_id,
                                                      output_expires_s))

    def save_batch(self, b: Batch) -> None:
        """A status transition (or new counts): one committed write."""
        self.db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?", (b.status, _encode(b), b.id))

    def finish_batch(self, b: Batch, files: list[FileObject]) -> None:
        """A batch's final status and its result files, in one transaction."""
        with self.db:
            self.db.execute("BEGIN")
            for f in files:
                self.db.execute("INSERT OR REPLACE INTO files (id, doc, expires_at, lines, span, uses) "
                                "VALUES (?, ?, ?, 0, 0, '[]')", (f.id, _encode(f), f.expires_at))
            self.db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?", (b.status, _encode(b), b.id))

    def get_batch(self, batch_id: str) -> StoredBatch:
        if not BATCH_ID.fullmatch(batch_id):
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        row = self.db.execute("SELECT doc, output_id, error_id, output_expires_s FROM batches WHERE id = ?",
                              (batch_id,)).fetchone()
        if row is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return StoredBatch(_batch.decode(row[0]), row[1], row[2], row[3])

    def list_batches(self, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of batches, newest first (OpenAI's order), after the batch `after`."""
        sql, args = "SELECT doc FROM batches", []
        if after is not None:
            sql += " WHERE seq < ?"
            args.append(self._seq("batches", after))
        rows = self.db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [_batch.decode(r[0]) for r in rows[:limit]], len(rows) > limit

    def unfinished(self, final: frozenset[str]) -> list[StoredBatch]:
        """Batches not in a final status, oldest first (they resume at start)."""
        marks = ", ".join("?" * len(final))
        rows = self.db.execute(f"SELECT id FROM batches WHERE status NOT IN ({marks}) ORDER BY seq",
                               tuple(final)).fetchall()
        return [self.get_batch(r[0]) for r in rows]

    def input_in_use(self, file_id: str, final: frozenset[str]) -> bool:
        marks = ", ".join("?" * len(final))
        return self.db.execute(
            f"SELECT 1 FROM batches WHERE json_extract(doc, '$.input_file_id') = ? AND status NOT IN ({marks}) "
            "LIMIT 1", (file_id, *final)).fetchone() is not None

    def _seq(self, table: str, item_id: str) -> int:
        row = self.db.execute(f"SELECT seq FROM {table} WHERE id = ?", (item_id,)).fetchone()
        if row is None:
            raise NotFound(f"`after`: no {table[:-1]} {item_id!r}", param="after")
        return row[0]


def set_aside(root: Path, damage: str) -> Path:
    """Rename the damaged store `root` (module doc), keeping every earlier one; log it once."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = root.with_name(DAMAGED_PREFIX + stamp)
    n = 1
    while aside.exists():
        n += 1
        aside = root.with_name(f"{DAMAGED_PREFIX}{stamp}-{n}")
    os.rename(root, aside)
    log.error("%s is damaged (%s): set aside as %s with the files it names; starting with an empty batch store "
              "(earlier batches and files are not served until it is repaired and put back)",
              root / "jobs.db", damage, aside.name)
    return aside


def now_s() -> int:
    return int(time.time())
