"""The runtime contract: one small adapter interface for every task.

A worker process owns its device and the adapters loaded on it. The worker loop
(`runtimes.worker`) only ever calls the methods below, so adding a task is one
new file plus one line in `runtimes.registry`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Collection, Generator
from typing import Any, ClassVar

import msgspec

from fleet.errors import ModelLoadFailed


#: A CPU forward's fixed cost in padded tokens until measured: MiniLM on 2 Zen 4
#: cores, the forward's time fitted over 12-480 padded tokens at load, gave 129-180
#: (a / b of ms = a + b x tokens); cutting 32-text requests with 128-192 ran them
#: 1.3-1.5x faster than one micro-batch each (issue 27).
CPU_FIXED_TOKENS = 128.0
#: Characters per token of English text under WordPiece / BPE (4.5 on the bench
#: corpus): the unit change for `Adapter.fixed_chars`. Other scripts have fewer,
#: which only makes their micro-batches longer (closer to cutting by count).
TYPICAL_CHARS_PER_TOKEN = 4.0
#: Per engine, the multiple of rows a CPU micro-batch is cut in (`Adapter.row_multiple`).
#: OpenVINO builds its kernels per input shape and keeps them in a 5,000-entry cache
#: that thrashes past ~1-2 thousand shapes; a shape it has not run costs 4-12 ms more
#: (MiniLM, Intel Xeon, 2 vCPUs). Rows in eighths meet ~40 % fewer shapes on the bench
#: corpus for ~1 point more padding, and ran merged batches 1.03-1.09x faster in four
#: pairs (bench/README, "Where the OpenVINO gap sits").
ROW_MULTIPLES = {"openvino": 8}


#: What `Adapter.batch` returns: yields (nothing) before each micro-batch, returns the results.
Steps = Generator[None, None, list]


@dataclass
class BatchContext:
    """What one batch tells its adapter, and what the adapter tells back: explicit,
    one per batch, so a batch run between two micro-batches of another has its own
    (nothing on the adapter is set by someone else and put back).

    `micro_cap`: inputs per micro-batch while clients share the model (None: the
    profile's `micro_batch_items`), so that another client's request waits at most
    one short micro-batch. `marks`: when the batch's last micro-batch was
    tokenized, through the forward (and pooling) and on the host (CLOCK_MONOTONIC
    ns), the request timeline's adapter stages (fleet.messages.WORKER_STAGES);
    adapters that do not stamp leave zeros."""

    micro_cap: int | None = None
    marks: tuple[int, int, int] = (0, 0, 0)


def run_through(steps: Steps) -> list:
    """Every step of `steps` (`Adapter.batch`) in one call: its results."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass(frozen=True)
class Profile:
    """Serving profile of one model on one device (models.toml `profile`)."""

    max_batch_items: int = 256
    max_batch_tokens: int = 16384
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    engine: str = "auto"  # auto | torch | openvino (runtimes/adapters/engines.py)
    linger_ms: float = 0.0
    #: Inputs per forward pass inside a batch (length-sorted micro-batches cut padding).
    micro_batch_items: int = 64
    #: LoRA adapters kept attached to this model at once (least recently used leave first).
    max_loras: int = 32

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None) -> "Profile":
        if not data:
            return cls()
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class ModelSpec:
    """Everything an adapter needs to load one model, resolved from the store."""

    name: str
    path: Path
    task: str
    runtime: str
    profile: Profile = field(default_factory=Profile)
    trust_remote_code: bool = False
    max_seq_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Adapter(abc.ABC):
    """One loaded model on one device."""

    #: The msgspec Struct a queue payload of this task decodes into.
    request_type: ClassVar[type[msgspec.Struct]]
    #: The engines a profile may name for it (`Profile.engine`; runtimes/adapters/engines.py):
    #: another is refused at load.
    engines: ClassVar[tuple[str, ...]] = ("torch",)

    def __init__(self, spec: ModelSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        #: dtype chosen at load (recorded in `fleetctl ps`).
        self.dtype = "float32"
        #: What runs the forward and how it was chosen (runtimes.adapters.engines.Choice; None:
        #: torch, never measured). `fleetctl ps` shows it.
        self.choice: Any = None
        #: A forward's fixed cost in padded tokens on this device (per-layer dispatch,
        #: thread wake-ups): micro-batches are cut where padding texts to one length
        #: costs more than another forward (`batching.micro_batches`). A CPU starts
        #: from CPU_FIXED_TOKENS (an adapter that times its forward at load refines
        #: it); None cuts by count alone (a GPU, where the fixed cost dominates).
        self.fixed_tokens: float | None = CPU_FIXED_TOKENS if device == "cpu" else None

    @property
    def engine(self) -> str:
        """What runs the forward: the measured or forced choice's engine, else torch."""
        return self.choice.candidate.engine if self.choice is not None else "torch"

    @property
    def row_multiple(self) -> int:
        """Rows a CPU micro-batch holds a multiple of, but for the batch's shortest run
        (`batching.padding_cuts`): its engine's `ROW_MULTIPLES`, else 1 (any count)."""
        return ROW_MULTIPLES.get(self.engine, 1)

    def micro_items(self, ctx: BatchContext) -> int:
        """Inputs per micro-batch for the batch of `ctx`: the profile's, or fewer (`BatchContext.micro_cap`)."""
        step = self.spec.profile.micro_batch_items
        return step if ctx.micro_cap is None else max(1, min(step, ctx.micro_cap))

    def fixed_chars(self) -> float:
        """`fixed_tokens` in the characters adapters measure texts in for
        `micro_batches` (0: cut by count alone)."""
        return 0.0 if self.fixed_tokens is None else self.fixed_tokens * TYPICAL_CHARS_PER_TOKEN

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights onto the device. Raises a FleetError on failure."""

    @abc.abstractmethod
    def footprint_bytes(self) -> int:
        """Bytes this model holds on its device (measured after load)."""

    def run_batch(self, requests: list[Any], ctx: BatchContext | None = None) -> list[msgspec.Struct]:
        """Run decoded requests together; one result (or WorkError) per request, in order.
        Adapters that cut micro-batches implement `batch` instead, and this runs all of it."""
        return run_through(self.batch(requests, BatchContext() if ctx is None else ctx))

    def batch(self, requests: list[Any], ctx: BatchContext) -> Steps:
        """`run_batch` as steps: a generator that yields before each micro-batch (the
        worker's step loop decides there whether the rest is still wanted, and what
        runs before it) and returns the results. An adapter without micro-batches
        implements `run_batch(requests)` alone: it is then one step with no boundary."""
        if type(self).run_batch is Adapter.run_batch:
            raise TypeError(f"{type(self).__name__} implements neither run_batch nor batch: this is a bug")
        return self.run_batch(requests)
        yield  # a generator with no boundary

    def unload(self) -> None:
        """Release device memory. Default: drop references."""

    # -- continuous adapters (generation) --------------------------------------
    #
    # A continuous adapter keeps requests across worker steps (a sequence
    # decodes one token per step). The worker admits claimed requests up to
    # `free_slots()`, then calls `step()` while `has_active()`, before it
    # chooses another lane; each finished request is acked when `step()`
    # returns it, and the worker's heartbeat keeps the leases of the others.

    #: True for adapters that implement the four methods below.
    continuous: ClassVar[bool] = False
    #: A second request type a continuous adapter's lane may carry, answered in
    #: batches beside its rounds by `side_batch` (a generator's typed decisions, read
    #: from the weights it holds: runtimes/adapters/decide_shared.py); None: its own type only.
    side_type: ClassVar[type[msgspec.Struct] | None] = None

    def side_batch(self, requests: list[Any], ctx: BatchContext) -> Steps:
        """`batch` for requests of `side_type` (the worker's round runs them at once)."""
        raise NotImplementedError(f"{type(self).__name__} answers no second request type")

    def free_slots(self) -> int:
        """Requests `admit` takes now."""
        return 0

    def admit(self, key: Any, request: Any) -> msgspec.Struct | None:
        """Start serving `request` (identified by `key` in what `step` returns).
        Returns a WorkError when it cannot start (bad input), else None; raises
        runtimes.memory.NotNow when it must wait for room (the worker returns it
        to its lane)."""
        raise NotImplementedError(f"{type(self).__name__} is not a continuous adapter")

    def has_active(self) -> bool:
        return False

    def step(self) -> tuple[list[tuple[Any, msgspec.Struct]], list[tuple[Any, msgspec.Struct]]]:
        """Advance every admitted request once: (partial results to stream, for
        requests that asked for them; finished results), each as (key, result)."""
        raise NotImplementedError(f"{type(self).__name__} is not a continuous adapter")

    def active_count(self) -> int:
        """Requests admitted and not finished."""
        return 0

    def reserved_bytes(self) -> int:
        """Device bytes held for admitted requests beyond the weights (a generator's
        key/value cache reserve); the worker counts them in the device budget."""
        return 0

    def needs_room(self) -> bool:
        """Does the next `step` grow `reserved_bytes` (a generator's open-ended
        answers)? The worker then refreshes the adapter's bound on it first."""
        return False

    def abort(self) -> list[Any]:
        """Drop every admitted request (after a failed step); returns their keys."""
        return []

    def cancel(self, keep: Callable[[Any], bool]) -> list[Any]:
        """Drop the admitted requests whose key fails `keep` (their deadline passed,
        or they were withdrawn); returns their keys."""
        return []

    def in_flight(self) -> list[Any]:
        """Keys of the admitted requests."""
        return []

    def round_tokens(self) -> tuple[int, int]:
        """(prompt tokens, tokens generated so far) of the admitted requests: the
        batch a step ran, as `/v1/ps` and the `X-Batch-Tokens` header show it."""
        return 0, 0

    # -- LoRA hosting ------------------------------------------------------------
    #
    # A LoRA adapter's requests queue in its base model's lane; the base's
    # adapter serves them in the same batches as its own (`lora_of` says which
    # adapter a request wants; the worker resolves and attaches it first).
    # Runtimes that host adapters implement the three methods after `lora_of`
    # (runtimes.lora.LoraHost); the others refuse every adapter at attach.

    def lora_of(self, request: Any) -> str | None:
        """The LoRA adapter (store name) `request` runs with: its `adapter`, or its
        `model` when that names another model than this one (an adapter named as
        the model, queued in its base's lane); None = this model alone."""
        adapter = getattr(request, "adapter", None)
        if adapter:
            return adapter
        model = getattr(request, "model", None)
        return model if model and model != self.spec.name else None

    def hosts(self, lora: str) -> bool:
        return False

    def attached_loras(self) -> list[str]:
        """Store names of the LoRA adapters attached now, least recently used first."""
        return []

    def attach_lora(self, spec: ModelSpec, keep: Collection[str] = ()) -> None:
        """Attach a LoRA adapter of this model, detaching the least recently used
        idle one past `max_loras` (never one of `keep`: adapters the batch about to
        run names)."""
        raise ModelLoadFailed(f"{self.spec.name} ({self.spec.runtime}) does not serve LoRA adapters")
