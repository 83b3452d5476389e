"""Residency inside workers, in-process: two `WorkerCore`s on one device over a
real `local_queue`, real tiny BERTs from the store, a real per-device load lock.

Scenarios: one copy per device (the second worker leaves the lane to the
holder), a second copy only when the holder cannot keep up, control commands
through the worker's control lane, a failed load that leaves the core serving.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from fleet.config import load_settings
from fleet.protocol import EmbedRequest
from fleet.local_queue import LocalQueue
from fleet.control import Command, CommandDone, control_lane
from fleet.runtimes.device_memory import DeviceMemory, LoadLock
from fleet.runtimes.footprint import estimate_footprint
from fleet.messages import STATUS_ERROR, STATUS_OK, EnvelopeIn, WorkError
from fleet.runtimes.hosting import Hosting
from fleet.runtimes.resolve import store_resolver
from fleet.runtimes.worker import WorkerCore
from tests.conftest import default_model_dir

_env = msgspec.msgpack.Decoder(EnvelopeIn)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("worker-models")
    home = tmp_path_factory.mktemp("worker-home")
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    lines = []
    for i, name in enumerate(("tiny-x", "tiny-y")):
        torch.manual_seed(10 + i)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
        BertModel(cfg).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        lines.append(f'[models."{name}"]\nsource = "path:{root / name}"\ntask = "embed"\n'
                     f'runtime = "sentence-transformers"\nprofile = {{ dtype = "float32" }}\n')
    (home / "models.toml").write_text("\n".join(lines))
    for name in ("tiny-x", "tiny-y"):
        out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], capture_output=True, text=True,
                             env={**os.environ, "FLEET_HOME": str(home)}, timeout=120)
        assert out.returncode == 0, out.stderr
    return home


@pytest.fixture
def queue():
    q = LocalQueue.create(None, slots=256, slab_bytes=4 << 20)
    yield q
    q.close()
    q.unlink()


class Clock:
    """A monotonic clock the test can push forward (lane waits are measured with it)."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        import time

        return time.monotonic_ns() + self.offset_ns


def core(queue: LocalQueue, home: Path, pid: int, budget: int = 1 << 30, **kw) -> WorkerCore:
    settings = load_settings(home=str(home))
    wid = queue.register_worker(pid, "cpu")
    c = WorkerCore(queue, wid, "cpu", store_resolver(settings),
                   hosting=Hosting(memory=DeviceMemory("cpu", budget, lambda: 1 << 40),
                                   load_lock=LoadLock.for_device(home, "cpu")), max_wait_ms=500, **kw)
    c.publish_info()
    return c


def put(queue: LocalQueue, model: str, rid: int) -> None:
    queue.put(queue.lane_id(model), msgspec.msgpack.encode(EmbedRequest(model, [f"text {rid}"])), tokens=4,
              request_id=rid, deadline_ns=0)


def results(queue: LocalQueue, n: int) -> list:
    got = []
    while len(got) < n:
        batch = queue.wait_results(5.0)
        assert batch, f"only {len(got)} of {n} results"
        got += batch
    return got


def test_a_second_worker_of_the_device_leaves_a_held_model_to_its_holder(queue, home):
    a, b = core(queue, home, 101), core(queue, home, 102)
    put(queue, "tiny-x", 1)
    assert a.step(0.1) == 1 and "tiny-x" in a.residency.models
    assert results(queue, 1)[0].status == STATUS_OK
    for rid in range(2, 6):
        put(queue, "tiny-x", rid)
    # b sees the lane but tiny-x is resident on a: b neither loads it nor claims from it.
    assert b.step(0.05) == 0 and b.step(0.05) == 0 and "tiny-x" not in b.residency.models
    assert a.step(0.1) == 4
    assert [d.status for d in results(queue, 4)] == [STATUS_OK] * 4


def test_a_second_copy_only_when_the_holder_cannot_keep_up(queue, home):
    clock = Clock()
    a, b = core(queue, home, 201), core(queue, home, 202, clock_ns=clock)
    put(queue, "tiny-x", 1)
    a.step(0.1)
    results(queue, 1)
    put(queue, "tiny-x", 2)
    # The lane starves (in b's clock) but a has only just loaded it: no second copy.
    clock.offset_ns = 10 * 1_000_000_000
    assert b.step(0.05) == 0 and "tiny-x" not in b.residency.models
    # a has held it for longer than the wait bound and the lane still starves: b loads a copy and serves.
    a.residency.models["tiny-x"].loaded_at -= 10
    a.publish_info()
    clock.offset_ns += 1_000_000_000  # past the verdict b keeps for a nap (it is decided again)
    assert b.step(0.1) == 1 and "tiny-x" in b.residency.models
    (done,) = results(queue, 1)
    assert done.status == STATUS_OK and done.request_id == 2


def control(queue: LocalQueue, c: WorkerCore, op: str, model: str, rid: int):
    queue.put(queue.lane_id(control_lane(c.worker_id)), msgspec.msgpack.encode(Command(op, model)), tokens=1,
              request_id=rid, deadline_ns=0)
    assert c.step(0.1) == 1
    (done,) = results(queue, 1)
    body = _env.decode(done.result).body
    if done.status == STATUS_OK:
        return msgspec.msgpack.decode(body, type=CommandDone)
    assert done.status == STATUS_ERROR
    return msgspec.msgpack.decode(body, type=WorkError)


def test_control_commands_through_the_control_lane(queue, home):
    a, b = core(queue, home, 301), core(queue, home, 302)
    pinned = control(queue, a, "pin", "tiny-y", 1)
    assert (pinned.loaded, pinned.pinned, pinned.already) == (True, True, False) and pinned.bytes > 0
    # Another worker's control lane is not b's to serve.
    queue.put(queue.lane_id(control_lane(a.worker_id)), msgspec.msgpack.encode(Command("unpin", "tiny-y")),
              tokens=1, request_id=2, deadline_ns=0)
    assert b.step(0.05) == 0
    assert a.step(0.1) == 1 and not results(queue, 1)[0].status
    assert "tiny-y" not in a.residency.pinned
    assert control(queue, a, "pin", "tiny-y", 3).already is True
    refused = control(queue, a, "unload", "tiny-y", 4)
    assert refused.code == "bad_request" and "unpin it first" in refused.message
    control(queue, a, "unpin", "tiny-y", 5)
    unloaded = control(queue, a, "unload", "tiny-y", 6)
    assert unloaded.loaded is False and "tiny-y" not in a.residency.models
    assert control(queue, a, "unload", "tiny-y", 7).already is True
    assert control(queue, a, "evaporate", "tiny-y", 8).code == "bad_request"
    missing = control(queue, a, "load", "no-such-model", 9)
    assert missing.code in ("model_not_found", "bad_request")
    assert control(queue, a, "load", "tiny-x", 10).loaded is True  # and a still works


def test_a_failed_load_answers_the_lane_and_the_core_keeps_serving(queue, home, tmp_path):
    a = core(queue, home, 401)
    original = a.residency.resolve

    def resolve(name):
        spec = original("tiny-x" if name == "tiny-broken" else name)
        if name == "tiny-broken":
            # tiny-x's config and tokenizer, but weights whose data is cut short.
            broken = tmp_path / "broken"
            if not broken.exists():
                shutil.copytree(spec.path, broken)
                head = b'{"embeddings.word_embeddings.weight":{"dtype":"F32","shape":[100,32],"data_offsets":[0,12800]}}'
                (broken / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 64)
            spec.path, spec.name = broken, name
        return spec

    a.residency.resolve = resolve
    put(queue, "tiny-broken", 1)
    put(queue, "tiny-broken", 2)
    assert a.step(0.1) == 2
    errors = [msgspec.msgpack.decode(_env.decode(d.result).body, type=WorkError) for d in results(queue, 2)]
    assert {e.code for e in errors} == {"model_load_failed"} and "tiny-broken" in errors[0].message
    assert "tiny-broken" not in a.residency.models and a.residency.loading == ""
    put(queue, "tiny-y", 3)
    assert a.step(0.1) == 1 and results(queue, 1)[0].status == STATUS_OK


def test_a_lazy_load_goes_to_a_device_with_room_rather_than_evicting(queue, home):
    fp = estimate_footprint(home / "models" / "tiny-x", "sentence-transformers", dtype="float32")
    a = core(queue, home, 501, budget=fp.activation_bytes + int(1.5 * fp.weights_bytes))  # room for one
    put(queue, "tiny-x", 1)
    assert a.step(0.1) == 1 and results(queue, 1)[0].status == STATUS_OK
    # Another device of the daemon reports a large, empty budget (its worker's info blob).
    other = queue.register_worker(999_999, "cuda:9")
    queue.set_worker_info(other, msgspec.msgpack.encode({"device": "cuda:9", "budget_bytes": 1 << 30,
                                                         "used_bytes": 0, "models": {}}))
    put(queue, "tiny-y", 2)
    assert a.step(0.05) == 0 and a.step(0.05) == 0 and set(a.residency.models) == {"tiny-x"}  # not evicted for it
    # That device goes away: now this worker evicts and serves it.
    queue.unregister_worker(other)
    assert a.step(0.1) == 1 and set(a.residency.models) == {"tiny-y"}
    (done,) = results(queue, 1)
    assert done.status == STATUS_OK and done.request_id == 2


# ---- scoped verdicts: two workers sharing one device budget ---------------------------------


def codes(done: list) -> list[str]:
    return [msgspec.msgpack.decode(_env.decode(d.result).body, type=WorkError).code if d.status else "ok"
            for d in done]


def depth(queue: LocalQueue, model: str) -> int:
    return next((s.depth for s in queue.lane_stats() if s.model == model), 0)


def room_for_one(home: Path) -> int:
    """A budget with room for one tiny model and its worker's activations, not two."""
    fp = estimate_footprint(home / "models" / "tiny-x", "sentence-transformers", dtype="float32")
    return 2 * fp.activation_bytes + int(1.5 * fp.weights_bytes)


def test_a_peers_idle_model_is_evicted_on_request_not_answered_model_too_large(queue, home):
    a, b = core(queue, home, 601, room_for_one(home)), core(queue, home, 602, room_for_one(home))
    put(queue, "tiny-x", 1)
    assert a.step(0.1) == 1 and codes(results(queue, 1)) == ["ok"]
    # tiny-x sits idle on a and holds the room b needs for tiny-y: b asks a (control lane)
    # and its requests wait; they are not failed with model_too_large.
    for rid in (2, 3):
        put(queue, "tiny-y", rid)
    assert b.step(0.05) == 0 and "tiny-y" not in b.residency.models
    assert queue.wait_results(0.1) == []
    assert a.step(0.1) == 1 and "tiny-x" not in a.residency.models  # the evict command (its reply goes to request id 0)
    assert [d.request_id for d in results(queue, 1)] == [0]
    served = sum(b.step(0.1) for _ in range(5))
    assert served == 2 and "tiny-y" in b.residency.models
    assert sorted(codes(results(queue, 2))) == ["ok", "ok"]
    assert a.residency.evictions == {"tiny-x": {"lru": 1}}


def test_a_peers_busy_model_makes_the_lane_wait_then_it_is_served(queue, home):
    a, b = core(queue, home, 701, room_for_one(home)), core(queue, home, 702, room_for_one(home))
    put(queue, "tiny-x", 1)
    assert a.step(0.1) == 1 and codes(results(queue, 1)) == ["ok"]
    put(queue, "tiny-x", 2)  # tiny-x has work waiting: it is not evicted for tiny-y
    put(queue, "tiny-y", 3)
    assert b.step(0.05) == 0 and queue.wait_results(0.1) == []
    assert depth(queue, "tiny-x") == 1 and depth(queue, "tiny-y") == 1
    # a serves its queue; then tiny-x is idle, b asks, a evicts, b loads and serves.
    done = []
    for _ in range(20):
        a.step(0.05)
        b.step(0.05)
        done += queue.wait_results(0.01)
        if {2, 3} <= {d.request_id for d in done}:
            break
    answers = [(d.request_id, c) for d, c in zip(done, codes(done)) if d.request_id]
    assert sorted(answers) == [(2, "ok"), (3, "ok")] and "tiny-y" in b.residency.models


def test_a_model_too_large_for_the_device_still_fails_its_requests(queue, home):
    fp = estimate_footprint(home / "models" / "tiny-x", "sentence-transformers", dtype="float32")
    a = core(queue, home, 801, fp.total_bytes - 1)
    core(queue, home, 802, fp.total_bytes - 1)  # a peer of the device, holding nothing
    put(queue, "tiny-x", 1)
    assert a.step(0.1) == 1
    (done,) = results(queue, 1)
    assert codes([done]) == ["model_too_large"]
    assert "more than the whole cpu budget" in msgspec.msgpack.decode(_env.decode(done.result).body,
                                                                        type=WorkError).message


def test_the_worker_record_keeps_every_resident_model_it_can(queue, home):
    """`fleetctl ps`, the daemon and the peers read a worker's models from its info
    blob (at most INFO_BYTES). A worker holding many keeps each model's summary
    (what placement and ps use) before it cuts any to a name, and the most recently
    used names before none. The record is the real one (`publish_info`), read back
    from the queue; the extra residents are copies of a real one, each used at its
    own time."""
    import copy

    from fleet.local_queue.layout import INFO_BYTES
    from fleet.runtimes.info import SUMMARY

    c = core(queue, home, 301)
    put(queue, "tiny-x", 1)
    assert c.step(0.1) == 1
    results(queue, 1)
    real = c.residency.models["tiny-x"]

    def published() -> dict:
        c.publish_info()
        (blob,) = [w.info for w in queue.workers() if w.wid == c.worker_id]
        assert len(blob) <= INFO_BYTES
        return msgspec.msgpack.decode(blob)["models"]

    full = published()["tiny-x"]
    assert {"settings", "forward", "threads", "cost", "bytes"} <= full.keys(), full
    summary = {k: full[k] for k in SUMMARY if k in full}
    assert summary["bytes"] > 0 and len(summary) == len(SUMMARY)
    seen = set()
    try:
        for n in (8, 40, 3000):
            c.residency.models.clear()
            for i in range(n):
                c.residency.models[f"m{i:05d}"] = copy.copy(real)
                c.residency.models[f"m{i:05d}"].last_used = real.last_used + i  # m{n-1} used last
            got = published()
            if all(m.keys() == full.keys() for m in got.values()):
                seen.add("full")
                assert len(got) == n
            elif all(m.keys() == summary.keys() for m in got.values()):
                seen.add("summary")
                assert len(got) == n and all(m["bytes"] == summary["bytes"] for m in got.values())
            else:
                seen.add("names")
                assert all(m == {} for m in got.values()) and 0 < len(got) < n
                assert sorted(got) == [f"m{i:05d}" for i in range(n - len(got), n)]  # the latest used
        assert seen == {"full", "summary", "names"}, seen
    finally:
        c.residency.models.clear()
        c.residency.models["tiny-x"] = real
