"""Worker-side scheduling policy: plain functions over plain data (STYLE.md 3).

Times are monotonic nanoseconds; token counts are estimates written by the
daemon at put time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class LaneView(Protocol):
    lane: int
    model: str
    depth: int
    oldest_enqueue_ns: int


def choose_lane(lanes: Iterable[LaneView], held: set[str], now_ns: int, max_wait_ns: int) -> LaneView | None:
    """The lane this worker should serve next, or None when nothing waits.

    1. A lane whose oldest item has waited past `max_wait_ns` is starving: serve
       the most starved one, held or not (bounded wait, no lane starves).
    2. Otherwise prefer lanes of models this worker already holds (no load).
    3. Among those (or among all, if it holds none of them), the lane whose
       oldest item has waited longest.
    """
    waiting = [lane for lane in lanes if lane.depth > 0]
    if not waiting:
        return None
    oldest = min(waiting, key=lambda lane: lane.oldest_enqueue_ns)
    if now_ns - oldest.oldest_enqueue_ns > max_wait_ns:
        return oldest
    mine = [lane for lane in waiting if lane.model in held]
    return min(mine, key=lambda lane: lane.oldest_enqueue_ns) if mine else oldest


def form_batch(tokens: Sequence[int], max_items: int, max_tokens: int) -> int:
    """How many of the claimed items (in order) to run now; the rest go back.

    Always at least one, so an item bigger than the budget still runs (alone).
    """
    total = 0
    for count, t in enumerate(tokens[:max_items]):
        total += t
        if count and total > max_tokens:
            return count
    return min(len(tokens), max_items)
