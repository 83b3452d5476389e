"""WorkerCore serving a continuous adapter (runtimes.continuous) on a real queue
with a tiny real Llama: partial results before the final ack, LoRA resolution
failures answered alone, and unloading mid-generation answering what was held."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from fleet.errors import ModelNotFound
from fleet.protocol import GenerateRequest
from fleet.local_queue import LocalQueue
from fleet.runtimes.base import ModelSpec, Profile
from fleet.messages import STATUS_ERROR, STATUS_OK, STATUS_PARTIAL, EnvelopeIn, GenerateChunk, GenerateResult, \
    WorkError
from fleet.runtimes.worker import WorkerCore
from tests.gen_models import Reference, build_llama, build_lora

MODEL = "tiny"
_enc = msgspec.msgpack.Encoder().encode
_env = msgspec.msgpack.Decoder(EnvelopeIn)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen-worker")
    base = build_llama(root / MODEL)
    return {MODEL: base, "lora-x": build_lora(base, root / "lora-x", seed=3)}


@pytest.fixture
def core(folders):
    q = LocalQueue.create(slots=512, slab_bytes=4 << 20, max_lanes=8, max_workers=2)

    def resolve(name: str) -> ModelSpec:
        if name == MODEL:
            return ModelSpec(MODEL, folders[MODEL], "generate", "transformers", Profile())
        if name == "lora-x":
            return ModelSpec(name, folders[name], "generate", "peft", extra={"base": MODEL})
        raise ModelNotFound(f"unknown model {name!r}")

    c = WorkerCore(q, q.register_worker(os.getpid(), "cpu"), "cpu", resolve, served_by="box/0")
    yield c
    q.close()
    q.unlink()


def put(core: WorkerCore, rid: int, **fields) -> None:
    req = GenerateRequest(model=fields.pop("model", MODEL), temperature=0.0, **fields)
    core.queue.put(core.queue.lane_id(MODEL), _enc(req), tokens=10, request_id=rid)


def run_until(core: WorkerCore, want: set[int], limit: int = 500) -> list:
    """Step the worker, collecting results, until every request id in `want` has its final one."""
    seen, final = [], set()
    for _ in range(limit):
        core.step(timeout_s=0.01)
        for d in core.queue.wait_results(0):
            seen.append(d)
            if d.status != STATUS_PARTIAL:
                final.add(d.request_id)
        if want <= final:
            return seen
    raise AssertionError(f"no final result for {want - final}")


def body(done, type_):
    return msgspec.msgpack.decode(_env.decode(done.result).body, type=type_)


def test_stream_pieces_come_before_the_final_result(core: WorkerCore, folders) -> None:
    ref = Reference(folders[MODEL])
    put(core, 1, prompt="hello world", max_tokens=16, stream=True)
    put(core, 2, prompt="the quick brown fox", max_tokens=16)
    seen = run_until(core, {1, 2})
    pieces = [d for d in seen if d.request_id == 1 and d.status == STATUS_PARTIAL]
    final = next(d for d in seen if d.request_id == 1 and d.status == STATUS_OK)
    assert pieces and seen.index(pieces[-1]) < seen.index(final)
    assert not any(d.request_id == 2 and d.status == STATUS_PARTIAL for d in seen)  # it did not ask to stream
    text = "".join(msgspec.msgpack.decode(d.result, type=GenerateChunk).text for d in pieces)
    result = body(final, GenerateResult)
    assert result.text == ref.greedy("hello world", 16)[0] and result.text.startswith(text)
    core.queue.check()


def test_an_unknown_lora_fails_alone(core: WorkerCore, folders) -> None:
    ref = Reference(folders[MODEL])
    put(core, 1, prompt="hello", max_tokens=4, model="no-such-lora")
    put(core, 2, prompt="hello", max_tokens=4, model="lora-x")
    put(core, 3, prompt="hello", max_tokens=4)
    seen = {d.request_id: d for d in run_until(core, {1, 2, 3})}
    assert seen[1].status == STATUS_ERROR and body(seen[1], WorkError).code == "model_not_found"
    assert body(seen[2], GenerateResult).text == ref.greedy("hello", 4, folders["lora-x"])[0]
    assert body(seen[3], GenerateResult).text == ref.greedy("hello", 4)[0]


def test_unloading_mid_generation_answers_what_it_held(core: WorkerCore) -> None:
    for rid in range(3):
        put(core, rid, prompt="hello world", max_tokens=200)
    for _ in range(3):
        core.step(timeout_s=0.01)
    assert core.queue.lane_stats()[0].claimed == 3
    assert core.residency.unload(MODEL)
    done = core.queue.wait_results(0)
    assert sorted(d.request_id for d in done if d.status == STATUS_ERROR) == [0, 1, 2]
    assert {body(d, WorkError).code for d in done if d.status == STATUS_ERROR} == {"overloaded"}
    assert core.queue.lane_stats() == []  # nothing left claimed or queued
    core.queue.check()


def test_a_request_past_its_deadline_stops_generating(core: WorkerCore) -> None:
    import time

    core.residency.ensure(MODEL)  # loaded first: the deadline runs out mid-generation, not at admit
    lane = core.queue.lane_id(MODEL)
    req = GenerateRequest(model=MODEL, prompt="hello world", max_tokens=250, temperature=0.0)
    deadline_ns = time.monotonic_ns() + 500_000_000
    core.queue.put(lane, _enc(req), tokens=10, request_id=1, deadline_ns=deadline_ns)
    put(core, 2, prompt="hello world", max_tokens=250)
    core.step(timeout_s=0.01)  # admit both (and prefill: one token each)
    resident = core.residency.models[MODEL]
    assert resident.adapter.active_count() == 2
    # The deadline passes between two steps, whatever the box's speed: a fast one
    # would otherwise finish both sequences (one decode a step) before it.
    time.sleep(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9) + 0.01)
    seen = run_until(core, {1})
    late = next(d for d in seen if d.request_id == 1)
    assert late.status == STATUS_ERROR and body(late, WorkError).code == "timeout"
    assert resident.adapter.active_count() == 1  # the other one goes on
    seen = run_until(core, {2})
    assert body(next(d for d in seen if d.request_id == 2), GenerateResult).output_tokens > 0
    core.queue.check()
