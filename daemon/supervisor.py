"""Worker processes: start one per device, watch them, restart the dead.

A watcher thread blocks on the processes' sentinels (real wake-ups, not a
sleep loop). When a worker dies, its claimed items go back to their lanes at
once (`release_worker`), so requests it held are redelivered to whoever pulls
next; the worker is restarted with a bounded backoff. A worker that is alive
but stuck stops heartbeating (its heartbeat thread renews nothing once a batch
or load runs past its bound, runtimes.state.Progress): when its last heartbeat
is older than `lease_ms` the watcher kills it, and it is handled like any dead
worker. Every tick (at most a second apart) the watcher also expires lapsed leases.

A paused box is not a hung worker: when every process stops (a VM stall, a frozen
cgroup, SIGSTOP) and resumes, every heartbeat and lease is as old as the pause.
The watcher tells that from a hang by its own clock: a tick that comes more than
PAUSE_S later than due means the watcher itself did not run, so it gives every
worker a fresh lease (heartbeat and claims) before judging any; a worker that
really hangs stops heartbeating again and is killed a lease later.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from fleet.config import Settings
from fleet.errors import BadRequest
from fleet.local_queue import LocalQueue

log = logging.getLogger("fleet.daemon")

_ctx = mp.get_context("spawn")

#: A watcher tick this much later than due (seconds) means the watcher did not run
#: meanwhile (the process or the whole box was paused): workers get a fresh lease.
PAUSE_S = 1.0


@dataclass
class Slot:
    """One supervised worker: which device it is bound to and its current process."""

    index: int
    device: str
    process: mp.process.BaseProcess | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    history: list[float] = field(default_factory=list)
    #: CPUs the worker runs on (empty: all the daemon may use) and its intra-op threads (0: torch's default).
    cpus: tuple[int, ...] = ()
    threads: int = 0


@dataclass(frozen=True)
class Placement:
    """Where the processes compute: the API process's CPUs and, per worker, its
    CPUs and intra-op threads (empty CPUs: unpinned; 0 threads: torch's default)."""

    api_cpus: tuple[int, ...]
    workers: tuple[tuple[tuple[int, ...], int], ...]


#: From this many usable CPUs on, the API process (event loop, results and queue
#: threads) keeps one CPU of its own and CPU workers compute on the others. Below
#: it, a reserved CPU would take half or more of the workers' compute.
API_CPU_FROM = 4


def place_on_cpus(cpus: list[int], devices: list[str], *, cpu_threads: int = 0) -> Placement:
    """Thread counts and pinning per device (pure).

    CPU workers share the usable CPUs: each gets its own contiguous slice and as
    many intra-op threads as its slice has CPUs, so workers never run more threads
    than there are cores (two workers at torch's default would each run one per
    core, and their OpenMP threads would wait on one another's preempted peers).
    With API_CPU_FROM or more CPUs the API process keeps the first for itself.
    An explicit `cpu_threads` (FLEET_CPU_THREADS) is obeyed and nothing is pinned.
    GPU workers compute on their GPU: unpinned, torch's default threads."""
    n_cpu = devices.count("cpu")
    if cpu_threads or not n_cpu:
        return Placement((), tuple(((), cpu_threads if d == "cpu" else 0) for d in devices))
    api: tuple[int, ...] = ()
    pool = list(cpus)
    if len(pool) >= API_CPU_FROM:
        api, pool = (pool[0],), pool[1:]
    if len(pool) < n_cpu:
        # More CPU workers than CPUs: one thread each, unpinned (the user asked for it).
        return Placement(api, tuple(((), 1 if d == "cpu" else 0) for d in devices))
    share, extra = divmod(len(pool), n_cpu)
    # A lone worker with no CPU kept for the API gains nothing from a pin.
    pin = bool(api) or n_cpu > 1
    workers, at, k = [], 0, 0
    for d in devices:
        if d != "cpu":
            workers.append(((), 0))
            continue
        size = share + (1 if k < extra else 0)
        workers.append((tuple(pool[at:at + size]) if pin else (), size))
        at, k = at + size, k + 1
    return Placement(api, tuple(workers))


def pin_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def count_gpus() -> int:
    """NVIDIA GPUs this process may use; 0 without pynvml, a driver or a GPU.

    NVML counts every GPU on the box, but CUDA (torch in the workers) numbers
    only those in CUDA_VISIBLE_DEVICES, in that order: when it is set, its
    entries up to the first invalid one (CUDA's own rule) are the GPUs."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError and friends: no driver, no GPU
        return 0
    try:
        found = int(pynvml.nvmlDeviceGetCount())
    except Exception:
        found = 0
    finally:
        pynvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    usable = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        usable += 1
    return min(usable, found)


def detect_devices(device: str, workers: int, *, gpu_count: Callable[[], int] = count_gpus) -> list[str]:
    """One device per worker process.

    - `cpu`: `workers` CPU workers (0 = one).
    - `cuda:K`: `workers` workers on GPU K (0 = one); K must exist.
    - `cuda`: the GPUs round-robin, `workers` of them (0 = one per GPU); a GPU must exist.
    - `auto`: like `cuda` when there is a GPU, else like `cpu`.
    Raises BadRequest for a device that is not there, so `serve` fails with the reason.
    """
    if workers < 0:
        raise BadRequest(f"--workers must be >= 0, got {workers}")
    if device == "cpu":
        return ["cpu"] * max(1, workers)
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device != "auto" and match is None:
        raise BadRequest(f"--device must be auto, cpu, cuda or cuda:K, not {device!r}")
    gpus = gpu_count()
    if match is not None and match.group(1) is not None:
        k = int(match.group(1))
        if k >= gpus:
            raise BadRequest(f"device {device} does not exist: {gpus} GPU(s) visible")
        return [device] * max(1, workers)
    if gpus:
        return [f"cuda:{i % gpus}" for i in range(workers or gpus)]
    if device == "cuda":
        raise BadRequest("--device cuda: no NVIDIA GPU is visible (use --device cpu or auto)")
    return ["cpu"] * max(1, workers)


#: What a worker process runs. By name, so that the API process never imports the
#: worker's modules (and torch with them): only the spawned child does.
WORKER_ENTRY = "fleet.runtimes.process:run"


def run_entry(entry: str, *args) -> None:
    """The spawned child's first frame: import `module:function` here and run it."""
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(*args)


class Supervisor:
    def __init__(self, settings: Settings, queue: LocalQueue, devices: list[str], *,
                 target: str = WORKER_ENTRY,
                 on_restart: Callable[[Slot], None] | None = None,
                 preload: Callable[[], list[str]] | None = None) -> None:
        self.settings = settings
        self.queue = queue
        self.placement = place_on_cpus(sorted(os.sched_getaffinity(0)), devices, cpu_threads=settings.cpu_threads)
        self.slots = [Slot(i, d, cpus=c, threads=t) for i, (d, (c, t)) in enumerate(zip(devices, self.placement.workers))]
        #: What every worker starts with: the settings as they were at start (a copy).
        self._spawn_settings = msgspec.structs.replace(settings)
        #: The models a worker started now preloads and pins (default: `settings.preload`):
        #: a preload unpinned through the API is not pinned again by a restart.
        self._preload = preload or (lambda: list(self._spawn_settings.preload))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The worker's entry point by dotted name, `module:function` taking
        #: `(queue name, index, device, settings blob)`; imported only in the child.
        self._target = target
        self._on_restart = on_restart

    def start(self) -> None:
        if self.placement.api_cpus:
            pin_process(self.placement.api_cpus)
        for slot in self.slots:
            self._spawn(slot)
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def _spawn(self, slot: Slot) -> None:
        blob = msgspec.msgpack.encode(msgspec.structs.replace(self._spawn_settings, preload=self._preload(),
                                                              cpu_threads=slot.threads))
        proc = _ctx.Process(
            target=run_entry, args=(self._target, self.queue.name, slot.index, slot.device, blob),
            name=f"fleet-worker-{slot.index}", daemon=False,
        )
        proc.start()
        if slot.cpus:
            # The child is still reading its start data: its one thread takes the
            # mask, and every thread it starts later (torch's) inherits it.
            os.sched_setaffinity(proc.pid, slot.cpus)
        slot.process = proc
        slot.started_at = time.time()
        log.info("worker %d started on %s (pid %d)", slot.index, slot.device, proc.pid)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.is_alive()]

    def view(self) -> list[dict]:
        """Each worker slot as `/v1/ps` shows it: index, device, pid (None while it
        waits for its restart), restarts so far and when the next start is due."""
        now = time.time()
        out = []
        for s in self.slots:
            proc = s.process
            out.append({
                "index": s.index,
                "device": s.device,
                "pid": proc.pid if proc is not None else None,
                "restarts": s.restarts,
                "up_s": round(now - s.started_at, 1) if proc is not None else 0.0,
                "restart_in_s": round(max(0.0, s.next_start - now), 1) if proc is None else 0.0,
                "cpus": list(s.cpus), "threads": s.threads,
            })
        return out

    def _watch(self) -> None:
        expire_every = max(0.05, min(1.0, self.settings.lease_ms / 2000))
        # When the last tick judged workers: its decisions used this clock reading.
        last_ns = time.monotonic_ns()
        while not self._stop.is_set():
            sentinels = {s.process.sentinel: s for s in self.slots if s.process is not None}
            pending = [s.next_start - time.time() for s in self.slots if s.process is None]
            timeout = max(0.01, min([expire_every, *pending]))
            ready = mp.connection.wait(list(sentinels), timeout=timeout)
            if self._stop.is_set():
                return
            # One clock reading judges this tick: a pause after it shows in the next tick's gap.
            now_ns = time.monotonic_ns()
            late_s = (now_ns - last_ns) / 1e9 - timeout
            last_ns = now_ns
            # The watcher must outlive any one failure: if it stopped, dead workers
            # would never be restarted nor their items returned.
            try:
                if late_s > PAUSE_S:
                    self._renew_after_pause(late_s)
                for sentinel in ready:
                    self._worker_died(sentinels[sentinel])
                self._kill_stuck(now_ns)
                if moved := self.queue.expire_leases(now_ns, max_attempts=self.settings.max_attempts):
                    log.warning("%d claimed item(s) lost their lease: back to their lanes (or poison at %d "
                                "attempts)", moved, self.settings.max_attempts)
            except Exception:
                log.exception("worker supervision step failed; retrying")
            now = time.time()
            for slot in self.slots:
                if slot.process is None and now >= slot.next_start:
                    try:
                        self._spawn(slot)
                    except Exception:  # e.g. out of processes or memory: try again later
                        log.exception("cannot start worker %d; retrying in 5 s", slot.index)
                        slot.next_start = now + 5.0
            if ready or any(s.started_at >= now for s in self.slots):
                # A death handled (its join waits up to 2 s) or a start took this tick's
                # time, not a pause: the next gap counts from here.
                last_ns = time.monotonic_ns()

    def _renew_after_pause(self, late_s: float) -> None:
        """The watcher did not run for `late_s` (the box was paused, or this process):
        its workers' heartbeats and leases are that old through no fault of theirs.
        Each live worker of this supervisor gets a fresh lease now (heartbeat and
        claims, `LocalQueue.heartbeat`), so none is killed nor has its items expire
        and go to another worker for the pause alone."""
        ours = {s.process.pid for s in self.slots if s.process is not None and s.process.is_alive()}
        renewed = [w.pid for w in self.queue.workers() if w.pid in ours and self.queue.heartbeat(w.wid)]
        log.warning("the daemon did not run for %.1f s (the box or this process was paused): worker(s) %s get a "
                    "fresh lease", late_s, ", ".join(map(str, renewed)) or "none")

    def _kill_stuck(self, now: int) -> None:
        """SIGKILL each live worker whose heartbeat is older than a lease at `now`
        (monotonic ns): it makes no progress (or is frozen), so its claims have lapsed;
        its sentinel then fires and `_worker_died` returns them and restarts it."""
        stale = {w.pid: now - w.last_heartbeat_ns for w in self.queue.workers()}
        for slot in self.slots:
            proc = slot.process
            if (proc is None or proc.pid not in stale or stale[proc.pid] <= self.settings.lease_ms * 1_000_000
                    or not proc.is_alive()):
                continue
            log.error("worker %d (pid %d) has not made progress for %.1f s; killing it", slot.index, proc.pid,
                      stale[proc.pid] / 1e9)
            proc.kill()

    def _worker_died(self, slot: Slot) -> None:
        proc = slot.process
        assert proc is not None
        # The sentinel fires when the child's fds close, a moment before the kernel
        # can reap it: wait briefly so the exit code (e.g. -9) is known and logged.
        proc.join(timeout=2.0)
        pid = proc.pid
        # 1. Schedule the restart first (so a failure below cannot leave a dead
        #    sentinel to spin on): 0.5 s, doubling per restart in the last minute, at most 30 s.
        now = time.time()
        slot.history = [t for t in slot.history if now - t < 60] + [now]
        slot.restarts += 1
        slot.process = None
        slot.next_start = now + min(30.0, 0.5 * 2 ** (len(slot.history) - 1))
        # 2. Give back what it held, now (not after the lease): nothing is lost. Each
        #    of its claims counts one attempt; at max_attempts the item is poison.
        moved = 0
        for info in self.queue.workers():
            if info.pid == pid:
                moved += self.queue.release_worker(info.wid, max_attempts=self.settings.max_attempts)
        log.warning("worker %d (pid %d) exited with %s; %d items returned to their lanes; restart in %.1f s",
                    slot.index, pid, proc.exitcode, moved, slot.next_start - now)
        if self._on_restart is not None:
            self._on_restart(slot)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker (each finishes its batch), then SIGKILL stragglers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        procs = [s.process for s in self.slots if s.process is not None]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.time() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
