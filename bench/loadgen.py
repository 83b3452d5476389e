"""The load generator: open-loop Poisson arrivals (or closed-loop clients) in its own process(es).

Open loop: a step at rate r for d seconds draws n = round(r*d) arrival times,
uniform order statistics over [0, d) (a Poisson process conditioned on its
count, so every step offers exactly r*d requests and a slow server cannot
slow the offered load down). Each request's latency is measured from its
*scheduled* arrival, not from when a connection was free, so queueing in the
generator or the server is counted (no coordinated omission). Closed loop: c
clients, each with its own connection, send back to back for d seconds.

Each generator process runs one asyncio loop (uvloop when installed) with a
keep-alive pool (`bench.httpclient`). It reports its own CPU time and how late
it fired arrivals (lag): a generator that falls behind is the bottleneck, and
the report says so. The parent talks to it over a pipe with MessagePack
messages. This module must not import torch or any model code.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from fleet.bench import httpclient
from fleet.bench.targets import Payload, build_payloads, reply_tokens

PROGRESS_EVERY_S = 0.25
#: Open connections per generator process, at most (beyond that requests wait, counted in latency).
MAX_CONNECTIONS = 512


class Setup(msgspec.Struct, frozen=True):
    kind: str
    task: str
    url: str
    model: str
    texts: list[str]
    lengths: list[int]
    batch: int
    encoding: str = "base64"
    api_key: str = ""
    seed: int = 7
    max_connections: int = MAX_CONNECTIONS


class StepPlan(msgspec.Struct, frozen=True):
    index: int
    mode: str  # "open" | "closed"
    #: requests/s (open) or clients (closed), for this generator process.
    offered: float
    duration_s: float
    #: How long past the step's end to wait for late replies before counting them as timeouts.
    grace_s: float = 10.0
    seed: int = 0


class StepRaw(msgspec.Struct):
    index: int
    sent: int
    ok: int
    errors: int
    #: HTTP status (0 = transport error, -1 = timeout, -2 = malformed reply) -> count, errors only.
    error_codes: dict[int, int]
    error_sample: str
    #: Latencies of successful requests, float32 milliseconds, raw bytes.
    latencies_ms: bytes
    #: The server's X-Queue-Ms / X-Inference-Ms per successful request (float32, NaN = not sent).
    server_queue_ms: bytes
    server_inference_ms: bytes
    tokens_ok: int
    #: Sum of the server's reported tokens over successful replies (-1: it reports none).
    server_tokens: int
    #: First arrival -> last completion (at least the step's duration), seconds.
    elapsed_s: float
    #: How late arrivals were fired, p99, ms (open loop).
    lag_p99_ms: float
    #: This process's CPU seconds during the step.
    cpu_s: float
    started_unix: float


class Progress(msgspec.Struct):
    index: int
    sent: int
    done: int
    errors: int


_enc = msgspec.msgpack.Encoder()


class _Recorder:
    def __init__(self, kind: str, task: str) -> None:
        self.kind, self.task = kind, task
        self.lat: list[float] = []
        self.queue_ms: list[float] = []
        self.inference_ms: list[float] = []
        self.ok = self.errors = self.sent = 0
        self.tokens = 0
        self.server_tokens = 0
        self.server_reports = True
        self.codes: dict[int, int] = {}
        self.sample = ""
        self.last_done = 0.0

    def fail(self, code: int, detail: str) -> None:
        self.errors += 1
        self.codes[code] = self.codes.get(code, 0) + 1
        if not self.sample:
            self.sample = detail[:300]

    def reply(self, payload: Payload, status: int, body: bytes, latency_s: float, done: float,
              queue_ms: float = float("nan"), inference_ms: float = float("nan")) -> None:
        self.last_done = max(self.last_done, done)
        if not 200 <= status < 300:
            self.fail(status, body[:300].decode("utf-8", "replace"))
            return
        try:
            served = reply_tokens(self.kind, self.task, body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.fail(-2, f"malformed reply: {exc}")
            return
        self.ok += 1
        self.lat.append(latency_s * 1000.0)
        self.queue_ms.append(queue_ms)
        self.inference_ms.append(inference_ms)
        if served < 0:
            self.server_reports = False
        else:
            self.server_tokens += served
        # Generation is measured in output tokens, which only the server knows.
        self.tokens += served if self.task == "generate" else payload.tokens


async def _send(pool: httpclient.Pool, payload: Payload, rec: _Recorder, t_sched: float) -> None:
    loop = asyncio.get_running_loop()
    conn = None
    for attempt in (0, 1):
        try:
            conn = await pool.acquire()
            status, body, keep, queue_ms, inference_ms = await httpclient.exchange(conn, payload.request)
            break
        except asyncio.CancelledError:
            pool.discard(conn)
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            stale = conn is not None and conn.reused and (
                isinstance(exc, ConnectionResetError | BrokenPipeError)
                or (isinstance(exc, asyncio.IncompleteReadError) and not exc.partial)
            )
            pool.discard(conn)
            conn = None
            # A reused connection the server closed while it sat idle fails before any
            # reply byte: that says nothing about the server, so send once more on a fresh one.
            if stale and attempt == 0:
                continue
            rec.last_done = max(rec.last_done, loop.time())
            rec.fail(0, f"{type(exc).__name__}: {exc}")
            return
    done = loop.time()
    if keep:
        pool.release(conn)
    else:
        pool.discard(conn)
    rec.reply(payload, status, body, done - t_sched, done, queue_ms, inference_ms)


async def _progress(pipe, plan: StepPlan, rec: _Recorder) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        pipe.send_bytes(b"P" + _enc.encode(Progress(plan.index, rec.sent, rec.ok + rec.errors, rec.errors)))


async def run_step(setup: Setup, payloads: list[Payload], pool: httpclient.Pool, plan: StepPlan,
                   pipe=None) -> tuple[StepRaw, bool]:
    """Run one step; returns its raw result and whether the pool must be rebuilt (cancelled requests)."""
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(plan.seed)
    rec = _Recorder(setup.kind, setup.task)
    reporter = asyncio.create_task(_progress(pipe, plan, rec)) if pipe is not None else None
    cpu0 = time.process_time()
    started_unix = time.time()
    lags = np.zeros(0)
    tasks: set[asyncio.Task] = set()
    t0 = loop.time()
    if plan.mode == "open":
        n = max(1, round(plan.offered * plan.duration_s))
        offsets = np.sort(rng.uniform(0.0, plan.duration_s, n))
        picks = rng.integers(0, len(payloads), n)
        lags = np.empty(n)
        for i in range(n):
            t_sched = t0 + offsets[i]
            delay = t_sched - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags[i] = loop.time() - t_sched
            rec.sent += 1
            task = asyncio.create_task(_send(pool, payloads[picks[i]], rec, t_sched))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    else:
        clients = max(1, round(plan.offered))
        end = t0 + plan.duration_s
        start = rng.integers(0, len(payloads), clients)

        async def client(k: int) -> None:
            j = int(start[k])
            while loop.time() < end:
                rec.sent += 1
                await _send(pool, payloads[j % len(payloads)], rec, loop.time())
                j += 1

        for k in range(clients):
            task = asyncio.create_task(client(k))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    cancelled = False
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=max(0.0, t0 + plan.duration_s + plan.grace_s - loop.time()))
        for task in pending:
            task.cancel()
        if pending:
            cancelled = True
            await asyncio.gather(*pending, return_exceptions=True)
            late = rec.sent - rec.ok - rec.errors
            for _ in range(late):
                rec.fail(-1, f"no reply within {plan.grace_s:g} s after the step")
    if reporter is not None:
        reporter.cancel()
    elapsed = max(plan.duration_s, (rec.last_done or loop.time()) - t0)
    raw = StepRaw(
        index=plan.index,
        sent=rec.sent,
        ok=rec.ok,
        errors=rec.errors,
        error_codes=rec.codes,
        error_sample=rec.sample,
        latencies_ms=np.asarray(rec.lat, dtype=np.float32).tobytes(),
        server_queue_ms=np.asarray(rec.queue_ms, dtype=np.float32).tobytes(),
        server_inference_ms=np.asarray(rec.inference_ms, dtype=np.float32).tobytes(),
        tokens_ok=rec.tokens,
        server_tokens=rec.server_tokens if rec.server_reports and rec.ok else -1,
        elapsed_s=elapsed,
        lag_p99_ms=float(np.percentile(lags, 99) * 1000.0) if lags.size else 0.0,
        cpu_s=time.process_time() - cpu0,
        started_unix=started_unix,
    )
    return raw, cancelled


def _child_main(pipe) -> None:
    """Generator process: read Setup, then StepPlans until an empty message; reply StepRaw per step."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    setup = msgspec.msgpack.decode(pipe.recv_bytes(), type=Setup)
    payloads = build_payloads(
        setup.kind, setup.task, setup.url, setup.model, setup.texts, setup.lengths, setup.batch,
        encoding=setup.encoding, api_key=setup.api_key, seed=setup.seed,
    )

    async def serve() -> None:
        pool = httpclient.Pool(httpclient.Endpoint(setup.url), setup.max_connections)
        while True:
            msg = await asyncio.get_running_loop().run_in_executor(None, pipe.recv_bytes)
            if not msg:
                break
            plan = msgspec.msgpack.decode(msg, type=StepPlan)
            raw, cancelled = await run_step(setup, payloads, pool, plan, pipe)
            if cancelled:
                pool.close()
                pool = httpclient.Pool(pool.ep, setup.max_connections)
            pipe.send_bytes(b"R" + _enc.encode(raw))
        pool.close()

    asyncio.run(serve())


@dataclass
class Merged:
    """One step's result over all generator processes."""

    sent: int
    ok: int
    errors: int
    error_codes: dict[int, int]
    error_sample: str
    latencies_ms: np.ndarray
    server_queue_ms: np.ndarray
    server_inference_ms: np.ndarray
    tokens_ok: int
    server_tokens: int
    elapsed_s: float
    lag_p99_ms: float
    cpu_s: float
    started_unix: float


def merge(raws: list[StepRaw]) -> Merged:
    codes: dict[int, int] = {}
    for r in raws:
        for k, v in r.error_codes.items():
            codes[int(k)] = codes.get(int(k), 0) + v
    return Merged(
        sent=sum(r.sent for r in raws),
        ok=sum(r.ok for r in raws),
        errors=sum(r.errors for r in raws),
        error_codes=codes,
        error_sample=next((r.error_sample for r in raws if r.error_sample), ""),
        latencies_ms=np.concatenate([np.frombuffer(r.latencies_ms, dtype=np.float32) for r in raws]),
        server_queue_ms=np.concatenate([np.frombuffer(r.server_queue_ms, dtype=np.float32) for r in raws]),
        server_inference_ms=np.concatenate([np.frombuffer(r.server_inference_ms, dtype=np.float32) for r in raws]),
        tokens_ok=sum(r.tokens_ok for r in raws),
        server_tokens=-1 if any(r.server_tokens < 0 for r in raws) else sum(r.server_tokens for r in raws),
        elapsed_s=max(r.elapsed_s for r in raws),
        lag_p99_ms=max(r.lag_p99_ms for r in raws),
        cpu_s=sum(r.cpu_s for r in raws),
        started_unix=min(r.started_unix for r in raws),
    )


class Generator:
    """Parent-side handle on `processes` generator processes (spawned: no fork of the parent's state)."""

    def __init__(self, setup: Setup, processes: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for k in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child_main, args=(child,), name=f"fleet-bench-gen-{k}", daemon=True)
            proc.start()
            child.close()
            parent.send_bytes(_enc.encode(msgspec.structs.replace(setup, seed=setup.seed + k)))
            self.pipes.append(parent)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, plan: StepPlan, on_progress=None) -> Merged:
        """Run one step split evenly over the processes; `on_progress(sent, done, errors)` while it runs."""
        share = plan.offered / len(self.procs)
        for k, pipe in enumerate(self.pipes):
            pipe.send_bytes(_enc.encode(msgspec.structs.replace(plan, offered=share, seed=plan.seed * 1009 + k)))
        results: dict[int, StepRaw] = {}
        latest: dict[int, Progress] = {}
        while len(results) < len(self.pipes):
            for k, pipe in enumerate(self.pipes):
                if k in results:
                    continue
                if not pipe.poll(0.05):
                    if not self.procs[k].is_alive():
                        raise RuntimeError(f"load generator process {self.procs[k].pid} died (exit {self.procs[k].exitcode})")
                    continue
                msg = pipe.recv_bytes()
                if msg[:1] == b"R":
                    results[k] = msgspec.msgpack.decode(msg[1:], type=StepRaw)
                else:
                    latest[k] = msgspec.msgpack.decode(msg[1:], type=Progress)
                    if on_progress is not None:
                        on_progress(
                            sum(p.sent for p in latest.values()),
                            sum(p.done for p in latest.values()),
                            sum(p.errors for p in latest.values()),
                        )
        return merge([results[k] for k in range(len(self.pipes))])

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
