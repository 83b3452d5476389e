"""What a worker holds and last did: its resident models and its last batch.

Plain records shared by the step loop (`runtimes.worker`), the residency
(`runtimes.residency`) and the continuous batcher (`runtimes.continuous`), so
that none of them imports the step loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from collections import deque
from dataclasses import dataclass, field

from fleet.runtimes.base import Adapter
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.linger import LastRun


@dataclass
class Resident:
    adapter: Adapter
    loaded_at: float
    last_used: float
    served: int = 0
    #: Tokenizer tokens of the requests it answered (encoders: their inputs'; generation:
    #: prompt and generated), cumulative: the daemon turns differences into tokens/s (`fleetctl top`).
    tokens: int = 0
    #: Micro-batches run and items dropped between them because nobody waited for
    #: them any longer (the worker closed the adapter's `batch` steps), cumulative.
    micro_batches: int = 0
    dropped: int = 0
    #: Items of other clients run between the micro-batches of a batch (runtimes.flows), cumulative.
    interjected: int = 0
    load_ms: float = 0.0
    #: Measured weights and the activation allowance (runtimes.footprint).
    footprint: Footprint = Footprint(0)
    #: The bytes `info` shows (weights plus attached LoRAs), measured again only
    #: when the attached LoRAs change: summing every tensor's size took longer
    #: than the rest of the info blob, after every batch.
    shown_bytes: tuple[frozenset[str], int] | None = None

    def weights_shown(self) -> int:
        loras = frozenset(self.adapter.attached_loras())
        if self.shown_bytes is None or self.shown_bytes[0] != loras:
            self.shown_bytes = (loras, self.adapter.footprint_bytes())
        return self.shown_bytes[1]


#: Batches kept in the info blob's ring (`batches`): the daemon reads it every
#: METRICS_REFRESH_S and turns entries past the last sequence it saw into batch
#: metrics, so a worker may run this many batches between two reads without loss.
BATCH_RING = 64


@dataclass
class BatchStats:
    """One batch a worker ran. `items` are its inputs (texts, images, a rerank's
    documents; a generation step's sequences) and `tokens` what its tokenizer gave
    them: the numbers `/metrics`, `fleetctl top` and `/v1/ps` show. `padded` and
    `requests` are the scheduler's units: the daemon's token estimate (requests x the
    longest estimate) and queue items (one per request or piece of one)."""

    model: str = ""
    items: int = 0
    tokens: int = 0
    padded: int = 0
    ms: float = 0.0
    at: float = 0.0
    returned: int = 0  # over-pulled items given back when this batch was formed
    loras: tuple[str, ...] = ()  # LoRA adapters mixed into it (store names)
    #: Generation: the prompt and generated tokens of the sequences in the step (`tokens` is their sum).
    prompt_tokens: int = 0
    generated_tokens: int = 0
    #: Queue items it ran (the linger rule's count: `LastRun.items`); 0: not an encoder batch.
    requests: int = 0
    #: It ran with the bound of a lane behind its target (`LastRun.behind`).
    behind: bool = False


@dataclass
class Ledger:
    """The batches this worker ran, for its info blob and its linger rule.

    Cumulative counters (published in the info blob; the daemon diffs them, so no
    event between two reads is missed): batches run (`seq`) and the last
    BATCH_RING of them as (model, items, tokens); the last batch whole (`/v1/ps`,
    the turn rule of `busy_continuous`); each model's last batch here, when it was
    acked with its items and time (`runs`: the linger rule, `linger_window`)."""

    last: BatchStats = field(default_factory=BatchStats)
    seq: int = 0
    ring: deque = field(default_factory=lambda: deque(maxlen=BATCH_RING))
    runs: dict[str, LastRun] = field(default_factory=dict)

    def ran(self, stats: BatchStats, acked_ns: int) -> None:
        """A batch of `stats` was acked at `acked_ns` (the worker's clock)."""
        self.last = stats
        self.runs[stats.model] = LastRun(acked_ns, stats.requests, stats.ms, stats.behind)
        self.seq += 1
        self.ring.append((stats.model, stats.items, stats.tokens))


@dataclass(frozen=True)
class NotNowMemo:
    """A "not here, now" load verdict, kept so the lane is skipped without deciding again."""

    until_ns: int  # the worker's clock
    #: Left to the workers holding the model: the worker may block for new work.
    left_to_holders: bool


@dataclass
class Progress:
    """What the worker's main loop runs now that may take long (a batch, a load), read by
    its heartbeat thread: leases are renewed only while it is within its bound.

    `busy` is one tuple (what, started ns, deadline ns, `paused_ns` at the start) or
    None, replaced whole by the main thread: the heartbeat thread never sees a torn
    record. `load` is the same for the model load running beside the batches, written
    by its own thread only (runtimes.loading). `paused_ns` is written by the heartbeat
    thread only (`excuse`): time this process did not run at all (a paused box:
    runtimes.policy.paused_ns), which no work's bound counts. Monotonic ns."""

    busy: tuple[str, int, int, int] | None = None
    load: tuple[str, int, int, int] | None = None
    paused_ns: int = 0

    @contextlib.contextmanager
    def running(self, what: str, bound_ms: float, *, slot: str = "busy") -> Iterator[None]:
        """`what` runs for the block, within `bound_ms`; `slot`: "busy" (the step loop's
        work) or "load" (the load beside it)."""
        now = time.monotonic_ns()
        setattr(self, slot, (what, now, now + int(bound_ms * 1e6), self.paused_ns))
        try:
            yield
        finally:
            setattr(self, slot, None)

    def excuse(self, ns: int) -> None:
        """`ns` of the last heartbeat gap this process was paused: not the work's time."""
        self.paused_ns += ns

    def overdue(self, now_ns: int) -> tuple[str, float] | None:
        """(what, ms it has run, pauses left out) when the work in progress (a batch, or
        the load beside it) is past its bound, else None."""
        for busy in (self.busy, self.load):
            if busy is None:
                continue
            ran_ns = now_ns - busy[1] - (self.paused_ns - busy[3])
            if busy[1] + ran_ns > busy[2]:
                return busy[0], ran_ns / 1e6
        return None
