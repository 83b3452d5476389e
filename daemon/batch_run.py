"""Offline jobs: one batch's run, from validation to its final status.

daemon/batches.py's module doc says what a batch is and how its statuses move;
this room is the producer that moves them: it validates the input's (url, model)
pairs, reads back what the result files already answer (a resumed run), sends
every other line through its route inside `BATCH_WORK` as the window of lines in
flight allows, appends each answer once (daemon/batchfile.py, invariants 1-3),
holds answers while the disk is full, and finally turns the result files into
files of the Files API. It is apart from `Batches` (the Files and Batches API the
controllers call) because a run changes for other reasons (retries, disk, resume)
than the API does; it reaches its owner only through `RunHost`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Protocol

import msgspec

from fleet.batches import (
    CANCELLED, CANCELLING, COMPLETED, ENDPOINT_TASK, EXPIRED, FAILED, FINALIZING, IN_PROGRESS, VALIDATING, Batch,
    BatchError, BatchErrors, BatchRequestCounts, BatchUsage, FileObject, LineError, LineResponse, OutputLine,
    RequestLine,
)
from fleet.errors import BadRequest, FleetError, ModelNotFound
from fleet.files import fsync_dir

from fleet.daemon import codec
from fleet.daemon.batchfile import LineReader, ResultFile, Scan, body_head, is_disk_full, scan_results, usage_of
from fleet.daemon.core import BATCH_WORK, BatchWork
from fleet.daemon.slots import ASGIApp
from fleet.daemon.jobstore import JobStore, StoredBatch, now_s

log = logging.getLogger("fleet.batches")

#: Statuses of a route's answer that are not answers: the line runs again later.
RETRY_STATUSES = frozenset({429, 503})
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
#: How often a run fsyncs its result files, and tries again to write after a full disk (s).
SYNC_EVERY_S = 1.0

_request_line = msgspec.json.Decoder(RequestLine)

_CANCELLED_LINE = LineError("batch_cancelled", "This request was not run: the batch was cancelled.")
_EXPIRED_LINE = LineError("batch_expired", "This request could not be executed before the completion window expired.")


class RunHost(Protocol):
    """What a run needs of the daemon's `Batches`: its stores, its window, its routes."""

    store: JobStore
    window: Window
    dispatch: ASGIApp
    retention_s: int
    runs: dict[str, BatchRun]

    def check_model(self, task: str, model: str | None) -> str: ...

    def result_path(self, file_id: str) -> Path: ...

    def deadline_s(self, b: Batch) -> float: ...

    def error_body(self, url: str, exc: FleetError) -> bytes: ...


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

    def __init__(self, batches: RunHost, stored: StoredBatch) -> None:
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
