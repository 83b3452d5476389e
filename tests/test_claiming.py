"""runtimes.claiming.ack_all: a batch's answers in one ack, and what happens when the
queue has no room for some of them (every worker path acks through it: the step loop's
batches, generation rounds and the decisions run beside them)."""

from __future__ import annotations

import msgspec

from fleet.local_queue import LocalQueue
from fleet.messages import STATUS_ERROR, STATUS_OK, Envelope
from fleet.runtimes.claiming import ack_all


def test_results_that_do_not_fit_are_answered_overloaded_each_once() -> None:
    q = LocalQueue.create(slots=8, slab_bytes=1 << 16)
    try:
        lane = q.lane_id("m")
        worker = q.register_worker(1, "cpu")

        def batch(rids: list[int], result: bytes) -> dict:
            q.put_many(lane, [b"a"] * len(rids), tokens=[1] * len(rids), request_ids=rids)
            claims = q.claim(lane, worker=worker, max_items=8, max_tokens=1 << 20, lease_ms=60_000)
            assert [c.request_id for c in claims] == rids
            ack_all(q, [(c.item_id, result, STATUS_OK) for c in claims], [c.item_id for c in claims], "w0", "m")
            done = q.wait_results(1.0)
            assert sorted(d.request_id for d in done) == rids  # each answered, once
            return {d.request_id: d for d in done}

        # Two results of 40 KiB are more than the 64 KiB slab holds: the batch is answered
        # `overloaded`, item by item, and the worker goes on.
        for d in batch([1, 2], b"r" * (40 << 10)).values():
            error = msgspec.msgpack.decode(bytes(d.result), type=Envelope).body
            assert d.status == STATUS_ERROR and error[0] == "overloaded" and "queue memory is full" in error[1]
        # Results that fit are acked as they are.
        assert [(d.status, bytes(d.result)) for d in batch([3, 4], b"ok").values()] == [(STATUS_OK, b"ok")] * 2
        assert q.depth() == 0
    finally:
        q.close()
        q.unlink()
