"""Memory policy as tables (runtimes.memory): fits, evict, plan, estimate, OOM split;
pins on disk (fleet.pins); the per-device view of `fleetctl ps`; worker choice
for admin calls. Pure functions and real files: milliseconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleet.daemon.commands import choose_worker, device_room
from fleet.pins import PinStore
from fleet.errors import BadRequest, ModelLoadFailed, ModelTooLarge, Unavailable
from fleetctl.residency import device_rows
from fleet.runtimes.device_memory import DeviceMemory, LoadLock, device_budget
from fleet.runtimes.footprint import RATIO_BOUNDS, Estimates, Footprint, estimate_footprint, weights_bytes
from fleet.runtimes.memory import (
    LOAD, TOO_LARGE, WAIT, LoadPlan, ResidentView, find_model_to_evict, fits_on_device, is_out_of_memory, load_error,
    plan_load, run_split_on_oom, used_bytes,
)

MB = 1 << 20


def r(name: str, weights_mb: int, *, worker: int = 1, act_mb: int = 0, pinned: bool = False, last_used: float = 0.0,
      reload_s: float = 0.0, waiting: int = 0) -> ResidentView:
    return ResidentView(name, worker, Footprint(weights_mb * MB, act_mb * MB), pinned, last_used, reload_s, waiting)


# ---- fits_on_device ------------------------------------------------------------------

FITS = [
    # (budget MB, free now MB, residents, incoming (weights, act) MB, worker, fits?)
    ("empty device, exactly the budget", 100, 1000, [], (60, 40), 1, True),
    ("one byte over the budget", 100, 1000, [], (61, 40), 1, False),
    ("budget ok, device memory taken by others", 100, 50, [], (60, 0), 1, False),
    ("same worker shares one activation area", 100, 1000, [r("a", 30, act_mb=40)], (30, 40), 1, True),
    ("another worker's activations add up", 100, 1000, [r("a", 30, act_mb=40, worker=2)], (30, 40), 1, False),
    ("a larger activation than the residents' grows the area", 100, 1000, [r("a", 30, act_mb=20)], (30, 41), 1, False),
]


@pytest.mark.parametrize("case,budget,free,residents,incoming,worker,expected", FITS, ids=[c[0] for c in FITS])
def test_fits_on_device(case, budget, free, residents, incoming, worker, expected):
    fp = Footprint(incoming[0] * MB, incoming[1] * MB)
    assert fits_on_device(budget * MB, free * MB, residents, fp, worker) is expected


def test_used_bytes_counts_weights_and_one_activation_area_per_worker():
    rs = [r("a", 10, act_mb=5), r("b", 20, act_mb=7), r("c", 1, act_mb=3, worker=2)]
    assert used_bytes(rs) == (10 + 20 + 1 + 7 + 3) * MB


# ---- find_model_to_evict ----------------------------------------------------------------

EVICT = [
    # (case, residents, incoming waiting, expected victim or None)
    ("least recently used first",
     [r("a", 10, last_used=30), r("b", 10, last_used=10), r("c", 10, last_used=20)], 1, "b"),
    ("pinned never", [r("a", 10, last_used=1, pinned=True), r("b", 10, last_used=5)], 1, "b"),
    ("only pinned left", [r("a", 10, pinned=True)], 1, None),
    ("another worker's models are not ours to evict",
     [r("a", 10, worker=2, last_used=1), r("b", 10, last_used=9)], 1, "b"),
    ("idle before busy, even if used longer ago",
     [r("a", 10, last_used=1, waiting=3), r("b", 10, last_used=50)], 5, "b"),
    ("a model with waiting requests is not evicted for one that has one", [r("a", 10, last_used=1, waiting=1)], 1,
     None),
    ("... but is for one with more waiting", [r("a", 10, last_used=1, waiting=2)], 3, "a"),
    ("reload cost counts as recency: the cheap reload goes first",
     [r("slow", 10, last_used=10, reload_s=30), r("fast", 10, last_used=20, reload_s=0.1)], 1, "fast"),
    ("a small reload cost does not reorder distant uses",
     [r("slow", 10, last_used=10, reload_s=2), r("fast", 10, last_used=20, reload_s=0.1)], 1, "slow"),
]


@pytest.mark.parametrize("case,residents,waiting,expected", EVICT, ids=[c[0] for c in EVICT])
def test_find_model_to_evict(case, residents, waiting, expected):
    victim = find_model_to_evict(residents, 1, waiting)
    assert (victim.name if victim else None) == expected


# ---- plan_load ----------------------------------------------------------------------------


def test_plan_loads_without_eviction_when_it_fits():
    plan = plan_load("x", Footprint(10 * MB), [r("a", 10)], worker=1, device="cpu", budget_bytes=100 * MB,
                     free_now_bytes=1 << 40)
    assert plan == LoadPlan(LOAD, ())


def test_plan_evicts_lru_until_it_fits_in_order():
    rs = [r("a", 30, last_used=3), r("b", 30, last_used=1), r("c", 30, last_used=2), r("p", 5, pinned=True)]
    plan = plan_load("x", Footprint(50 * MB), rs, worker=1, device="cpu", budget_bytes=100 * MB, free_now_bytes=1 << 40)
    assert plan.verdict == LOAD and plan.evict == ("b", "c")


def test_plan_counts_evicted_weights_as_free_device_memory():
    # The device itself is nearly full (free 5 MB); evicting "a" frees its 30 MB.
    plan = plan_load("x", Footprint(20 * MB), [r("a", 30)], worker=1, device="cuda:0", budget_bytes=1000 * MB,
                     free_now_bytes=5 * MB)
    assert plan.verdict == LOAD and plan.evict == ("a",)


def test_plan_waits_when_the_room_is_held_by_busier_models():
    plan = plan_load("x", Footprint(50 * MB), [r("a", 60, waiting=4)], worker=1, device="cpu",
                     budget_bytes=100 * MB, free_now_bytes=1 << 40, incoming_waiting=1)
    assert plan.verdict == WAIT and "a (4 waiting)" in plan.reason


def test_plan_refuses_what_pinned_models_leave_no_room_for_and_names_them():
    rs = [r("big-pin", 70, pinned=True), r("other", 20, worker=2), r("mine", 5)]
    plan = plan_load("x", Footprint(20 * MB), rs, worker=1, device="cpu", budget_bytes=100 * MB, free_now_bytes=1 << 40)
    assert plan.verdict == TOO_LARGE
    assert "x needs 20.0 MiB" in plan.reason and "budget of 100.0 MiB" in plan.reason
    assert "big-pin (70.0 MiB, pinned)" in plan.reason and "other (20.0 MiB, worker 2)" in plan.reason
    assert "mine" not in plan.reason  # it would be evicted: it does not hold the room


def test_plan_refuses_a_model_bigger_than_the_whole_budget():
    plan = plan_load("x", Footprint(90 * MB, 20 * MB), [], worker=1, device="cpu", budget_bytes=100 * MB,
                     free_now_bytes=1 << 40)
    assert plan.verdict == TOO_LARGE and "more than the whole cpu budget of 100.0 MiB" in plan.reason


def test_plan_says_when_other_processes_hold_the_device():
    plan = plan_load("x", Footprint(50 * MB), [], worker=1, device="cuda:0", budget_bytes=1000 * MB,
                     free_now_bytes=10 * MB)
    assert plan.verdict == TOO_LARGE and "only 10.0 MiB is free on the device" in plan.reason


# ---- estimate -------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((100, 10), np.float32), "ids": np.zeros(8, np.int64)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "2_Dense").mkdir()
    save_file({"d": np.zeros((4, 4), np.float16)}, str(tmp_path / "2_Dense" / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 10, "intermediate_size": 40, "num_attention_heads": 2, "max_position_embeddings": 64}))
    return tmp_path


def test_weights_from_headers_by_dtype(model_dir: Path):
    assert weights_bytes(model_dir) == 100 * 10 * 4 + 8 * 8 + 16 * 2
    # Cast to bf16: floats at 2 bytes, integer tensors unchanged.
    assert weights_bytes(model_dir, "bfloat16") == 100 * 10 * 2 + 8 * 8 + 16 * 2


def test_activation_allowance_follows_the_batch_budget(model_dir: Path):
    fp = estimate_footprint(model_dir, "sentence-transformers", max_batch_tokens=1 << 20, micro_batch_items=8)
    per_token = 4 * 10 + 40 + 2 * 2 * 64
    assert fp.activation_bytes == 8 * 64 * per_token * 4
    capped = estimate_footprint(model_dir, "sentence-transformers", max_batch_tokens=100, micro_batch_items=8)
    assert capped.activation_bytes == 100 * per_token * 4
    short = estimate_footprint(model_dir, "sentence-transformers", micro_batch_items=8, max_seq_len=16)
    assert short.activation_bytes == 8 * 16 * (4 * 10 + 40 + 2 * 2 * 16) * 4


def test_a_bad_header_is_an_error_not_a_guess(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"junk")
    with pytest.raises(ValueError, match="over the format's limit"):
        weights_bytes(tmp_path)
    err = load_error("m", "cpu", ValueError("bad header"))
    assert isinstance(err, ModelLoadFailed) and "m" in err.message


def test_estimates_are_corrected_by_what_was_measured():
    est = Estimates()
    header = Footprint(100, 7)
    assert est.estimate("a", "st", header) == Footprint(100, 7)
    est.record("a", "st", header, 50)
    assert est.estimate("a", "st", header) == Footprint(50, 7)  # exact on reload
    assert est.estimate("b", "st", Footprint(200, 9)) == Footprint(100, 9)  # same runtime: scaled
    assert est.estimate("c", "other", Footprint(200, 9)) == Footprint(200, 9)


def test_one_outlier_measurement_sizes_no_other_model():
    """Issue 42: a model whose headers said 4 bytes and which measured 1.74 GB (weights
    transformers initialised at random) made every other model of its runtime 4e8
    times too large to load. A ratio outside RATIO_BOUNDS corrects no other estimate;
    within them the runtime's models' median does, so no one model moves it past the
    bounds, and one outlier among several moves it little."""
    est = Estimates()
    est.record("foo", "st", Footprint(4, 7), 1_740_000_000)
    assert est.estimate("foo", "st", Footprint(4, 7)) == Footprint(1_740_000_000, 7)  # its own reload: as measured
    assert est.estimate("twin", "st", Footprint(90_000_000, 9)) == Footprint(90_000_000, 9)
    low, high = RATIO_BOUNDS
    est.record("a", "st", Footprint(100), int(100 * high))  # alone at the bound: it scales the others by it
    assert est.ratio("st") == high
    est.record("b", "st", Footprint(100), 200)  # bf16 stored, fp32 loaded
    est.record("c", "st", Footprint(100), 210)
    assert est.ratio("st") == 2.1  # the median of 2.0, 2.1 and 4.0
    assert est.estimate("twin", "st", Footprint(90_000_000, 9)) == Footprint(189_000_000, 9)
    est.record("a", "st", Footprint(100), 100)  # reloaded and measured again: its latest ratio counts
    assert est.ratio("st") == 2.0
    est.record("d", "st", Footprint(100), int(100 * low) - 1)  # under the bounds: not used either
    assert est.ratio("st") == 2.0 and est.ratio("other") == 1.0


# ---- OOM --------------------------------------------------------------------------------------


def test_an_oom_batch_is_split_until_it_fits_and_answers_stay_in_order():
    calls, freed = [], []

    def run(batch):
        calls.append(len(batch))
        if len(batch) > 2:
            raise MemoryError("no room")
        return [x * 10 for x in batch]

    assert run_split_on_oom(run, list(range(7)), lambda: freed.append(1)) == [x * 10 for x in range(7)]
    assert calls == [7, 3, 1, 2, 4, 2, 2] and len(freed) == 3


def test_a_single_request_that_does_not_fit_raises_and_other_errors_are_not_retried():
    def oom(batch):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(RuntimeError, match="out of memory"):
        run_split_on_oom(oom, [1])
    calls = []

    def broken(batch):
        calls.append(len(batch))
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        run_split_on_oom(broken, [1, 2, 3, 4])
    assert calls == [4]


def test_out_of_memory_kinds():
    import torch

    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    err = load_error("m", "cuda:0", torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert isinstance(err, ModelTooLarge) and "out of memory loading m on cuda:0" in err.message


# ---- device budget ----------------------------------------------------------------------------


def test_cpu_budget_configured_or_a_fraction_of_available_ram():
    import psutil

    fixed = device_budget("cpu", cpu_budget_bytes=123 * MB)
    assert fixed.budget_bytes == 123 * MB and fixed.source == "configured"
    avail = psutil.virtual_memory().available
    frac = device_budget("cpu", cpu_budget_fraction=0.25, fleet_used_bytes=100 * MB)
    # A quarter of (available + what fleet already holds), within RAM churn from other processes.
    assert abs(frac.budget_bytes - 0.25 * (avail + 100 * MB)) < 0.05 * avail
    assert 0 < frac.free_now() < avail
    assert DeviceMemory.unlimited().budget_bytes > 1 << 60


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() == 0, reason="needs an NVIDIA GPU with a driver (NVML found none)")
def test_nvml_budget_matches_torch_and_sees_an_allocation():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("NVML sees a GPU but this torch build has no CUDA")
    mem = device_budget("cuda:0", gpu_reserve_bytes=256 * MB)
    _, total = torch.cuda.mem_get_info(0)
    # NVML and torch count the same memory; the budget takes the smaller total, minus the reserve.
    assert mem.source == "nvml" and total * 0.98 - 256 * MB <= mem.budget_bytes <= total - 256 * MB
    before = mem.free_now()
    block = torch.empty(512 * MB, dtype=torch.uint8, device="cuda:0")
    during = mem.free_now()
    assert before - during >= 500 * MB  # NVML and torch both see the new 512 MiB
    del block
    after = mem.free_now()  # free_now empties torch's cache: the block counts as free again
    assert after - during >= 500 * MB


def test_load_lock_excludes_another_process(tmp_path: Path):
    lock = LoadLock.for_device(tmp_path, "cuda:1")
    assert lock.path == tmp_path / "run" / "load-cuda-1.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock.path)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(0.6)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with lock.held():
            waited = time.monotonic() - t0
        assert waited > 0.3  # it had to wait for the other process's load
    finally:
        holder.wait(timeout=10)


# ---- pins on disk --------------------------------------------------------------------------------


def test_pins_persist_per_device_and_survive_a_new_reader(tmp_path: Path):
    PinStore(tmp_path).add("tiny-a", "cpu")
    PinStore(tmp_path).add("tiny-b", "cuda:0")
    again = PinStore(tmp_path)
    assert set(again.load()) == {"tiny-a", "tiny-b"}
    assert again.for_device("cpu") == ["tiny-a"] and again.for_device("cuda:0") == ["tiny-b"]
    assert again.remove("tiny-a").device == "cpu" and again.remove("tiny-a") is None
    assert PinStore(tmp_path).for_device("cpu") == []
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_pins_refuse_bad_names_and_set_a_damaged_file_aside(tmp_path: Path):
    with pytest.raises(BadRequest, match="invalid model name"):
        PinStore(tmp_path).add("../etc", "cpu")
    # A damaged file (not JSON, or a bad name inside) is set aside, never read as pins
    # (tests/test_pins.py has the details: logged once, every damaged copy kept).
    for damaged in ("{not json", json.dumps({"format": 1, "pins": {"Bad/Name": {"device": "cpu", "at": ""}}})):
        (tmp_path / "pins.json").write_text(damaged)
        assert PinStore(tmp_path).load() == {} and not (tmp_path / "pins.json").exists()
    assert len(list(tmp_path.glob("pins.json.damaged-*"))) == 2


# ---- ps view and admin worker choice -----------------------------------------------------------------


def _worker(wid, device, models, *, budget=100 * MB, used=0, up=True, loading=""):
    return {"worker": wid, "device": device, "up": up, "models": models, "budget_bytes": budget, "used_bytes": used,
            "loading": loading}


def test_device_rows_sum_workers_per_device():
    state = {"workers": [
        _worker(1, "cpu", {"a": {"bytes": 10, "pinned": True, "last_used": 5.0, "served": 3}}, used=40),
        _worker(2, "cpu", {"b": {"bytes": 20, "pinned": False, "last_used": 9.0, "served": 1}}, used=30, loading="c"),
        _worker(3, "cuda:0", {}, budget=1000, used=0),
        _worker(4, "cpu", {"z": {"bytes": 1}}, used=999, up=False),
    ]}
    cpu, gpu = device_rows(state)
    assert (cpu["device"], cpu["budget_bytes"], cpu["used_bytes"]) == ("cpu", 100 * MB, 70)
    assert [m["name"] for m in cpu["models"]] == ["c", "b", "a"]  # loading first, then most recently used
    assert cpu["models"][2]["pinned"] is True and cpu["models"][1]["pinned"] is False
    assert gpu == {"device": "cuda:0", "budget_bytes": 1000, "used_bytes": 0, "models": []}


def test_choose_worker_prefers_a_holder_then_the_most_room():
    ws = [_worker(1, "cpu", {}, used=90 * MB), _worker(2, "cuda:0", {}, used=10 * MB),
          _worker(3, "cuda:1", {"m": {}}, used=50 * MB), _worker(4, "cuda:0", {}, up=False)]
    assert choose_worker(ws, "m", None)["worker"] == 3
    assert choose_worker(ws, "x", None)["worker"] == 2
    assert choose_worker(ws, "m", "cpu")["worker"] == 1
    assert device_room(ws[0], ws) == 10 * MB
    with pytest.raises(BadRequest, match="no worker runs on device 'cuda:7'"):
        choose_worker(ws, "m", "cuda:7")
    with pytest.raises(Unavailable):
        choose_worker([_worker(1, "cpu", {}, up=False)], "m", None)
