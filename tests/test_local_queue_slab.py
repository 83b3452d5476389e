"""local_queue's slab keeps finished work: results always have room, a block fits
its bytes exactly, and a large payload gets its turn when small ones fragment
the slab. One process, real shared memory."""

from __future__ import annotations

import os

import pytest

from fleet.local_queue import LocalQueue, QueueFull

LONG = 3_600_000  # ms: a lease that never runs out during a test
SLAB = 64 << 10


@pytest.fixture
def q():
    queue = LocalQueue.create(slots=2048, slab_bytes=SLAB, max_lanes=4, max_workers=2)
    yield queue
    queue.close()
    queue.unlink()


def free_bytes(q) -> int:
    return q.usage().slab_free_bytes


def fill(q, lane, size: int, first_rid: int) -> int:
    """Put `size`-byte payloads one by one until the queue refuses: how many went in."""
    n = 0
    while True:
        try:
            q.put(lane, b"p" * size, tokens=1, request_id=first_rid + n)
        except QueueFull:
            return n
        n += 1


@pytest.mark.parametrize("k", [6, 10, 12, 14])
def test_a_payload_of_exactly_2_to_the_k_bytes_takes_a_2_to_the_k_block(q, k):
    lane = q.lane_id("m")
    before = free_bytes(q)
    q.put(lane, os.urandom(1 << k), tokens=1, request_id=1)
    assert before - free_bytes(q) == 1 << k
    # Several items of one call share a block that fits their sum exactly.
    q.put_many(lane, [b"a" * 1024] * 4, tokens=[1] * 4, request_ids=[2, 3, 4, 5])
    assert before - free_bytes(q) == (1 << k) + 4096
    q.check()


def test_results_always_have_room_however_full_producers_keep_the_slab(q):
    lane = q.lane_id("m")
    w = q.register_worker(os.getpid(), "cpu")
    result = b"r" * 2048  # 64 items' results would be 128 KiB: twice the whole slab
    rid = fill(q, lane, 256, 0)
    assert rid > 100  # producers filled the slab up to its result reserve
    acked = 0
    for rnd in range(400):  # bounded: each round frees what it acks
        claims = q.claim(lane, worker=w, max_items=64, max_tokens=1 << 40, lease_ms=LONG, result_bytes=len(result))
        if not claims:
            break
        # The claim took only what the slab can hold results for; every ack fits.
        assert len(claims) < 64
        assert q.ack_many([(c.item_id, result, 0) for c in claims]) == [True] * len(claims)
        acked += len(claims)
        del claims
        got = q.wait_results(0)
        assert all(d.result == result for d in got)
        if rnd < 100:  # producers refill whatever the collected results freed
            fill(q, lane, 256, 10_000 + 100 * rnd)
    assert acked > rid and q.depth() == 0, (acked, q.depth())
    u = q.usage()
    assert u.slab_free_bytes == u.slab_bytes and u.slots_free == u.slots
    q.check()


def test_a_claim_with_no_room_for_any_result_takes_nothing_until_results_are_collected(q):
    lane = q.lane_id("m")
    w = q.register_worker(os.getpid(), "cpu")
    q.put_many(lane, [b"x"] * 4, tokens=[1] * 4, request_ids=[0, 1, 2, 3])
    big = SLAB // 2  # half the slab per result
    (c0,) = q.claim(lane, worker=w, max_items=1, max_tokens=1, lease_ms=LONG, result_bytes=big)
    assert q.ack(c0.item_id, b"y" * big)
    del c0
    # The first result is not collected yet: no block of `big` is left, so nothing is claimed.
    assert q.claim(lane, worker=w, max_items=4, max_tokens=10, lease_ms=LONG, result_bytes=big) == []
    assert q.depth() == 3
    assert len(q.wait_results(0)) == 1
    (c1,) = q.claim(lane, worker=w, max_items=4, max_tokens=10, lease_ms=LONG, result_bytes=big)
    assert c1.request_id == 1 and q.ack(c1.item_id, b"z" * big)
    del c1
    q.check()


def test_the_lanes_largest_result_is_set_aside_by_default(q):
    lane = q.lane_id("m")
    w = q.register_worker(os.getpid(), "cpu")
    q.put_many(lane, [b"x"] * 3, tokens=[1] * 3, request_ids=[0, 1, 2])
    (c0,) = q.claim(lane, worker=w, max_items=1, max_tokens=1, lease_ms=LONG)
    assert q.ack(c0.item_id, b"r" * 4096)  # the lane's first result: allocated at ack
    del c0
    q.wait_results(0)
    before = free_bytes(q)
    claims = q.claim(lane, worker=w, max_items=2, max_tokens=10, lease_ms=LONG)
    assert before - free_bytes(q) == 2 * 4096  # set aside at claim: 4 KiB per item
    assert q.ack_many([(c.item_id, b"s" * 4096, 0) for c in claims]) == [True, True]
    del claims
    assert [d.result for d in q.wait_results(0)] == [b"s" * 4096] * 2
    assert free_bytes(q) == SLAB
    q.check()


def test_returned_and_lost_claims_end_their_result_space(q):
    lane = q.lane_id("m")
    w = q.register_worker(os.getpid(), "cpu")
    q.put_many(lane, [b"x"] * 4, tokens=[1] * 4, request_ids=[0, 1, 2, 3])
    claims = q.claim(lane, worker=w, max_items=4, max_tokens=10, lease_ms=1, result_bytes=1024)
    assert free_bytes(q) < SLAB - 4096
    assert q.return_items([claims[0].item_id, claims[1].item_id]) == 2
    assert q.expire_leases(1 << 62) == 2  # the other two lose their lease
    # Their worker still acks them (it does not know): refused, and the space is let go.
    assert q.ack_many([(c.item_id, b"late", 0) for c in claims[2:]]) == [False, False]
    del claims
    assert free_bytes(q) == SLAB - 64  # only the four payloads (one shared block)
    u = q.usage()
    assert u.slots_free == u.slots - 4
    q.check()


def test_a_large_payload_gets_its_turn_when_small_ones_fragment_the_slab(q):
    lane = q.lane_id("m")
    w = q.register_worker(os.getpid(), "cpu")
    n = fill(q, lane, 64, 0)  # one 64-byte block each
    assert n == SLAB // 64 * 7 // 8
    # Every other small payload finishes: free space is plentiful, but in 64-byte holes.
    claims = q.claim(lane, worker=w, max_items=n, max_tokens=1 << 40, lease_ms=LONG, result_bytes=0)
    assert q.ack_many([(c.item_id, b"", 0) for c in claims[::2]]) == [True] * len(claims[::2])
    q.wait_results(0)
    rest = claims[1::2]
    del claims
    big = b"B" * (SLAB // 4)
    assert free_bytes(q) - len(big) > SLAB // 8  # room enough, counting the result reserve
    with pytest.raises(QueueFull, match="no slab block big enough"):
        q.put(lane, big, tokens=1, request_id=-1)
    # Small producers keep coming while consumers finish the rest in order: the small
    # ones wait behind the large one, which gets its room as soon as one merges.
    rid, small_refused, steps = 10_000, 0, 0
    while True:
        try:
            q.put(lane, b"s" * 64, tokens=1, request_id=rid)
            rid += 1
        except QueueFull as exc:
            assert "larger payload waits" in exc.message
            small_refused += 1
        try:
            q.put(lane, big, tokens=1, request_id=-1)
            break
        except QueueFull:
            pass
        assert rest, "the large payload never got its turn"
        c = rest.pop(0)
        assert q.ack(c.item_id, b"")
        del c
        q.wait_results(0)
        steps += 1
    assert small_refused == steps + 1 and rid == 10_000  # not one small payload went first
    # Its turn taken, small payloads go in again at once.
    q.put(lane, b"s" * 64, tokens=1, request_id=rid)
    del rest
    q.check()
