"""Worker process entry point: queue wiring, signals, heartbeat. No policy here.

Started by the daemon with the `spawn` start method (a fresh interpreter: no
inherited locks, threads or CUDA state), one process per device.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import msgspec
import posix_ipc

from fleet.config import Settings
from fleet.logs import route_library_logs, setup_worker


def exit_with_parent() -> None:
    """End this process the moment the daemon that spawned it dies, however it died.

    A SIGKILLed daemon runs no cleanup: without this its workers (each holding
    a model's memory) and, through them, its resource tracker (alive while any
    process holds its pipe) would live on under init. The spawn start method
    gives the child the read end of a pipe whose only write end the parent holds
    (`multiprocessing.parent_process().sentinel`): it reads EOF exactly when the
    parent process is gone, and at once if it already is. A blocked wait, not a
    poll; process-wide, unlike PR_SET_PDEATHSIG, which fires when the spawning
    *thread* ends (the supervisor restarts workers from its watcher thread).
    Not spawned by `multiprocessing` (a test calling `run` in-process): no-op."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait_for_parent() -> None:
        parent.join()
        logging.getLogger("fleet.worker").warning("daemon (pid %d) is gone; worker exits", parent.pid)
        # No cleanup to run: the queue died with its owner (the next daemon sweeps its entries).
        os._exit(1)

    threading.Thread(target=wait_for_parent, name="parent-watch", daemon=True).start()


def run(queue_name: str, index: int, device: str, settings_blob: bytes) -> None:
    from fleet.runtimes.heap import CPU_HEAP_ARENAS, limit_heap_arenas

    # Before the first thread: glibc fixes the arena limit when one first needs an
    # arena. Accelerator workers keep glibc's default (their tokenizer threads, up to
    # 8, would share one arena's lock).
    if device == "cpu":
        limit_heap_arenas(CPU_HEAP_ARENAS)
    exit_with_parent()
    settings = msgspec.msgpack.decode(settings_blob, type=Settings)
    # The daemon's log format (JSON lines off a terminal, readable on one) and its log
    # file; no progress bars (fleet.logs).
    setup_worker(settings.log_level, settings.home_path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop

    # OpenMP threads sleep at once when idle instead of spinning: this worker shares
    # its cores with the API process, the clients and whatever else runs on the box,
    # and a spinning thread waiting for a preempted peer burns the very core that peer
    # needs (a 2-thread forward of one short text took 84-964 ms spinning vs 30-42 ms
    # passive at load average 4-15 on the 2-core box; bench/README.md, latency).
    # Set before torch loads its OpenMP runtime, which reads it once; a value the
    # environment already gives is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The Rust tokenizer's own thread pool stays off: the worker already tokenizes the
    # next micro-batch on its tokenize-ahead thread while the current one runs, and
    # each pool thread kept its own malloc arena, where a big text's freed buffers
    # stayed (tests/test_soak.py: worker RSS +25..+60 MiB/min with the pool, -23 without,
    # same HEAD). Read when the library first tokenizes; a value the environment gives is kept.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Heavy imports happen here, in the worker, never in the API process.
    import torch
    import transformers.utils.logging  # noqa: F401 (its stderr handler, installed at import, goes next)

    route_library_logs()

    from fleet.pins import PinStore
    from fleet.local_queue import LocalQueue
    from fleet.runtimes.device_memory import LoadLock, device_budget, device_used_bytes
    from fleet.runtimes.policy import paused_ns
    from fleet.runtimes.hosting import Hosting
    from fleet.runtimes.resolve import store_profiles, store_resolver
    from fleet.runtimes.worker import WorkerCore

    if settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    queue = LocalQueue.attach(queue_name)
    worker_id = queue.register_worker(os.getpid(), device)
    core = WorkerCore(
        queue, worker_id, device, store_resolver(settings, device),
        served_by=f"{settings.box_name}/{index}", lease_ms=settings.lease_ms,
        hosting=Hosting(
            memory=device_budget(
                device, cpu_budget_bytes=settings.cpu_budget_bytes, cpu_budget_fraction=settings.cpu_budget_fraction,
                cpu_reserve_bytes=settings.cpu_reserve_bytes, gpu_reserve_bytes=settings.gpu_reserve_bytes,
                fleet_used_bytes=device_used_bytes(queue, device),
            ),
            load_timeout_ms=settings.load_timeout_ms, load_lock=LoadLock.for_device(settings.home, device),
        ),
        max_wait_ms=settings.lane_max_wait_ms, target_ms=settings.batch_target_ms, linger_ms=settings.linger_ms,
    )
    core.residency.profile_of = store_profiles(settings, device)  # a SIGHUP's `profile` command
    core.residency.peek = store_resolver(settings, device, verify=False)  # sizing a model it may not load
    core.publish_info()
    log = logging.getLogger("fleet.worker")

    def heartbeat() -> None:
        # Marks this worker alive and renews its leases, but only while the main loop
        # makes progress: a batch or load past its bound (core.progress) renews
        # nothing, so its claims lapse and the supervisor restarts this worker. A gap
        # between two ticks in which the process did not run (a paused box) is
        # excused from the bound first: the batch resumed with the box is not stuck.
        late_logged = False
        period_s = min(1.0, settings.lease_ms / 3000)
        tick_ns, cpu_ns = time.monotonic_ns(), time.process_time_ns()
        while not stop.wait(period_s):
            now_ns, now_cpu_ns = time.monotonic_ns(), time.process_time_ns()
            if paused := paused_ns(now_ns - tick_ns, now_cpu_ns - cpu_ns, int(period_s * 1e9)):
                core.progress.excuse(paused)
                log.warning("this worker did not run for %.1f s (the box or the process was paused)", paused / 1e9)
            tick_ns, cpu_ns = now_ns, now_cpu_ns
            late = core.progress.overdue(now_ns)
            if late is None:
                queue.heartbeat(worker_id)
                late_logged = False
            elif not late_logged:
                log.error("%s has run %.0f ms, past its bound: leases not renewed; the supervisor restarts "
                          "this worker", *late)
                late_logged = True

    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    # Preloads and this device's persisted pins stay resident (a failure is logged;
    # requests for that model get the error when they come).
    try:
        pins = PinStore(settings.home).for_device(device)
    except Exception as exc:
        log.error("cannot read pins: %s", exc)
        pins = []
    core.residency.restore([*settings.preload, *pins])
    while not stop.is_set():
        try:
            core.step(timeout_s=0.25)
        except posix_ipc.SignalError:
            continue  # SIGTERM interrupted a queue wait (EINTR): the loop sees `stop` and ends cleanly
    queue.unregister_worker(worker_id)
    queue.close()
    end_process()


def end_process() -> None:
    """A spawned worker ends here, its work done and its queue closed: logs flushed, then
    `os._exit(0)`, without the interpreter's finalisation and C++ static destructors.
    Those ran libtorch's and its libraries' teardown while threads they started (intra-op,
    tokenize-ahead, loaders) could still be joinable, and a `std::thread` destroyed
    joinable aborts the process: "terminate called without an active exception" in the
    daemon's log (issue 28). Nothing is left to write at this point. Not spawned by
    multiprocessing (a test calling `run` in-process): returns."""
    if multiprocessing.parent_process() is None:
        return
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)
