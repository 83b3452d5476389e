"""WorkerCore against a real shared-memory queue, with a fake adapter and resolver.

The queue, its claims, returns, leases and wake-ups are real; only the model
is fake (STYLE.md 3: the resolver and adapter class are injected). The last
test runs real worker processes under the real Supervisor, with a worker
entry point that dies (SIGKILL) on a marker payload: poison handling end to end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import posix_ipc
import pytest

from fleet.config import Settings
from fleet.errors import ModelLoadFailed
from fleet.protocol import EmbedRequest
from local_queue import STATUS_POISON, LocalQueue
from runtimes.base import Adapter, ModelSpec, Profile
from fleet.messages import STATUS_ERROR, STATUS_OK, EmbedResult, Envelope, WorkError
from runtimes.worker import WorkerCore

POISON = "POISON"
#: The first worker to run this stops itself (SIGSTOP): frozen, heartbeat included, but alive.
STALL = "STALL"
_encode = msgspec.msgpack.Encoder().encode
_envelope = msgspec.msgpack.Decoder(Envelope)
_info = msgspec.msgpack.Decoder()


class FakeEmbedder(Adapter):
    """Echoes each request's texts back as its 'vector' bytes; logs every batch it runs."""

    request_type = EmbedRequest
    batches: list[tuple[str, list[list[str]]]] = []

    def load(self) -> None:
        if self.spec.extra.get("load_error") == "fleet":
            raise ModelLoadFailed(f"cannot load {self.spec.name!r}: weights are corrupt")
        if self.spec.extra.get("load_error") == "bug":
            raise RuntimeError("adapter crashed while loading")

    def footprint_bytes(self) -> int:
        return 1234

    def run_batch(self, requests):
        texts = [r.inputs for r in requests]
        if any(POISON in t for t in texts):
            os.kill(os.getpid(), signal.SIGKILL)  # a model that takes the process down
        flag = self.spec.extra.get("stall_flag")
        if flag and any(STALL in t for t in texts) and not os.path.exists(flag):
            Path(flag).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process freezes, heartbeat thread too
        FakeEmbedder.batches.append((self.spec.name, texts))
        return [EmbedResult("|".join(t).encode(), (len(t), 1), len(t)) for t in texts]


def make_resolver(profiles: dict[str, Profile], extra: dict[str, dict] | None = None):
    def resolve(name: str) -> ModelSpec:
        if name not in profiles:
            raise ModelLoadFailed(f"model {name!r} is not in the store")
        return ModelSpec(name, Path("/nonexistent"), "embed", "fake", profile=profiles[name],
                         extra=(extra or {}).get(name, {}))
    return resolve


def fake_adapters(task: str, runtime: str) -> type[Adapter]:
    assert (task, runtime) == ("embed", "fake")
    return FakeEmbedder


@pytest.fixture()
def queue():
    q = LocalQueue.create(slots=256, slab_bytes=1 << 20)
    yield q
    q.close()
    q.unlink()


@pytest.fixture(autouse=True)
def clear_batches():
    FakeEmbedder.batches.clear()


def core_for(queue, profiles, extra=None, **kw) -> WorkerCore:
    wid = queue.register_worker(os.getpid(), "cpu")
    return WorkerCore(queue, wid, "cpu", make_resolver(profiles, extra), adapter_for=fake_adapters,
                      served_by="box/0", **kw)


def put(queue, model: str, text: str, *, request_id: int, tokens: int = 10, deadline_ns: int = 0) -> int:
    payload = _encode(EmbedRequest(model=model, inputs=[text]))
    return queue.put(queue.lane_id(model), payload, tokens=tokens, request_id=request_id, deadline_ns=deadline_ns)


def results(queue, n: int, timeout_s: float = 5.0) -> dict[int, tuple[int, object]]:
    """request id -> (status, decoded envelope body), for exactly n results."""
    out: dict[int, tuple[int, object]] = {}
    end = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < end:
        for d in queue.wait_results(0.2):
            assert d.request_id not in out, f"request {d.request_id} answered twice"
            env = _envelope.decode(d.result) if d.result else None
            out[d.request_id] = (d.status, env.body if env else None)
    assert len(out) == n, f"{len(out)} of {n} results"
    return out


def lane_order(queue, model: str) -> list[int]:
    """Request ids queued in a lane, head first (claimed by an observer, then returned)."""
    observer = queue.register_worker(os.getpid(), "observer")
    claims = queue.claim(queue.lane_id(model), worker=observer, max_items=1000, max_tokens=1 << 30, lease_ms=10_000)
    queue.return_items([c.item_id for c in claims])
    queue.unregister_worker(observer)
    return [c.request_id for c in claims]


def test_overpull_goes_back_to_the_head_in_order(queue):
    core = core_for(queue, {"m": Profile(max_batch_items=8, max_batch_tokens=100)})
    # Claimed within the 100-token sum: 10, 40, 10, 40 (the next 10 would exceed it).
    # Padded (items x longest), the two 40s do not fit beside the 10s: they go back.
    for rid, tokens in enumerate([10, 40, 10, 40, 10, 10], start=1):
        put(queue, "m", f"t{rid}", request_id=rid, tokens=tokens)
    assert core.step() == 2
    assert FakeEmbedder.batches == [("m", [["t1"], ["t3"]])]
    got = results(queue, 2)
    assert {rid: st for rid, (st, _) in got.items()} == {1: STATUS_OK, 3: STATUS_OK}
    assert lane_order(queue, "m") == [2, 4, 5, 6]
    info = _info.decode(queue.workers()[0].info)
    assert info["last_batch"] | {"ms": 0, "at": 0} == {
        "model": "m", "items": 2, "tokens": 20, "padded": 20, "ms": 0, "at": 0, "returned": 2}


def test_returned_items_are_served_next_and_keep_their_attempts(queue):
    core = core_for(queue, {"m": Profile(max_batch_items=8, max_batch_tokens=100)})
    for rid, tokens in enumerate([10, 10, 40, 10, 10], start=1):
        put(queue, "m", f"t{rid}", request_id=rid, tokens=tokens)
    core.step()  # runs 1, 2, 4, 5; returns 3
    core.step()  # 3, alone at the head
    assert FakeEmbedder.batches == [("m", [["t1"], ["t2"], ["t4"], ["t5"]]), ("m", [["t3"]])]
    assert all(st == STATUS_OK for st, _ in results(queue, 5).values())


def test_prefers_a_held_model_until_another_lane_starves(queue):
    profiles = {"a": Profile(), "b": Profile()}
    core = core_for(queue, profiles, max_wait_ms=150)
    core.load("b")
    put(queue, "a", "a1", request_id=1)  # older, but its model is not held here
    put(queue, "b", "b1", request_id=2)
    core.step()
    assert FakeEmbedder.batches[-1] == ("b", [["b1"]])
    time.sleep(0.2)  # a1 has now waited past the 150 ms bound
    put(queue, "b", "b2", request_id=3)
    core.step()
    assert FakeEmbedder.batches[-1] == ("a", [["a1"]])
    assert set(core.models) == {"a", "b"}
    core.step()
    assert FakeEmbedder.batches[-1] == ("b", [["b2"]])
    assert len(results(queue, 3)) == 3


@pytest.mark.parametrize("how, code", [("fleet", "model_load_failed"), ("bug", "model_load_failed"),
                                       ("missing", "model_load_failed")])
def test_load_failure_answers_its_lane_and_the_worker_goes_on(queue, how, code):
    profiles = {"good": Profile()}
    extra = {}
    if how != "missing":
        profiles["broken"] = Profile()
        extra["broken"] = {"load_error": how}
    core = core_for(queue, profiles, extra)
    for rid in (1, 2, 3):
        put(queue, "broken", f"x{rid}", request_id=rid)
    assert core.step() == 3
    got = results(queue, 3)
    for status, body in got.values():
        assert status == STATUS_ERROR
        err = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=WorkError)
        assert err.code == code
        assert "broken" in err.message or "loading" in err.message
    assert "broken" not in core.models
    put(queue, "good", "fine", request_id=4)
    assert core.step() == 1
    assert results(queue, 1)[4][0] == STATUS_OK


def test_undecodable_payload_is_answered_alone(queue):
    core = core_for(queue, {"m": Profile()})
    lane = queue.lane_id("m")
    put(queue, "m", "first", request_id=1)
    queue.put(lane, b"\xc1 not msgpack", tokens=5, request_id=2)
    queue.put(lane, _encode({"model": "m", "inputs": "not a list"}), tokens=5, request_id=3)
    put(queue, "m", "last", request_id=4)
    assert core.step() == 4
    assert FakeEmbedder.batches == [("m", [["first"], ["last"]])]
    got = results(queue, 4)
    assert got[1][0] == got[4][0] == STATUS_OK
    for rid in (2, 3):
        status, body = got[rid]
        assert status == STATUS_ERROR
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=WorkError).code == "bad_request"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(got[4][1]), type=EmbedResult).data == b"last"


def test_linger_gathers_items_that_arrive_within_it(queue):
    core = core_for(queue, {"m": Profile(linger_ms=400)})
    put(queue, "m", "early", request_id=1)
    threading.Timer(0.1, lambda: put(queue, "m", "late", request_id=2)).start()
    t0 = time.monotonic()
    assert core.step() == 2
    elapsed = time.monotonic() - t0
    assert FakeEmbedder.batches == [("m", [["early"], ["late"]])]
    assert 0.3 < elapsed < 1.5  # it lingered to the end: the batch still had room


def test_linger_ends_when_another_lane_has_work(queue):
    core = core_for(queue, {"m": Profile(linger_ms=2_000), "other": Profile()})
    put(queue, "m", "alone", request_id=1)
    threading.Timer(0.1, lambda: put(queue, "other", "o", request_id=2)).start()
    t0 = time.monotonic()
    core.step()
    assert time.monotonic() - t0 < 1.0
    assert FakeEmbedder.batches == [("m", [["alone"]])]
    core.step()
    assert FakeEmbedder.batches[-1] == ("other", [["o"]])


def test_default_linger_applies_when_the_profile_sets_none(queue):
    core = core_for(queue, {"m": Profile()}, linger_ms=300)
    put(queue, "m", "one", request_id=1)
    threading.Timer(0.1, lambda: put(queue, "m", "two", request_id=2)).start()
    core.step()
    assert FakeEmbedder.batches == [("m", [["one"], ["two"]])]


def test_claimed_item_past_its_deadline_is_answered_timeout_unrun(queue):
    core = core_for(queue, {"m": Profile(linger_ms=300)})
    put(queue, "m", "soon-late", request_id=1, deadline_ns=time.monotonic_ns() + 100_000_000)
    assert core.step() == 1
    assert FakeEmbedder.batches == []
    status, body = results(queue, 1)[1]
    assert status == STATUS_ERROR
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=WorkError).code == "timeout"


def test_suspect_item_runs_alone(queue):
    core = core_for(queue, {"m": Profile()})
    for rid in (1, 2, 3):
        put(queue, "m", f"t{rid}", request_id=rid)
    # Another worker claims all three and dies: they come back with one attempt each.
    dead = queue.register_worker(999_999, "cpu")
    queue.claim(queue.lane_id("m"), worker=dead, max_items=8, max_tokens=1000, lease_ms=10_000)
    assert queue.release_worker(dead, max_attempts=3) == 3
    for _ in range(3):
        assert core.step() == 1
    assert FakeEmbedder.batches == [("m", [["t1"]]), ("m", [["t2"]]), ("m", [["t3"]])]
    assert len(results(queue, 3)) == 3


def test_cost_model_is_fitted_and_published(queue):
    core = core_for(queue, {"m": Profile(max_batch_items=4)}, target_ms=250.0)
    rid = 0
    for n in (1, 2, 3, 4, 4):
        for _ in range(n):
            rid += 1
            put(queue, "m", f"t{rid}", request_id=rid, tokens=10 * n)
        core.step()
    results(queue, rid)
    info = _info.decode(queue.workers()[0].info)
    cost = info["models"]["m"]["cost"]
    assert cost["samples"] == 5
    assert cost["a_ms"] >= 0 and cost["b_ms_per_1k_tokens"] >= 0
    assert info["last_batch"]["items"] == 4 and info["last_batch"]["padded"] == 160


# -- real processes: a marker payload kills whichever worker runs it ---------------

def dying_worker_main(queue_name: str, index: int, device: str, settings_blob: bytes) -> None:
    """Supervisor target: a real worker process (WorkerCore on the real queue, heartbeat
    thread) whose fake model SIGKILLs the process when a request contains POISON."""
    settings = msgspec.msgpack.decode(settings_blob, type=Settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    q = LocalQueue.attach(queue_name)
    wid = q.register_worker(os.getpid(), device)
    core = WorkerCore(q, wid, device, make_resolver({"m": Profile(max_batch_items=8)},
                                                    {"m": {"stall_flag": str(Path(settings.home) / "stalled")}}),
                      adapter_for=fake_adapters, served_by=f"box/{index}", lease_ms=settings.lease_ms)

    def heartbeat() -> None:
        while not stop.wait(settings.lease_ms / 3000):
            q.heartbeat(wid)

    threading.Thread(target=heartbeat, daemon=True).start()
    while not stop.is_set():
        try:
            core.step(timeout_s=0.1)
        except posix_ipc.SignalError:
            continue  # SIGTERM interrupted a queue wait: the loop sees `stop`
    q.unregister_worker(wid)
    q.close()


@pytest.mark.slow
def test_poison_request_fails_after_max_attempts_and_the_rest_are_served(tmp_path):
    from daemon.supervisor import Supervisor

    q = LocalQueue.create(slots=256, slab_bytes=1 << 20)
    settings = Settings(home=str(tmp_path), lease_ms=5_000, max_attempts=3)
    sup = Supervisor(settings, q, ["cpu", "cpu"], target=f"{__name__}:dying_worker_main")
    try:
        texts = {rid: f"good-{rid}" for rid in range(1, 25)}
        texts[12] = POISON
        for rid, text in texts.items():
            put(q, "m", text, request_id=rid)
        sup.start()
        got = results(q, len(texts), timeout_s=60)
        assert got[12] == (STATUS_POISON, None)
        for rid, (status, body) in got.items():
            if rid == 12:
                continue
            assert status == STATUS_OK, rid
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=EmbedResult).data == texts[rid].encode()
        assert sum(s.restarts for s in sup.slots) == 3  # one death per attempt, then no more
        time.sleep(0.5)
        assert q.depth() == 0 and q.usage().done == 0
    finally:
        sup.stop()
        q.close()
        q.unlink()


@pytest.mark.slow
def test_frozen_worker_loses_its_lease_and_its_late_ack_is_refused(tmp_path):
    from daemon.supervisor import Supervisor

    q = LocalQueue.create(slots=256, slab_bytes=1 << 20)
    # Short leases: the frozen worker's claims expire within a second.
    settings = Settings(home=str(tmp_path), lease_ms=600, max_attempts=3)
    # Two device names: one copy of a model per device is the memory manager's
    # rule, and a frozen holder keeps its copy "held" until its heartbeat goes
    # stale; this test is about the lease, so the other worker holds its own copy.
    sup = Supervisor(settings, q, ["cpu-a", "cpu-b"], target=f"{__name__}:dying_worker_main")
    flag = tmp_path / "stalled"
    try:
        sup.start()
        wait = time.monotonic() + 30
        while len(q.workers()) < 2 and time.monotonic() < wait:
            time.sleep(0.05)
        put(q, "m", STALL, request_id=1)
        got = results(q, 1, timeout_s=30)
        # Served by the other worker after the lease expired (not by a restart:
        # the frozen one is alive, so nothing was released on its death).
        assert got[1][0] == STATUS_OK
        assert flag.exists() and sum(s.restarts for s in sup.slots) == 0
        frozen = int(flag.read_text())
        os.kill(frozen, signal.SIGCONT)  # it wakes up and acks an item it no longer holds
        time.sleep(1.0)
        assert q.wait_results(0.5) == [], "the late ack must not produce a second answer"
        put(q, "m", "after", request_id=2)
        assert results(q, 1, timeout_s=10)[2][0] == STATUS_OK
    finally:
        if flag.exists():
            try:
                os.kill(int(flag.read_text()), signal.SIGCONT)  # never leave a stopped child behind
            except ProcessLookupError:
                pass
        sup.stop()
        q.close()
        q.unlink()
