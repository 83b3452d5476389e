"""The herd rule across devices, in-process: two `WorkerCore`s on two devices over
a real `local_queue`, with a fake adapter whose loads and batches take real time
(so the load time and the batch cost model are measured, not set).

Scenarios: a worker of another device leaves a model to its holder while the
holder keeps up (no second copy for a small queue), loads a copy when the queue
would keep the holder busy longer than a load takes, serves a lane that starves
whatever holds it, and, while all that waits is left to holders, blocks on the
queue's wake-ups instead of polling.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec
import pytest

from fleet.protocol import EmbedRequest
from fleet.local_queue import LocalQueue
from fleet.runtimes.base import Adapter, ModelSpec, Profile
from fleet.messages import EmbedResult
from fleet.runtimes.worker import WorkerCore

_encode = msgspec.msgpack.Encoder().encode
LOAD_S = 0.05  # a fake load: 50 ms
#: A fake batch: 1 ms + 0.01 ms per padded token (items x longest).
A_S, B_S = 0.001, 0.00001
PROFILE = Profile(max_batch_items=64, max_batch_tokens=2000)


class TimedEmbedder(Adapter):
    """Sleeps through its load and its batches; records which device loaded what."""

    request_type = EmbedRequest
    loads: list[tuple[str, str]] = []

    def load(self) -> None:
        time.sleep(LOAD_S)
        TimedEmbedder.loads.append((self.spec.name, self.device))

    def footprint_bytes(self) -> int:
        return 1000

    def run_batch(self, requests):
        longest = max(len(r.inputs[0]) for r in requests)
        time.sleep(A_S + B_S * len(requests) * longest)
        return [EmbedResult(b"v", (1, 1), 1) for _ in requests]


def resolve(name: str) -> ModelSpec:
    return ModelSpec(name, Path("/nonexistent"), "embed", "fake", profile=PROFILE)


@pytest.fixture()
def queue():
    q = LocalQueue.create(slots=1024, slab_bytes=4 << 20)
    TimedEmbedder.loads.clear()
    yield q
    q.close()
    q.unlink()


def core(queue: LocalQueue, device: str, **kw) -> WorkerCore:
    wid = queue.register_worker(os.getpid(), device)
    c = WorkerCore(queue, wid, device, resolve, adapter_for=lambda task, runtime: TimedEmbedder,
                   served_by=f"box/{wid}", **kw)
    c.publish_info()
    return c


def put(queue: LocalQueue, model: str, tokens: int, rid: int) -> None:
    # The fake batch's time follows its inputs' length; the daemon's token estimate says the same.
    queue.put(queue.lane_id(model), _encode(EmbedRequest(model=model, inputs=["x" * tokens])), tokens=tokens,
              request_id=rid)


def drain_results(queue: LocalQueue) -> int:
    return len(queue.wait_results(0.01))


def holder_of_m(queue: LocalQueue) -> WorkerCore:
    """Worker on cuda-like device 0 that loaded `m` and fitted its batch cost (3 batches)."""
    a = core(queue, "dev:0")
    for rid, tokens in enumerate((10, 500, 1500), start=1):
        put(queue, "m", tokens, rid)
        assert a.step(0.1) == 1
    drain_results(queue)
    info = msgspec.msgpack.decode(queue.workers()[0].info)
    assert info["models"]["m"]["cost"]["samples"] == 3 and info["models"]["m"]["load_ms"] >= LOAD_S * 1e3
    return a


def depth(queue: LocalQueue, model: str) -> int:
    return next(s.depth for s in queue.lane_stats() if s.model == model)


def test_a_small_queue_is_left_to_the_holder_on_another_device(queue):
    a = holder_of_m(queue)
    b = core(queue, "dev:1")
    for rid in range(10, 15):  # 5 x 10 tokens: ~1.5 ms of work for a, against a 50 ms load
        put(queue, "m", 10, rid)
    assert b.step(0.05) == 0
    assert "m" not in b.residency.models and TimedEmbedder.loads == [("m", "dev:0")]
    assert depth(queue, "m") == 5  # nothing claimed by b: its requests wait for their holder
    assert a.step(0.1) == 5


def test_a_queue_longer_than_a_load_gets_a_second_copy(queue):
    a = holder_of_m(queue)
    b = core(queue, "dev:1")
    for rid in range(100, 160):  # 60 x 300 tokens: ~180 ms of work for a, more than a 50 ms load
        put(queue, "m", 300, rid)
    served = b.step(0.05)
    assert served > 0 and "m" in b.residency.models
    assert TimedEmbedder.loads == [("m", "dev:0"), ("m", "dev:1")]
    assert depth(queue, "m") == 60 - served
    assert a.residency.models["m"]  # the holder keeps its copy


class Clock:
    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        return time.monotonic_ns() + self.offset_ns


def test_a_starving_lane_is_served_whatever_holds_it(queue):
    holder_of_m(queue)
    clock = Clock()
    b = core(queue, "dev:1", clock_ns=clock, max_wait_ms=500)
    put(queue, "m", 10, 20)
    assert b.step(0.05) == 0 and "m" not in b.residency.models
    clock.offset_ns = 1_000_000_000  # in b's clock the request has now waited 1 s, past the 0.5 s bound
    assert b.step(0.05) == 1 and "m" in b.residency.models


def test_a_load_announced_elsewhere_counts_as_a_holder(queue):
    b = core(queue, "dev:1")
    # A worker of a third device has announced it is loading `m` (as WorkerCore.load publishes it).
    other = queue.register_worker(os.getpid(), "dev:2")
    queue.set_worker_info(other, _encode({"device": "dev:2", "models": {}, "loading": "m",
                                          "loading_since_ns": time.monotonic_ns()}))
    put(queue, "m", 10, 30)
    assert b.step(0.05) == 0 and TimedEmbedder.loads == []
    # Its load failed and it said so: the model has no holder now, and b loads it.
    queue.set_worker_info(other, _encode({"device": "dev:2", "models": {}, "loading": ""}))
    assert b.step(0.05) == 1 and TimedEmbedder.loads == [("m", "dev:1")]


def test_a_declining_worker_blocks_until_new_work_instead_of_polling(queue):
    holder_of_m(queue)
    b = core(queue, "dev:1")
    put(queue, "m", 10, 40)
    # All that waits is left to the holder: b blocks on the queue for its whole timeout.
    t0 = time.monotonic()
    assert b.step(0.4) == 0
    assert time.monotonic() - t0 >= 0.35
    # New work for a model nobody holds ends the wait at once.
    threading.Timer(0.1, put, args=(queue, "n", 10, 41)).start()
    t0 = time.monotonic()
    assert b.step(2.0) == 0
    assert 0.08 <= time.monotonic() - t0 < 1.0
    assert b.step(0.1) == 1 and "n" in b.residency.models and "m" not in b.residency.models


def test_work_for_lanes_left_to_their_holders_does_not_wake_a_declining_worker(queue):
    # Issue 34: a worker beside a busy holder ran a whole step for every request put
    # into the holder's lane. While its "not here, now" verdict holds (a clock that
    # stands still: it never lapses), work for that lane leaves it waiting for its
    # timeout; work for another lane still ends the wait at once.
    holder_of_m(queue)
    frozen = time.monotonic_ns()
    b = core(queue, "dev:1", clock_ns=lambda: frozen)
    put(queue, "m", 10, 40)
    for at, rid in ((0.05, 41), (0.1, 42), (0.15, 43)):
        threading.Timer(at, put, args=(queue, "m", 10, rid)).start()
    t0 = time.monotonic()
    assert b.step(0.4) == 0
    assert time.monotonic() - t0 >= 0.35 and depth(queue, "m") == 4
    threading.Timer(0.1, put, args=(queue, "n", 10, 44)).start()
    t0 = time.monotonic()
    assert b.step(2.0) == 0
    assert 0.08 <= time.monotonic() - t0 < 1.0
    assert b.step(0.1) == 1 and "n" in b.residency.models and "m" not in b.residency.models


def test_a_lane_behind_for_a_load_time_gets_a_copy_on_the_same_device(queue):
    """Rent or buy (runtimes.placement.replica_wanted): a second worker of the holder's
    device loads a copy once the lane has been behind (head waiting past the batch
    target, never starving) at every look for as long as a load took; not sooner, and
    a look that finds the lane caught up starts the clock again."""
    a = holder_of_m(queue)
    clock = Clock()
    b = core(queue, "dev:0", clock_ns=clock, target_ms=20)  # the default lane_max_wait_ms (2 s) stays
    load_ns = int(msgspec.msgpack.decode(queue.workers()[0].info)["models"]["m"]["load_ms"] * 1e6)
    # b's steps that leave the lane to a wait 1 ms: b's clock is the real one moved on by
    # hand, and the real time between looks stays small against a load (~50 ms).
    put(queue, "m", 10, 50)
    assert b.step(0.001) == 0 and "m" not in b.residency.models  # waited < 20 ms: not behind
    clock.offset_ns = 30_000_000  # in b's clock the head has waited 30 ms: behind, since now
    assert b.step(0.001) == 0 and "m" not in b.residency.models
    # Caught up: the holder drains the lane, and b's next look finds it empty.
    assert a.step(0.1) == 1
    drain_results(queue)
    assert b.step(0.001) == 0 and "m" not in b.residency.models
    put(queue, "m", 10, 51)
    clock.offset_ns += 30_000_000  # behind again: the clock starts over
    assert b.step(0.001) == 0 and "m" not in b.residency.models
    clock.offset_ns += load_ns // 2  # behind for half a load: still the holder's
    assert b.step(0.001) == 0 and "m" not in b.residency.models and TimedEmbedder.loads == [("m", "dev:0")]
    clock.offset_ns += load_ns  # behind for 1.5 loads (the holder has served longer than that)
    time.sleep(load_ns * 1.5 / 1e9)
    assert b.step(0.05) == 1 and "m" in b.residency.models
    assert TimedEmbedder.loads == [("m", "dev:0"), ("m", "dev:0")]
    assert a.residency.models["m"]  # the holder keeps its copy


def counted(names: list[str]):
    """`resolve`, appending each name it resolves to `names`."""
    def counting(name: str) -> ModelSpec:
        names.append(name)
        return resolve(name)
    return counting


def declining_worker(queue: LocalQueue, resolver, clock: Clock, max_wait_ms: int) -> WorkerCore:
    """A worker of another device than m's holder, resolving through `resolver` on `clock`."""
    wid = queue.register_worker(os.getpid(), "dev:1")
    b = WorkerCore(queue, wid, "dev:1", resolver, adapter_for=lambda task, runtime: TimedEmbedder,
                   served_by=f"box/{wid}", clock_ns=clock, max_wait_ms=max_wait_ms)
    b.publish_info()
    return b


def test_a_declining_worker_sizes_a_model_once_and_again_for_its_load(queue):
    """A resolve re-hashes every file of the model. A worker that leaves a lane to its
    holder decides again at every step while work comes: those decisions reuse one
    sizing (runtimes.residency.SIZED_KEEP_NS), and its load, when it comes, sizes the
    model afresh (every load re-hashes: a changed file is reported, never served)."""
    holder_of_m(queue)
    resolved: list[str] = []
    clock = Clock()
    b = declining_worker(queue, counted(resolved), clock, max_wait_ms=500)
    for rid in range(60, 65):
        put(queue, "m", 10, rid)
        clock.offset_ns += 30_000_000  # past the "not here, now" memo (IDLE_NAP_S)
        assert b.step(0.001) == 0 and "m" not in b.residency.models
    assert resolved == ["m"]  # five decisions, one sizing
    clock.offset_ns += 1_000_000_000  # the lane starves in b's clock: b serves it
    assert b.step(0.05) >= 1 and "m" in b.residency.models
    assert resolved == ["m", "m"]  # the load sized it afresh


def test_a_declining_worker_sizes_without_rehashing_and_its_load_rehashes_once(queue):
    """A worker's decisions that may not load size the model through `peek` (the store
    read without re-hashing the files: the hash of a model's weights every
    SIZED_KEEP_NS was the whole cost of a worker beside a busy holder); its load
    re-hashes once (runtimes.resolve.store_resolver verify=True)."""
    from fleet.runtimes.residency import SIZED_KEEP_NS

    holder_of_m(queue)
    verified: list[str] = []
    peeked: list[str] = []
    clock = Clock()
    b = declining_worker(queue, counted(verified), clock, max_wait_ms=15_000)
    b.residency.peek = counted(peeked)
    for rid in range(70, 73):
        put(queue, "m", 10, rid)
        clock.offset_ns += 30_000_000  # past the "not here, now" memo (IDLE_NAP_S)
        assert b.step(0.001) == 0 and "m" not in b.residency.models
    clock.offset_ns += SIZED_KEEP_NS + 1  # the kept sizing lapses: sized again, still without hashing
    assert b.step(0.001) == 0 and "m" not in b.residency.models
    assert (peeked, verified) == (["m", "m"], [])
    clock.offset_ns += 6_000_000_000  # the lane starves in b's clock (16 s > 15): b serves it
    assert b.step(0.05) >= 1 and "m" in b.residency.models
    assert (peeked, verified) == (["m", "m"], ["m"])  # the load re-hashed, once
