"""Worker-side scheduling policy: plain functions over plain data (STYLE.md 3).

Units: times are monotonic nanoseconds (`*_ns`) or milliseconds (`*_ms`);
token counts are the daemon's estimates written at put time. A batch's
*padded* size is items x longest item, the shape the model actually runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class LaneView(Protocol):
    lane: int
    model: str
    depth: int
    oldest_enqueue_ns: int
    #: Only batch work is queued (local_queue invariant 2: its head is batch work).
    head_batch: bool


def choose_lane(lanes: Iterable[LaneView], held: set[str], now_ns: int, max_wait_ns: int) -> LaneView | None:
    """The lane this worker should serve next, or None when nothing waits.

    1. A lane whose oldest interactive item has waited past `max_wait_ns` is
       starving: serve the most starved one, held or not (bounded wait, no lane starves).
    2. Otherwise lanes with interactive work before lanes with batch work only
       (a lane's batch work runs after its interactive work anyway: the queue
       keeps it behind), and among those, lanes of models this worker already
       holds (no load).
    3. Among those (or among all of the kind, if it holds none of them), the lane
       whose oldest item has waited longest.
    Batch work never starves a lane's interactive work here; its own wait is
    bounded where it is queued: past `batch_max_wait_ms` the daemon promotes it to
    interactive at its enqueue time (`LocalQueue.promote`), and rule 1 applies.
    """
    waiting = [lane for lane in lanes if lane.depth > 0]
    if not waiting:
        return None
    interactive = [lane for lane in waiting if not lane.head_batch]
    if interactive:
        oldest = min(interactive, key=lambda lane: lane.oldest_enqueue_ns)
        if now_ns - oldest.oldest_enqueue_ns > max_wait_ns:
            return oldest
        waiting = interactive
    else:
        oldest = min(waiting, key=lambda lane: lane.oldest_enqueue_ns)
    mine = [lane for lane in waiting if lane.model in held]
    return min(mine, key=lambda lane: lane.oldest_enqueue_ns) if mine else oldest


#: Rows of one batch are less than this many times shorter than its widest row:
#: a short item is not padded to a long one's width (it waits a round instead).
MAX_PAD_RATIO = 4


def form_batch(tokens: Sequence[int], attempts: Sequence[int], max_items: int, max_padded_tokens: int,
               max_pad_ratio: float = MAX_PAD_RATIO, *, batch: Sequence[bool] | None = None,
               max_fill_tokens: int | None = None) -> list[int]:
    """Indices (ascending, so claim order) of the claimed items to run now; the rest go back.

    1. The head (the oldest claimed item) always runs, even alone over budget:
       every round makes progress, and an item sent back is at its lane's head
       next round, so nothing waits behind shorter items for more than a round.
    2. A suspect (attempts > 0: it was claimed by a worker that died) runs
       alone. If the head is one, the batch is the head; later suspects go
       back. A poison item then only ever takes down its own batch, and the
       items that shared a crashed batch with it are not charged its attempts.
    3. Bucket by length: choose the width `w` (the head's length <= w <
       max_pad_ratio x the head's) that lets the most items run, where the
       batch is the items of length in (w / max_pad_ratio, w], in lane order,
       at most min(max_items, max_padded_tokens // w) of them. Ties go to the
       narrower `w` (less padding). Items outside the band go back: a long one
       does not widen a batch of short ones, short ones are not padded to a
       long head's width.
    4. Batch work (`batch[i]`, local_queue's batch items) fills what interactive
       work leaves: the band is chosen for the most interactive items first,
       then the most items; batch items join only while the batch stays within
       `max_fill_tokens` padded tokens (`batch_fill_cap`; default: the whole
       budget). A batch head runs all the same (rule 1).
    """
    n = len(tokens)
    if n == 0:
        return []
    if n == 1 or attempts[0] > 0 or max_items <= 1:
        return [0]
    t = np.maximum(np.asarray(tokens, dtype=np.int64), 1)  # an empty payload still occupies a row
    ok = np.asarray(attempts, dtype=np.int64) == 0
    head = int(t[0])
    widths = np.unique(t[ok & (t >= head) & (t < head * max_pad_ratio)])
    room = np.minimum(max_items, np.maximum(1, max_padded_tokens // widths))  # items a batch of each width holds
    if batch is None or not any(batch):
        fits = np.sort(t[ok])
        # Items in each candidate band, capped by the item and padded budgets.
        in_band = (np.searchsorted(fits, widths, side="right")
                   - np.searchsorted(fits, widths / max_pad_ratio, side="right"))
        counts = np.minimum(in_band, room)
        best = int(np.argmax(counts))  # argmax takes the first max: the narrowest width
        w = int(widths[best])
        chosen = np.flatnonzero(ok & (t <= w) & (t * max_pad_ratio > w))[:int(counts[best])]
        return chosen.tolist()
    is_batch = np.asarray(batch, dtype=bool)
    # (candidate widths x items): which items fall in each width's band.
    band = ok & (t <= widths[:, None]) & (t * max_pad_ratio > widths[:, None])
    inter = np.minimum((band & ~is_batch).sum(axis=1), room)
    fill = room if max_fill_tokens is None else np.minimum(room, np.maximum(1, max_fill_tokens // widths))
    extra = np.clip(fill - inter, 0, (band & is_batch).sum(axis=1))
    if is_batch[0]:
        extra = np.maximum(extra, 1)  # a batch head runs (rule 1), and it is the band's first batch item
    best = int(np.argmax(inter * (n + 1) + extra))  # most interactive, then most items, then narrowest
    row = band[best]
    chosen = np.concatenate([np.flatnonzero(row & ~is_batch)[:int(inter[best])],
                             np.flatnonzero(row & is_batch)[:int(extra[best])]])
    return np.sort(chosen).tolist()


#: Batches a cost model must have seen before it sizes batches.
MIN_SAMPLES = 3


@dataclass
class CostModel:
    """Batch time of one model on this worker's device: ms ≈ a + b·padded_tokens.

    Fitted online from the worker's own measured batches by exponentially
    weighted least squares (recursive least squares with forgetting factor
    `decay`): old batches fade, so the fit follows a device whose speed
    changes (thermal limits, a neighbour sharing it). The sums below are all
    the state; `fit` solves the 2x2 normal equations from them.
    """

    decay: float = 0.9
    w: float = 0.0  # sum of weights
    sx: float = 0.0  # padded tokens
    sy: float = 0.0  # ms
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0

    def observe(self, padded_tokens: int, ms: float) -> None:
        d, x = self.decay, float(padded_tokens)
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + ms
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * ms
        self.samples += 1

    def fit(self) -> tuple[float, float]:
        """(a ms, b ms per padded token), both >= 0; (0, 0) before any sample."""
        if self.samples == 0:
            return 0.0, 0.0
        var = self.w * self.sxx - self.sx * self.sx
        # All batches the same size (relative spread under 1e-9): no slope to
        # tell apart from the intercept; charge it all to tokens.
        if var <= 1e-9 * self.w * self.sxx:
            return (0.0, self.sy / self.sx) if self.sx > 0 else (self.sy / self.w, 0.0)
        b = (self.w * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.w
        if b < 0:  # time does not grow with tokens (noise): a flat cost
            return self.sy / self.w, 0.0
        if a < 0:  # a fixed cost below zero is noise: fit through the origin
            return 0.0, self.sxy / self.sxx
        return a, b

    def predict_ms(self, padded_tokens: int) -> float:
        a, b = self.fit()
        return a + b * padded_tokens


def batch_token_cap(cost: CostModel | None, target_ms: float, max_padded_tokens: int) -> int:
    """Padded tokens a batch may have so that its predicted time stays within `target_ms`.

    The profile's `max_padded_tokens` when there is no target, time does not
    grow with tokens, or the fixed cost alone exceeds the target. Never below
    a/b tokens. Before MIN_SAMPLES batches of the model (a worker just loaded
    it): its first batch is its head alone (1: the claim always takes one), the
    next ones as many tokens as the target holds at the mean time a token took
    so far, fixed cost included (it errs small). The profile's budget there
    made a cold start's first batch every request queued (MiniLM on one CPU
    thread: 11 requests of 2 600 tokens, 8 s, before any was answered).
    """
    if target_ms <= 0 or cost is None:
        return max_padded_tokens
    if cost.samples == 0:
        return 1
    if cost.samples < MIN_SAMPLES:
        if cost.sy <= 0:
            return max_padded_tokens
        return int(round(min(max_padded_tokens, max(target_ms * cost.sx / cost.sy, 1))))
    a, b = cost.fit()
    if b <= 0:
        return max_padded_tokens
    room = target_ms - a
    if room <= 0:
        # The fixed cost alone misses the target: a smaller batch cannot meet it,
        # it only pays that fixed cost more often. Throughput decides.
        return max_padded_tokens
    # Never below a/b tokens (where the fixed cost is half the batch time):
    # smaller batches buy little latency and, on a slow or busy device whose
    # fitted `a` is large, would shrink every batch to one item and collapse
    # throughput exactly when it is needed most.
    return int(round(min(max_padded_tokens, max(room / b, a / b, 1))))


#: A lane that is behind (`behind`) aims its batches at this many batch targets (2 s
#: at the shipped 250 ms; on 2 Zen 4 cores more than MiniLM's 16 384-token budget).
#: Another client arriving meanwhile does not wait for it: it runs between two
#: micro-batches (`runtimes.worker`, `interject`).
BEHIND_TARGETS = 8


def interactive_waits(lane: LaneView) -> bool:
    """Interactive work is queued in the lane: its head is not batch work (local_queue
    invariant 2), so `oldest_enqueue_ns` is an interactive item's. What `behind` and
    `runtimes.linger.still_behind` judge; batch work alone never counts."""
    return lane.depth > 0 and not lane.head_batch


def behind(lane: LaneView, now_ns: int, target_ms: float) -> bool:
    """The lane's interactive work is behind: its head has waited longer than a
    whole batch is aimed to take (`target_ms`), so more than one batch's worth is
    queued and every request in it waits anyway. A batch may then aim for
    BEHIND_TARGETS targets (the one-target bound is already missed):
    length-sorting across several requests pads far less and pays a forward's
    fixed cost fewer times, so the backlog clears sooner (issue 27: one request a
    batch at saturation ran at 0.69-0.73x length-sorted batches). Self-limiting:
    a batch takes what arrived during the last one, and once caught up the head
    waits less than the target again. Batch work (a batch-only lane) never
    counts: it is always old, and its batches must stay short for the
    interactive work that may arrive (`batch_fill_cap`)."""
    return target_ms > 0 and interactive_waits(lane) and now_ns - lane.oldest_enqueue_ns > target_ms * 1e6


#: While a model has interactive work, batch work may make its batches this much
#: longer (a fraction of the interactive batch's predicted time).
FILL_SLACK = 0.25
#: A model's interactive work counts as current this long after its last batch
#: with interactive items (ns); after that batch work alone fills whole budgets.
#: Long against the gaps of interactive traffic (at 1 request/s, one gap in three
#: is over 1 s: a shorter window lets a whole-budget batch start in many of them),
#: and costless to batch work alone, which sees no interactive work at all.
INTERACTIVE_QUIET_NS = 10_000_000_000


def batch_fill_cap(cap: int, interactive_padded: int, recent_padded: int, fit: tuple[float, float] | None) -> int:
    """Padded tokens a batch may reach when batch work fills it (`form_batch` 4).

    1. No interactive work in this batch and none of this model lately
       (`recent_padded` 0, see INTERACTIVE_QUIET_NS): `cap`, the whole budget.
       Batch work alone runs in batches as large as interactive work would.
    2. With interactive items in the batch (`interactive_padded`): batch work
       may add FILL_SLACK of their predicted time. An interactive request pays
       that much at most in its own batch, and one that arrives meanwhile waits
       for a batch at most that much longer than one without batch work.
    3. A batch of batch work only, while interactive work is current: FILL_SLACK
       of a recent interactive batch's predicted time (`recent_padded`): what an
       interactive request arriving now waits for before its own turn.
    A batch's time is the model's fitted cost `fit` = (a ms, b ms per padded
    token): on a GPU, whose fixed cost a dominates, 2 lets batch work ride along
    in most of the budget; on a CPU, whose time grows with tokens, about a quarter
    of the interactive tokens, and 3 leaves room for one item (`form_batch` always
    runs the head). Without a fit (None), or with one whose time does not grow
    with tokens (b <= 0: its batches were all alike, or noise), by tokens alone:
    such a fit cannot say what more tokens cost. Never more than `cap`, never less
    than the interactive part.
    """
    if interactive_padded <= 0 and recent_padded <= 0:
        return cap
    factor = 1.0 + FILL_SLACK if interactive_padded > 0 else FILL_SLACK
    ref = interactive_padded if interactive_padded > 0 else recent_padded
    if fit is None or fit[1] <= 0:
        return max(interactive_padded, min(cap, int(ref * factor)))
    a, b = fit
    return max(interactive_padded, min(cap, int((factor * (a + b * ref) - a) / b + 1e-6)))


#: While several clients share a model (`contended`), its batches aim for this share
#: of the batch target: a client arriving meanwhile waits for a batch this short.
CONTENDED_SHARE = 0.25
#: A client counts as current in a lane this long after its last batch there (ns).
FLOW_QUIET_NS = 1_000_000_000


def contended(last_seen: dict[int, int], now_ns: int, quiet_ns: int = FLOW_QUIET_NS) -> bool:
    """Several clients (queue flows) had interactive work in this model's batches within
    `quiet_ns` (`last_seen`: flow -> when its last batch here was acked). The lane's
    fair order (local_queue invariant 2) puts a light client's request next; what it
    still waits for is the batch running when it comes: while the model is shared,
    batches aim for CONTENDED_SHARE of the target (`batch_token_cap` keeps them
    above a/b tokens, so a GPU, whose fixed cost dominates, keeps its batches)."""
    return sum(1 for at in last_seen.values() if now_ns - at < quiet_ns) > 1


def lighter_client(last_seen: dict[int, int], sizes: dict[int, int], flows: set[int], tokens: int, now_ns: int,
                   quiet_ns: int = FLOW_QUIET_NS) -> bool:
    """A client other than `flows` is current in the lane (`contended`) whose requests
    are shorter than a batch of `tokens` (`sizes`: flow -> the fewest tokens of an
    item of its last batch here; one never measured counts as shorter): its next
    request would run between this batch's micro-batches (`WorkerCore.interject`
    runs only a shorter request there), so they are cut to MICRO_SHARE. Clients of
    equal requests (two floods) gain nothing from the cut and keep a target's
    micro-batches: cut to the share, two flooding clients on a 2-core CPU moved
    3.3-4.3 requests/s together against 7.2-7.5 for one (bench/README, issue 25)."""
    return any(f not in flows and now_ns - at < quiet_ns and sizes.get(f, 0) < tokens
               for f, at in last_seen.items())


#: While a client of shorter requests shares a model (`lighter_client`), a micro-batch
#: aims for this share of the batch target: its request, arriving during a batch, is
#: run between two micro-batches (`runtimes.worker.WorkerCore.interject`), so it waits
#: about this long, not for the batch.
MICRO_SHARE = 0.125
#: ... and on a device with a forward's fixed cost (a CPU), never fewer tokens than
#: this share of that cost (`micro_items_cap`).
MICRO_FLOOR = 0.5
#: Between two micro-batches, another client's request is looked for this many places
#: into the lane, behind the next requests of the clients whose batch runs
#: (`runtimes.worker.WorkerCore.still_wanted`): the fair order puts a client served
#: lately a request or two of a flood behind (a closed-loop client beside a
#: 16-connection flood: one or two places; bench/README "Fair admission").
INTERJECT_LOOK = 16


def runs_first(other_tokens: int, heaviest: int) -> bool:
    """Between two micro-batches of a running batch, does another client's request
    of `other_tokens` run before the rest (`runtimes.worker.WorkerCore.interject`)?
    Only when it is shorter than the batch's heaviest client's part (`heaviest`:
    that client's tokens in it). A light client waits for one micro-batch of a
    flood's batch; clients of equal requests keep their fair order. Compared with
    the whole batch's tokens (before), a batch that held two clients' requests
    was passed over by every other client's request of the same size, one per
    micro-batch. A batch runs at least one micro-batch between two others, so it
    always ends. (Compared with what is left of that part instead, a light
    client waited for a flood batch's last micro-batches: its p95 went from
    1.2-2.2x to 2.7-3.2x alone, bench.fairness flood.)"""
    return other_tokens < heaviest


def micro_items_cap(cost: CostModel | None, target_ms: float, tokens: int, rows: int,
                    fixed_tokens: float | None = None, *, share: float = MICRO_SHARE) -> int | None:
    """Inputs per micro-batch so that one is predicted to run about `share` of
    `target_ms` (MICRO_SHARE: while clients share the model; 1: a batch of one
    client's, so one arriving meanwhile waits about a target), for a batch of
    `tokens` over `rows` inputs. None when that says nothing (no rows, no tokens,
    no fitted cost or target) or the whole batch fits the share.

    With `fixed_tokens` (the adapter's fixed cost of one forward, `Adapter.fixed_tokens`:
    a CPU), a micro-batch of t padded tokens takes b x (fixed + t) by the fit's slope
    b: the share buys share / b - fixed tokens, never fewer than MICRO_FLOOR x
    `fixed_tokens` (a micro-batch two thirds fixed cost). On a 2-core CPU the share
    is under a forward's fixed cost, so the floor is the micro-batch: at a whole
    fixed cost's worth one ran about as long as a light client's request of 8 texts
    (31 vs 33 ms), and that client, asking again at once, waited for one, its p95
    2.1-2.3x alone; at half, 1.5x, the flood beside it slower (bench/README, issue
    25). The fit's own a is a whole batch's fixed cost (several
    forwards, decoding, acks): on a 2-core CPU it exceeds the share alone, which left
    shared batches uncut. Without it (a GPU), `batch_token_cap` of the share, never
    below a/b tokens (a device whose fixed cost dominates keeps its micro-batches)."""
    if rows <= 0 or tokens <= 0 or target_ms <= 0 or cost is None or cost.samples < MIN_SAMPLES:
        return None
    share_ms = target_ms * share
    if fixed_tokens is not None:
        b = cost.fit()[1]
        if b <= 0 or (budget := max(share_ms / b - fixed_tokens, MICRO_FLOOR * fixed_tokens)) >= tokens:
            return None  # no slope to size by, or the whole batch fits the share
    else:
        budget = batch_token_cap(cost, share_ms, 1 << 40)
        if budget >= 1 << 40:
            return None
    return max(1, int(budget * rows / tokens))


def fill_flags(flows: Sequence[int], batch: Sequence[bool]) -> list[bool]:
    """Which claimed items only fill a batch (`form_batch` 4): batch work, and the
    items of clients other than the head's. A batch is formed for its head's client;
    others ride along within FILL_SLACK of its time (`batch_fill_cap`), so a light
    client at the head of the lane is not made to wait for a flood's batch in its own."""
    head = flows[0] if flows else 0
    return [b or f != head for f, b in zip(flows, batch)]


#: No batch is declared stuck before it has run this long (ms): a device's hiccups
#: (a neighbour process, clocks throttling, a page fault storm) are not a hang.
STALL_FLOOR_MS = 5_000.0
#: A batch is stuck once it has run this many times its predicted time.
STALL_FACTOR = 20.0
#: The bound while a model's cost is not fitted yet (its first MIN_SAMPLES batches on
#: this worker: kernel compilation, allocator warm-up, and no prediction to scale).
#: The default request timeout (Settings.timeout_ms): a batch still running past it
#: answers nobody in time. A worker killed for it loses only time: its items come
#: back as suspects and run alone, and single items are what a cost model fits first.
WARMUP_STALL_MS = 30_000.0


#: A heartbeat tick this much later than due (ns) may be a pause of the whole process.
PAUSE_SLACK_NS = 1_000_000_000


def paused_ns(gap_ns: int, cpu_ns: int, period_ns: int) -> int:
    """How much of a heartbeat gap this process was paused (ns): `gap_ns` between two
    ticks due `period_ns` apart, during which the process (all its threads) used
    `cpu_ns` of CPU. A gap more than PAUSE_SLACK_NS late in which the process computed
    less than half the time is a pause (the box or its cgroup stopped, the VM stalled,
    SIGSTOP): its lateness counts against no batch or load. A late tick of a process
    that computed (a call holding the GIL) is the work's own time: 0."""
    late = gap_ns - period_ns
    if late <= PAUSE_SLACK_NS or 2 * cpu_ns >= gap_ns:
        return 0
    return late


def stall_bound_ms(cost: CostModel | None, padded_tokens: int) -> float:
    """How long a batch may run before its worker counts as stuck (its leases are
    then no longer renewed): STALL_FACTOR x its predicted time, at least
    STALL_FLOOR_MS; WARMUP_STALL_MS while the cost model has too few samples."""
    if cost is None or cost.samples < MIN_SAMPLES:
        return WARMUP_STALL_MS
    return max(STALL_FLOOR_MS, STALL_FACTOR * cost.predict_ms(padded_tokens))


def padded_tokens(tokens: Sequence[int]) -> int:
    """Items x longest: the padded size of a batch of these items."""
    return len(tokens) * max(tokens, default=0)


# ---- copies across workers (the herd rule) ------------------------------------------------


class BatchCost(Protocol):
    def predict_ms(self, padded_tokens: int) -> float: ...


@dataclass(frozen=True)
class LinearCost:
    """A fitted batch cost another worker published (its info's `cost`): ms ≈ a + b·padded tokens."""

    a_ms: float
    b_ms_per_token: float

    def predict_ms(self, padded_tokens: int) -> float:
        return self.a_ms + self.b_ms_per_token * padded_tokens


#: Load time assumed (ms) while no holder of a model has measured one: the order
#: of a small encoder's cold load (bench/memory_load: ~0.6 s for MiniLM on CPU).
UNMEASURED_LOAD_MS = 500.0


@dataclass(frozen=True)
class Copies:
    """The copies of one model on other workers, held or being loaded, as their info blobs say."""

    holders: int = 0
    #: The fit published by the holder with the most samples (None: no holder has MIN_SAMPLES yet).
    cost: LinearCost | None = None
    #: The longest load a holder measured, ms (UNMEASURED_LOAD_MS when none has).
    load_ms: float = UNMEASURED_LOAD_MS


def find_copies(infos: Iterable[tuple[int, dict]], model: str, *,
                announced: tuple[int, int] | None = None) -> Copies:
    """Copies of `model` among other workers' decoded info blobs ((wid, info), the
    shape `WorkerCore.info` publishes: `models` by name with `cost` and `load_ms`,
    `loading` and `loading_since_ns`).

    A worker that is loading the model counts as a holder: a load is announced
    before it starts, so peers do not start the same load meanwhile. With
    `announced` (this worker's own (loading_since_ns, wid), published before
    looking), a loader counts only if it announced first: of two workers that
    announce the same load and then look, the later one yields, and the
    earlier one, which may not have seen it, goes ahead.
    """
    holders, best, samples, load_ms = 0, None, -1, 0.0
    for wid, info in infos:
        m = info.get("models", {}).get(model)
        if m is not None:
            holders += 1
            load_ms = max(load_ms, float(m.get("load_ms", 0.0)))
            c = m.get("cost") or {}
            n = int(c.get("samples", 0))
            if n >= MIN_SAMPLES and n > samples:
                best, samples = LinearCost(float(c["a_ms"]), float(c["b_ms_per_1k_tokens"]) / 1e3), n
        elif info.get("loading") == model and (
                announced is None or (int(info.get("loading_since_ns", 0)), wid) < announced):
            holders += 1
    return Copies(holders, best, load_ms or UNMEASURED_LOAD_MS)


def should_load_copy(queued_tokens: int, holders: int, cost: BatchCost | None, load_ms: float) -> bool:
    """Load a model this worker does not hold?

    Yes when no other worker holds or is loading it. Otherwise only when the
    work queued for it would keep each holder busy longer than a load takes
    (`cost.predict_ms(queued_tokens) > holders x load_ms`): only then does
    another copy finish the backlog sooner than the holders alone, and only
    then is the eviction it may cost worth it. Without a fitted cost the
    backlog is unknown: leave it to the holders (a lane that starves is served
    anyway, `choose_lane` 1, so the wait stays bounded).
    """
    if holders <= 0:
        return True
    if cost is None:
        return False
    return cost.predict_ms(queued_tokens) > holders * load_ms


def rows_of(requests: list) -> int:
    """Inputs a batch's requests carry (texts; a rerank's documents, `RerankRequest.docs`),
    0 when their type names none (`micro_items_cap` then leaves micro-batches as the
    profile says)."""
    rows = 0
    for r in requests:
        inputs = getattr(r, "inputs", None)
        if inputs is None:
            inputs = getattr(r, "docs", None)
        if inputs is None:
            return 0
        rows += len(inputs)
    return rows
