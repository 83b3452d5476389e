"""Batch work below interactive work, on the daemon's side: `Broker.run(batch=True)`
queues behind interactive items and is promoted once it waited past its bound
(a real shared-memory queue, the real broker on a real event loop; no worker)."""

from __future__ import annotations

import asyncio

import pytest

from fleet.daemon.broker import Broker
from fleet.local_queue import LocalQueue


@pytest.fixture
def queue():
    q = LocalQueue.create(slots=64, slab_bytes=1 << 18)
    yield q
    q.close()
    q.unlink()


def test_batch_work_waiting_past_its_bound_is_promoted(queue):
    async def scenario() -> list[bool]:
        broker = Broker(queue, max_depth=100, max_attempts=3, batch_max_wait_ms=200)
        broker.start(asyncio.get_running_loop())
        seen = []
        try:
            waiting = asyncio.ensure_future(broker.run("m", b"batch", tokens=1, timeout_s=30, batch=True))
            await asyncio.sleep(0.05)
            seen.append(queue.lane_stats()[0].head_batch)  # queued as batch work
            await asyncio.sleep(0.4)  # past the bound, and the sweep every 50 ms
            seen.append(queue.lane_stats()[0].head_batch)  # promoted: interactive now
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            seen.append(queue.depth() == 0)  # a withdrawn request leaves its lane
        finally:
            broker.stop()
        return seen

    assert asyncio.run(scenario()) == [True, False, True]
