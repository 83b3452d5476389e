"""Device memory: what a model will cost, what a device can hold, what to evict.

Two halves (STYLE.md 3):

* **Pure policy** over plain data, tested with tables: `estimate_footprint`
  (weights from safetensors headers by dtype, plus an activation allowance
  from the batch budget; for a generator, one step of its continuous batcher:
  `decoder_step`), `fits_on_device`, `find_model_to_evict`, and
  `plan_load`, which composes them into one decision: load now (after
  evicting these), wait (the room is held by models with more demand), or
  never (`model_too_large`, naming what holds the memory).
* **Effects**, injected into the worker: `device_budget` (NVML with a
  `torch.cuda.mem_get_info` cross-check on NVIDIA, psutil on CPU),
  `Estimates` (the estimate corrected by what was measured after each load),
  `LoadLock` (one load at a time per device, across worker processes).

Units: bytes everywhere; times in seconds (wall clock, `time.time()`).

Accounting. A device's `used` is the weights of every model resident on it
(all workers on the device, read from their info blobs; a generator's counts
the key/value cache its admitted sequences reserve) plus, per worker, the
largest activation allowance among its models: a worker runs one batch at a
time, so its models share one activation area; two workers on one device can
run batches at once, so their areas add up.

No torch import at module level: the daemon imports the pure half.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.weights import read_header

log = logging.getLogger("fleet.worker")

_LIBC: Any = None


#: Heap trims (`HeapTrim`) at most this often: one costs a few ms on a large heap.
TRIM_EVERY_NS = 1_000_000_000


@dataclass
class HeapTrim:
    """Returns the heap freed by a worker's batches to the system when it idles, at
    most every TRIM_EVERY_NS (issue 16: worker RSS kept climbing under mixed load)."""

    trim: Callable[[], None] = field(default=lambda: return_freed_heap())
    #: (batches run, clock ns) at the last trim.
    last: tuple[int, int] = (0, 0)

    def if_due(self, batches: int, now_ns: int) -> None:
        """Nothing waits: trim if batches ran since the last trim, long enough ago."""
        seq, at = self.last
        if batches != seq and now_ns - at >= TRIM_EVERY_NS:
            self.trim()
            self.last = (batches, now_ns)


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`). Freed
    batch buffers (tokenizer output, activations under glibc's raised mmap threshold)
    otherwise stay in the worker's RSS as free heap, and it climbs with every new
    batch shape. A no-op where the C library has no malloc_trim."""
    if libc := glibc():
        libc.malloc_trim(0)


def glibc() -> Any:
    """The C library when it is glibc (it has malloc_trim and mallopt), else False."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


#: glibc's mallopt parameter for the most malloc arenas a process keeps.
M_ARENA_MAX = -8
#: Arenas a CPU worker keeps (`limit_heap_arenas`).
CPU_HEAP_ARENAS = 2


def limit_heap_arenas(arenas: int) -> bool:
    """Keep at most `arenas` malloc arenas in this process (glibc `mallopt`), unless the
    environment sets MALLOC_ARENA_MAX. Call before the process starts a thread: glibc
    fixes the limit when a thread first needs an arena of its own. Without it a worker
    that starts a thread per load (runtimes.loading) now and then took a new arena
    for one, and the freed pages it kept stayed in the worker's RSS (+27 MiB steps over
    load/unload cycles of a 57 MB reranker; flat with two). False where it does not apply."""
    if "MALLOC_ARENA_MAX" in os.environ or not (libc := glibc()):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))

#: safetensors dtype tag -> bytes per element.
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}
_PROFILE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The library each runtime imports on its first load. The worker imports it
#: before timing a load: a one-time import is not part of a reload's cost.
RUNTIME_LIBRARIES = {"sentence-transformers": "sentence_transformers", "transformers": "transformers", "peft": "peft"}
#: Reload cost credit: a model that takes s seconds to load counts as used s
#: seconds more recently when choosing what to evict (cheap reloads go first).
RELOAD_CREDIT = 1.0


# ---- estimate ----------------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """What one model holds on its device: weights (resident) and an activation
    allowance (the largest batch its profile allows, shared per worker). A
    generator's key/value cache is not part of it: its sequences reserve their
    cache as they are admitted and wait for room (runtimes.generate
    `reserved_bytes`, counted with its weights once it is resident)."""

    weights_bytes: int
    activation_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes


def safetensors_tensors(path: Path) -> Iterator[tuple[str, list[int]]]:
    """(dtype tag, shape) of each tensor in a safetensors file, from its header only."""
    yield from read_header(path).values()


def weights_bytes(folder: Path, dtype: str = "auto") -> int:
    """Bytes the weights take once loaded: every safetensors file under `folder`,
    float tensors counted at `dtype` (a profile dtype; `auto` = as stored)."""
    cast = _PROFILE_BYTES.get(dtype)
    total = 0
    for path in sorted(folder.rglob("*.safetensors")):
        for tag, shape in safetensors_tensors(path):
            n = 1
            for d in shape:
                n *= d
            per = cast if cast is not None and tag in _FLOAT_TAGS else DTYPE_BYTES.get(tag, 4)
            total += n * per
    return total


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def encoder_shape(folder: Path) -> dict[str, int]:
    """hidden size, intermediate size, heads and longest sequence of a transformers encoder folder."""
    cfg = _read_json(folder / "config.json")
    st = _read_json(folder / "sentence_bert_config.json")
    hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim") or 768)
    return {
        "hidden": hidden,
        "intermediate": int(cfg.get("intermediate_size") or cfg.get("hidden_dim") or 4 * hidden),
        "heads": int(cfg.get("num_attention_heads") or cfg.get("n_heads") or 12),
        "seq": int(st.get("max_seq_length") or cfg.get("max_position_embeddings") or 512),
    }


def activation_allowance(runtime: str, shape: dict[str, int], *, max_batch_tokens: int, micro_batch_items: int,
                         max_seq_len: int | None, dtype_bytes: int) -> int:
    """Peak bytes of one forward pass at the profile's largest micro-batch.

    Encoders (every runtime but the decoders of `estimate_footprint`): a micro-batch is at most
    `micro_batch_items` inputs padded to the longest sequence, capped by the
    batch token budget. Per padded token, one layer at its peak holds a few
    hidden-size tensors (residual, q/k/v, output), the feed-forward
    intermediate, and its row of attention scores before and after softmax
    (heads x seq, twice); layers run one after another, so one layer's peak
    is the model's.
    """
    seq = min(shape["seq"], max_seq_len) if max_seq_len else shape["seq"]
    tokens = min(max_batch_tokens, micro_batch_items * seq)
    per_token = 4 * shape["hidden"] + shape["intermediate"] + 2 * shape["heads"] * seq
    return tokens * per_token * dtype_bytes


#: Context a causal LM's config that names none gets (runtimes.generate's default).
DEFAULT_CONTEXT = 2048


def decoder_shape(folder: Path) -> dict[str, int]:
    """What sizes one step of a causal LM, from its config.json (a multimodal config's
    `text_config`): widths, heads, layers, vocabulary and position table."""
    cfg = _read_json(folder / "config.json")
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 768)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 12)
    return {
        "hidden": hidden,
        "intermediate": int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden),
        "heads": heads,
        "kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "layers": int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 12),
        "vocab": int(cfg.get("vocab_size") or 32000),
        "positions": int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or DEFAULT_CONTEXT),
    }


def kv_token_bytes(shape: dict[str, int], dtype_bytes: int) -> int:
    """Bytes one token takes in a causal LM's key/value cache: keys and values of every layer."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype_bytes


def decoder_step(shape: dict[str, int], *, rows: int, max_batch_tokens: int, max_seq_len: int | None,
                 dtype_bytes: int) -> tuple[int, int]:
    """(tokens, peak activation bytes) of one forward of a causal LM over a step's rows.

    The tokens a step admits: at most `rows` sequences of at most the context
    (`max_seq_len`, never past the position table: runtimes.generate's `max_len`),
    cut to `max_batch_tokens` (a prefill group's budget). Attention is SDPA, which
    holds no seq x seq score matrix (measured: one 16 384-token row on the CPU held
    ~80 KB a token, where materialised scores would take 14 heads x 16 384 x 4 bytes
    = 900 KB a token); a padded prefill of two rows or more carries a boolean mask
    of rows x width x width. Per token, one layer at its peak holds four hidden-size
    tensors (residual, normed input, attention and MLP outputs), three intermediate
    (gate, up, their product), queries, keys and values twice (projected, rotated),
    and two hidden-size vectors in fp32 (normalisation); layers run one after
    another, so one layer's peak is the step's. The logits are the last position's
    only (`logits_to_keep=1`), upcast to fp32 for the pick. Checked against peak RSS
    of real prefills (2 x 8 192 padded tokens, bf16): Qwen2 0.90, Qwen3 0.78, Gemma-3
    0.92, Phi-3 0.75 of this estimate.
    """
    context = min(max_seq_len, shape["positions"]) if max_seq_len else shape["positions"]
    tokens = min(rows * context, max_batch_tokens)
    width = min(context, tokens // 2) if rows > 1 else 0  # the widest padded prefill of two rows or more
    qkv = shape["heads"] * shape["head_dim"] + 2 * shape["kv_heads"] * shape["head_dim"]
    per_token = (4 * shape["hidden"] + 3 * shape["intermediate"] + 2 * qkv) * dtype_bytes + 2 * 4 * shape["hidden"]
    logits = rows * shape["vocab"] * (dtype_bytes + 4)
    return tokens, tokens * (per_token + width) + logits


def estimate_footprint(folder: Path, runtime: str, *, task: str = "", dtype: str = "auto",
                       max_batch_tokens: int = 16384, max_batch_items: int = 64, micro_batch_items: int = 64,
                       max_seq_len: int | None = None) -> Footprint:
    """Footprint of the model in `folder` before loading it: headers and configs only.

    A generator (task `generate`) is sized as one step of its continuous batcher:
    `max_batch_items` rows and the tokens `decoder_step` admits. Its key/value
    cache is reserved as sequences are admitted, bounded by the room left
    (runtimes.generate: a sequence waits for room, and one that could never fit
    is refused), so neither a long context window nor a full step's cache refuses
    a model that can answer one request. An LLM reranker (runtime `llm-rerank`) runs the same decoder over
    micro-batches, without a cache. Every other runtime is an encoder
    (`activation_allowance`)."""
    weights = weights_bytes(folder, dtype)
    act_bytes = _PROFILE_BYTES.get(dtype, 4)
    if task == "generate" or runtime == "llm-rerank":
        shape = decoder_shape(folder)
        rows = max_batch_items if task == "generate" else micro_batch_items
        _, activation = decoder_step(shape, rows=rows, max_batch_tokens=max_batch_tokens,
                                     max_seq_len=max_seq_len, dtype_bytes=act_bytes)
        return Footprint(weights, activation)
    activation = activation_allowance(runtime, encoder_shape(folder), max_batch_tokens=max_batch_tokens,
                                      micro_batch_items=micro_batch_items, max_seq_len=max_seq_len,
                                      dtype_bytes=act_bytes)
    return Footprint(weights, activation)


#: A model's measured/estimated weight bytes outside these bounds say its headers did
#: not describe what loaded (a checkpoint that lacks most of its architecture's
#: weights), not how its runtime stores weights: that ratio corrects no other model's
#: estimate. Within them: a dtype changed at load (bf16 or fp16 stored, fp32 loaded:
#: 2; 8-bit stored, fp32 loaded: 4) or buffers the headers do not list.
RATIO_BOUNDS = (0.25, 4.0)


@dataclass
class Estimates:
    """Footprint estimates, corrected by measurement.

    After a load, the measured weight bytes of that model replace its header
    estimate (a reload is then exact), and the models' measured/estimated ratios
    within RATIO_BOUNDS scale the header estimates of the runtime's models not yet
    loaded, by their median: one model's measurement never scales another's
    estimate past the bounds, and one odd model among several moves it little.
    """

    measured: dict[str, int] = field(default_factory=dict)
    #: runtime -> model -> its measured/estimated weight ratio (within RATIO_BOUNDS).
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)

    def ratio(self, runtime: str) -> float:
        """What scales the runtime's header estimates: the median of its models' ratios (1 with none)."""
        seen = sorted(self.ratios.get(runtime, {}).values())
        if not seen:
            return 1.0
        mid = len(seen) // 2
        return seen[mid] if len(seen) % 2 else (seen[mid - 1] + seen[mid]) / 2

    def estimate(self, name: str, runtime: str, header: Footprint) -> Footprint:
        if name in self.measured:
            return dataclasses.replace(header, weights_bytes=self.measured[name])
        return dataclasses.replace(header, weights_bytes=int(header.weights_bytes * self.ratio(runtime)))

    def record(self, name: str, runtime: str, header: Footprint, measured_bytes: int) -> None:
        self.measured[name] = measured_bytes
        mine = self.ratios.setdefault(runtime, {})
        mine.pop(name, None)
        if header.weights_bytes <= 0:
            return
        ratio = measured_bytes / header.weights_bytes
        low, high = RATIO_BOUNDS
        if low <= ratio <= high:
            mine[name] = ratio
        else:
            log.warning("%s measured %d bytes against %d estimated from its headers: not used to size other "
                        "%s models", name, measured_bytes, header.weights_bytes, runtime)


# ---- policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidentView:
    """One model resident on the device, as the policy sees it."""

    name: str
    worker: int
    footprint: Footprint
    pinned: bool = False
    last_used: float = 0.0
    #: Seconds its last load took (what evicting it costs when it is needed again).
    reload_s: float = 0.0
    #: Items queued for it now.
    waiting: int = 0
    #: When it finished loading (wall clock, seconds).
    loaded_at: float = 0.0


@dataclass(frozen=True)
class LoadPlan:
    verdict: str  # LOAD | WAIT | TOO_LARGE
    evict: tuple[str, ...] = ()
    reason: str = ""


LOAD, WAIT, TOO_LARGE = "load", "wait", "too_large"

#: Demand credited to an explicit load or pin (an operator asked): it may
#: evict unpinned models even while requests wait for them.
EXPLICIT_DEMAND = 1 << 30
#: A peer whose heartbeat is older than this is not counted (its memory is
#: being given back; the supervisor releases dead workers at once).
PEER_STALE_NS = 30 * 1_000_000_000
#: How long a worker naps when the only waiting work is not its to serve.
IDLE_NAP_S = 0.02


class NotNow(Exception):
    """Not a failure: this worker should not load the model now (another worker
    of the device holds or loads it, or its room is held by busier models).
    Its requests stay queued."""


def used_bytes(residents: Iterable[ResidentView]) -> int:
    """Weights of all, plus the largest activation allowance per worker."""
    weights = 0
    act: dict[int, int] = {}
    for r in residents:
        weights += r.footprint.weights_bytes
        act[r.worker] = max(act.get(r.worker, 0), r.footprint.activation_bytes)
    return weights + sum(act.values())


def fits_on_device(budget_bytes: int, free_now_bytes: int, residents: list[ResidentView],
                   incoming: Footprint, worker: int) -> bool:
    """Would `incoming`, loaded by `worker`, fit next to `residents`?

    Both limits hold: the budget (what fleet may use on this device) and the
    memory free right now (other processes use the device too). `free_now`
    is measured with the residents loaded, so only the new bytes count there.
    """
    after = residents + [ResidentView("", worker, incoming)]
    grow = used_bytes(after) - used_bytes(residents)
    return used_bytes(after) <= budget_bytes and grow <= free_now_bytes


def eviction_order(r: ResidentView) -> tuple[int, float]:
    """Sort key: no waiting requests first, then least recently used, with
    the reload cost credited as recency."""
    return (r.waiting, r.last_used + RELOAD_CREDIT * r.reload_s)


def find_model_to_evict(residents: list[ResidentView], worker: int, incoming_waiting: int) -> ResidentView | None:
    """The model `worker` should evict next to make room, or None.

    Only the worker's own models (one owner per device memory, STYLE.md 5),
    never a pinned one, and never one with waiting requests for a model that
    has no more waiting than it: a busy model is not thrown out for a quiet
    one (its queue drains first, then it is evictable).
    """
    candidates = [
        r for r in residents
        if r.worker == worker and not r.pinned and (r.waiting == 0 or r.waiting < incoming_waiting)
    ]
    return min(candidates, key=eviction_order, default=None)


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def plan_load(name: str, incoming: Footprint, residents: list[ResidentView], *, worker: int, device: str,
              budget_bytes: int, free_now_bytes: int, incoming_waiting: int = 0) -> LoadPlan:
    """Decide how `worker` can load `name` on `device`.

    1. It fits: load.
    2. Evict `find_model_to_evict` one by one until it fits: load after those.
    3. It would fit if models that are busy now were evicted: wait (its
       requests stay queued; the busy queues drain, then step 2 succeeds).
    4. Not even evicting every unpinned model of this worker makes room:
       `too_large`, naming what holds the memory.
    """
    left = list(residents)
    free = free_now_bytes
    evict: list[str] = []
    while not fits_on_device(budget_bytes, free, left, incoming, worker):
        victim = find_model_to_evict(left, worker, incoming_waiting)
        if victim is None:
            break
        left.remove(victim)
        free += victim.footprint.weights_bytes
        evict.append(victim.name)
    else:
        return LoadPlan(LOAD, tuple(evict))
    # Could it fit if this worker's busy unpinned models went too?
    movable = [r for r in left if r.worker == worker and not r.pinned]
    fixed = [r for r in left if r not in movable]
    free_all = free + sum(r.footprint.weights_bytes for r in movable)
    if movable and fits_on_device(budget_bytes, free_all, fixed, incoming, worker):
        busy = ", ".join(f"{r.name} ({r.waiting} waiting)" for r in movable)
        return LoadPlan(WAIT, (), f"{name} waits for room held by busier models: {busy}")
    return LoadPlan(TOO_LARGE, (), too_large_reason(name, incoming, fixed, device=device,
                                                    budget_bytes=budget_bytes, free_now_bytes=free_all))


def budget_setting(device: str) -> str:
    """The settings that size `device`'s budget, for a model that cannot fit in it."""
    if device.startswith("cuda"):
        return ("the budget is the GPU's memory less gpu_reserve_bytes (FLEET_GPU_RESERVE_BYTES): lower it, or "
                "serve the model on a larger GPU")
    return ("raise cpu_budget_bytes (FLEET_CPU_BUDGET_BYTES; 0 = cpu_budget_fraction of the available RAM) in "
            "config.toml, then restart the daemon")


def too_large_reason(name: str, incoming: Footprint, holders: list[ResidentView], *, device: str,
                     budget_bytes: int, free_now_bytes: int) -> str:
    """One clear sentence: what the model needs, what the device allows, who holds the rest."""
    need = f"{name} needs {_mb(incoming.total_bytes)} ({_mb(incoming.weights_bytes)} weights + " \
           f"{_mb(incoming.activation_bytes)} activations)"
    if incoming.total_bytes > budget_bytes:
        smaller = (", or lower its profile's max_batch_tokens (models.toml) for smaller batches"
                   if incoming.activation_bytes > incoming.weights_bytes else "")
        return f"{need}, more than the whole {device} budget of {_mb(budget_bytes)}; {budget_setting(device)}{smaller}"
    held = sorted(holders, key=lambda r: -r.footprint.weights_bytes)
    parts = [
        f"{r.name} ({_mb(r.footprint.weights_bytes)}, {'pinned' if r.pinned else f'worker {r.worker}'})"
        for r in held
    ]
    text = f"{need}; {device} has a budget of {_mb(budget_bytes)}"
    if parts:
        text += f" and {_mb(used_bytes(holders))} is held by " + ", ".join(parts)
    if free_now_bytes < incoming.total_bytes:
        text += f"; only {_mb(max(0, free_now_bytes))} is free on the device right now (other processes use the rest)"
    return text


def load_error(name: str, device: str, exc: BaseException) -> Exception:
    """The error a failed load answers its waiting requests with."""
    from fleet.errors import FleetError, ModelLoadFailed, ModelTooLarge

    if isinstance(exc, FleetError):
        return exc
    if is_out_of_memory(exc):
        return ModelTooLarge(f"out of memory loading {name} on {device}: {type(exc).__name__}: {exc}",
                             hint="unpin or unload a model, or use a device with more memory")
    return ModelLoadFailed(f"cannot load {name!r} on {device}: {type(exc).__name__}: {exc}")


# ---- OOM during a batch --------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM, a failed host allocation, or Python's MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def run_split_on_oom(run: Callable[[list[Any]], list[Any]], requests: list[Any],
                     on_oom: Callable[[], None] = lambda: None) -> list[Any]:
    """`run(requests)`; on out-of-memory, free what can be freed (`on_oom`) and
    run each half on its own, down to single requests. A single request that
    still does not fit raises the OOM (the caller answers it)."""
    try:
        return run(requests)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(requests) < 2:
            raise
        log.warning("out of memory on a batch of %d; splitting it", len(requests))
    on_oom()
    mid = len(requests) // 2
    return run_split_on_oom(run, requests[:mid], on_oom) + run_split_on_oom(run, requests[mid:], on_oom)


# ---- device budget (effects) ------------------------------------------------------------


@dataclass
class DeviceMemory:
    """One device's budget and a live reading of its free memory (minus the reserve)."""

    device: str
    budget_bytes: int
    free_now: Callable[[], int]
    source: str = ""

    @classmethod
    def unlimited(cls, device: str = "cpu") -> DeviceMemory:
        return cls(device, 1 << 62, lambda: 1 << 62, "unlimited")


def cuda_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """NVML's handle for CUDA device `index`. CUDA numbers only the GPUs in
    CUDA_VISIBLE_DEVICES, NVML numbers all of them: match by UUID when torch
    can say it, else assume the same order."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_memory(index: int) -> tuple[int, int]:
    """(total, free) bytes of CUDA device `index` from NVML (nvidia-ml-py)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml, index))
        return int(info.total), int(info.free)
    finally:
        pynvml.nvmlShutdown()


#: NVML and torch disagreeing by more than this is logged (they count the
#: same physical memory; a gap means another process allocated in between or
#: the indices do not map one to one, e.g. CUDA_VISIBLE_DEVICES reordering).
CROSS_CHECK_SLACK = 256 << 20


def cuda_free(index: int, reserve_bytes: int) -> int:
    """Free bytes on GPU `index` minus the reserve: the smaller of NVML and torch's view."""
    import torch

    torch.cuda.empty_cache()  # blocks cached by torch's allocator are ours to reuse: count them free
    _, nv_free = nvml_memory(index)
    torch_free, _ = torch.cuda.mem_get_info(index)
    if abs(nv_free - torch_free) > CROSS_CHECK_SLACK:
        log.warning("cuda:%d free memory: NVML says %d MiB, torch says %d MiB; using the smaller",
                    index, nv_free >> 20, torch_free >> 20)
    return min(nv_free, torch_free) - reserve_bytes


def device_budget(device: str, *, cpu_budget_bytes: int = 0, cpu_budget_fraction: float = 0.5,
                  cpu_reserve_bytes: int = 256 << 20, gpu_reserve_bytes: int = 512 << 20,
                  fleet_used_bytes: int = 0) -> DeviceMemory:
    """The budget of `device` for this daemon's models.

    NVIDIA: total memory (NVML, cross-checked with torch) minus the reserve;
    what is free right now is re-read at every load decision.
    CPU: `cpu_budget_bytes` if set, else `cpu_budget_fraction` of the RAM
    available now plus what fleet's models on this device already hold (so
    every worker of the device computes the same budget); loads also need
    that much RAM really available, minus `cpu_reserve_bytes`.
    """
    if device.startswith("cuda"):
        import torch

        index = cuda_index(device)
        total, _ = nvml_memory(index)
        _, torch_total = torch.cuda.mem_get_info(index)
        if total != torch_total:
            log.warning("cuda:%d total memory: NVML %d MiB, torch %d MiB; using the smaller",
                        index, total >> 20, torch_total >> 20)
        return DeviceMemory(device, min(total, torch_total) - gpu_reserve_bytes,
                            lambda: cuda_free(index, gpu_reserve_bytes), "nvml")
    import psutil

    if cpu_budget_bytes > 0:
        budget, source = cpu_budget_bytes, "configured"
    else:
        budget = int(cpu_budget_fraction * (psutil.virtual_memory().available + fleet_used_bytes))
        source = f"{cpu_budget_fraction:g} of available RAM"
    return DeviceMemory(device, budget, lambda: psutil.virtual_memory().available - cpu_reserve_bytes, source)


class LoadLock:
    """One load (decision + load) at a time per device, across the worker
    processes of a daemon: an flock on `FLEET_HOME/run/load-<device>.lock`
    (the kernel drops it if the holder dies). Without a path, a no-op (a
    single in-process core)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None

    @classmethod
    def for_device(cls, home: str | Path, device: str) -> LoadLock:
        run = Path(home) / "run"
        run.mkdir(parents=True, exist_ok=True)
        return cls(run / f"load-{device.replace(':', '-')}.lock")

    @contextlib.contextmanager
    def held(self, *, blocking: bool = True) -> Iterator[bool]:
        """Hold the lock for the block; with `blocking=False` the block gets False at
        once (holding nothing) when another process holds it."""
        if not self.acquire(blocking=blocking):
            yield False
            return
        try:
            yield True
        finally:
            self.release()

    def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock (False at once, holding nothing, when another process holds it
        and `blocking` is false). Held until `release`, whichever thread calls it: a load
        that runs beside serving holds it from its decision to its settling
        (runtimes.residency). Not reentrant: the flock is this process's, so one worker
        takes it once (`Residency.pending` keeps one load at a time)."""
        if self.path is None:
            return True
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self.path is not None and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def device_used_bytes(queue: Any, device: str) -> int:
    """What the live workers of `device` report using (their info blobs' `used_bytes`)."""
    import msgspec

    total = 0
    for w in queue.workers():
        if w.device == device and w.info:
            total += int(msgspec.msgpack.decode(w.info).get("used_bytes", 0))
    return total
