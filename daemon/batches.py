"""Offline jobs: OpenAI's Files and Batches API on fleet's lanes (DESIGN.md, "Offline jobs").

A batch is a producer in the daemon (docs/architecture.md, "Where a new thing
goes"). Its run reads the input file's lines and sends each through the route
its `url` names, in the ASGI app HTTP requests take (`Daemon.dispatch`: the hot
routes, then the Litestar app), inside `BATCH_WORK`. So a line is decoded by the
route's own strict Structs, checked and answered by its task's function in
daemon/tasks.py (one line, one call), and queued as batch work: behind its lane's
interactive work (local_queue invariant 2; `runtimes.policy.batch_fill_cap`),
promoted after `batch_max_wait_ms` (`Broker.promote_loop`), waiting until the
batch's window closes. The route's answer, status and body as they are, becomes
the line's output (200) or error line (anything else).

Statuses (OpenAI's), and what moves a batch between them:

    validating -> in_progress -> finalizing -> completed
    validating -> failed            a line names an url or model that cannot run (before any work)
    in_progress -> cancelling -> cancelled     `cancel`: no new line starts; lines in
                                               flight are withdrawn from their lanes
    in_progress -> expired          the completion window closed

Every line of the input is answered once, in the output file (a 200) or in the
error file (another status; or, never run, `batch_cancelled` / `batch_expired`),
what was done before a cancel or expiry is kept (daemon/batchfile.py,
invariants 1-3). A batch not in a final status when the daemon stops (SIGTERM,
SIGKILL, a box that lost power) resumes at the next start on the same
FLEET_HOME: its result files are read back, a torn tail cut off, and only the
lines they do not answer run. A line answered 429 or 503 (the queue is full, the
daemon drains) is not an answer: it runs again (after `Retry-After`), or after the
restart. A full disk pauses a batch: status `in_progress`, with a `disk_full`
entry in `errors`; it goes on by itself once a write succeeds (nothing is written
half, nothing is lost: the answers held meanwhile are written first).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec

from fleet.batches import (
    CANCELLED, CANCELLING, COMPLETED, ENDPOINT_TASK, ENDPOINTS, EXPIRED, FAILED, FINAL, FINALIZING, IN_PROGRESS,
    VALIDATING, Batch, BatchCreateRequest, BatchError, BatchErrors, BatchRequestCounts, BatchUsage, ExpiresAfter,
    FileDeleted, FileObject, LineError, LineResponse, OutputLine, RequestLine,
)
from fleet.errors import BadRequest, FleetError, InsufficientStorage, ModelNotFound

from fleet.daemon import codec
from fleet.daemon.batchfile import (
    InputCheck, LineReader, ResultFile, Scan, UploadSink, body_head, is_disk_full, receive_upload, scan_results,
    usage_of,
)
from fleet.daemon.core import BATCH_WORK, ASGIApp, BatchWork, Daemon
from fleet.daemon.jobstore import JobStore, StoredBatch, new_batch_id, new_file_id, now_s

log = logging.getLogger("fleet.batches")

#: OpenAI's bounds on a file's `expires_after.seconds`.
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2_592_000
#: `completion_window`: OpenAI takes "24h"; fleet any whole number of s, m or h in this range.
WINDOW_MIN_S, WINDOW_MAX_S = 1, 7 * 86_400
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smh])")
#: Statuses of a route's answer that are not answers: the line runs again later.
RETRY_STATUSES = frozenset({429, 503})
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
#: How often a run fsyncs its result files, and tries again to write after a full disk (s).
SYNC_EVERY_S = 1.0
#: A batch's line may still be answered this long after its window closed: past
#: that the queue gives up on it, after the run has expired the batch.
DEADLINE_GRACE_S = 5.0
#: How often expired files are deleted (s): this often, or every `batch_retention_days`
#: when that is shorter, so a file outlives its `expires_at` by at most one period.
RETENTION_EVERY_S = 600.0

_request_line = msgspec.json.Decoder(RequestLine)

_CANCELLED_LINE = LineError("batch_cancelled", "This request was not run: the batch was cancelled.")
_EXPIRED_LINE = LineError("batch_expired", "This request could not be executed before the completion window expired.")


def window_seconds(text: str) -> int:
    m = _WINDOW.fullmatch(text)
    seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)] if m else 0
    if not WINDOW_MIN_S <= seconds <= WINDOW_MAX_S:
        raise BadRequest(f"completion_window must be like \"24h\" (a whole number of s, m or h, at most 7 days), "
                         f"not {text!r}", param="completion_window")
    return seconds


def expiry_seconds(policy: ExpiresAfter | None, field: str) -> int | None:
    if policy is None:
        return None
    if policy.anchor != "created_at":
        raise BadRequest(f"{field}.anchor must be \"created_at\", not {policy.anchor!r}", param=f"{field}.anchor")
    if not EXPIRES_MIN_S <= policy.seconds <= EXPIRES_MAX_S:
        raise BadRequest(f"{field}.seconds must be between {EXPIRES_MIN_S} and {EXPIRES_MAX_S}, got {policy.seconds}",
                         param=f"{field}.seconds")
    return policy.seconds


class Window:
    """Lines in flight, for all batches of the daemon: at most `lines` and `nbytes` of
    request bytes (one line over `nbytes` still goes, alone)."""

    def __init__(self, lines: int, nbytes: int) -> None:
        self.lines, self.nbytes = max(1, lines), nbytes
        self.used_lines = self.used_bytes = 0
        self._waiters: deque[asyncio.Future] = deque()

    def _fits(self, n: int) -> bool:
        return self.used_lines < self.lines and (self.used_bytes + n <= self.nbytes or self.used_lines == 0)

    async def acquire(self, n: int) -> None:
        while not self._fits(n):
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if not fut.done():
                    fut.cancel()
        self.used_lines += 1
        self.used_bytes += n

    def release(self, n: int) -> None:
        self.used_lines -= 1
        self.used_bytes -= n
        while self._waiters:  # each re-checks: a few runs at most wait here
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)


async def call_route(app: ASGIApp, path: str, body: bytes, request_id: str) -> tuple[int, dict[str, str], bytes]:
    """POST `body` (JSON) to `path` of the ASGI `app`, in this process: (status, headers, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                    (b"accept", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode())],
    }
    delivered = False
    never = asyncio.Event()
    status, headers, chunks = 500, {}, []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # nobody disconnects: the answer is read whole
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


class BatchRun:
    """One batch's producer, from validation to its final status (see the module doc)."""

    def __init__(self, batches: Batches, stored: StoredBatch) -> None:
        self.batches = batches
        self.b = stored.batch
        self.output_id, self.error_id = stored.output_id, stored.error_id
        self.output_expires_s = stored.output_expires_s
        self.hex = self.b.id.removeprefix("batch_")
        self.stopping: str | None = None  # "cancel", "expire", "drain", "shutdown"
        self.inflight: dict[int, asyncio.Task] = {}
        self.scan: Scan | None = None
        self.out: ResultFile | None = None
        self.err: ResultFile | None = None
        self.backlog: list[tuple[ResultFile, bytes]] = []  # answers held while the disk is full
        self.writable = asyncio.Event()
        self.writable.set()
        self.task: asyncio.Task | None = None

    # -- what clients see --------------------------------------------------------------

    @property
    def store(self) -> JobStore:
        return self.batches.store

    def save(self) -> None:
        try:
            self.store.save_batch(self.b)
        except Exception as exc:  # a full disk: the status lives on in memory, saved at the next transition
            log.error("batch %s: saving its status %s failed: %s", self.b.id, self.b.status, exc)

    def set_errors(self, errors: list[BatchError] | None) -> None:
        self.b.errors = BatchErrors(errors) if errors else None

    # -- the run ---------------------------------------------------------------------------

    def start(self) -> None:
        # A context of its own: not the one of the request that created it (its log request id).
        self.task = asyncio.get_running_loop().create_task(self.main(), name=f"batch {self.b.id}",
                                                           context=contextvars.Context())

    async def main(self) -> None:
        try:
            if self.b.status == VALIDATING:
                errors = self.validate()
                if errors:
                    self.set_errors(errors)
                    self.b.status, self.b.failed_at = FAILED, now_s()
                    self.save()
                    log.info("batch %s failed validation: %s", self.b.id, errors[0].message)
                    return
                self.b.status, self.b.in_progress_at = IN_PROGRESS, now_s()
                self.save()
            await self.open_results()
            if self.b.status == CANCELLING:
                self.stopping = "cancel"
            elif time.time() >= (self.b.expires_at or 0):
                self.stopping = "expire"
            else:
                await self.produce()
            if self.stopping in ("drain", "shutdown"):
                return  # not answered lines run after the restart
            if self.stopping == "cancel":
                await self.settle(_CANCELLED_LINE)
                await self.finalize(CANCELLED)
            elif self.stopping == "expire":
                await self.settle(_EXPIRED_LINE)
                await self.finalize(EXPIRED)
            else:
                self.b.status, self.b.finalizing_at = FINALIZING, now_s()
                self.save()
                await self.finalize(COMPLETED)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("batch %s failed", self.b.id)
            self.set_errors([BatchError("internal", f"the batch stopped on an internal error: {type(exc).__name__}")])
            self.b.status, self.b.failed_at = FAILED, now_s()
            self.save()
        finally:
            for f in (self.out, self.err):
                if f is not None:
                    f.close()
            self.batches.runs.pop(self.b.id, None)

    def validate(self) -> list[BatchError]:
        """Before any work: every (url, model) the input uses must run here (the
        upload kept each distinct pair with its first line: no second read of the file)."""
        try:
            f = self.store.get_file(self.b.input_file_id)
        except FleetError:
            return [BatchError("invalid_file", f"input file {self.b.input_file_id!r} no longer exists",
                               "input_file_id")]
        task = ENDPOINT_TASK[self.b.endpoint]
        errors: list[BatchError] = []
        models: set[str] = set()
        for url, model, line in sorted(f.uses, key=lambda u: u[2]):
            if url != self.b.endpoint:
                errors.append(BatchError("invalid_url", f"line {line}: url {url!r} is not the batch's endpoint "
                                                        f"{self.b.endpoint!r}", "url", line))
                continue
            try:
                models.add(self.batches.check_model(task, model))
            except FleetError as exc:
                code = "model_not_found" if isinstance(exc, ModelNotFound) else "invalid_model"
                errors.append(BatchError(code, f"line {line}: {exc.message}", "body.model", line))
        self.b.model = next(iter(models)) if len(models) == 1 else None
        self.b.request_counts = BatchRequestCounts(total=f.lines)
        return errors[:100]

    async def open_results(self) -> None:
        """Read what the result files already answer (a resumed run), cut torn tails,
        and open them for appending."""
        total = self.b.request_counts.total
        scan = Scan(bytearray(self.store.get_file(self.b.input_file_id).span + 1))
        for file_id in (self.output_id, self.error_id):
            await asyncio.to_thread(scan_results, self.batches.result_path(file_id), scan)
        if scan.cut_bytes:
            log.warning("batch %s: cut %d bytes of a torn last line from its results; those lines run again",
                        self.b.id, scan.cut_bytes)
        self.scan = scan
        self.b.request_counts = BatchRequestCounts(total, scan.completed, scan.failed)
        self.b.usage = BatchUsage(input_tokens=scan.input_tokens, output_tokens=scan.output_tokens,
                                  total_tokens=scan.input_tokens + scan.output_tokens)
        self.out = ResultFile(self.batches.result_path(self.output_id))
        self.err = ResultFile(self.batches.result_path(self.error_id))

    async def produce(self) -> None:
        """Start every line not answered yet, as the window lets; wait for them all."""
        window = self.batches.window
        reader = LineReader(self.batches.store.path(self.b.input_file_id))
        syncer = asyncio.get_running_loop().create_task(self.sync_loop())
        expiry = asyncio.get_running_loop().call_later(max(0.0, (self.b.expires_at or 0) - time.time()),
                                                       self.stop, "expire")
        try:
            while self.stopping is None:
                lines = await asyncio.to_thread(reader.next_lines)
                if not lines:
                    break
                for n, raw in lines:
                    if self.scan.answered[n]:
                        continue
                    await self.writable.wait()
                    await window.acquire(len(raw))
                    if self.stopping is not None:
                        window.release(len(raw))
                        break
                    self.inflight[n] = asyncio.get_running_loop().create_task(self.execute(n, raw))
                else:
                    continue
                break
            while self.inflight:
                await asyncio.wait(list(self.inflight.values()))
            while self.backlog and self.stopping is None:
                await asyncio.sleep(SYNC_EVERY_S)  # the disk is full: wait for the held answers to go out
        finally:
            expiry.cancel()
            syncer.cancel()
            reader.close()
            for task in list(self.inflight.values()):
                task.cancel()

    def stop(self, reason: str) -> None:
        """No new line starts; lines in flight are withdrawn (their queue items are
        cancelled by the broker: a claimed one's answer is dropped on arrival)."""
        if self.stopping is None:
            self.stopping = reason
            for task in list(self.inflight.values()):
                task.cancel()
            self.writable.set()  # a paused producer sees the stop at once

    async def execute(self, n: int, raw: bytes) -> None:
        """Run line `n` through its route and record the answer."""
        try:
            req = _request_line.decode(raw)
            request_id = f"req_{self.hex[:12]}_{n}"
            body = bytes(req.body)
            if body_head(body).stream:
                err = BadRequest("`stream: true` is not supported in a batch: each request is answered whole, "
                                 "in one line of the output file", param="stream")
                status, headers, reply = 400, {}, self.batches.error_body(req.url, err)
            else:
                BATCH_WORK.set(BatchWork(self.batches.deadline_s(self.b)))
                while True:
                    status, headers, reply = await call_route(self.batches.dispatch, req.url, body, request_id)
                    if status not in RETRY_STATUSES:
                        break
                    wait = float(headers.get("retry-after", RETRY_MIN_S) or RETRY_MIN_S)
                    await asyncio.sleep(min(RETRY_MAX_S, max(RETRY_MIN_S, wait)))
                    if self.stopping is not None:
                        return
            ignored = headers.get("x-fleet-ignored-fields")
            response = LineResponse(status, request_id, msgspec.Raw(reply),
                                    {"x-fleet-ignored-fields": ignored} if ignored else None)
            self.record(n, req.custom_id, response, None)
            if status == 200:
                tin, tout = usage_of(reply)
                u = self.b.usage
                u.input_tokens += tin
                u.output_tokens += tout
                u.total_tokens += tin + tout
        finally:
            self.inflight.pop(n, None)
            self.batches.window.release(len(raw))

    def record(self, n: int, custom_id: str, response: LineResponse | None, error: LineError | None) -> None:
        """Append line `n`'s answer (invariant 3: once); a full disk holds it and pauses the batch."""
        if self.scan.answered[n]:
            raise RuntimeError(f"batch {self.b.id}: line {n} answered twice; this is a bug")
        self.scan.answered[n] = 1
        line = codec.json_line(OutputLine(f"batch_req_{self.hex}_{n}", custom_id, response, error)) + b"\n"
        target = self.out if response is not None and response.status_code == 200 else self.err
        counts = self.b.request_counts
        if response is not None:
            if response.status_code == 200:
                counts.completed += 1
            else:
                counts.failed += 1
        self.write(target, line)

    def write(self, target: ResultFile, line: bytes) -> None:
        if self.backlog:
            self.backlog.append((target, line))
            return
        try:
            target.append(line)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.backlog.append((target, line))
            self.pause_for_disk()

    def pause_for_disk(self) -> None:
        if self.writable.is_set() and self.stopping is None:
            log.error("batch %s paused: the disk that holds FLEET_HOME is full", self.b.id)
            self.writable.clear()
            self.set_errors([BatchError("disk_full", "paused: no space left on the disk that holds the batch's "
                                                     "files; it goes on by itself once space is freed")])

    def flush_backlog(self) -> bool:
        """Write the answers held while the disk was full, in order; True when none is left."""
        while self.backlog:
            target, line = self.backlog[0]
            try:
                target.append(line)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                return False
            self.backlog.pop(0)
        if not self.writable.is_set():
            log.info("batch %s goes on: its answers are written again", self.b.id)
            self.set_errors(None)
            self.writable.set()
        return True

    async def sync_loop(self) -> None:
        """Every SYNC_EVERY_S: fsync what was written, and retry held answers."""
        while True:
            await asyncio.sleep(SYNC_EVERY_S)
            if self.backlog:
                self.flush_backlog()
            try:
                await asyncio.to_thread(self.sync)
            except OSError as exc:
                log.error("batch %s: fsync of its results failed: %s", self.b.id, exc)

    def sync(self) -> None:
        for f in (self.out, self.err):
            if f is not None:
                f.sync()

    async def settle(self, why: LineError) -> None:
        """Answer every line not answered (cancelled or expired) with `why`, in the error file."""
        reader = LineReader(self.store.path(self.b.input_file_id))
        try:
            while lines := await asyncio.to_thread(reader.next_lines):
                for n, raw in lines:
                    if not self.scan.answered[n]:
                        self.record(n, _request_line.decode(raw).custom_id, None, why)
        finally:
            reader.close()

    async def finalize(self, final: str) -> None:
        """The result files become files of the Files API (purpose `batch_output`),
        and the batch takes its final status, in one transaction."""
        if self.backlog and not self.flush_backlog():
            self.set_errors([BatchError("disk_full", f"{len(self.backlog)} answers could not be written: no space "
                                                     "left on the disk that holds the batch's files")])
            self.backlog.clear()
        await asyncio.to_thread(self.sync)
        files: list[FileObject] = []
        now = now_s()
        for file_id, kind in ((self.output_id, "output"), (self.error_id, "error")):
            tmp, final_path = self.store.temp_path(file_id), self.store.path(file_id)
            if tmp.exists():
                if tmp.stat().st_size == 0:
                    tmp.unlink()
                    continue
                os.replace(tmp, final_path)
            if not final_path.exists():
                continue
            keep_s = self.output_expires_s or self.batches.retention_s
            files.append(FileObject(file_id, final_path.stat().st_size, now, f"{self.b.id}_{kind}.jsonl",
                                    "batch_output", expires_at=now + keep_s))
            setattr(self.b, f"{kind}_file_id", file_id)
        fsync_dir(self.store.files_dir)
        self.b.status = final
        setattr(self.b, {COMPLETED: "completed_at", CANCELLED: "cancelled_at", EXPIRED: "expired_at"}[final], now)
        self.store.finish_batch(self.b, files)
        log.info("batch %s %s: %d of %d lines answered 200, %d otherwise", self.b.id, final,
                 self.b.request_counts.completed, self.b.request_counts.total, self.b.request_counts.failed)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Batches:
    """The daemon's offline jobs: files, batches and their runs (`Daemon.batches`)."""

    def __init__(self, daemon: Daemon, dispatch: ASGIApp) -> None:
        self.daemon = daemon
        self.dispatch = dispatch
        #: Bytes of uploads in flight, taken from the quota (`room`); changed on upload threads.
        self.uploading = 0
        self._uploading_lock = threading.Lock()
        s = daemon.settings
        self.store = JobStore(s.home_path)
        self.window = Window(s.batch_inflight, s.batch_inflight_bytes)
        self.retention_s = int(s.batch_retention_days * 86_400)
        self.runs: dict[str, BatchRun] = {}
        self._retention: asyncio.Task | None = None
        self._threads = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume what a stop left unfinished, and start deleting expired files."""
        unfinished = self.store.unfinished(FINAL)
        keep = {f".tmp-{i}" for sb in unfinished for i in (sb.output_id, sb.error_id)} | {
            i for sb in unfinished for i in (sb.output_id, sb.error_id)}
        gone = self.store.sweep_orphans(keep)
        if gone:
            log.warning("removed %d unfinished uploads or unnamed files from the batch store", len(gone))
        for stored in unfinished:
            if stored.batch.status != VALIDATING:
                log.info("batch %s resumes (%s)", stored.batch.id, stored.batch.status)
            if stored.batch.status == FINALIZING:
                stored.batch.status = IN_PROGRESS  # its results are read back: any line they lack runs first
            self._run(stored)
        self._retention = asyncio.get_running_loop().create_task(self.retention_loop())

    def drain(self) -> None:
        for run in list(self.runs.values()):
            run.stop("drain")

    async def stop(self) -> None:
        if self._retention is not None:
            self._retention.cancel()
        tasks = []
        for run in list(self.runs.values()):
            run.stop("shutdown")
            if run.task is not None:
                tasks.append(run.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in tasks:
            task.cancel()
        self.store.close()

    def _run(self, stored: StoredBatch) -> BatchRun:
        run = self.runs[stored.batch.id] = BatchRun(self, stored)
        run.start()
        return run

    async def retention_loop(self) -> None:
        while True:
            try:
                self.delete_expired()
            except Exception:
                log.exception("deleting expired batch files failed")
            await asyncio.sleep(min(RETENTION_EVERY_S, max(1.0, self.retention_s)))

    def delete_expired(self) -> list[str]:
        """Files past their `expires_at`, except the input of a batch still running."""
        gone = [f for f in self.store.expired_files(now_s()) if not self.store.input_in_use(f, FINAL)]
        for file_id in gone:
            self.store.delete_file(file_id)
        if gone:
            log.info("deleted %d expired batch files", len(gone))
        return gone

    # -- helpers for runs ----------------------------------------------------------------

    def result_path(self, file_id: str) -> Path:
        """A result file: under its temp name while its batch runs, its own once final."""
        final = self.store.path(file_id)
        return final if final.exists() else self.store.temp_path(file_id)

    def deadline_s(self, b: Batch) -> float:
        return time.monotonic() + max(0.0, (b.expires_at or 0) - time.time()) + DEADLINE_GRACE_S

    def check_model(self, task: str, model: str | None) -> str:
        """The model a line of `task` runs on (its default when it names none); raises
        what the route would answer for a model that cannot run it."""
        from fleet.daemon.defaults import default_model
        from fleet.daemon.controllers.systemone import decision_model

        # A decision line's `jev-latest` is the box's default decision model, as on its route.
        name = decision_model(self.daemon, model) if task == "decide" and model else model or default_model(
            self.daemon, task)
        try:
            self.daemon.manifest(name, task)
        except ModelNotFound:
            upstreams = self.daemon.upstreams
            rule = upstreams.rule(name) if upstreams is not None else None
            if rule is not None and rule.mode == "remote":
                return name  # its lines run upstream (daemon.spill), as its requests do
            if self.daemon.cluster is None:
                raise
            self.daemon.cluster.check_model(name, task)
        return name

    def error_body(self, url: str, exc: FleetError) -> bytes:
        from fleet.daemon.http import error_parts

        return error_parts(exc, method="POST", path=url, msgpack=False, private=())[0]

    # -- files ---------------------------------------------------------------------------

    async def upload(self, stream: AsyncIterator[bytes], boundary: bytes) -> FileObject:
        """`POST /v1/files`: the JSONL streamed to disk, checked line by line, then named."""
        s = self.daemon.settings
        file_id = new_file_id()
        tmp = self.store.temp_path(file_id)
        taken = [0]
        try:
            sink = UploadSink(tmp, InputCheck(s.max_body_bytes, s.batch_max_lines), s.batch_max_file_bytes,
                              self.room(taken))
        except OSError as exc:
            if is_disk_full(exc):
                raise InsufficientStorage("no space left for the file on the disk that holds FLEET_HOME") from None
            raise
        try:
            up = await receive_upload(stream, boundary, sink, asyncio.to_thread)
            purpose = up.fields.get("purpose")
            if purpose != "batch":
                raise BadRequest(f"purpose must be \"batch\" (fleet keeps files for batches only), not {purpose!r}",
                                 param="purpose")
            expires = self._upload_expiry(up.fields)
            os.replace(tmp, self.store.path(file_id))
            fsync_dir(self.store.files_dir)
        except BaseException:
            sink.close()
            tmp.unlink(missing_ok=True)
            self.give_back(taken)
            raise
        sink.close()
        now = now_s()
        f = FileObject(file_id, up.size, now, os.path.basename(up.filename)[:255], "batch",
                       expires_at=now + (expires or self.retention_s))
        uses = [(url, model, line) for (url, model), line in sink.check.uses.items()]
        try:
            self.store.add_file(f, lines=sink.check.lines, span=sink.check.line_no, uses=uses)
        except Exception:
            self.store.path(file_id).unlink(missing_ok=True)
            raise
        finally:
            self.give_back(taken)  # stored (counted by files_bytes) or gone
        log.info("file %s: %d request lines, %d bytes", file_id, sink.check.lines, up.size)
        return f

    def room(self, taken: list[int]) -> Callable[[int], None]:
        """The quota of one upload: `take(n)` (on an upload thread) takes n bytes of what
        batch files may still take (`batch_files_max_bytes`, else a quarter of the disk),
        counting the files stored when the upload began and the uploads in flight, or
        raises 507; `taken[0]` is what this upload holds (given back by `give_back`)."""
        limit = self.daemon.settings.batch_files_max_bytes or shutil.disk_usage(self.store.files_dir).total // 4
        stored = self.store.files_bytes()

        def take(n: int) -> None:
            with self._uploading_lock:
                if stored + self.uploading + n > limit:
                    raise InsufficientStorage(
                        f"batch files would take more than their quota of {limit} bytes (batch_files_max_bytes; "
                        f"by default a quarter of the disk): delete the files no longer needed "
                        f"(DELETE /v1/files/{{id}}), or raise the quota", param="file")
                self.uploading += n
                taken[0] += n

        return take

    def give_back(self, taken: list[int]) -> None:
        with self._uploading_lock:
            self.uploading -= taken[0]
            taken[0] = 0

    @staticmethod
    def _upload_expiry(fields: dict[str, str]) -> int | None:
        anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return None
        try:
            policy = ExpiresAfter(anchor or "", int(seconds or ""))
        except ValueError:
            raise BadRequest(f"expires_after[seconds] must be a whole number, not {seconds!r}",
                             param="expires_after.seconds") from None
        return expiry_seconds(policy, "expires_after")

    def file(self, file_id: str) -> FileObject:
        self.store.path(file_id)
        return self.store.get_file(file_id).file

    def files(self, *, after: str | None, limit: int, order: str, purpose: str | None) -> tuple[list[FileObject], bool]:
        if not 1 <= limit <= 10_000:
            raise BadRequest(f"limit must be between 1 and 10000, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order must be \"asc\" or \"desc\", not {order!r}", param="order")
        return self.store.list_files(after=after, limit=limit, order=order, purpose=purpose)

    def delete_file(self, file_id: str) -> FileDeleted:
        self.file(file_id)
        if self.store.input_in_use(file_id, FINAL):
            raise BadRequest(f"file {file_id!r} is the input of a batch still running: cancel it first",
                             param="file_id")
        self.store.delete_file(file_id)
        return FileDeleted(file_id)

    def content_path(self, file_id: str) -> tuple[Path, FileObject]:
        f = self.file(file_id)
        return self.store.path(file_id), f

    # -- batches -------------------------------------------------------------------------

    def create(self, req: BatchCreateRequest) -> Batch:
        """`POST /v1/batches`: a batch in `validating`; its run checks the lines' models
        at once and starts them (or fails it, naming the line)."""
        if req.endpoint not in ENDPOINTS:
            raise BadRequest(f"endpoint {req.endpoint!r} is not one batches run; they run {', '.join(ENDPOINTS)}",
                             param="endpoint")
        seconds = window_seconds(req.completion_window)
        output_expires_s = expiry_seconds(req.output_expires_after, "output_expires_after")
        if req.metadata is not None and (len(req.metadata) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())):
            raise BadRequest("metadata takes at most 16 pairs, keys of at most 64 characters and values of at most "
                             "512", param="metadata")
        try:
            stored_file = self.store.get_file(req.input_file_id)
        except FleetError:
            stored_file = None
        if stored_file is None or stored_file.file.purpose != "batch":
            raise BadRequest(f"input_file_id {req.input_file_id!r} is not a file uploaded with purpose \"batch\"",
                             param="input_file_id")
        now = now_s()
        b = Batch(id=new_batch_id(), endpoint=req.endpoint, input_file_id=req.input_file_id,
                  completion_window=req.completion_window, status=VALIDATING, created_at=now,
                  expires_at=now + seconds, metadata=req.metadata,
                  request_counts=BatchRequestCounts(total=stored_file.lines))
        stored = StoredBatch(b, new_file_id(), new_file_id(), output_expires_s)
        self.store.add_batch(b, output_id=stored.output_id, error_id=stored.error_id,
                             output_expires_s=output_expires_s)
        self._run(stored)
        return b

    def get(self, batch_id: str) -> Batch:
        run = self.runs.get(batch_id)
        return run.b if run is not None else self.store.get_batch(batch_id).batch

    def list(self, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        if not 1 <= limit <= 100:
            raise BadRequest(f"limit must be between 1 and 100, got {limit}", param="limit")
        page, more = self.store.list_batches(after=after, limit=limit)
        return [self.runs[b.id].b if b.id in self.runs else b for b in page], more

    def cancel(self, batch_id: str) -> Batch:
        """`POST /v1/batches/{id}/cancel`: `cancelling` at once; no new line starts, lines
        in flight are withdrawn, the rest are answered `batch_cancelled`; then `cancelled`."""
        b = self.get(batch_id)
        if b.status in (CANCELLING, CANCELLED):
            return b
        if b.status not in (VALIDATING, IN_PROGRESS):
            raise BadRequest(f"batch {batch_id!r} is {b.status}: only a batch validating or in progress can be "
                             "cancelled", param="batch_id")
        run = self.runs[batch_id]
        b.status, b.cancelling_at = CANCELLING, now_s()
        run.save()
        run.stop("cancel")
        return b

