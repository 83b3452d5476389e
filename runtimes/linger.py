"""The linger rule: how long a short batch waits for company, and when a lane
counts as still behind after a batch that ran behind its target.

Units as `runtimes.policy`: monotonic nanoseconds (`*_ns`) or milliseconds (`*_ms`).
Plain functions over the model's last batch on this worker (`LastRun`, kept by
`runtimes.state.Ledger`) and the lane's view (`policy.LaneView`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.runtimes.policy import LaneView, interactive_waits


@dataclass(frozen=True)
class LastRun:
    """A model's last batch on this worker, as the linger rule reads it."""

    acked_ns: int  # monotonic ns just before its results were acked (no answer of it was out before)
    items: int
    ms: float  # its run time
    #: It ran with the bound of a lane behind its target (`policy.behind`, `still_behind`).
    behind: bool = False


#: After a batch that ran behind, the linger lasts at most this share of its run time
#: (`linger_window`): its clients' round trip (3-6 ms on a 2-core CPU) within the 2 %
#: of a batch of 150 ms or more that each of them waited for it.
BEHIND_LINGER_SHARE = 0.02


def linger_span_ms(linger_ms: float, last: LastRun) -> float:
    """How long after `last`'s ack its clients count as coming back (`still_behind`):
    the profile's linger, or BEHIND_LINGER_SHARE of a behind batch's time."""
    return max(linger_ms, BEHIND_LINGER_SHARE * last.ms) if last.behind else linger_ms


def linger_window(linger_ms: float, last: LastRun | None, head_enqueue_ns: int, head_tokens: int,
                  cost: tuple[float, float]) -> tuple[float, int]:
    """(how long a short batch may wait for company, ms; from when, monotonic ns).

    1. Company is expected when requests of this model overlap: its last batch
       held several items, or the head was queued before that batch's results
       were acked (it arrived while the batch ran). A lone sequential client
       shows neither: its next request leaves only after its answer arrived,
       after the ack. Then: (0, head_enqueue_ns), no linger.
    2. The wait counts from when the worker could first have run the head: its
       enqueue, or the last ack if it came while that batch ran (it waited for
       the worker, not for company). Clients answered by that batch send again
       about a round trip after the ack; counted from the head's enqueue, a head
       that waited through the batch would never wait for them, and two
       closed-loop clients would stay split into alternating one-item runs.
    3. The window: the profile's `linger_ms`, or longer where one more item pays
       for it: half of what it saves, `(a - b·w) / 2` with the model's fitted
       cost `(a ms per run, b ms per padded token)` and w the head's tokens (at
       most half the last batch's time: a noisy fit can exceed it). An item of
       the head's width that joins skips its own run (saves a) and adds b·w to
       this one; with one item waiting, a wait W costs it W + b·w and saves the
       joiner about a - W, so it pays while W < (a - b·w) / 2. On a GPU (b·w much
       smaller than a) that is about a/2; on a CPU where one short text costs
       about as much as the run's fixed part, nothing beyond the profile's.
       No batch of the model yet: the profile's linger, from the head's enqueue.
    4. After a batch that ran behind its target (`LastRun.behind`), at least
       BEHIND_LINGER_SHARE of its time (`linger_span_ms`): the clients it answered
       together come back within a round trip, longer than the profile's 1 ms, and
       join one batch (`still_behind`) instead of the first of them running alone.
       The wait ends as soon as they are all back (`Claimer.linger_for_more`).
    """
    if last is None:
        return linger_ms, head_enqueue_ns
    if last.items < 2 and head_enqueue_ns >= last.acked_ns:
        return 0.0, head_enqueue_ns
    a, b = cost
    return (max(linger_span_ms(linger_ms, last), min(a - b * head_tokens, last.ms) / 2),
            max(head_enqueue_ns, last.acked_ns))


def linger_left_ms(now_ns: int, since_ns: int, linger_ms: float, *, items: int, max_items: int,
                   padded_tokens: int, max_padded_tokens: int, lane_drained: bool) -> float:
    """How much longer to wait for more items before running a short batch (<= 0: run now).

    Linger only when the worker took everything its lane held (`lane_drained`)
    and the batch still has room. The wait counts from `since_ns` (the head's
    enqueue, or when the worker got free for it: `linger_window`), so lingering
    adds at most `linger_ms` to anyone's wait.
    """
    if linger_ms <= 0 or not lane_drained or items >= max_items or padded_tokens >= max_padded_tokens:
        return 0.0
    return linger_ms - (now_ns - since_ns) / 1e6


def still_behind(lane: LaneView, last: LastRun | None, linger_ms: float) -> bool:
    """The model's last batch here ran behind (`LastRun.behind`) and the lane's
    interactive head came no later than that batch's linger window after its ack
    (`linger_window`): work that waited through it, or one of the clients it
    answered sending again. A behind batch answers a backlog's clients together,
    and a closed loop of them sends again within a round trip (3-6 ms on a 2-core
    CPU); with the one-target bound again, the first one or two back ran as a batch
    of their own while the rest waited through it, so batches alternated 1-2 and 6-8
    requests, and the short ones ran at 0.74-0.93x the tokens/s of 8 merged
    (bench/README, "MiniLM saturated"). Self-limiting as `behind`: a head that comes
    later than the window is new work, judged by its own wait."""
    return (last is not None and last.behind and interactive_waits(lane)
            and lane.oldest_enqueue_ns - last.acked_ns <= linger_span_ms(linger_ms, last) * 1e6)
