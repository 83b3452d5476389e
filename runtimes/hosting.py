"""How a worker hosts models on its device: the effects its `Residency` is built with.

Apart from the residency (runtimes.residency), which decides, because these are
the parts that touch the world and are swapped out where the world is not real:
sizing a model from its headers (`footprint_from_headers`), refusing weights
that do not fit their architecture (`refuse_mismatched_weights`), giving freed
memory back (`return_freed_memory`), and `Hosting`, which bundles them with the
device's budget and load lock (a simulated device sizes models itself and has
no allocator: bench/sim).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

from fleet.errors import ModelLoadFailed
from fleet.runtimes.base import ModelSpec
from fleet.runtimes.device_memory import DeviceMemory, LoadLock
from fleet.runtimes.footprint import Footprint, estimate_footprint
from fleet.runtimes.heap import return_freed_heap
from fleet.weights import check_weights, refusal


def footprint_from_headers(spec: ModelSpec) -> Footprint:
    """A model's footprint before loading it: its safetensors headers and configs."""
    return estimate_footprint(
        spec.path, spec.runtime, task=spec.task, dtype=spec.profile.dtype,
        max_batch_tokens=spec.profile.max_batch_tokens, max_batch_items=spec.profile.max_batch_items,
        micro_batch_items=spec.profile.micro_batch_items, max_seq_len=spec.max_seq_len,
    )


def refuse_mismatched_weights(spec: ModelSpec) -> None:
    """ModelLoadFailed when the weights do not fit the architecture the runtime builds
    (fleet.weights, checked in this process from the headers): transformers would fill
    the gaps with random parameters. A model stored before pulls checked this is
    refused here instead of served."""
    report = check_weights(spec.path, spec.task, spec.runtime, trust_remote_code=spec.trust_remote_code, here=True)
    if (why := refusal(report, spec.task, spec.runtime)) is not None:
        raise ModelLoadFailed(f"cannot load {spec.name!r}: {why}",
                              hint=f"pull it again from a folder with its own weights (fleetctl pull ... --name "
                                   f"{spec.name} --force)")


def return_freed_memory(device: str) -> None:
    """Give freed model memory back now, so the next decision reads it as free:
    models hold reference cycles (gc), torch caches freed CUDA blocks, and the C
    heap keeps freed host memory (weights under glibc's mmap threshold, a load
    thread's arena) in the worker's RSS until trimmed (`return_freed_heap`)."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return_freed_heap()


@dataclass(frozen=True)
class Hosting:
    """How a worker hosts models on its device, beside its budget: the effects and
    bounds its `Residency` is built with (injected: a simulated device sizes models
    itself and has no allocator)."""

    #: Device budget and live free memory (runtimes.device_memory.device_budget); unlimited when None (bare tests).
    memory: DeviceMemory | None = None
    #: How long one model load may take before this worker counts as stuck (Settings.load_timeout_ms).
    load_timeout_ms: float = 300_000.0
    #: One load at a time per device, across this daemon's workers (none when None: bare tests).
    load_lock: LoadLock | None = None
    #: A model's footprint before it loads (headers).
    estimate_footprint: Callable[[ModelSpec], Footprint] = footprint_from_headers
    #: Gives freed device memory back.
    return_freed: Callable[[str], None] = return_freed_memory
