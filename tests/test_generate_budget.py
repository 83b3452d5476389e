"""Generation inside the memory budget, on a real queue with a tiny real Llama
(WorkerCore in-process): the key/value cache is reserved per admitted sequence
and counted in the worker's memory; a request whose reserve does not fit waits
in its lane; a step that runs out of memory sheds sequences, which finish
later with the same tokens, instead of failing the batch; a withdrawn request
(its client went away: `LocalQueue.cancel` of a claimed item) stops at the
worker's next step."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from fleet.errors import ModelNotFound
from fleet.messages import STATUS_ERROR, STATUS_OK, STATUS_PARTIAL, EnvelopeIn, GenerateResult, WorkError
from fleet.protocol import GenerateRequest
from fleet.local_queue import LocalQueue
from fleet.runtimes.base import ModelSpec, Profile
from fleet.runtimes.adapters.generate_rows import kv_reserve, shed_count
from fleet.runtimes.device_memory import DeviceMemory
from fleet.runtimes.worker import WorkerCore
from tests.gen_models import Reference, build_llama

MODEL = "tiny"
PROMPTS = ["hello world", "the quick brown fox", "a b c", "invoices must be paid", "z y x", "fleet serving"]
_enc = msgspec.msgpack.Encoder().encode
_env = msgspec.msgpack.Decoder(EnvelopeIn)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("gen-budget") / MODEL)


@pytest.fixture(scope="module")
def ref(folder: Path) -> Reference:
    return Reference(folder)


@pytest.fixture
def core(folder: Path):
    q = LocalQueue.create(slots=512, slab_bytes=4 << 20, max_lanes=8, max_workers=2)

    def resolve(name: str) -> ModelSpec:
        if name == MODEL:
            return ModelSpec(MODEL, folder, "generate", "transformers", Profile())
        raise ModelNotFound(f"unknown model {name!r}")

    c = WorkerCore(q, q.register_worker(os.getpid(), "cpu"), "cpu", resolve, served_by="box/0")
    yield c
    q.close()
    q.unlink()


def put(core: WorkerCore, rid: int, **fields) -> int:
    req = GenerateRequest(model=MODEL, temperature=0.0, **fields)
    return core.queue.put(core.queue.lane_id(MODEL), _enc(req), tokens=10, request_id=rid)


def run_until(core: WorkerCore, want: set[int], limit: int = 2000) -> dict:
    """Step the worker until every request id in `want` has its final result; {id: Done}."""
    final = {}
    for _ in range(limit):
        core.step(timeout_s=0.01)
        for d in core.queue.wait_results(0):
            if d.status != STATUS_PARTIAL:
                final[d.request_id] = d
        if want <= set(final):
            return final
    raise AssertionError(f"no final result for {want - set(final)}")


def body(done, type_):
    return msgspec.msgpack.decode(_env.decode(done.result).body, type=type_)


def prompt_len(ref: Reference, prompt: str) -> int:
    return len(ref.tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize(("rows", "shed"), [(1, 0), (2, 1), (3, 1), (8, 4), (9, 4)])
def test_shed_count_is_the_newest_half_and_never_a_lone_row(rows: int, shed: int) -> None:
    assert shed_count(rows) == shed


def test_kv_reserve_is_rows_times_the_widest_row() -> None:
    assert kv_reserve(512, 3, 40) == 512 * 3 * 40
    assert kv_reserve(512, 0, 0) == 0


def test_the_cache_reserve_is_counted_in_the_worker_memory(core: WorkerCore, ref: Reference) -> None:
    core.residency.ensure(MODEL)
    adapter = core.residency.models[MODEL].adapter
    idle = core.residency.used_bytes()
    assert adapter.kv_token_bytes > 0
    put(core, 1, prompt="hello world", max_tokens=100)
    put(core, 2, prompt="a", max_tokens=20)
    core.step(timeout_s=0.01)  # admits both
    widest = prompt_len(ref, "hello world") + 100
    assert adapter.reserved_bytes() == kv_reserve(adapter.kv_token_bytes, 2, widest)
    assert core.residency.used_bytes() == idle + adapter.reserved_bytes()
    info = msgspec.msgpack.decode(core.queue.workers()[0].info)
    assert info["used_bytes"] == core.residency.used_bytes()  # published: the device's other workers count it
    run_until(core, {1, 2})
    assert adapter.reserved_bytes() == 0 and core.residency.used_bytes() == idle


def test_a_request_whose_reserve_does_not_fit_waits_in_its_lane(core: WorkerCore, ref: Reference) -> None:
    core.residency.ensure(MODEL)
    adapter = core.residency.models[MODEL].adapter
    # Room for one sequence of 60 new tokens, not two: the second waits for the first.
    one = kv_reserve(adapter.kv_token_bytes, 1, prompt_len(ref, PROMPTS[0]) + 60)
    core.residency.memory = DeviceMemory("cpu", core.residency.used_bytes() + one + one // 2, lambda: 1 << 62)
    put(core, 1, prompt=PROMPTS[0], max_tokens=60)
    put(core, 2, prompt=PROMPTS[0], max_tokens=60)
    core.step(timeout_s=0.01)
    assert adapter.active_count() == 1
    assert [(s.depth, s.claimed) for s in core.queue.lane_stats()] == [(1, 1)]  # the second waits, queued
    done = run_until(core, {1, 2})
    want = ref.greedy(PROMPTS[0], 60)[0]
    assert [body(done[i], GenerateResult).text for i in (1, 2)] == [want, want]
    core.queue.check()


def test_a_request_that_cannot_fit_even_alone_fails_clearly_and_alone(core: WorkerCore, ref: Reference) -> None:
    core.residency.ensure(MODEL)
    adapter = core.residency.models[MODEL].adapter
    room = kv_reserve(adapter.kv_token_bytes, 1, prompt_len(ref, "a") + 40)
    core.residency.memory = DeviceMemory("cpu", core.residency.used_bytes() + room, lambda: 1 << 62)
    put(core, 1, prompt="hello world", max_tokens=200)
    put(core, 2, prompt="a", max_tokens=40)
    done = run_until(core, {1, 2})
    assert done[1].status == STATUS_ERROR
    error = body(done[1], WorkError)
    assert error.code == "model_too_large" and "max_tokens" in error.message
    assert body(done[2], GenerateResult).text == ref.greedy("a", 40)[0]


def oom_when(adapter, predicate):
    """Make the model's forward raise torch's out-of-memory error whenever
    `predicate(input_ids)` holds (a full device, as other processes can cause)."""
    import torch

    calls = {"oom": 0}

    def hook(module, args, kwargs):
        if predicate(kwargs["input_ids"]):
            calls["oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    return adapter.base.register_forward_pre_hook(hook, with_kwargs=True), calls


def test_an_out_of_memory_decode_step_sheds_sequences_that_finish_later_loses_nothing(
        core: WorkerCore, ref: Reference) -> None:
    core.residency.ensure(MODEL)
    adapter = core.residency.models[MODEL].adapter
    # Decode steps of more than 3 rows do not fit; prefills do.
    handle, calls = oom_when(adapter, lambda ids: ids.shape[1] == 1 and ids.shape[0] > 3)
    try:
        for rid, prompt in enumerate(PROMPTS):
            put(core, rid, prompt=prompt, max_tokens=30, stream=rid % 2 == 0)
        done = run_until(core, set(range(len(PROMPTS))))
    finally:
        handle.remove()
    assert calls["oom"] > 0
    assert all(d.status == STATUS_OK for d in done.values())
    assert [body(done[i], GenerateResult).text for i in range(len(PROMPTS))] == \
        [ref.greedy(p, 30)[0] for p in PROMPTS]
    core.queue.check()


def test_an_out_of_memory_prefill_waits_and_a_lone_sequence_that_never_fits_fails_alone(
        core: WorkerCore, ref: Reference) -> None:
    core.residency.ensure(MODEL)
    adapter = core.residency.models[MODEL].adapter
    long_prompt = " ".join(["invoices must be paid"] * 6)
    # Any forward over the long prompt runs out of memory; prefills of several rows too.
    handle, calls = oom_when(adapter, lambda ids: ids.shape[1] >= prompt_len(ref, long_prompt)
                             or (ids.shape[1] > 1 and ids.shape[0] > 1))
    try:
        put(core, 1, prompt=long_prompt, max_tokens=5)
        for rid, prompt in enumerate(PROMPTS[:3], start=2):
            put(core, rid, prompt=prompt, max_tokens=20)
        done = run_until(core, {1, 2, 3, 4})
    finally:
        handle.remove()
    assert calls["oom"] > 0
    assert done[1].status == STATUS_ERROR and body(done[1], WorkError).code == "overloaded"
    assert [body(done[i], GenerateResult).text for i in (2, 3, 4)] == [ref.greedy(p, 20)[0] for p in PROMPTS[:3]]
    core.queue.check()


def test_a_withdrawn_request_stops_at_the_next_step(core: WorkerCore) -> None:
    item = put(core, 1, prompt="hello world", max_tokens=250, stream=True)
    put(core, 2, prompt="hello world", max_tokens=30)
    for _ in range(4):
        core.step(timeout_s=0.01)
    adapter = core.residency.models[MODEL].adapter
    assert adapter.active_count() == 2 and core.queue.lane_stats()[0].claimed == 2
    assert core.queue.cancel(item) is False  # claimed: not removed, marked
    core.step(timeout_s=0.01)
    assert adapter.active_count() == 1 and core.queue.lane_stats()[0].claimed == 1
    withdrawn = [d for d in core.queue.wait_results(0) if d.request_id == 1 and d.status != STATUS_PARTIAL]
    assert len(withdrawn) == 1 and body(withdrawn[0], WorkError).code == "timeout"
    done = run_until(core, {2})
    assert body(done[2], GenerateResult).output_tokens > 0
    core.queue.check()
