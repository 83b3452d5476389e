"""NVML (nvidia-ml-py) opened once per process, for the reads that recur.

`nvmlInit` loads the driver's library and enumerates the GPUs: milliseconds, more on a
virtual machine, against microseconds for a memory or utilisation read after it. Reading
NVML as init, read, shutdown paid that every time, and two readers recur: a worker that
leaves a lane to the model's holders decides again every IDLE_NAP_S (20 ms) while work
comes, reading the device's free memory at each decision (runtimes.device_memory), and
`/v1/top` reads every GPU on the API's event loop (daemon.top). On the one GPU box fleet
ran on, the worker that held no model burned 0.44-0.65 core under load.

So NVML is opened at the first read and left open for the process's life (the driver
counts inits; the process's exit releases it). Where it cannot open (no pynvml, no driver,
no GPU) the first error is kept and raised again: a process does not gain a driver later.
One-shot readers (`fleetctl doctor`, the supervisor counting GPUs at start) keep their own
init and shutdown.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_lock = threading.Lock()
#: (the initialised pynvml module, None) or (None, why it cannot open); None: not tried yet.
_opened: tuple[Any, BaseException | None] | None = None


def nvml() -> Any:
    """The initialised pynvml module. Raises ImportError or pynvml's NVMLError where NVML
    cannot open here (the same error at every call of this process)."""
    global _opened
    if _opened is None:
        with _lock:
            if _opened is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    _opened = (pynvml, None)
                except Exception as exc:  # ImportError, NVMLError: no library, driver or GPU
                    _opened = (None, exc)
    module, error = _opened
    if module is None:
        raise error  # type: ignore[misc]
    return module


def nvml_index(device: str, visible: str | None) -> int | str:
    """NVML's name for `cuda:K`: CUDA numbers only the GPUs of CUDA_VISIBLE_DEVICES, in its
    order (an index or a `GPU-<uuid>`); NVML numbers every GPU."""
    k = int(device.split(":", 1)[1]) if ":" in device else 0
    if not visible:
        return k
    entries = [e.strip() for e in visible.split(",")]
    entry = entries[k] if k < len(entries) else str(k)
    return int(entry) if entry.isdigit() else entry


def handle(lib: Any, device: str) -> Any:
    """NVML's handle (from the pynvml module `lib`) for `cuda:K` as this process's
    CUDA_VISIBLE_DEVICES numbers it, without opening CUDA."""
    which = nvml_index(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return lib.nvmlDeviceGetHandleByIndex(which) if isinstance(which, int) else lib.nvmlDeviceGetHandleByUUID(which)
