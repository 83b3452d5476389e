"""Scheduling policy as tables of cases: lane choice, batch forming, cost model,
and the devices workers are bound to (the linger rule: test_linger).

Pure functions over plain data; no queue, no clock (times are given).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleet.daemon.supervisor import detect_devices
from fleet.errors import BadRequest
from fleet.runtimes.policy import (
    FILL_SLACK, FLOW_QUIET_NS, MICRO_SHARE, MIN_SAMPLES, UNMEASURED_LOAD_MS, Copies, CostModel, LinearCost,
    batch_fill_cap, batch_token_cap, choose_lane, contended, fill_flags, find_copies, form_batch, lighter_client,
    micro_items_cap, padded_tokens, runs_first, should_load_copy,
)

MS = 1_000_000  # ns


@dataclass
class Lane:
    lane: int
    model: str
    depth: int
    oldest_enqueue_ns: int
    head_batch: bool = False


NOW = 10_000 * MS
BOUND = 2_000 * MS


@pytest.mark.parametrize(
    "lanes, held, expected",
    [
        pytest.param([], set(), None, id="nothing-queued"),
        pytest.param([Lane(0, "a", 0, 0)], {"a"}, None, id="only-empty-lanes"),
        pytest.param([Lane(0, "a", 3, NOW - 10 * MS)], set(), 0, id="one-lane-not-held-is-loaded"),
        pytest.param([Lane(0, "a", 1, NOW - 500 * MS), Lane(1, "b", 1, NOW - 100 * MS)], {"b"}, 1,
                     id="held-beats-older"),
        pytest.param([Lane(0, "a", 1, NOW - 500 * MS), Lane(1, "b", 1, NOW - 100 * MS)], set(), 0,
                     id="none-held-oldest-first"),
        pytest.param([Lane(0, "a", 1, NOW - 500 * MS), Lane(1, "b", 1, NOW - 100 * MS)], {"a", "b"}, 0,
                     id="all-held-oldest-first"),
        pytest.param([Lane(0, "a", 1, NOW - 2_500 * MS), Lane(1, "b", 9, NOW - 100 * MS)], {"b"}, 0,
                     id="starving-lane-beats-held"),
        pytest.param([Lane(0, "a", 1, NOW - 2_000 * MS), Lane(1, "b", 9, NOW - 100 * MS)], {"b"}, 1,
                     id="exactly-at-bound-is-not-starving"),
        pytest.param([Lane(0, "a", 1, NOW - 3_000 * MS), Lane(1, "b", 1, NOW - 5_000 * MS),
                      Lane(2, "c", 1, NOW - 10 * MS)], {"a", "c"}, 1, id="most-starved-first"),
        pytest.param([Lane(0, "a", 0, NOW - 9_000 * MS), Lane(1, "b", 2, NOW - 10 * MS)], {"a"}, 1,
                     id="drained-lane-ignored"),
        pytest.param([Lane(0, "a", 5, NOW - 500 * MS, True), Lane(1, "b", 1, NOW - 10 * MS)], {"a"}, 1,
                     id="interactive-beats-held-batch-work"),
        pytest.param([Lane(0, "a", 5, NOW - 9_000 * MS, True), Lane(1, "b", 1, NOW - 10 * MS)], set(), 1,
                     id="batch-work-waiting-past-the-bound-is-not-starving"),
        pytest.param([Lane(0, "a", 5, NOW - 900 * MS, True), Lane(1, "b", 5, NOW - 10 * MS, True)], {"b"}, 1,
                     id="batch-work-only-held-first"),
        pytest.param([Lane(0, "a", 5, NOW - 900 * MS, True), Lane(1, "b", 5, NOW - 10 * MS, True)], set(), 0,
                     id="batch-work-only-oldest-first"),
        pytest.param([Lane(0, "a", 1, NOW - 2_500 * MS), Lane(1, "b", 5, NOW - 10 * MS, True)], {"b"}, 0,
                     id="starving-interactive-beats-held-batch-work"),
    ],
)
def test_choose_lane(lanes, held, expected):
    got = choose_lane(lanes, held, NOW, BOUND)
    assert (got.lane if got else None) == expected


def test_choose_lane_never_starves_a_lane():
    # A worker that holds "hot" and always finds it busy still serves "cold"
    # once cold's head has waited past the bound, and not before.
    cold_enqueued = 0
    served_cold_at = None
    for t in range(0, 5_000, 100):
        now = t * MS
        lanes = [Lane(0, "cold", 1, cold_enqueued), Lane(1, "hot", 50, now - 5 * MS)]
        if choose_lane(lanes, {"hot"}, now, BOUND).model == "cold":
            served_cold_at = t
            break
    assert served_cold_at == 2_100


@pytest.mark.parametrize(
    "tokens, attempts, max_items, max_padded, expected",
    [
        pytest.param([], [], 8, 100, [], id="empty"),
        pytest.param([10], [0], 8, 5, [0], id="head-over-budget-runs-alone"),
        pytest.param([10, 10, 10], [0, 0, 0], 8, 100, [0, 1, 2], id="all-fit"),
        pytest.param([10, 10, 10, 10], [0, 0, 0, 0], 2, 1_000, [0, 1], id="item-cap"),
        pytest.param([10, 10, 10, 10], [0, 0, 0, 0], 8, 30, [0, 1, 2], id="padded-cap"),
        pytest.param([10, 90, 10, 10], [0, 0, 0, 0], 8, 100, [0, 2, 3], id="long-item-goes-back"),
        pytest.param([10, 90, 10, 10], [0, 0, 0, 0], 8, 400, [0, 2, 3], id="long-item-outside-band-even-if-it-fits"),
        pytest.param([10, 30, 10, 39], [0, 0, 0, 0], 8, 400, [0, 1, 2, 3], id="within-4x-band-all-run"),
        pytest.param([50, 10, 10, 50, 10], [0, 0, 0, 0, 0], 8, 150, [0, 3], id="short-items-not-padded-to-long-head"),
        pytest.param([2000] + [20] * 15, [0] * 16, 256, 32768, [0], id="long-head-runs-without-shorts"),
        pytest.param([20] * 3 + [2000] + [20] * 3, [0] * 7, 256, 32768, [0, 1, 2, 4, 5, 6], id="long-item-waits-a-round"),
        pytest.param([10, 20, 30], [0, 0, 0], 8, 60, [0, 1], id="narrowest-width-on-tie"),
        pytest.param([10, 10, 10], [1, 0, 0], 8, 100, [0], id="suspect-head-runs-alone"),
        pytest.param([10, 10, 10, 10], [0, 2, 0, 0], 8, 100, [0, 2, 3], id="later-suspect-goes-back"),
        pytest.param([0, 0, 0], [0, 0, 0], 8, 2, [0, 1], id="empty-payloads-count-one-row"),
        pytest.param([5, 5], [0, 0], 1, 100, [0], id="max-items-one"),
    ],
)
def test_form_batch(tokens, attempts, max_items, max_padded, expected):
    keep = form_batch(tokens, attempts, max_items, max_padded)
    assert keep == expected
    assert keep == sorted(keep)


I, B = False, True  # an interactive item, a batch item


@pytest.mark.parametrize(
    "tokens, batch, max_items, max_padded, max_fill, expected",
    [
        pytest.param([10, 10, 10, 10], [I, I, B, B], 8, 1_000, None, [0, 1, 2, 3], id="batch-fills-the-rest"),
        pytest.param([10, 10, 10, 10], [I, B, B, I], 3, 1_000, None, [0, 1, 3], id="interactive-first-at-item-cap"),
        pytest.param([10, 10, 10, 10, 10], [I, I, B, B, B], 8, 1_000, 30, [0, 1, 2], id="fill-cap-bounds-batch-work"),
        pytest.param([10, 10, 10], [I, I, B], 8, 1_000, 5, [0, 1], id="fill-cap-never-drops-interactive"),
        pytest.param([10, 30, 30, 5, 5, 5, 5, 5], [I, I, I, B, B, B, B, B], 8, 1_000, None, [0, 1, 2],
                     id="band-with-most-interactive-beats-more-items"),
        pytest.param([10, 10, 10], [B, B, B], 8, 1_000, 0, [0], id="batch-head-runs-under-a-zero-fill"),
        pytest.param([10, 10, 10], [B, B, B], 8, 1_000, None, [0, 1, 2], id="batch-work-alone-takes-the-budget"),
        pytest.param([10, 10, 10], [I, B, B], 8, 1_000, 20, [0, 1], id="padded-fill"),
    ],
)
def test_form_batch_with_batch_work(tokens, batch, max_items, max_padded, max_fill, expected):
    assert form_batch(tokens, [0] * len(tokens), max_items, max_padded, batch=batch,
                      max_fill_tokens=max_fill) == expected


@pytest.mark.parametrize(
    "cap, interactive, recent, fit, expected",
    [
        pytest.param(4_096, 0, 0, (1.0, 0.05), 4_096, id="batch-work-alone-whole-budget"),
        pytest.param(4_096, 0, 0, None, 4_096, id="batch-work-alone-unfitted"),
        # CPU-like (time grows with tokens): 40 interactive tokens cost 3 ms; 1.25 x 3 ms = 3.75 ms -> 55 tokens.
        pytest.param(4_096, 40, 0, (1.0, 0.05), 55, id="cpu-fill-a-quarter-more-time"),
        # GPU-like (fixed cost dominates): 5.04 ms -> 6.3 ms -> 1 300 tokens.
        pytest.param(4_096, 40, 0, (5.0, 0.001), 1_300, id="gpu-fill-rides-along"),
        pytest.param(1_000, 40, 0, (5.0, 0.001), 1_000, id="never-past-the-cap"),
        pytest.param(4_096, 0, 40, (1.0, 0.05), 0, id="cpu-batch-only-round-head-only"),
        pytest.param(4_096, 0, 400, (1.0, 0.05), 85, id="cpu-batch-only-quarter-of-a-big-interactive-batch"),
        pytest.param(4_096, 40, 0, None, 50, id="unfitted-by-tokens"),
        pytest.param(4_096, 40, 0, (3.0, 0.0), 50, id="flat-cost-by-tokens"),
        pytest.param(4_096, 0, 40, (3.0, 0.0), 10, id="flat-cost-batch-only-by-tokens"),
    ],
)
def test_batch_fill_cap(cap, interactive, recent, fit, expected):
    assert batch_fill_cap(cap, interactive, recent, fit) == expected
    assert FILL_SLACK == 0.25  # the table's numbers


def test_form_batch_stays_within_budget_unless_alone():
    import random

    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 40)
        tokens = [rng.randint(1, 200) for _ in range(n)]
        attempts = [0 if rng.random() > 0.1 else 1 for _ in range(n)]
        max_items, max_padded = rng.randint(1, 16), rng.randint(50, 2_000)
        keep = form_batch(tokens, attempts, max_items, max_padded)
        assert keep[0] == 0, "the head always runs"
        if len(keep) > 1:
            kept = [tokens[i] for i in keep]
            assert len(keep) <= max_items
            assert padded_tokens(kept) <= max_padded
            assert all(attempts[i] == 0 for i in keep), "suspects run alone"
            assert min(kept) * 4 > max(kept), "rows within the padding band"


def fitted(samples, decay=0.9):
    cost = CostModel(decay=decay)
    for x, y in samples:
        cost.observe(x, y)
    return cost


@pytest.mark.parametrize(
    "samples, a, b",
    [
        pytest.param([], 0.0, 0.0, id="no-samples"),
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 2.0, 0.05, id="exact-line"),
        pytest.param([(300, 30.0)] * 5, 0.0, 0.1, id="one-size-only-charges-tokens"),
        pytest.param([(100, 9.0), (200, 8.0), (300, 7.0)], 8.0, 0.0, id="falling-time-is-flat"),
        # sum(xy) / sum(xx) = 9400 / 140000
        pytest.param([(100, 1.0), (200, 12.0), (300, 23.0)], 0.0, 0.06714, id="negative-intercept-through-origin"),
    ],
)
def test_cost_model_fit(samples, a, b):
    # decay 1: plain least squares, so the expected values are textbook ones.
    got_a, got_b = fitted(samples, decay=1.0).fit()
    assert got_a == pytest.approx(a, abs=1e-3)
    assert got_b == pytest.approx(b, abs=1e-3)


def test_cost_model_follows_a_device_that_slows_down():
    cost = fitted([(x, 1.0 + 0.01 * x) for x in (100, 200, 300, 400)] * 5)
    assert cost.predict_ms(1_000) == pytest.approx(11.0, rel=1e-6)
    for x in (100, 200, 300, 400) * 10:  # now twice as slow per token
        cost.observe(x, 1.0 + 0.02 * x)
    assert cost.predict_ms(1_000) == pytest.approx(21.0, rel=0.02)


@pytest.mark.parametrize(
    "samples, target_ms, max_padded, expected",
    [
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 0.0, 5_000, 5_000, id="no-target"),
        # Before MIN_SAMPLES: the first batch is its head alone, then the target at the
        # mean time a token took (decayed sums: 50 x 290 / 18.3 tokens).
        pytest.param([], 50.0, 5_000, 1, id="no-samples"),
        pytest.param([(100, 7.0), (200, 12.0)], 50.0, 5_000, 792, id="too-few-samples"),
        pytest.param([(100, 7.0), (200, 12.0)], 1_000.0, 5_000, 5_000, id="too-few-samples-profile-caps"),
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 52.0, 5_000, 1_000, id="target-caps"),
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 1_000.0, 5_000, 5_000, id="profile-caps"),
        # a = 2 ms, b = 0.05 ms/token. A target below the fixed cost cannot be met by
        # shrinking batches: full budget (it used to shrink them to one item).
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 1.0, 5_000, 5_000, id="target-below-fixed-cost"),
        # Room of 1 ms = 20 tokens, but never below a/b = 40 tokens (half efficiency).
        pytest.param([(100, 7.0), (200, 12.0), (400, 22.0)], 3.0, 5_000, 40, id="floor-at-half-efficiency"),
        pytest.param([(100, 9.0), (200, 8.0), (300, 7.0)], 5.0, 5_000, 5_000, id="flat-cost-no-cap"),
    ],
)
def test_batch_token_cap(samples, target_ms, max_padded, expected):
    assert MIN_SAMPLES == 3
    assert batch_token_cap(fitted(samples), target_ms, max_padded) == expected


@pytest.mark.parametrize("tokens, expected", [([], 0), ([5], 5), ([3, 9, 4], 27)])
def test_padded_tokens(tokens, expected):
    assert padded_tokens(tokens) == expected


# -- which devices the workers get (daemon.supervisor.detect_devices, GPU count injected) --


@pytest.mark.parametrize(
    "device, workers, gpus, expected",
    [
        pytest.param("auto", 0, 0, ["cpu"], id="no-gpu-one-cpu-worker"),
        pytest.param("auto", 3, 0, ["cpu"] * 3, id="no-gpu-n-cpu-workers"),
        pytest.param("auto", 0, 2, ["cuda:0", "cuda:1"], id="one-per-gpu"),
        pytest.param("auto", 3, 2, ["cuda:0", "cuda:1", "cuda:0"], id="round-robin"),
        pytest.param("cuda", 0, 1, ["cuda:0"], id="cuda-any"),
        pytest.param("cuda:1", 0, 2, ["cuda:1"], id="one-gpu-named"),
        pytest.param("cuda:1", 2, 2, ["cuda:1", "cuda:1"], id="two-workers-on-one-gpu"),
        pytest.param("cpu", 0, 4, ["cpu"], id="cpu-even-with-gpus"),
        pytest.param("cpu", 2, 4, ["cpu", "cpu"], id="cpu-n-workers"),
    ],
)
def test_detect_devices(device, workers, gpus, expected):
    assert detect_devices(device, workers, gpu_count=lambda: gpus) == expected


@pytest.mark.parametrize(
    "device, workers, gpus, message",
    [
        pytest.param("cuda", 0, 0, "no NVIDIA GPU", id="cuda-without-gpu"),
        pytest.param("cuda:2", 0, 2, "does not exist", id="gpu-index-out-of-range"),
        pytest.param("tpu", 0, 0, "--device must be", id="unknown-device"),
        pytest.param("cuda:x", 0, 1, "--device must be", id="bad-index"),
        pytest.param("cpu", -1, 0, "--workers", id="negative-workers"),
    ],
)
def test_detect_devices_refuses(device, workers, gpus, message):
    with pytest.raises(BadRequest, match=message):
        detect_devices(device, workers, gpu_count=lambda: gpus)


# -- copies across workers: the herd rule ------------------------------------------------

FIT = LinearCost(a_ms=4.0, b_ms_per_token=0.01)  # 10k queued tokens: 104 ms of work


@pytest.mark.parametrize("queued_tokens, holders, cost, load_ms, expected", [
    (0, 0, None, 500.0, True),  # nobody holds it: someone must load it
    (10, 0, FIT, 500.0, True),
    (10_000, 1, FIT, 500.0, False),  # the holder drains 104 ms sooner than a 500 ms load ends
    (10_000, 1, FIT, 100.0, True),  # more queued than a load takes: a second copy pays
    (10_000, 2, FIT, 100.0, False),  # ... unless two holders share it (52 ms each)
    (30_000, 2, FIT, 100.0, True),  # 304 ms of work > 2 x 100 ms
    (1 << 30, 1, None, 1.0, False),  # no fitted cost: the backlog is unknown, leave it to the holder
])
def test_should_load_copy(queued_tokens, holders, cost, load_ms, expected):
    assert should_load_copy(queued_tokens, holders, cost, load_ms) is expected


def test_should_load_copy_takes_a_worker_cost_model():
    cost = CostModel()
    for tokens in (1000, 2000, 4000, 8000):
        cost.observe(tokens, 2.0 + 0.001 * tokens)  # 2 ms + 1 ms per 1k tokens
    assert should_load_copy(60_000, 1, cost, 50.0) is True  # 62 ms > 50 ms
    assert should_load_copy(40_000, 1, cost, 50.0) is False  # 42 ms < 50 ms


def _held(name: str, *, load_ms: float = 0.0, samples: int = 0, a_ms: float = 0.0, b_1k: float = 0.0) -> dict:
    return {name: {"load_ms": load_ms, "cost": {"a_ms": a_ms, "b_ms_per_1k_tokens": b_1k, "samples": samples}}}


@pytest.mark.parametrize("infos, announced, expected", [
    ([], None, Copies(0, None, UNMEASURED_LOAD_MS)),
    # Another model held, and a blob without models (a worker that just registered).
    ([(1, {"models": _held("other", load_ms=90.0)}), (2, {})], None, Copies(0, None, UNMEASURED_LOAD_MS)),
    # Two holders: the longest measured load; the fit of the one with the most samples.
    ([(1, {"models": _held("m", load_ms=300.0, samples=5, a_ms=8.0, b_1k=10.0)}),
      (2, {"models": _held("m", load_ms=250.0, samples=9, a_ms=6.0, b_1k=12.0)})],
     None, Copies(2, LinearCost(6.0, 0.012), 300.0)),
    # A holder with too few batches publishes no usable fit; names-only blobs count too.
    ([(1, {"models": _held("m", load_ms=120.0, samples=MIN_SAMPLES - 1, a_ms=1.0, b_1k=1.0)}),
      (2, {"models": {"m": {}}})], None, Copies(2, None, 120.0)),
    # A worker loading it counts as a holder before it has measured anything.
    ([(3, {"models": {}, "loading": "m", "loading_since_ns": 50})], None, Copies(1, None, UNMEASURED_LOAD_MS)),
    # After announcing (since 100 ns, worker 5): only loaders that announced first count.
    ([(3, {"loading": "m", "loading_since_ns": 50})], (100, 5), Copies(1, None, UNMEASURED_LOAD_MS)),
    ([(3, {"loading": "m", "loading_since_ns": 150})], (100, 5), Copies(0, None, UNMEASURED_LOAD_MS)),
    ([(3, {"loading": "m", "loading_since_ns": 100})], (100, 5), Copies(1, None, UNMEASURED_LOAD_MS)),  # tie: lower wid
    ([(7, {"loading": "m", "loading_since_ns": 100})], (100, 5), Copies(0, None, UNMEASURED_LOAD_MS)),
])
def test_find_copies(infos, announced, expected):
    assert find_copies(infos, "m", announced=announced) == expected


@pytest.mark.parametrize("seen, expected", [
    ({}, False),
    ({7: 100}, False),  # one client: its batches as large as the budget allows
    ({7: 100, 9: 100}, True),  # two clients current
    ({7: 100, 9: 100 - FLOW_QUIET_NS}, False),  # the other one went quiet
])
def test_contended(seen, expected):
    assert contended(seen, 200) is expected


@pytest.mark.parametrize("seen, sizes, expected", [
    ({7: 100}, {7: 550}, False),  # the batch's own client only
    ({7: 100, 9: 100}, {7: 550, 9: 158}, True),  # another client of shorter requests: cut
    ({7: 100, 9: 100}, {7: 550, 9: 550}, False),  # two floods of equal requests: no cut
    ({7: 100, 9: 100}, {7: 550, 9: 900}, False),  # the other's requests are longer
    ({7: 100, 9: 100}, {7: 550}, True),  # the other never measured here: counts as shorter
    ({7: 100, 9: 100 - FLOW_QUIET_NS}, {7: 550, 9: 158}, False),  # the shorter one went quiet
])
def test_lighter_client(seen, sizes, expected):
    assert lighter_client(seen, sizes, {7}, 550, 200) is expected


@pytest.mark.parametrize("other, heaviest, expected", [
    (40, 2_080, True),  # a light client beside a flood's batch
    (2_080, 2_080, False),  # an equal request: the batch running keeps its turn
    (2_000, 2_080, True),
    (2_100, 2_080, False),  # a longer one never runs between
])
def test_runs_first(other, heaviest, expected):
    assert runs_first(other, heaviest) is expected


@pytest.mark.parametrize("flows, batch, expected", [
    ([], [], []),
    ([1, 1, 1], [False, False, False], [False, False, False]),  # one client: nothing is filler
    ([2, 1, 2, 1], [False, False, False, False], [False, True, False, True]),  # the head's client first
    ([1, 1, 2], [False, True, False], [False, True, True]),  # batch work fills whoever's it is
])
def test_fill_flags(flows, batch, expected):
    assert fill_flags(flows, batch) == expected


@pytest.mark.parametrize("samples, target_ms, tokens, rows, expected", [
    # 1 ms a token, target 128 ms: a micro-batch of MICRO_SHARE (16 ms) is 16 tokens:
    # 4 texts of 4 tokens, 1 of 16, never below one.
    ([(16, 16.0), (64, 64.0)] * 2, 128.0, 64, 16, 4),
    ([(16, 16.0), (64, 64.0)] * 2, 128.0, 64, 4, 1),
    ([(16, 16.0), (64, 64.0)] * 2, 128.0, 6400, 16, 1),
    # A fixed cost that dominates (a GPU): 20 ms + 0.001 ms a token misses the 16 ms
    # alone: no cap; 10 ms + 0.001 ms a token: never below a/b tokens (10 000), so a
    # batch of 64 texts of 4 tokens is not cut.
    ([(100, 20.1), (1_000, 21.0)] * 2, 128.0, 256, 64, None),
    ([(1_000, 11.0), (5_000, 15.0)] * 2, 128.0, 256, 64, 2_500),
    ([(16, 16.0)] * (MIN_SAMPLES - 1), 128.0, 64, 16, None),  # not fitted yet
    ([(16, 16.0), (64, 64.0)] * 2, 0.0, 64, 16, None),  # no target
    ([(16, 16.0), (64, 64.0)] * 2, 128.0, 64, 0, None),  # requests that name no inputs
])
def test_micro_items_cap(samples, target_ms, tokens, rows, expected):
    assert MICRO_SHARE == 0.125
    assert micro_items_cap(fitted(samples), target_ms, tokens, rows) == expected


@pytest.mark.parametrize("samples, fixed, tokens, rows, expected", [
    # A CPU whose forward costs 15 ms before its tokens (174 tokens at 0.088 ms a token)
    # and whose batches fit a = 33 ms: the share (31.25 ms of 250) buys 355 - 174 = 181
    # padded tokens: 3 texts of 50 tokens (the fit's a alone, 33 ms, used to leave it uncut).
    ([(1_000, 121.0), (3_000, 297.0)] * 2, 174.0, 800, 16, 3),
    # A share under two fixed costs: never fewer than MICRO_FLOOR of the fixed cost's
    # tokens (150: 3 texts of 50, a forward two thirds fixed cost).
    ([(1_000, 121.0), (3_000, 297.0)] * 2, 300.0, 800, 16, 3),
    ([(1_000, 121.0), (3_000, 297.0)] * 2, 500.0, 800, 16, 5),  # 250 tokens: 5 texts
    ([(1_000, 121.0), (3_000, 121.0)] * 2, 174.0, 800, 16, None),  # no slope: nothing to size by
    ([(16, 16.0)] * (MIN_SAMPLES - 1), 174.0, 800, 16, None),  # not fitted yet
])
def test_micro_items_cap_by_a_forwards_fixed_cost(samples, fixed, tokens, rows, expected):
    cost = fitted(samples)
    assert cost.samples < MIN_SAMPLES or cost.fit()[0] > 250.0 * MICRO_SHARE or expected is None
    assert micro_items_cap(cost, 250.0, tokens, rows, fixed) == expected
