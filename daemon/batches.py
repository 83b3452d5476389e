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

The rooms: this module is the Files and Batches API the controllers call (`Batches`:
uploads, quotas, retention, create, list, cancel, resume at start); one batch's run
is daemon/batch_run.py (`BatchRun`), the file formats daemon/batchfile.py, and what
lasts across restarts daemon/jobstore.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fleet.batches import (
    CANCELLED, CANCELLING, ENDPOINTS, FINAL, FINALIZING, IN_PROGRESS, VALIDATING, Batch, BatchCreateRequest,
    BatchRequestCounts, ExpiresAfter, FileDeleted, FileObject,
)
from fleet.files import fsync_dir
from fleet.errors import BadRequest, FleetError, InsufficientStorage, ModelNotFound

from fleet.daemon.batch_run import BatchRun, Window
from fleet.daemon.batchfile import InputCheck, UploadSink, is_disk_full, receive_upload
from fleet.daemon.core import Daemon
from fleet.daemon.slots import ASGIApp
from fleet.daemon.jobstore import JobStore, StoredBatch, new_batch_id, new_file_id, now_s

log = logging.getLogger("fleet.batches")

#: OpenAI's bounds on a file's `expires_after.seconds`.
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2_592_000
#: `completion_window`: OpenAI takes "24h"; fleet any whole number of s, m or h in this range.
WINDOW_MIN_S, WINDOW_MAX_S = 1, 7 * 86_400
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smh])")
#: A batch's line may still be answered this long after its window closed: past
#: that the queue gives up on it, after the run has expired the batch.
DEADLINE_GRACE_S = 5.0
#: How often expired files are deleted (s): this often, or every `batch_retention_days`
#: when that is shorter, so a file outlives its `expires_at` by at most one period.
RETENTION_EVERY_S = 600.0



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
        from fleet.daemon.defaults import decision_model, default_model

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

