"""The files of offline jobs, byte by byte: uploads streamed to disk and checked line
by line, input lines read back for a run, result lines appended whole, and the
results read back after a restart.

Nothing here holds a whole file in memory: an upload goes to disk in pieces of
UPLOAD_PIECE bytes (written and checked on a thread, so the event loop only
gathers them), a run reads its input in pieces of READ_PIECE bytes, and a
restart reads its results the same way. The largest thing held is one line.

Result files (output and error) are append-only. Invariants:
1. Every write is one whole line (`ResultFile.append`): a write that fails
   part way (a full disk) is cut back to where it began (`ftruncate`), so a
   file is always whole lines, each answering one input line.
2. A line's `id` names its input line (`batch_req_<batch>_<line number>`);
   reading the files back (`scan_results`) tells which lines were answered.
   A torn tail (no newline, or bytes that do not decode: a box that lost power
   between two fsyncs) is cut off there and its lines run again.
3. A batch has one writer (its run, on the event loop), which appends a line
   only for an input line not yet answered: every input line is answered once.
"""

from __future__ import annotations

import errno
import hashlib
import os
from array import array
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from fleet.batches import ENDPOINTS, RequestLine
from fleet.errors import BadRequest, InsufficientStorage, PayloadTooLarge

from fleet.daemon.fields import Unknown, refusal, shown

#: Bytes an upload hands to its writing thread at a time.
UPLOAD_PIECE = 1 << 20
#: Bytes a run or a scan reads at a time.
READ_PIECE = 1 << 20
#: Largest form field besides the file (`purpose`, `expires_after[...]`).
MAX_FIELD_BYTES = 1024
#: The form fields of an upload besides `file`: OpenAI's (its SDKs send `expires_after`
#: as these two fields). Any other field, or one given twice, is refused.
FORM_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")

_request_line = msgspec.json.Decoder(RequestLine)


class _BodyHead(msgspec.Struct):
    """What a batch needs to know of a request body before running it (other fields are the route's)."""

    model: str | None = None
    stream: bool | None = None


_body_head = msgspec.json.Decoder(_BodyHead)


def body_head(body: bytes | msgspec.Raw) -> _BodyHead:
    """The body's `model` and `stream`; a body the route will refuse reads as neither."""
    try:
        return _body_head.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _BodyHead()


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


# ---- checking an input file as it arrives ------------------------------------------------------

@dataclass
class InputCheck:
    """An input file checked line by line as its bytes arrive (`feed`, then `finish`).

    A line is one request: a JSON object with exactly `custom_id` (a non-empty
    string), `method` ("POST"), `url` (an endpoint batches run) and `body` (a JSON
    object of at most `max_body_bytes`). Blank lines are skipped (they count in the
    line numbers). The first bad line stops the upload with a 400 naming its number.
    What the batch will check against the daemon's models is kept: each distinct
    (url, model) with the first line that uses it (`uses`); and `custom_id`s must
    be unique (an 8-byte hash each is kept: 12 bytes a line)."""

    max_body_bytes: int
    max_lines: int
    line_no: int = 0
    lines: int = 0
    uses: dict[tuple[str, str | None], int] = field(default_factory=dict)
    _carry: bytearray = field(default_factory=bytearray)
    _hashes: array = field(default_factory=lambda: array("Q"))
    _hash_lines: array = field(default_factory=lambda: array("I"))

    def feed(self, data: bytes | memoryview) -> None:
        data = bytes(data)
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if self._carry:
                self._carry += data[start:end]
                line, self._carry = bytes(self._carry), bytearray()
            else:
                line = data[start:end]
            self._line(line)
            start = end + 1
        if start < len(data):
            self._carry += data[start:]
            if len(self._carry) > self.max_body_bytes + MAX_FIELD_BYTES:
                raise PayloadTooLarge(f"line {self.line_no + 1}: over the limit of {self.max_body_bytes} bytes "
                                      "for one request (max_body_bytes)")

    def finish(self, file: Path) -> None:
        """The end of the file: its last line (with no newline after it), then the
        checks of the whole file (at least one request, unique custom_ids)."""
        if self._carry:
            line, self._carry = bytes(self._carry), bytearray()
            self._line(line)
        if not self.lines:
            raise BadRequest("the file holds no request lines (JSONL: one request per line)", param="file")
        self._check_unique(file)

    def _line(self, raw: bytes) -> None:
        self.line_no += 1
        n = self.line_no
        if not raw.strip():
            return
        try:
            req = _request_line.decode(raw)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"line {n}: {exc}", param="file") from None
        except msgspec.DecodeError as exc:
            raise BadRequest(f"line {n} is not a JSON object: {exc}", param="file") from None
        if len(req.body) > self.max_body_bytes:
            raise PayloadTooLarge(f"line {n}: its body of {len(req.body)} bytes is over the limit of "
                                  f"{self.max_body_bytes} bytes for one request (max_body_bytes)")
        if not req.custom_id:
            raise BadRequest(f"line {n}: `custom_id` is empty", param="file")
        if req.method != "POST":
            raise BadRequest(f"line {n}: `method` must be \"POST\", not {req.method!r}", param="file")
        if req.url not in ENDPOINTS:
            raise BadRequest(f"line {n}: `url` {req.url!r} is not an endpoint batches run; they run "
                             f"{', '.join(ENDPOINTS)}", param="file")
        if not bytes(req.body).lstrip().startswith(b"{"):
            raise BadRequest(f"line {n}: `body` must be a JSON object", param="file")
        self.lines += 1
        if self.lines > self.max_lines:
            raise PayloadTooLarge(f"line {n}: more than {self.max_lines} requests in one file (batch_max_lines)")
        self.uses.setdefault((req.url, body_head(req.body).model), n)
        digest = hashlib.blake2b(req.custom_id.encode(), digest_size=8).digest()
        self._hashes.append(int.from_bytes(digest, "little"))
        self._hash_lines.append(n)

    def _check_unique(self, file: Path) -> None:
        hashes = np.frombuffer(self._hashes, dtype=np.uint64)
        order = np.argsort(hashes, kind="stable")
        same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
        if not len(same):
            return
        lines = np.frombuffer(self._hash_lines, dtype=np.uint32)
        for i in same.tolist():  # a hash collision of two different ids is told apart here
            a, b = sorted((int(lines[order[i]]), int(lines[order[i + 1]])))
            ids = {n: _request_line.decode(raw).custom_id for n, raw in read_lines(file, {a, b})}
            if ids[a] == ids[b]:
                raise BadRequest(f"line {b}: custom_id {ids[a]!r} is already used on line {a}: each request "
                                 "of a batch needs its own", param="file")


def read_lines(path: Path, wanted: set[int]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of the `wanted` lines of a file."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n in wanted:
                yield n, raw.rstrip(b"\n")
                wanted = wanted - {n}
                if not wanted:
                    return


# ---- receiving an upload ----------------------------------------------------------------------

@dataclass
class Upload:
    filename: str
    fields: dict[str, str]
    size: int


class UploadSink:
    """The file part of an upload, written to `tmp` and checked, one piece at a time
    (`write` runs on a thread: the event loop only gathers the next piece)."""

    def __init__(self, tmp: Path, check: InputCheck, max_bytes: int,
                 room: Callable[[int], None] | None = None) -> None:
        """`room(n)`: takes n more bytes of the batch files' quota, or raises (Batches.room)."""
        self.tmp, self.check, self.max_bytes, self.room = tmp, check, max_bytes, room
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.size = 0

    def write(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.max_bytes:
            raise PayloadTooLarge(f"the file is over the limit of {self.max_bytes} bytes (batch_max_file_bytes)",
                                  param="file")
        if self.room is not None:
            self.room(len(piece))
        self.check.feed(piece)
        view = memoryview(piece)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            if is_disk_full(exc):
                raise InsufficientStorage("no space left for the file on the disk that holds FLEET_HOME") from None
            raise

    def finish(self) -> None:
        """The whole file is in: its last checks, then on disk (fsync) before it is named."""
        self.check.finish(self.tmp)
        try:
            os.fsync(self.fd)
        except OSError as exc:
            if is_disk_full(exc):
                raise InsufficientStorage("no space left for the file on the disk that holds FLEET_HOME") from None
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_form_field(name: str, fields: dict[str, str]) -> None:
    """Refuse a form field an upload does not take (before its value is read), or one
    given twice: OpenAI's words on OpenAI's route, with the closest known field."""
    if name in fields:
        raise BadRequest(f"form field `{shown(name)}` is given twice", param=shown(name))
    if name not in FORM_FIELDS:
        raise refusal([Unknown(name, name, ("file", *FORM_FIELDS))])


async def receive_upload(stream: AsyncIterator[bytes], boundary: bytes, sink: UploadSink, run_in_thread) -> Upload:
    """Parse a multipart/form-data body as it streams in: the part named `file` goes
    to `sink` in UPLOAD_PIECE pieces (`run_in_thread(fn, *args)` runs each write off
    the loop), the other fields are kept (each at most MAX_FIELD_BYTES)."""
    from multipart import MultipartSegment, ParserError, PushMultipartParser

    fields: dict[str, str] = {}
    filename: str | None = None
    part: MultipartSegment | None = None
    in_file = False
    value = bytearray()
    pending: list[bytes] = []
    pending_bytes = 0

    async def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            piece = b"".join(pending)
            pending, pending_bytes = [], 0
            await run_in_thread(sink.write, piece)

    try:
        with PushMultipartParser(boundary, max_segment_count=16) as parser:
            async for chunk in stream:
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        part, value = event, bytearray()
                        in_file = part.name == "file"
                        if not in_file:
                            check_form_field(part.name, fields)
                        if in_file:
                            if filename is not None:
                                raise BadRequest("the form holds more than one `file`", param="file")
                            filename = part.filename or "upload.jsonl"
                    elif event:
                        if in_file:
                            pending.append(event)
                            pending_bytes += len(event)
                            if pending_bytes >= UPLOAD_PIECE:
                                await flush()
                        else:
                            value += event
                            if len(value) > MAX_FIELD_BYTES:
                                raise BadRequest(f"form field {part.name!r} is over {MAX_FIELD_BYTES} bytes")
                    elif part is not None and not in_file:
                        fields[part.name] = value.decode("utf-8", "replace")
            await flush()
    except (ParserError, ValueError) as exc:
        raise BadRequest(f"the body is not valid multipart/form-data: {exc}") from None
    if filename is None:
        raise BadRequest("the form has no `file` part: send the JSONL file as `file`", param="file")
    await run_in_thread(sink.finish)
    return Upload(filename, fields, sink.size)


# ---- a run's input and results -------------------------------------------------------------

class LineReader:
    """An input file's request lines in order, from a line number on, READ_PIECE
    bytes at a time (`next_lines` is called on a thread)."""

    def __init__(self, path: Path) -> None:
        self.f = path.open("rb")
        self.line_no = 0

    def next_lines(self, max_bytes: int = READ_PIECE) -> list[tuple[int, bytes]]:
        """The next lines (number, bytes without the newline), about `max_bytes` of
        them; blank lines are skipped; [] at the end."""
        out, got = [], 0
        while got < max_bytes:
            raw = self.f.readline()
            if not raw:
                break
            self.line_no += 1
            line = raw.rstrip(b"\r\n")
            if line.strip():
                out.append((self.line_no, line))
                got += len(line)
        return out

    def close(self) -> None:
        self.f.close()


class ResultFile:
    """An output or error file being written: whole lines only (invariant 1)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.lines = 0
        self.dirty = False

    def append(self, data: bytes) -> None:
        """Write `data` (whole lines, each ending in a newline) or nothing: a failure
        part way cuts the file back to where it was, then raises (OSError)."""
        start = self.size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            os.ftruncate(self.fd, start)
            raise
        self.size = start + len(data)
        self.dirty = True

    def sync(self) -> None:
        if self.dirty:
            self.dirty = False
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ScanLine(msgspec.Struct):
    id: str
    response: _ScanResponse | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class _Body(msgspec.Struct):
    usage: _Usage | None = None


class _ScanResponse(msgspec.Struct):
    status_code: int = 0
    body: _Body | None = None


_scan_line = msgspec.json.Decoder(_ScanLine)
_body_usage = msgspec.json.Decoder(_Body)


def usage_of(body: bytes) -> tuple[int, int]:
    """(input, output) tokens a route's JSON reply reports: OpenAI's `prompt_tokens` /
    `completion_tokens` or fleet's `input_tokens` / `output_tokens`; (0, 0) without."""
    try:
        u = _body_usage.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0
    if u is None:
        return 0, 0
    return u.prompt_tokens or u.input_tokens, u.completion_tokens or u.output_tokens


@dataclass
class Scan:
    """What a batch's result files say after a restart."""

    answered: bytearray  # [line number] = 1 if an output or error line answers it
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cut_bytes: int = 0  # torn tail bytes cut off


def scan_results(path: Path, scan: Scan) -> None:
    """Read a result file back into `scan` (invariant 2); cut a torn tail off."""
    if not path.exists():
        return
    good = 0  # end of the last whole, readable line
    with path.open("r+b") as f:
        carry = b""
        while piece := f.read(READ_PIECE):
            data = carry + piece
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                line = data[start:end]
                try:
                    rec = _scan_line.decode(line)
                    line_no = int(rec.id.rsplit("_", 1)[1])
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError):
                    break
                if 0 < line_no < len(scan.answered):
                    scan.answered[line_no] = 1
                    status = rec.response.status_code if rec.response is not None else 0
                    if status == 200:
                        scan.completed += 1
                    elif status:
                        scan.failed += 1
                    if rec.response is not None and rec.response.body is not None and rec.response.body.usage:
                        u = rec.response.body.usage
                        scan.input_tokens += u.prompt_tokens or u.input_tokens
                        scan.output_tokens += u.completion_tokens or u.output_tokens
                good += end + 1 - start
                start = end + 1
            else:
                carry = data[start:]
                continue
            break  # an unreadable line: everything from it on is cut
        size = f.seek(0, os.SEEK_END)
        if size > good:
            scan.cut_bytes += size - good
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
