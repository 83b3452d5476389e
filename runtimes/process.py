"""Worker process entry point: queue wiring, signals, heartbeat. No policy here.

Started by the daemon with the `spawn` start method (a fresh interpreter: no
inherited locks, threads or CUDA state), one process per device.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import msgspec
import posix_ipc

from fleetctl.config import Settings


def run(queue_name: str, index: int, device: str, settings_blob: bytes) -> None:
    settings = msgspec.msgpack.decode(settings_blob, type=Settings)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop

    # Heavy imports happen here, in the worker, never in the API process.
    import torch

    from local_queue import LocalQueue
    from runtimes.resolve import store_resolver
    from runtimes.worker import WorkerCore

    if settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    queue = LocalQueue.attach(queue_name)
    worker_id = queue.register_worker(os.getpid(), device)
    core = WorkerCore(
        queue, worker_id, device, store_resolver(settings),
        served_by=f"{settings.box_name}/{index}", lease_ms=settings.lease_ms,
        max_wait_ms=settings.lane_max_wait_ms, target_ms=settings.batch_target_ms, linger_ms=settings.linger_ms,
    )
    core.publish_info()

    def heartbeat() -> None:
        # Renews this worker's leases while a long batch runs on the main thread.
        while not stop.wait(settings.lease_ms / 3000):
            queue.heartbeat(worker_id)

    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    log = logging.getLogger("fleet.worker")
    for name in settings.preload:
        try:
            core.load(name)
        except Exception as exc:  # keep serving other models; requests for this one get the error
            log.error("preload of %s failed: %s", name, exc)
    while not stop.is_set():
        try:
            core.step(timeout_s=0.25)
        except posix_ipc.SignalError:
            continue  # SIGTERM interrupted a queue wait (EINTR): the loop sees `stop` and ends cleanly
    queue.unregister_worker(worker_id)
    queue.close()
