"""local_queue in one process: scenarios, then a stateful model check (hypothesis).

Cross-process behaviour (spawned workers, SIGKILL, lock-holder death) is in
test_local_queue_procs.py.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fleet.local_queue import (
    STATUS_EXPIRED,
    STATUS_POISON,
    ItemTooLarge,
    LocalQueue,
    LockBusy,
    QueueError,
    QueueFull,
    UnknownWorker,
    put_id,
)
from fleet.local_queue.layout import INFO_BYTES

LONG = 3_600_000  # ms: a lease that never runs out during a test
FOREVER_NS = 1 << 62  # an expire_leases "now" past every lease


@pytest.fixture
def q():
    queue = LocalQueue.create(slots=256, slab_bytes=1 << 18, max_lanes=8, max_workers=4)
    yield queue
    queue.close()
    queue.unlink()


def put_all(q, lane, rids, *, size=16, tokens=1, deadline_ns=0):
    return q.put_many(lane, [bytes([r % 256]) * size for r in rids], tokens=[tokens] * len(rids),
                      request_ids=list(rids), deadline_ns=deadline_ns)


def rids_of(claims):
    return [c.request_id for c in claims]


def take(q, lane, wid, n=1000, tokens=1 << 40, lease_ms=LONG):
    return q.claim(lane, worker=wid, max_items=n, max_tokens=tokens, lease_ms=lease_ms)


def all_results(q):
    out = {}
    for d in q.wait_results(0):
        assert d.request_id not in out
        out[d.request_id] = d
    return out


# -- scenarios ------------------------------------------------------------------

def test_each_lane_is_fifo_and_payloads_round_trip(q):
    a, b = q.lane_id("embed-a"), q.lane_id("embed-b")
    for r in range(10):
        q.put(a if r % 2 else b, b"payload-%d" % r, tokens=1, request_id=r)
    w = q.register_worker(1, "cpu")
    ca, cb = take(q, a, w), take(q, b, w)
    assert rids_of(ca) == [1, 3, 5, 7, 9] and rids_of(cb) == [0, 2, 4, 6, 8]
    assert [bytes(c.payload) for c in ca] == [b"payload-%d" % r for r in (1, 3, 5, 7, 9)]
    assert all(c.lane == a and c.attempts == 0 for c in ca)
    assert q.depth() == 0


def test_claim_respects_max_items_and_max_tokens_but_always_gives_one(q):
    lane = q.lane_id("m")
    for r, t in enumerate([3, 3, 3, 10, 1, 1]):
        q.put(lane, b"x", tokens=t, request_id=r)
    w = q.register_worker(1, "cpu")
    assert rids_of(take(q, lane, w, n=10, tokens=7)) == [0, 1]  # 3+3; a third would be 9
    assert rids_of(take(q, lane, w, n=1, tokens=100)) == [2]
    assert rids_of(take(q, lane, w, n=10, tokens=5)) == [3]  # 10 tokens alone, over budget
    assert rids_of(take(q, lane, w, n=10, tokens=5)) == [4, 5]
    assert take(q, lane, w) == []
    with pytest.raises(ValueError):
        take(q, lane, w, n=0)
    with pytest.raises(ValueError):
        take(q, lane, w, lease_ms=1 << 62)


def test_returned_items_go_back_to_the_head_in_lane_order(q):
    lane = q.lane_id("m")
    put_all(q, lane, range(8))
    w1, w2 = q.register_worker(1, "cpu"), q.register_worker(2, "cpu")
    c1 = take(q, lane, w1, n=2)  # 0, 1
    c2 = take(q, lane, w2, n=3)  # 2, 3, 4
    # Returned out of order, by two workers: the lane still reads 1, 3, 4, 5, ...
    assert q.return_items([c2[2].item_id, c2[1].item_id]) == 2
    assert q.return_items([c1[1].item_id]) == 1
    assert q.return_items([c1[1].item_id]) == 0  # already back
    again = take(q, lane, w1)
    assert rids_of(again) == [1, 3, 4, 5, 6, 7]
    assert all(c.attempts == 0 for c in again)
    assert q.lane_stats()[0].claimed == 8


def test_batch_work_queues_behind_interactive_work_and_fills_the_rest(q):
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    q.put_many(lane, [b"b"] * 3, tokens=[1] * 3, request_ids=[10, 11, 12], batch=True)
    assert q.lane_stats()[0].head_batch
    put_all(q, lane, [0, 1])  # interactive, after the batch items were put: ahead of them
    q.put(lane, b"b", tokens=1, request_id=13, batch=True)
    put_all(q, lane, [2])
    assert not q.lane_stats()[0].head_batch
    first = take(q, lane, w, n=4)
    assert rids_of(first) == [0, 1, 2, 10] and [c.batch for c in first] == [False, False, False, True]
    # A returned interactive item goes back ahead of the batch items still queued.
    assert q.return_items([first[1].item_id, first[3].item_id]) == 2
    assert rids_of(take(q, lane, w)) == [1, 10, 11, 12, 13]
    q.check()


def test_promote_moves_a_batch_item_among_interactive_ones_by_put_order(q):
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    put_all(q, lane, [0])
    [b1, b2] = q.put_many(lane, [b"b", b"b"], tokens=[1, 1], request_ids=[10, 11], batch=True)
    put_all(q, lane, [1, 2])
    assert q.promote([b2, b2 + (1 << 24)]) == 1  # a wrong generation is skipped
    assert q.promote([b2]) == 0  # no longer batch work
    got = take(q, lane, w)
    assert rids_of(got) == [0, 11, 1, 2, 10]  # 11 was put before 1 and 2
    assert [c.batch for c in got] == [False, False, False, False, True]
    assert q.promote([b1]) == 0  # claimed, not queued
    q.check()


def test_a_flow_that_sends_little_goes_ahead_of_a_flow_with_a_backlog(q):
    # Start-time fair queueing (invariant 2): flow 1 queues 6 items of 10 tokens;
    # flow 2's item starts at the lane's virtual time, ahead of flow 1's later items.
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    q.put_many(lane, [b"h"] * 6, tokens=[10] * 6, request_ids=[0, 1, 2, 3, 4, 5], flow=1)
    assert rids_of(take(q, lane, w, n=1)) == [0]  # the lane's virtual time is now 0
    q.put(lane, b"l", tokens=10, request_id=100, flow=2)
    assert rids_of(take(q, lane, w, n=2)) == [100, 1]  # 100 starts at 0, before 1 (10)
    # Flow 2 sent again at once: its finish time (10) is its next start, behind 1, ahead of 2 (20).
    q.put(lane, b"l", tokens=10, request_id=101, flow=2)
    q.put(lane, b"l", tokens=30, request_id=102, flow=3)  # a new flow starts at the virtual time (10)
    got = take(q, lane, w)
    assert rids_of(got) == [101, 102, 2, 3, 4, 5]
    # Returned items go back to their places; one flow's items keep their put order.
    assert q.return_items([got[3].item_id, got[0].item_id, got[5].item_id]) == 3
    assert rids_of(take(q, lane, w)) == [101, 3, 5]
    q.check()


def test_head_flow_names_the_client_a_claim_would_take_next(q):
    # The hint a worker reads between micro-batches (runtimes.worker.interject): the
    # head's (flow, tokens) when it is interactive work, None for an empty lane or batch work.
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    assert q.head_flow(lane) is None
    q.put_many(lane, [b"b"], tokens=[1], request_ids=[10], batch=True)
    assert q.head_flow(lane) is None
    q.put_many(lane, [b"h"] * 3, tokens=[10] * 3, request_ids=[0, 1, 2], flow=1)
    assert q.head_flow(lane) == (1, 10)
    take(q, lane, w, n=1)
    q.put(lane, b"l", tokens=4, request_id=20, flow=2)  # ahead of flow 1's backlog
    assert q.head_flow(lane) == (2, 4)
    assert rids_of(take(q, lane, w, n=1)) == [20] and q.head_flow(lane) == (1, 10)


def test_first_other_flow_finds_a_client_behind_the_running_clients_requests(q):
    # The other hint (runtimes.worker.interject, `behind`): the first interactive item of
    # a flow not in `flows`, when only interactive items of `flows` are ahead of it,
    # within `look` places; None past batch work, past `look`, or in an empty lane.
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    assert q.first_other_flow(lane, {1}, 4) is None
    q.put_many(lane, [b"h"] * 3, tokens=[10] * 3, request_ids=[0, 1, 2], flow=1)  # keys 0, 10, 20
    q.put_many(lane, [b"b"], tokens=[1], request_ids=[10], batch=True)
    assert q.first_other_flow(lane, {1}, 4) is None  # flow 1 only, then batch work
    assert q.first_other_flow(lane, {2}, 4) == (0, 1, 10)  # the head itself
    take(q, lane, w, n=1)  # the lane's time is 0 now
    # Flow 2 was served lately (a request of 15 tokens, withdrawn): its next starts at 15.
    assert q.cancel(q.put(lane, b"x", tokens=15, request_id=19, flow=2))
    q.put(lane, b"l", tokens=4, request_id=20, flow=2)
    assert q.head_flow(lane) == (1, 10) and q.first_other_flow(lane, {1}, 4) == (1, 2, 4)
    assert q.first_other_flow(lane, {1}, 1) is None  # not within one place
    assert q.first_other_flow(lane, {1, 2}, 4) is None  # only `flows`, then batch work
    assert rids_of(take(q, lane, w, n=4)) == [1, 20, 2, 10]
    q.check()


def test_fair_places_hold_with_batch_work_behind_and_after_promotion(q):
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    [b1] = q.put_many(lane, [b"b"], tokens=[1], request_ids=[10], batch=True)
    q.put_many(lane, [b"h"] * 3, tokens=[5] * 3, request_ids=[0, 1, 2], flow=1)
    q.put(lane, b"l", tokens=5, request_id=20, flow=2)  # starts at 0 with flow 1's first
    assert rids_of(take(q, lane, w, n=2)) == [0, 20]  # virtual time 0: same start, put order
    q.put(lane, b"l", tokens=5, request_id=21, flow=2)  # flow 2 finished at 5: starts at 5 with 1
    assert q.promote([b1]) == 1  # a batch item past its bound takes the virtual time (0): first
    got = take(q, lane, w)
    assert rids_of(got) == [10, 1, 21, 2] and [c.batch for c in got] == [False] * 4
    q.check()


def test_an_idle_flows_finish_time_is_forgotten_not_charged(q):
    # A flow's finish time only matters while it is ahead of the lane's virtual time:
    # past it, the flow starts at the virtual time again (and the producer may drop it).
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    q.put_many(lane, [b"a"] * 3, tokens=[100] * 3, request_ids=[0, 1, 2], flow=1)  # flow 1 finishes at 300
    take(q, lane, w)  # virtual time 200
    q.put_many(lane, [b"b"] * 4, tokens=[100] * 4, request_ids=[10, 11, 12, 13], flow=2)  # 200 .. 500
    assert rids_of(take(q, lane, w, n=2)) == [10, 11]  # virtual time 300
    q.put(lane, b"a", tokens=1, request_id=3, flow=1)  # flow 1: max(300, 300) = 300, ahead of 12 (400)
    assert rids_of(take(q, lane, w)) == [3, 12, 13]
    q._forget_idle_flows()
    assert q._flows == {(lane, 2): 600}  # flow 1 finished at 301 <= virtual time 400
    q.check()


def test_cancel_removes_only_queued_items(q):
    lane = q.lane_id("m")
    ids = put_all(q, lane, range(3), size=1000)
    w = q.register_worker(1, "cpu")
    claimed = take(q, lane, w, n=1)
    assert q.cancel(ids[1]) is True
    assert q.cancel(ids[1]) is False  # already gone
    assert q.cancel(ids[0]) is False  # claimed
    assert q.cancel(claimed[0].item_id) is False
    assert q.cancel(ids[2] + (1 << 24)) is False  # same slot, other generation
    assert q.depth() == 1
    assert rids_of(take(q, lane, w)) == [2]
    assert q.wait_results(0) == []  # a cancelled item produces no result


def test_items_past_their_deadline_complete_as_expired(q):
    lane = q.lane_id("m")
    past = time.monotonic_ns() - 1
    put_all(q, lane, [0, 1], deadline_ns=past)
    put_all(q, lane, [2], deadline_ns=time.monotonic_ns() + 60 * 10**9)
    put_all(q, lane, [3])
    w = q.register_worker(1, "cpu")
    got = take(q, lane, w)
    assert rids_of(got) == [2, 3]
    assert got[0].deadline_ns > past and got[1].deadline_ns == 0
    res = all_results(q)
    assert {r: (d.status, d.result) for r, d in res.items()} == {0: (STATUS_EXPIRED, b""), 1: (STATUS_EXPIRED, b"")}
    assert q.depth() == 0


def test_lease_expiry_requeues_at_the_head_and_poisons_at_max_attempts(q):
    lane = q.lane_id("m")
    (pid,) = put_all(q, lane, [7])
    put_all(q, lane, [8])
    w = q.register_worker(1, "cpu")
    for attempt in range(3):
        c = take(q, lane, w, n=1)
        assert rids_of(c) == [7] and c[0].attempts == attempt
        assert q.expire_leases(time.monotonic_ns()) == 0  # lease not run out yet
        assert q.expire_leases(FOREVER_NS, max_attempts=3) == 1
    res = all_results(q)
    assert list(res) == [7] and res[7].status == STATUS_POISON and res[7].result == b""
    assert res[7].item_id == pid
    assert rids_of(take(q, lane, w)) == [8]


def test_an_ack_after_the_lease_was_lost_is_rejected(q):
    lane = q.lane_id("m")
    put_all(q, lane, [1])
    w1, w2 = q.register_worker(1, "cpu"), q.register_worker(2, "cpu")
    (old,) = take(q, lane, w1)
    assert q.expire_leases(FOREVER_NS) == 1
    (new,) = take(q, lane, w2)
    assert put_id(new.item_id) == put_id(old.item_id) and new.item_id != old.item_id
    assert q.ack(old.item_id, b"late") is False
    assert q.return_items([old.item_id]) == 0
    assert q.ack(new.item_id, b"fresh") is True
    assert q.ack(new.item_id, b"twice") is False
    res = all_results(q)
    assert res[1].result == b"fresh" and res[1].status == 0
    assert q.wait_results(0) == []


def test_acks_cannot_use_the_queues_own_statuses(q):
    lane = q.lane_id("m")
    put_all(q, lane, [1])
    w = q.register_worker(1, "cpu")
    (c,) = take(q, lane, w)
    for status in (STATUS_EXPIRED, STATUS_POISON, 256, -1):
        with pytest.raises(ValueError):
            q.ack(c.item_id, b"r", status=status)
    assert q.ack(c.item_id, b"r", status=249) is True


def test_an_ack_after_the_lease_ran_out_but_before_expiry_counts(q):
    lane = q.lane_id("m")
    put_all(q, lane, [1])
    w = q.register_worker(1, "cpu")
    (c,) = take(q, lane, w, lease_ms=1)
    time.sleep(0.01)
    assert q.ack(c.item_id, b"ok", status=1) is True  # nobody took it away
    assert q.expire_leases() == 0
    assert all_results(q)[1].status == 1


def test_slab_exhaustion_raises_queue_full_then_recovers(q):
    lane = q.lane_id("m")
    big = b"b" * 16384
    n = 0
    with pytest.raises(QueueFull) as e:
        while True:
            q.put(lane, big, tokens=1, request_id=n)
            n += 1
    assert isinstance(e.value, QueueError) and "slab" in e.value.message  # the daemon maps it to 429
    # 16 KiB payloads take 16 KiB blocks (the block fits exactly); 1/8 is kept for results.
    assert n == (1 << 18) // 16384 * 7 // 8 and q.depth() == n
    with pytest.raises(QueueFull):  # all or nothing: the small one is not kept either
        q.put_many(lane, [b"s", big], tokens=[1, 1], request_ids=[100, 101])
    assert q.depth() == n
    w = q.register_worker(1, "cpu")
    for c in take(q, lane, w, n=2):
        assert q.ack(c.item_id, b"")
    assert len(q.wait_results(0)) == 2
    q.put(lane, big, tokens=1, request_id=200)
    for c in take(q, lane, w):
        assert q.ack(c.item_id, b"done")
    assert len(q.wait_results(0)) == n - 1
    u = q.usage()
    assert u.slab_free_bytes == u.slab_bytes and u.slots_free == u.slots
    q.check()


def test_slot_exhaustion_raises_queue_full():
    q = LocalQueue.create(slots=4, slab_bytes=1 << 16)
    try:
        lane = q.lane_id("m")
        put_all(q, lane, range(4))
        with pytest.raises(QueueFull):
            q.put(lane, b"x", tokens=1, request_id=9)
        assert q.usage().slots_free == 0 and q.depth() == 4
    finally:
        q.close()
        q.unlink()


def test_out_of_range_numbers_are_refused_before_anything_is_queued(q):
    lane = q.lane_id("m")
    for kw in (dict(tokens=[1, -1], request_ids=[1, 2]), dict(tokens=[1, 1], request_ids=[1, 1 << 63])):
        with pytest.raises(ValueError):
            q.put_many(lane, [b"a", b"b"], **kw)
    with pytest.raises(ValueError):
        q.put(lane, b"a", tokens=1, request_id=1, deadline_ns=-5)
    assert q.depth() == 0 and q.usage().slots_free == 256


def test_a_payload_larger_than_the_slab_can_never_fit(q):
    lane = q.lane_id("m")
    with pytest.raises(ItemTooLarge) as e:
        q.put(lane, b"x" * ((1 << 18) + 1), tokens=1, request_id=1)
    assert isinstance(e.value, QueueError) and "largest block" in e.value.message  # the daemon: 413
    assert q.depth() == 0


def test_lane_names_and_limits(q):
    name = "é" * 64  # 128 bytes of utf-8
    lane = q.lane_id(name)
    assert q.lane_id(name) == lane and q.lane_name(lane) == name
    with pytest.raises(ValueError):
        q.lane_id("é" * 64 + "x")
    with pytest.raises(ValueError):
        q.lane_id("")
    with pytest.raises(KeyError):
        q.lane_id("unknown", create=False)
    with pytest.raises(ValueError):
        q.put(99, b"x", tokens=1, request_id=1)
    for i in range(7):
        q.lane_id(f"m{i}")
    with pytest.raises(QueueFull):
        q.lane_id("one-too-many")
    other = LocalQueue.attach(q.name)  # another handle learns the names from shm
    try:
        assert other.lane_id("m3", create=False) == q.lane_id("m3")
        assert other.lane_name(lane) == name
    finally:
        other.close()


@contextmanager
def lock_held_elsewhere(q):
    """The queue lock held by another thread of this process until the block ends."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        with q._lock:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(5)
        yield
    finally:
        release.set()
        holder.join(5)


def test_a_claim_on_an_empty_lane_does_not_wait_for_the_lock(q):
    # A worker's follow-up claim usually finds its lane empty: it answers from a
    # lock-free read instead of waiting for whoever holds the lock.
    empty, busy = q.lane_id("empty"), q.lane_id("busy")
    put_all(q, busy, [1])
    w = q.register_worker(1, "cpu")
    with lock_held_elsewhere(q):
        with q.no_wait():  # inside, a call that would wait for the lock raises LockBusy
            assert take(q, empty, w) == []
            with pytest.raises(LockBusy):
                take(q, busy, w)
            with pytest.raises(UnknownWorker):
                take(q, empty, w + 1)
    assert rids_of(take(q, busy, w)) == [1]


def test_a_put_or_collect_that_must_not_wait_raises_lock_busy_and_changes_nothing(q):
    """The event loop's put and collect (`wait=False`): while another thread holds the
    lock each raises LockBusy at once, nothing put and nothing taken; both go through
    once it is let go."""
    lane = q.lane_id("m")
    w = q.register_worker(1, "cpu")
    put_all(q, lane, [1])
    (claim,) = take(q, lane, w)
    assert q.ack_many([(claim.item_id, b"result", 0)]) == [True]
    with lock_held_elsewhere(q):
        with pytest.raises(LockBusy):
            q.put(lane, b"x" * 100, tokens=1, request_id=2, wait=False)
        with pytest.raises(LockBusy):
            q.put(lane, b"x" * (1 << 17), tokens=1, request_id=3, wait=False)  # copied outside: never waits
        with pytest.raises(LockBusy):
            q.collect(wait=False)
    assert q.depth() == 0
    assert [(d.request_id, d.result) for d in q.collect(wait=False)] == [(1, b"result")]
    q.put(lane, b"x" * 100, tokens=1, request_id=2, wait=False)
    assert rids_of(take(q, lane, w)) == [2]


def test_lane_stats_report_busy_lanes(q):
    a, b, _ = q.lane_id("a"), q.lane_id("b"), q.lane_id("idle")
    t0 = time.monotonic_ns()
    put_all(q, a, [1, 2, 3], tokens=5)
    put_all(q, b, [4], tokens=7)
    w = q.register_worker(1, "cpu")
    take(q, b, w)
    stats = {s.model: s for s in q.lane_stats()}
    assert set(stats) == {"a", "b"}
    assert (stats["a"].depth, stats["a"].tokens, stats["a"].claimed) == (3, 15, 0)
    assert (stats["b"].depth, stats["b"].tokens, stats["b"].claimed) == (0, 0, 1)
    assert stats["a"].oldest_enqueue_ns >= t0 and stats["b"].oldest_enqueue_ns == 0
    assert q.depth() == 3


def test_workers_register_report_and_release(q):
    lane = q.lane_id("m")
    put_all(q, lane, range(5))
    w = q.register_worker(4242, "cuda:0")
    q.set_worker_info(w, b"\x81\xa6models\x90")
    got = take(q, lane, w, n=3)
    (info,) = q.workers()
    assert (info.wid, info.pid, info.device, info.claimed, info.info) == (w, 4242, "cuda:0", 3, b"\x81\xa6models\x90")
    with pytest.raises(ValueError):
        q.set_worker_info(w, b"x" * (INFO_BYTES + 1))
    assert q.release_worker(w) == 3
    assert q.workers() == [] and q.heartbeat(w) is False
    with pytest.raises(UnknownWorker):
        take(q, lane, w)
    assert q.ack(got[0].item_id, b"late") is False
    w2 = q.register_worker(4243, "cpu")
    assert w2 != w
    again = take(q, lane, w2)
    assert rids_of(again) == [0, 1, 2, 3, 4] and [c.attempts for c in again] == [1, 1, 1, 0, 0]
    q.unregister_worker(w2)
    assert q.workers() == []
    for _ in range(4):
        q.register_worker(1, "cpu")
    with pytest.raises(QueueFull):
        q.register_worker(1, "cpu")


def test_heartbeat_and_renew_extend_leases(q):
    lane = q.lane_id("m")
    put_all(q, lane, [1, 2])
    w = q.register_worker(1, "cpu")
    take(q, lane, w, n=1, lease_ms=1000)
    t_claimed = time.monotonic_ns()
    time.sleep(0.05)
    assert q.heartbeat(w) is True
    # Without the heartbeat the lease would have run out at t_claimed + 1000 ms.
    assert q.expire_leases(t_claimed + 1_010_000_000) == 0
    assert q.renew(w, 5000) == 1
    assert q.expire_leases(time.monotonic_ns() + 4_000_000_000) == 0
    assert q.expire_leases(time.monotonic_ns() + 6_000_000_000) == 1


def test_wait_for_work_wakes_on_put_and_times_out(q):
    lane = q.lane_id("m")
    t = time.monotonic()
    assert q.wait_for_work(0.1) is False
    assert 0.09 <= time.monotonic() - t < 1.0
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((q.wait_for_work(10.0), time.monotonic())))
    waiter.start()
    time.sleep(0.1)
    t = time.monotonic()
    q.put(lane, b"x", tokens=1, request_id=1)
    waiter.join(5)
    assert woke and woke[0][0] is True and woke[0][1] - t < 1.0
    assert q.wait_for_work(0) is True


def test_wait_for_work_since_a_generation_waits_for_new_work_only(q):
    lane = q.lane_id("m")
    q.put(lane, b"not mine", tokens=1, request_id=1)
    gen = q.work_generation()
    assert q.wait_for_work(0.05, since=gen) is False  # queued, but nothing new
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((q.wait_for_work(10.0, since=gen), time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    assert not woke
    t = time.monotonic()
    q.put(lane, b"new", tokens=1, request_id=2)
    waiter.join(5)
    assert woke and woke[0][0] is True and woke[0][1] - t < 1.0
    w = q.register_worker(1, "cpu")
    (c, _) = take(q, lane, w)
    gen = q.work_generation()
    q.return_items([c.item_id])  # a return makes work claimable too
    assert q.wait_for_work(0, since=gen) is True


def test_new_work_wakes_every_waiting_worker_not_just_one(q):
    lane = q.lane_id("m")
    gen = q.work_generation()
    woke = []
    waiters = [threading.Thread(target=lambda: woke.append(q.wait_for_work(10.0, since=gen))) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.2)
    q.put(lane, b"one item", tokens=1, request_id=1)  # the one woken first may not want it
    for t in waiters:
        t.join(5)
    assert woke == [True, True, True]


def test_wait_results_wakes_on_ack(q):
    lane = q.lane_id("m")
    put_all(q, lane, [5])
    w = q.register_worker(1, "cpu")
    (c,) = take(q, lane, w)
    got = []
    waiter = threading.Thread(target=lambda: got.extend(q.wait_results(10.0)))
    waiter.start()
    time.sleep(0.1)
    t = time.monotonic()
    q.ack(c.item_id, b"r")
    waiter.join(5)
    assert time.monotonic() - t < 1.0
    assert [(d.request_id, d.result) for d in got] == [(5, b"r")]


def _child_round_trip(handle, name: str) -> None:
    # `handle` arrived pickled (it re-attaches by name); `name` is the plain-string way.
    q = LocalQueue.attach(name)
    lane = q.lane_id("from-child")
    q.put_many(lane, [b"c0", b"c1"], tokens=[1, 1], request_ids=[10, 11])
    w = handle.register_worker(0, "cpu")
    for c in handle.claim(handle.lane_id("from-parent"), worker=w, max_items=10, max_tokens=100, lease_ms=LONG):
        handle.ack(c.item_id, bytes(c.payload).upper())
    q.close()
    handle.close()


def test_a_spawned_process_attaches_by_name(q):
    put_all(q, q.lane_id("from-parent"), [1], size=3)
    proc = mp.get_context("spawn").Process(target=_child_round_trip, args=(q, q.name))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    res = all_results(q)
    assert res[1].result == bytes([1]) * 3
    w = q.register_worker(0, "cpu")
    assert rids_of(take(q, q.lane_id("from-child"), w)) == [10, 11]
    again = pickle.loads(pickle.dumps(q))
    assert again.name == q.name and again.depth() == 0
    again.close()


def test_attach_refuses_what_is_not_a_queue(q):
    with pytest.raises(FileNotFoundError):
        LocalQueue.attach("fleet-q-does-not-exist")
    with pytest.raises(ValueError):
        LocalQueue.attach("../etc/passwd")


def test_unlink_removes_every_named_object():
    q = LocalQueue.create()
    name = q.name
    q.close()
    q.unlink()
    import os

    assert not any(f.startswith(name) for f in os.listdir("/dev/shm"))
    with pytest.raises(FileNotFoundError):
        LocalQueue.attach(name)


# -- stateful model ---------------------------------------------------------------

SLOTS, SLAB = 48, 1 << 17
RESULT_MAX = 64  # results fit one 64-byte unit, so an ack never finds the slab full


class QueueModel(RuleBasedStateMachine):
    """Random put/claim/return/ack/cancel/expire against a plain model of the queue."""

    @initialize()
    def setup(self):
        self.q = LocalQueue.create(slots=SLOTS, slab_bytes=SLAB, max_lanes=3, max_workers=2)
        self.lanes = [self.q.lane_id(f"lane{i}") for i in range(3)]
        self.wid = self.q.register_worker(1, "cpu")
        self.next_rid = 0
        self.items = {}  # rid -> dict(lane, payload, tokens, expired, attempts, put_id, batch, key)
        self.queued = {lane: [] for lane in self.lanes}  # rid lists in lane order; put order == rid order
        # Fair queueing (invariant 2): each lane's virtual time, each (lane, flow)'s finish time.
        self.vtime = {lane: 0 for lane in self.lanes}
        self.finish = {}
        self.held = {}  # claim id -> (rid, short lease)
        self.stale = []  # claim ids no longer held
        self.expect = {}  # rid -> (status, result) not yet collected
        self.finished = set()  # rids done (collected) or cancelled: never seen again

    def teardown(self):
        q = getattr(self, "q", None)
        if q is None:
            return
        try:
            self.drain_and_verify()
        finally:
            self.held.clear()
            q.close()
            q.unlink()

    def drain_and_verify(self):
        q = self.q
        self.ack_some([True] * len(self.held))
        # A worker acks (or returns) every claim it got, held or lost: that ends the
        # result space its claims set aside.
        assert not any(q.ack_many([(cid, b"late", 0) for cid in self.stale]))
        for lane in self.lanes:
            for _ in range(100):  # results are collected as they come, as the daemon does
                if not self.queued[lane]:
                    break
                self.claim(lane, 64, 1 << 40, False)
                self.ack_some([True] * len(self.held))
                self.collect()
            assert not self.queued[lane]
        self.collect()
        assert set(self.items) == self.finished
        u = q.usage()
        assert u.slab_free_bytes == u.slab_bytes and u.slots_free == u.slots and q.depth() == 0
        q.check()

    @rule(lane=st.integers(0, 2), sizes=st.lists(st.one_of(st.integers(0, 300), st.integers(1000, 20000)),
                                                min_size=1, max_size=6),
          tokens=st.integers(0, 40), expired=st.booleans(), batch=st.booleans(), flow=st.integers(0, 2))
    def put(self, lane, sizes, tokens, expired, batch, flow):
        lane = self.lanes[lane]
        u = self.q.usage()
        rids = list(range(self.next_rid, self.next_rid + len(sizes)))
        payloads = [bytes([r % 251]) * n for r, n in zip(rids, sizes)]
        # Keep room for every held item's result (RESULT_MAX each), see RESULT_MAX.
        if u.slab_free_bytes - sum(max(64, 1 << (n - 1).bit_length()) for n in sizes if n) < 64 * SLOTS:
            with pytest.raises(QueueFull):
                self.q.put_many(lane, payloads + [b"z" * (u.slab_free_bytes + 1)],
                                tokens=[1] * (len(sizes) + 1), request_ids=rids + [-1])
            assert self.q.usage() == u  # all or nothing
            return
        try:
            ids = self.q.put_many(lane, payloads, tokens=[tokens] * len(sizes), request_ids=rids,
                                  deadline_ns=1 if expired else 0, batch=batch, flow=flow)
        except QueueFull:  # too few slots, or no block big enough
            assert self.q.usage() == u
            return
        self.next_rid += len(sizes)
        key = max(self.vtime[lane], self.finish.get((lane, flow), 0))
        for r, p, i in zip(rids, payloads, ids):
            self.items[r] = dict(lane=lane, payload=p, tokens=tokens, expired=expired, attempts=0, put_id=i,
                                 batch=batch, key=float("inf") if batch else key, flow=flow)
            if not batch:
                key += max(1, tokens)
            self.queued[lane].append(r)
        if not batch:
            self.finish[(lane, flow)] = key
        self._sort(lane)

    def _sort(self, lane):
        """A lane's order (invariant 2): interactive items by (virtual start time, put
        order), then batch items by put order."""
        self.queued[lane].sort(key=lambda r: (self.items[r]["key"], r))

    @rule(which=st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
    def promote(self, which):
        live = [r for r in self.items if r not in self.finished]
        if not live:
            return
        rids = list(dict.fromkeys(live[w % len(live)] for w in which))
        want = [r for r in rids if self.items[r]["batch"] and r in self.queued[self.items[r]["lane"]]]
        assert self.q.promote([self.items[r]["put_id"] for r in rids]) == len(want)
        for r in want:
            lane = self.items[r]["lane"]
            self.items[r].update(batch=False, key=self.vtime[lane])
            self._sort(lane)

    @rule(lane=st.integers(0, 2), max_items=st.integers(1, 8), max_tokens=st.integers(1, 120),
          short=st.booleans())
    def claim_rule(self, lane, max_items, max_tokens, short):
        self.claim(self.lanes[lane], max_items, max_tokens, short)

    def claim(self, lane, max_items, max_tokens, short):
        # Model: expired items at the head complete; then a prefix within the budget,
        # shortened to what the slab can hold results for (each claimed item sets
        # aside the lane's largest result so far).
        got = self.q.claim(lane, worker=self.wid, max_items=max_items, max_tokens=max_tokens,
                           lease_ms=1 if short else LONG)
        want, left, tok = [], list(self.queued[lane]), 0
        while left and len(want) < max_items:
            it = self.items[left[0]]
            if it["expired"]:
                self.expect[left.pop(0)] = (STATUS_EXPIRED, b"")
                continue
            if want and tok + it["tokens"] > max_tokens or len(want) == len(got):
                break
            tok += it["tokens"]
            want.append(left.pop(0))
        assert rids_of(got) == want, (rids_of(got), want, self.q.usage())
        keys = [self.items[r]["key"] for r in want if not self.items[r]["batch"]]
        self.vtime[lane] = max([self.vtime[lane], *keys])
        for c in got:
            it = self.items[c.request_id]
            assert bytes(c.payload) == it["payload"] and c.attempts == it["attempts"] and c.batch == it["batch"]
            assert c.flow == it["flow"]
            assert put_id(c.item_id) == it["put_id"]
            self.held[c.item_id] = (c.request_id, short)
        self.queued[lane] = left

    def _requeue(self, rid):
        lane = self.items[rid]["lane"]
        self.queued[lane].append(rid)
        self._sort(lane)

    @precondition(lambda self: self.held)
    @rule(pick=st.lists(st.booleans(), min_size=1, max_size=20))
    def return_some(self, pick):
        chosen = [cid for cid, p in zip(list(self.held), pick) if p]
        assert self.q.return_items(chosen + self.stale[-2:]) == len(chosen)
        for cid in chosen:
            rid, _ = self.held.pop(cid)
            self.stale.append(cid)
            self._requeue(rid)

    @precondition(lambda self: self.held)
    @rule(pick=st.lists(st.booleans(), min_size=1, max_size=20), status=st.integers(0, 3),
          rsize=st.integers(0, RESULT_MAX))
    def ack_some(self, pick, status=0, rsize=8):
        chosen = [cid for cid, p in zip(list(self.held), pick) if p]
        batch = [(cid, bytes([self.held[cid][0] % 7]) * rsize, status) for cid in chosen]
        stale = [(cid, b"stale", 0) for cid in self.stale[-2:]]
        before = self.q.usage()
        try:
            got = self.q.ack_many(batch + stale)
        except QueueFull:  # all or nothing; then the documented fallback, empty results
            assert self.q.usage() == before
            batch = [(cid, b"", stt) for cid, _, stt in batch]
            got = self.q.ack_many(batch + stale)
        assert got == [True] * len(batch) + [False] * len(stale)
        for cid, res, stt in batch:
            rid, _ = self.held.pop(cid)
            self.stale.append(cid)
            self.expect[rid] = (stt, res)

    @rule(which=st.integers(0, 10**6), stale=st.booleans())
    def cancel(self, which, stale):
        live = [r for r in self.items if r not in self.finished]
        if not live:
            return
        rid = live[which % len(live)]
        it = self.items[rid]
        queued = rid in self.queued[it["lane"]]
        if stale:  # a wrong generation never touches the item
            assert self.q.cancel(it["put_id"] + (1 << 24)) is False
            return
        assert self.q.cancel(it["put_id"]) is queued
        if queued:
            self.queued[it["lane"]].remove(rid)
            self.finished.add(rid)
        elif any(r == rid for r, _ in self.held.values()):
            it["expired"] = True  # a claimed item's deadline passes: if it comes back, it expires

    @rule()
    def expire_short_leases(self):
        moved = self.q.expire_leases(time.monotonic_ns() + 50_000_000, max_attempts=3)
        lost = [cid for cid, (_, short) in self.held.items() if short]
        assert moved == len(lost)
        for cid in sorted(lost, key=lambda c: self.held[c][0]):
            rid, _ = self.held.pop(cid)
            self.stale.append(cid)
            it = self.items[rid]
            it["attempts"] += 1
            if it["attempts"] >= 3:
                self.expect[rid] = (STATUS_POISON, b"")
            else:
                self._requeue(rid)

    @rule()
    def collect(self):
        got = {}
        for d in self.q.wait_results(0):
            assert d.request_id not in got and d.request_id not in self.finished
            assert d.item_id == self.items[d.request_id]["put_id"]
            got[d.request_id] = (d.status, d.result)
        assert got == self.expect, ({k: v for k, v in got.items() if self.expect.get(k) != v}, {k: v for k, v in self.expect.items() if got.get(k) != v})
        self.finished |= set(got)
        self.expect = {}

    @invariant()
    def structure_is_consistent(self):
        if not hasattr(self, "q"):
            return
        self.q.check()
        assert self.q.depth() == sum(len(v) for v in self.queued.values())
        stats = {s.lane: s for s in self.q.lane_stats()}
        for lane in self.lanes:
            depth = len(self.queued[lane])
            claimed = sum(1 for rid, _ in self.held.values() if self.items[rid]["lane"] == lane)
            s = stats.get(lane)
            assert (s.depth, s.claimed) == (depth, claimed) if s else depth == claimed == 0
            if depth:
                assert s.head_batch == self.items[self.queued[lane][0]]["batch"]


QueueModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_queue_matches_its_model = QueueModel.TestCase
