"""The linger rule as tables of cases (`runtimes.linger`): how long a short batch
waits for company, and when a lane counts as still behind.

Pure functions over plain data; no queue, no clock (times are given).
"""

from __future__ import annotations

import pytest

from fleet.runtimes.linger import LastRun, linger_left_ms, linger_window, still_behind
from fleet.runtimes.policy import behind
from tests.test_policy import MS, Lane


@pytest.mark.parametrize(
    "waited_ms, linger_ms, items, padded, drained, expected",
    [
        pytest.param(0.0, 0.0, 1, 10, True, 0.0, id="no-linger-configured"),
        pytest.param(0.0, 5.0, 1, 10, True, 5.0, id="fresh-short-batch-lingers"),
        pytest.param(2.0, 5.0, 1, 10, True, 3.0, id="counted-from-head-enqueue"),
        pytest.param(7.0, 5.0, 1, 10, True, -2.0, id="head-waited-longer-than-linger"),
        pytest.param(0.0, 5.0, 1, 10, False, 0.0, id="lane-not-drained"),
        pytest.param(0.0, 5.0, 8, 10, True, 0.0, id="batch-full-by-items"),
        pytest.param(0.0, 5.0, 2, 1_000, True, 0.0, id="batch-full-by-tokens"),
    ],
)
def test_linger_left_ms(waited_ms, linger_ms, items, padded, drained, expected):
    now = 50_000 * MS
    got = linger_left_ms(now, now - int(waited_ms * MS), linger_ms, items=items, max_items=8,
                         padded_tokens=padded, max_padded_tokens=1_000, lane_drained=drained)
    assert got == pytest.approx(expected)


#: The last batch: acked at 1 000 ms, 8 requests, 900 ms, run behind its target (its
#: clients count as coming back for 2 % of that: 18 ms).
BEHIND_RUN = LastRun(1_000 * MS, 8, 900.0, behind=True)


@pytest.mark.parametrize("last, head_ms, depth, head_batch, expected", [
    (BEHIND_RUN, 1_003, 1, False, True),  # one of the clients it answered, sending again 3 ms after
    (BEHIND_RUN, 1_018, 1, False, True),  # at the window's end
    (BEHIND_RUN, 1_019, 1, False, False),  # later: new work, judged by its own wait
    (BEHIND_RUN, 400, 5, False, True),  # waited through that batch
    (BEHIND_RUN, 1_003, 0, False, False),  # nothing waits
    (BEHIND_RUN, 1_003, 1, True, False),  # batch work at the head never counts
    (LastRun(1_000 * MS, 8, 900.0), 1_003, 1, False, False),  # the last batch kept the target
    (None, 1_003, 1, False, False),  # no batch of the model here yet
])
def test_still_behind(last, head_ms, depth, head_batch, expected):
    assert still_behind(Lane(0, "m", depth, head_ms * MS, head_batch), last, 1.0) is expected


@pytest.mark.parametrize("last, head_ms, expected", [
    (BEHIND_RUN, 1_003, (18.0, 1_003 * MS)),  # 2 % of the behind batch, from the head's arrival
    (LastRun(1_000 * MS, 8, 900.0), 1_003, (1.0, 1_003 * MS)),  # the profile's linger otherwise
    (LastRun(1_000 * MS, 8, 20.0, behind=True), 1_003, (1.0, 1_003 * MS)),  # 2 % of 20 ms is under it
    (LastRun(1_000 * MS, 1, 900.0, behind=True), 1_003, (0.0, 1_003 * MS)),  # a lone sequential client
    (None, 1_003, (1.0, 1_003 * MS)),
])
def test_linger_window(last, head_ms, expected):
    # A CPU's fit: a = 50 ms, b = 0.08 ms a token; the head's 1 100 tokens cost more than a.
    assert linger_window(1.0, last, head_ms * MS, 1_100, (50.0, 0.08)) == pytest.approx(expected)


@pytest.mark.parametrize("depth, head_batch", [(0, False), (3, True)], ids=["empty", "batch-work-only"])
def test_behind_and_still_behind_judge_only_interactive_work(depth, head_batch):
    # An hour-old head: behind by its wait, and within the window of a behind batch
    # acked after it. Neither rule counts a lane without interactive work.
    lane = Lane(0, "m", depth, 0, head_batch)
    assert not behind(lane, 3_600_000 * MS, 250.0)
    assert not still_behind(lane, LastRun(3_600_000 * MS, 8, 900.0, behind=True), 1.0)
    interactive = Lane(0, "m", 1, 0)
    assert behind(interactive, 3_600_000 * MS, 250.0)
    assert still_behind(interactive, LastRun(3_600_000 * MS, 8, 900.0, behind=True), 1.0)
