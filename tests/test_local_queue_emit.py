"""local_queue partial results (`emit_many`): streaming pieces of a claimed item
reach the consumer before its final ack, in order, without completing it."""

from __future__ import annotations

import os

import pytest

from fleet.local_queue import LocalQueue, QueueFull

LONG = 3_600_000  # ms: a lease that never runs out during a test
PARTIAL = 2  # the caller's status value for partials (opaque to the queue)


@pytest.fixture
def q():
    queue = LocalQueue.create(slots=64, slab_bytes=1 << 16, max_lanes=4, max_workers=2)
    yield queue
    queue.close()
    queue.unlink()


def claim_one(q, rid: int = 7):
    lane = q.lane_id("gen")
    q.put(lane, b"prompt", tokens=1, request_id=rid)
    wid = q.register_worker(os.getpid(), "cpu")
    (c,) = q.claim(lane, worker=wid, max_items=1, max_tokens=100, lease_ms=LONG)
    return lane, wid, c


def test_partials_arrive_in_order_before_the_final_result_and_leave_the_item_claimed(q):
    lane, _, c = claim_one(q)
    assert q.emit_many([(c.item_id, b"he", PARTIAL), (c.item_id, b"llo", PARTIAL)]) == [True, True]
    assert q.emit(c.item_id, b" world", status=PARTIAL)
    q.check()
    (stats,) = q.lane_stats()
    assert stats.claimed == 1 and stats.depth == 0  # still the worker's
    got = q.wait_results(0)
    assert [(d.request_id, d.status, d.result) for d in got] == [(7, PARTIAL, b"he"), (7, PARTIAL, b"llo"),
                                                              (7, PARTIAL, b" world")]
    assert q.ack(c.item_id, b"hello world", status=0)
    (final,) = q.wait_results(0)
    assert (final.request_id, final.status, final.result) == (7, 0, b"hello world")
    q.check()
    usage = q.usage()
    assert usage.slots_free == usage.slots and usage.slab_free_bytes == usage.slab_bytes


def test_partials_and_final_in_one_read_keep_emit_order(q):
    _, _, c = claim_one(q)
    q.emit(c.item_id, b"a", status=PARTIAL)
    q.emit(c.item_id, b"b", status=PARTIAL)
    q.ack(c.item_id, b"ab", status=0)
    assert [d.result for d in q.wait_results(0)] == [b"a", b"b", b"ab"]


def test_a_claim_no_longer_held_publishes_nothing(q):
    lane, wid, c = claim_one(q)
    q.return_items([c.item_id])
    assert q.emit_many([(c.item_id, b"late", PARTIAL)]) == [False]
    assert q.wait_results(0) == []
    (again,) = q.claim(lane, worker=wid, max_items=1, max_tokens=100, lease_ms=LONG)
    q.ack(again.item_id, b"done", status=0)
    assert q.emit(again.item_id, b"after the end", status=PARTIAL) is False
    assert [d.result for d in q.wait_results(0)] == [b"done"]
    q.check()


def test_partials_leave_the_result_reserve_to_final_acks(q):
    lane, _, c = claim_one(q)
    # Fill the slab with payloads up to the reserve (puts refuse past it).
    while True:
        try:
            q.put(lane, b"x" * 4000, tokens=1, request_id=99)
        except QueueFull:
            break
    before = q.usage()
    with pytest.raises(QueueFull):
        q.emit(c.item_id, b"y" * 4000, status=PARTIAL)
    after = q.usage()
    assert (after.slots_free, after.slab_free_bytes, after.done) == (before.slots_free, before.slab_free_bytes, 0)
    assert q.ack(c.item_id, b"z" * 4000, status=0)  # the final result still finds room
    assert [d.request_id for d in q.wait_results(0)] == [7]
    q.check()


def test_status_and_size_are_checked_before_anything_changes(q):
    _, _, c = claim_one(q)
    with pytest.raises(ValueError):
        q.emit(c.item_id, b"a", status=300)
    assert q.wait_results(0) == [] and q.usage().done == 0


def test_results_copied_out_are_not_lost_when_the_lock_turns_busy():
    """The event loop collects inside no_wait(): a result larger than COPY_INLINE is
    taken under the lock, copied after it, and its reservation let go under the lock
    again. If that second lock is busy, the result is still returned (it was taken
    already: losing it would leave its request to time out) and the reservation is let
    go at the next collect. Fault injected: the queue's lock turns busy after the take."""
    from fleet.local_queue import LockBusy
    from fleet.local_queue.blocks import COPY_INLINE

    q = LocalQueue.create(slots=64, slab_bytes=4 << 20, max_lanes=2, max_workers=2)
    try:
        lane = q.lane_id("m")
        w = q.register_worker(os.getpid(), "cpu")
        big = os.urandom(COPY_INLINE + 4096)
        q.put(lane, b"x", tokens=1, request_id=7)
        (claim,) = q.claim(lane, worker=w, max_items=1, max_tokens=10, lease_ms=60_000)
        assert q.ack_many([(claim.item_id, big, 0)]) == [True]
        free_before = q.usage().slab_free_bytes

        real, entered = q._lock, []

        class TurnsBusy:
            def __enter__(self):
                entered.append(1)
                if len(entered) > 1:
                    raise LockBusy("held by another process (injected)")
                return real.__enter__()

            def __exit__(self, *exc):
                return real.__exit__(*exc)

            def __call__(self, fn, *args):  # the lock's call form: fn(*args) holding it
                with self:
                    return fn(*args)

        q._lock = TurnsBusy()
        try:
            with q.no_wait():
                done = q.collect()
        finally:
            q._lock = real
        assert [(d.request_id, d.result) for d in done] == [(7, big)]
        assert len(entered) == 2 and q._late_release  # the release waited
        assert q.collect() == [] and not q._late_release  # let go at the next collect
        assert q.usage().slab_free_bytes > free_before
        q.check()
    finally:
        q.close()
        q.unlink()
