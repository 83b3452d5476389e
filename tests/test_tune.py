"""fleetctl tune: the search on a synthetic cost model, tuned profiles in models.toml,
the worker's profile choice by device class, and /v1/ps reporting it end to end."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from fleet.bench.tune import (
    Target, default_candidate, finite, keep_default_unless_beaten, model_params, over_budget, ratio_vs_default,
    result_doc, search_profile, search_space, seed_from_default, tuned_info,
)
from fleet.bench.tune_measure import BenchKnobs, dtype_checks, engine_tables, not_as_named, served_engine
from fleet.bench.tune_search import DIMS, Candidate, Measurement, Space, coordinate_search, default_space, start_point
from fleet.catalog import Profile, TunedInfo, load_catalog, select_profile, write_tuned_profile
from fleet.errors import BadRequest, ModelNotFound

MODEL = "all-minilm-l6-v2"

# ---- the search on a synthetic cost model ---------------------------------------------------

SPACE = Space(
    dtypes=("bfloat16", "float32"),
    max_batch_tokens=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
    max_batch_items=(16, 32, 64, 128, 256, 512),
    linger_ms=(0.0, 1.0, 2.0, 5.0, 10.0),
    workers=(1, 2),
)
OPTIMUM = Candidate("bfloat16", 8192, 64, 2.0, 1)


def synthetic(c: Candidate) -> float:
    """Knee tokens/s of a made-up server: a product of unimodal terms, peak at OPTIMUM
    (bf16 2.4x fp32, batch tokens and items peak at 8192 / 64 on a log scale,
    linger 2 ms, one worker)."""
    dt = 2.4 if c.dtype == "bfloat16" else 1.0
    tok = math.exp(-0.5 * (math.log2(c.max_batch_tokens / 8192) / 1.2) ** 2)
    items = math.exp(-0.5 * (math.log2(c.max_batch_items / 64) / 1.5) ** 2)
    linger = 1.0 - 0.04 * abs(math.log((c.linger_ms + 0.5) / 2.5))
    workers = 1.0 if c.workers == 1 else 0.8
    return 1000.0 * dt * tok * items * linger * workers


def grid() -> list[Candidate]:
    import itertools

    return [Candidate(*v) for v in itertools.product(*(SPACE.values(d) for d in DIMS))]


def test_synthetic_optimum_is_the_grid_max():
    assert max(grid(), key=synthetic) == OPTIMUM


@pytest.mark.parametrize("start", [
    Candidate("float32", 65536, 512, 10.0, 2),
    Candidate("float32", 1024, 16, 0.0, 1),
    Candidate("bfloat16", 32768, 256, 1.0, 1),
])
def test_coordinate_search_finds_the_optimum_without_a_grid(start):
    calls: list[Candidate] = []

    def measure(c):
        calls.append(c)
        return Measurement(synthetic(c), 100.0)

    result = coordinate_search(SPACE, start, measure, max_evals=60, min_gain=0.01)
    assert result.stopped == "converged"
    # Within 2 % of the true optimum, far fewer measurements than the grid.
    assert result.best_measurement.tokens_per_s >= 0.98 * synthetic(OPTIMUM)
    assert result.best == OPTIMUM
    assert len(calls) == len(set(calls)), "a candidate was measured twice"
    assert len(calls) <= SPACE.grid_size // 20, (len(calls), SPACE.grid_size)


def test_coordinate_search_under_noise_stays_near_the_optimum():
    """±4 % multiplicative noise (a shared box): the winner is within 12 % of the optimum."""
    for seed in range(5):
        rng = random.Random(seed)

        def measure(c, rng=rng):
            return Measurement(synthetic(c) * rng.uniform(0.96, 1.04), 100.0)

        result = coordinate_search(SPACE, Candidate("float32", 65536, 512, 10.0, 2), measure,
                                   max_evals=60, min_gain=0.05)
        assert synthetic(result.best) >= 0.88 * synthetic(OPTIMUM), (seed, result.best)


def test_budget_stops_the_search_and_keeps_the_best_so_far():
    measured = []

    def measure(c):
        measured.append(c)
        return Measurement(synthetic(c), 50.0)

    result = coordinate_search(SPACE, Candidate("float32", 1024, 16, 0.0, 1), measure, max_evals=4)
    assert result.stopped == "budget"
    assert len(measured) == 4
    assert result.best_measurement.tokens_per_s == max(synthetic(c) for c in measured)


def test_failed_candidates_never_win_and_seed_is_free():
    start = Candidate("bfloat16", 8192, 64, 2.0, 1)
    measured = []

    def measure(c):
        measured.append(c)
        return Measurement(0.0, math.inf, ok=False, note="crashed")

    result = coordinate_search(SPACE, start, measure, seed={start: Measurement(500.0, 80.0)}, max_evals=50)
    assert start not in measured  # the seeded start is not measured again
    assert result.best == start and result.best_measurement.tokens_per_s == 500.0
    assert result.trials[0].move == "start" and all(not t.measurement.ok for t in result.trials[1:])


def test_p95_breaks_ties():
    start = Candidate("float32", 4096, 64, 0.0, 1)

    def measure(c):  # flat throughput, lower p95 only with linger 1 ms
        return Measurement(1000.0, 40.0 if c.linger_ms == 1.0 else 100.0)

    result = coordinate_search(SPACE, start, measure, max_evals=40, min_gain=0.05)
    assert result.best.linger_ms == 1.0


def test_start_point_from_size_and_device():
    space = default_space("cpu", 2, ("bfloat16", "float32"))
    small = start_point(space, params=22_700_000, device="cpu", default={"max_batch_items": 256, "linger_ms": 1.0,
                                                                          "dtype": "bfloat16"})
    big = start_point(space, params=335_000_000, device="cpu", default={"max_batch_items": 256, "dtype": "bfloat16"})
    gpu = start_point(default_space("cuda:0", 16, ("bfloat16", "float32")), params=22_700_000, device="cuda:0",
                      default={"dtype": "bfloat16"})
    assert small.max_batch_tokens == 8192 and small.max_batch_items == 256 and small.dtype == "bfloat16"
    assert big.max_batch_tokens < small.max_batch_tokens  # a larger model starts with smaller batches
    assert gpu.max_batch_tokens > small.max_batch_tokens  # a GPU starts wider
    assert space.workers == (1, 2) and space.snap(replace(small, max_batch_tokens=9000)).max_batch_tokens == 8192


def test_dtype_check_lines_are_read_from_the_daemon_log():
    log = ("INFO fleet.worker dtype check all-minilm-l6-v2 bfloat16: min cosine 0.999965 (need 0.9999) -> keep\n"
           "INFO fleet.worker dtype check other bfloat16: min cosine 0.9 (need 0.9999) -> fp32\n")
    assert dtype_checks(log, MODEL) == ["bfloat16: min cosine 0.999965 (need 0.9999) -> keep"]


def test_the_engine_verdict_table_is_read_from_the_daemon_log():
    """fleet.runtimes.adapters.engines.choose's verdict line, in the log's JSON lines and readable lines
    alike; another model's, other engine lines and a later verdict's precedence."""
    import json

    measured = {"torch float32": "1 short=9.10ms 32 texts=120.00ms",
                "openvino bfloat16": "1 short=4.00ms 32 texts=50.00ms",
                "torch bfloat16": "refused: min cosine 0.99 (need 0.9999)"}
    log = "\n".join([
        json.dumps({"level": "info", "logger": "fleet.worker", "msg": "engine other: torch float32, fastest that "
                    "agrees ({'torch float32': 'x'})"}),
        json.dumps({"level": "info",
                    "msg": f"engine check {MODEL} openvino bfloat16: min cosine 0.99999 -> candidate"}),
        json.dumps({"level": "info", "msg": f"engine {MODEL}: openvino bfloat16, fastest that agrees ({measured!r})",
                    "pid": 7}),
        "not json {",
    ])
    assert engine_tables(log, MODEL) == measured
    kept = {"openvino float32": "1 short=5.00ms"}
    plain = f"19:00:01 INFO    fleet.worker[12] engine {MODEL}: openvino float32 (kept verdict: {kept!r})"
    assert engine_tables(log + "\n" + plain, MODEL) == kept  # the last load's verdict
    assert engine_tables(log, "no-such-model") == {} and engine_tables("", MODEL) == {}


@pytest.mark.parametrize("record, served", [
    ({"dtype": "bfloat16", "engine": {"engine": "openvino", "by": "measured", "tokens_per_s": 10836, "ms": {}}},
     {"engine": "openvino", "dtype": "bfloat16", "by": "measured", "tokens_per_s": 10836.0}),
    ({"dtype": "float32", "engine": {"engine": "torch", "by": "profile", "tokens_per_s": 0, "ms": {}}},
     {"engine": "torch", "dtype": "float32", "by": "profile", "tokens_per_s": 0.0}),
    # No engines weighed (a GPU, a CPU without OpenVINO): torch, as Adapter.engine says.
    ({"dtype": "bfloat16"}, {"engine": "torch", "dtype": "bfloat16", "by": "", "tokens_per_s": 0.0}),
])
def test_the_served_engine_is_read_from_a_ps_record(record, served):
    assert served_engine(record) == served


@pytest.mark.parametrize("candidate, why", [
    (Candidate("auto", 8192, 64, 0.0, 1), ""),  # the default: whatever its load chose
    (Candidate("bfloat16", 8192, 64, 0.0, 1, "openvino"), ""),
    (Candidate("float32", 8192, 64, 0.0, 1, "openvino"), "daemon serves openvino bfloat16, not openvino float32"),
    (Candidate("bfloat16", 8192, 64, 0.0, 1, "torch"), "daemon serves openvino bfloat16, not torch bfloat16"),
])
def test_a_candidate_is_measured_only_on_the_engine_and_dtype_it_names(candidate, why):
    assert not_as_named(candidate, {"engine": "openvino", "dtype": "bfloat16", "by": "profile"}) == why


# ---- the run: the default first, the space from what it served, the choice ----------------

SHIPPED = {"dtype": "auto", "max_batch_tokens": 32768, "max_batch_items": 256, "linger_ms": 1.0}


def test_the_default_candidate_is_the_shipped_profile_on_one_worker():
    assert default_candidate(SHIPPED) == Candidate("auto", 32768, 256, 1.0, 1)
    assert default_candidate(SHIPPED).engine == "auto" and default_candidate(SHIPPED).profile()["engine"] == "auto"
    assert default_candidate({**SHIPPED, "linger_ms": 2}).linger_ms == 2.0
    assert default_candidate({**SHIPPED, "engine": "torch"}).engine == "torch"  # a shipped forced engine stays


@pytest.mark.parametrize("device, cores, served, workers_max, dtypes, workers", [
    ("cpu", 2, "bfloat16", None, ("bfloat16", "float32"), (1, 2)),
    ("cpu", 8, "float32", None, ("float32",), (1, 2, 3, 4)),
    ("cpu", 8, "float16", 2, ("float16", "float32"), (1, 2)),
    ("cpu", 8, "float32", 0, ("float32",), (1, 2, 3, 4)),  # 0: no cap
    ("cuda:0", 16, "bfloat16", 1, ("bfloat16", "float32"), (1,)),
    ("cuda:0", 16, "bfloat16", None, ("bfloat16", "float32"), (1, 2)),
])
def test_the_space_follows_the_served_dtype_and_the_workers_cap(device, cores, served, workers_max, dtypes, workers):
    space = search_space(device, cores, served, workers_max)
    assert space.dtypes == dtypes and space.workers == workers
    assert space.max_batch_tokens == default_space(device, cores).max_batch_tokens


@pytest.mark.parametrize("default, seeded", [
    (Candidate("auto", 32768, 256, 1.0, 1), True),
    (Candidate("auto", 30000, 256, 1.0, 1), False),  # off the batch-tokens ladder
    (Candidate("auto", 8192, 100, 1.0, 1), False),  # off the batch-items ladder
    (Candidate("auto", 8192, 64, 3.0, 1), False),  # off the linger ladder
])
@pytest.mark.parametrize("served_engine_, held", [("openvino", "openvino"), ("torch", "torch"), ("", "torch")])
def test_the_default_seeds_the_search_only_on_the_ladders(default, seeded, served_engine_, held):
    m = Measurement(500.0, 80.0, dtype="bfloat16", engine=served_engine_)
    point, seed = seed_from_default(search_space("cpu", 2, "bfloat16"), default, "bfloat16", m)
    assert point == replace(default, dtype="bfloat16", engine=held)
    assert seed == ({point: m} if seeded else {})


BEST, DEFAULT = Candidate("bfloat16", 8192, 64, 2.0, 1), Candidate("bfloat16", 32768, 256, 1.0, 1)


@pytest.mark.parametrize("best_m, default_m, keeps_default", [
    (Measurement(900.0, 50.0), Measurement(500.0, 80.0), False),  # beaten
    (Measurement(500.0, 80.0), Measurement(500.0, 80.0), True),  # a tie is not a win
    (Measurement(400.0, 80.0), Measurement(500.0, 80.0), True),  # the budget ran out on a worse point
    (Measurement(500.0, 60.0), Measurement(500.0, 80.0), False),  # same knee, lower p95
    (Measurement(900.0, 50.0), Measurement(0.0, math.inf, ok=False), False),  # no default knee
    (Measurement(0.0, math.inf, ok=False), Measurement(0.0, math.inf, ok=False), False),  # nothing served
])
def test_the_default_is_kept_unless_beaten(best_m, default_m, keeps_default):
    got = keep_default_unless_beaten(BEST, best_m, DEFAULT, default_m)
    assert got == ((DEFAULT, default_m) if keeps_default else (BEST, best_m))


@pytest.mark.parametrize("chosen, default, ratio", [
    (Measurement(900.0, 50.0), Measurement(300.0, 80.0), 3.0),
    (Measurement(300.0, 50.0), Measurement(300.0, 80.0), 1.0),
    (Measurement(900.0, 50.0), Measurement(0.0, 80.0), None),
    (Measurement(900.0, 50.0), Measurement(300.0, 80.0, ok=False), None),
])
def test_ratio_vs_default(chosen, default, ratio):
    assert ratio_vs_default(chosen, default) == ratio


@pytest.mark.parametrize("now, deadline, seconds, over", [
    (100.0, 100.0, [], False),  # nothing measured yet: only a passed deadline stops
    (100.1, 100.0, [], True),
    (100.0, 150.0, [40.0], False),
    (100.0, 150.0, [60.0], True),
    (100.0, 150.0, [10.0, 60.0, 20.0], False),  # the median (20 s), not the slowest
    (100.0, 150.0, [10.0, 60.0], True),  # of two, the upper one
])
def test_over_budget_looks_one_typical_candidate_ahead(now, deadline, seconds, over):
    assert over_budget(now, deadline, seconds) is over


@pytest.mark.parametrize("value, json_value", [
    (math.inf, None), (math.nan, None), (1.5, 1.5), ("inf", "inf"),
    ({"p95": math.inf, "n": [1.0, -math.inf]}, {"p95": None, "n": [1.0, None]}),
])
def test_finite_turns_inf_and_nan_into_null(value, json_value):
    assert finite(value) == json_value


def test_model_params_from_the_safetensors_sizes(tmp_path: Path):
    assert model_params(tmp_path) == 1
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.safetensors").write_bytes(b"\0" * 400)
    (tmp_path / "vocab.txt").write_bytes(b"\0" * 10_000)
    assert model_params(tmp_path) == 1100


def target(device: str = "cpu", cores: int = 2) -> Target:
    return Target(model=MODEL, task="embed", folder=Path("/nonexistent"), device=device, device_class="cpu-x",
                  cores=cores, home=Path("/nonexistent"), default=dict(SHIPPED), params=22_700_000)


def served_as_bf16(c: Candidate) -> Measurement:
    return Measurement(synthetic(replace(c, dtype="bfloat16" if c.dtype == "auto" else c.dtype)), 100.0,
                       dtype="bfloat16" if c.dtype == "auto" else c.dtype, seconds=2.0)


def test_a_run_measures_the_default_first_then_searches_from_the_start_point():
    measured, events = [], []

    def measure(c):
        measured.append(c)
        return served_as_bf16(c)

    t = search_profile(target(), measure, deadline=math.inf, max_candidates=60, min_gain=0.01,
                       on_default=lambda c, m: events.append(("default", c)),
                       on_trial=lambda tr: events.append(("trial", tr.candidate)))
    assert measured[0] == Candidate("auto", 32768, 256, 1.0, 1) and events[0] == ("default", measured[0])
    assert t.space.dtypes == ("bfloat16", "float32")
    assert t.search.start == start_point(t.space, params=22_700_000, device="cpu",
                                         default={**SHIPPED, "dtype": "bfloat16", "engine": "torch"})
    assert t.chosen == replace(OPTIMUM, engine="torch") and t.search.stopped == "converged"
    assert t.ratio == t.chosen_measurement.tokens_per_s / t.default_measurement.tokens_per_s > 1
    assert t.confirm is None
    assert [c for kind, c in events if kind == "trial"] == measured[1:]


def test_a_run_counts_the_default_in_max_candidates():
    measured = []
    t = search_profile(target(), lambda c: measured.append(c) or served_as_bf16(c), deadline=math.inf,
                       max_candidates=4, min_gain=0.01)
    assert len(measured) == 4 and t.search.stopped == "budget"


def test_a_run_stops_before_a_candidate_that_would_pass_the_deadline():
    now = [0.0]

    def measure(c):
        now[0] += 30.0  # each candidate takes 30 s of the fake clock
        return replace(served_as_bf16(c), seconds=30.0)

    t = search_profile(target(), measure, deadline=100.0, max_candidates=60, min_gain=0.01, clock=lambda: now[0])
    # The default (0-30 s), then candidates while the clock plus 30 s stays within 100 s.
    assert len(t.search.trials) == 2 and t.search.stopped == "budget" and now[0] == 90.0


def test_a_run_keeps_the_default_when_nothing_beats_it():
    def measure(c):
        m = served_as_bf16(c)
        return replace(m, tokens_per_s=5000.0) if c.dtype == "auto" else m

    t = search_profile(target(), measure, deadline=math.inf, max_candidates=60, min_gain=0.01)
    assert t.chosen == Candidate("bfloat16", 32768, 256, 1.0, 1, "torch")
    assert t.chosen_measurement.tokens_per_s == 5000.0
    assert t.ratio == 1.0


def served_on_openvino(c: Candidate) -> Measurement:
    """A daemon on a box with OpenVINO: the default (engine auto) loads OpenVINO bf16 by
    measurement; a candidate serves the engine and dtype it names."""
    if c.engine == "auto":
        return replace(served_as_bf16(c), engine="openvino", engine_by="measured", engine_tokens_per_s=10836.4)
    return replace(served_as_bf16(c), engine=c.engine, engine_by="profile")


def test_the_engine_the_default_served_is_held_and_named_by_every_candidate():
    measured = []
    t = search_profile(target(), lambda c: measured.append(c) or served_on_openvino(c), deadline=math.inf,
                       max_candidates=60, min_gain=0.01)
    assert measured[0].engine == "auto" and measured[0].profile()["engine"] == "auto"  # the default as shipped
    assert len(measured) > 3 and {c.engine for c in measured[1:]} == {"openvino"}
    assert {c.dtype for c in measured[1:]} == {"bfloat16", "float32"}  # the float32 rung is OpenVINO's f32
    assert all(c.profile()["engine"] == "openvino" for c in measured[1:])
    assert t.search.start.engine == "openvino" and t.chosen == replace(OPTIMUM, engine="openvino")
    assert t.chosen.runs_on == "openvino bfloat16" and t.chosen.profile()["engine"] == "openvino"
    # What --write stores: the profile names the engine; the tuned table says where it came from.
    table = {"openvino bfloat16": "1 short=4.00ms 32 texts=50.00ms", "torch float32": "1 short=9.00ms"}
    got = tuned_info(t, device="cpu", cores=2, dtype_log=[], budget_minutes=8.0, versions={}, tuned_at="x",
                     engine_table=table)
    assert (got.engine_choice, got.engine_by, got.engine_tokens_per_s) == ("openvino bfloat16", "measured", 10836.4)
    assert got.engine_table == table
    doc = result_doc(target(), t, budget_minutes=8.0, knobs=BenchKnobs(), dtype_log=[], machine={}, versions={},
                     command=[], engine_table=table)
    assert doc["chosen"]["candidate"]["engine"] == "openvino" and doc["engine_table"] == table
    assert {r["candidate"]["engine"] for r in doc["trials"]} == {"openvino"}
    assert doc["default"]["measurement"]["engine"] == "openvino"


def test_a_run_refuses_a_default_that_did_not_serve():
    with pytest.raises(BadRequest, match="the default profile did not serve: boom"):
        search_profile(target(), lambda c: Measurement(0.0, math.inf, ok=False, note="boom"),
                       deadline=math.inf, max_candidates=60, min_gain=0.01)


def test_a_failed_default_that_served_a_dtype_still_searches():
    def measure(c):
        return Measurement(0.0, math.inf, dtype="float32", ok=False) if c.dtype == "auto" else served_as_bf16(c)

    t = search_profile(target(), measure, deadline=math.inf, max_candidates=60, min_gain=0.01)
    assert t.space.dtypes == ("float32",) and t.chosen_measurement.ok and t.ratio is None


def test_a_confirm_run_measures_the_default_then_the_choice_outside_the_budget():
    confirmed, events = [], []
    t = search_profile(target(), served_as_bf16, deadline=math.inf, max_candidates=5, min_gain=0.01,
                       confirm_with=lambda c: confirmed.append(c) or Measurement(123.0, 9.0),
                       on_confirm=lambda: events.append("confirm"))
    assert events == ["confirm"] and confirmed == [t.default, t.chosen]
    assert t.confirm["default"]["tokens_per_s"] == 123.0 and t.confirm["chosen"]["p95_ms"] == 9.0


def test_what_write_stores_and_what_the_results_hold():
    t = search_profile(target(cores=4), served_as_bf16, deadline=math.inf, max_candidates=5, min_gain=0.01)
    versions = {"fleet": "0.1", "torch": "2.13.0", "numpy": "2.0", "git_commit": "abc"}
    got = tuned_info(t, device="cpu", cores=4, dtype_log=["bfloat16: ok", "bfloat16: ok", "float32: ok"],
                     budget_minutes=8.0, versions=versions, tuned_at="2026-12-02T15:00:00Z")
    assert got.knee_tokens_per_s == round(t.chosen_measurement.tokens_per_s, 1)
    assert got.baseline_tokens_per_s == round(t.default_measurement.tokens_per_s, 1)
    assert got.candidates == 5 and got.workers == 1 and got.cpu_threads == 4
    assert got.dtype_check == "bfloat16: ok; float32: ok"
    # A load that weighed no engines (served_as_bf16 names none): torch, nothing measured.
    assert (got.engine_choice, got.engine_by, got.engine_tokens_per_s, got.engine_table) == \
        ("torch bfloat16", "", None, {})
    assert got.versions == {"fleet": "0.1", "torch": "2.13.0", "git_commit": "abc"}
    assert tuned_info(t, device="cuda:0", cores=4, dtype_log=[], budget_minutes=8.0, versions={},
                      tuned_at="x").cpu_threads == 0
    doc = result_doc(target(), t, budget_minutes=8.0, knobs=BenchKnobs(), dtype_log=[], machine={}, versions={},
                     command=["fleetctl", "tune", MODEL])
    assert doc["kind"] == "tune" and doc["device_class"] == "cpu-x" and doc["stopped"] == "budget"
    assert [r["index"] for r in doc["trials"]] == list(range(4))
    assert doc["default"]["candidate"]["dtype"] == "auto" and doc["ratio_vs_default"] == t.ratio


# ---- tuned profiles in models.toml ---------------------------------------------------------


def info(knee: float = 1234.5) -> TunedInfo:
    return TunedInfo(tuned_at="2026-12-02T15:00:00Z", knee_tokens_per_s=knee, knee_p95_ms=321.0, knee_rps=1.5,
                     baseline_tokens_per_s=1000.0, workers=1, cpu_threads=2, dtype_check="bfloat16: ok",
                     candidates=9, budget_minutes=8.0, versions={"torch": "2.13.0", "fleet": "0.1"})


def test_profile_round_trips_and_merges_with_the_shipped_entry(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text('# my overlay\n[models."all-minilm-l6-v2".profile]\nlinger_ms = 3.0\n')
    prof = Profile(max_batch_items=64, max_batch_tokens=8192, dtype="bfloat16", linger_ms=2.0)
    write_tuned_profile(home, MODEL, "cpu-test1", prof, info())
    # A second class and a rewrite of the first: one table each, comments kept.
    write_tuned_profile(home, MODEL, "cuda-sm90", replace_profile(prof, max_batch_items=512), info(9000.0))
    write_tuned_profile(home, MODEL, "cpu-test1", replace_profile(prof, max_batch_items=128), info(2000.0))
    text = (home / "models.toml").read_text()
    assert text.startswith("# my overlay\n")
    assert text.count('[models."all-minilm-l6-v2".profiles."cpu-test1"]') == 1
    tomllib.loads(text)

    entry = load_catalog(home).get(MODEL)
    shipped = load_catalog(tmp_path / "empty").get(MODEL)
    assert entry.source == shipped.source and entry.task == "embed"  # the shipped entry is kept
    assert entry.profile.linger_ms == 3.0  # the overlay's own profile key still merges
    assert entry.profiles["cpu-test1"] == replace_profile(prof, max_batch_items=128)
    assert entry.profiles["cuda-sm90"].max_batch_items == 512
    assert entry.tuned["cpu-test1"].knee_tokens_per_s == 2000.0
    assert entry.tuned["cpu-test1"].versions["torch"] == "2.13.0"


def test_a_profile_naming_its_engine_round_trips_with_its_tuned_table(tmp_path: Path):
    home = tmp_path / "home"
    prof = Profile(max_batch_items=64, max_batch_tokens=8192, dtype="bfloat16", engine="openvino", linger_ms=2.0)
    table = {"openvino bfloat16": "1 short=4.00ms 32 texts=50.00ms", "torch bfloat16": 'refused: "cosine" 0.99'}
    tuned = TunedInfo(tuned_at="2026-12-04T19:00:00Z", knee_tokens_per_s=9000.0, knee_p95_ms=80.0,
                      engine_choice="openvino bfloat16", engine_by="measured", engine_tokens_per_s=10836.4,
                      engine_table=table)
    write_tuned_profile(home, MODEL, "cpu-test1", prof, tuned)
    text = (home / "models.toml").read_text()
    assert 'engine = "openvino"' in text
    entry = load_catalog(home).get(MODEL)
    assert entry.profiles["cpu-test1"] == prof
    assert select_profile(entry, "cpu-test1")[0].engine == "openvino"
    assert entry.tuned["cpu-test1"] == tuned
    assert entry.profile.engine == "auto"  # the default profile, for every other class, still measures


def test_an_old_tuned_profile_without_engine_still_loads(tmp_path: Path):
    """As written before the engine was kept (the shipped file's tuned class, say): the
    engine comes from the entry's profile ("auto"), the tuned table reads without one."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(
        '[models."all-minilm-l6-v2".profiles."cpu-old"]\nmax_batch_items = 256\nmax_batch_tokens = 16384\n'
        'dtype = "bfloat16"\nlinger_ms = 1.0\n'
        '[models."all-minilm-l6-v2".tuned."cpu-old"]\ntuned_at = "2026-12-02T15:33:03Z"\n'
        'knee_tokens_per_s = 2689.5\nknee_p95_ms = 735.1\ndtype_check = "bfloat16: ok"\n'
        'versions = { "torch" = "2.13.0+cpu" }\n')
    entry = load_catalog(home).get(MODEL)
    prof, key = select_profile(entry, "cpu-old")
    assert key == "cpu-old" and prof.engine == "auto" and prof.dtype == "bfloat16"
    old = entry.tuned["cpu-old"]
    assert old.knee_tokens_per_s == 2689.5 and old.engine_choice == "" and old.engine_table == {}
    assert old.engine_tokens_per_s is None


def test_partial_class_profile_takes_the_rest_from_the_default(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text('[models."all-minilm-l6-v2".profiles."cpu-x"]\nlinger_ms = 7.0\n')
    entry = load_catalog(home).get(MODEL)
    got = entry.profiles["cpu-x"]
    assert got.linger_ms == 7.0
    assert got.max_batch_items == entry.profile.max_batch_items and got.max_batch_tokens == entry.profile.max_batch_tokens


def test_write_refuses_bad_class_and_unknown_models(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(BadRequest):
        write_tuned_profile(home, MODEL, "cpu/../x", Profile(), info())
    with pytest.raises(ModelNotFound):
        write_tuned_profile(home, "not-in-catalog", "cpu-x", Profile(), info())
    assert not (home / "models.toml").exists()  # nothing half-written
    # A model only in the store gets its entry written from the manifest's fields.
    write_tuned_profile(home, "mine", "cpu-x", Profile(max_batch_items=8), info(),
                        new_entry={"source": "path:/models/mine", "task": "embed", "runtime": "sentence-transformers"})
    entry = load_catalog(home).get("mine")
    assert select_profile(entry, "cpu-x") == (entry.profiles["cpu-x"], "cpu-x")
    assert entry.profiles["cpu-x"].max_batch_items == 8


def test_select_profile_by_device_class(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    write_tuned_profile(home, MODEL, "cpu-amx", Profile(max_batch_items=32, max_batch_tokens=4096), info())
    entry = load_catalog(home).get(MODEL)
    assert select_profile(entry, "cpu-amx") == (entry.profiles["cpu-amx"], "cpu-amx")
    prof, key = select_profile(entry, "cuda-sm80")
    assert key == "default" and prof == entry.profile


def test_shipped_catalog_has_a_tuned_profile_for_this_cpu_class():
    from fleet.runtimes.device import device_class

    shipped = load_catalog(Path("/nonexistent-fleet-home"))
    entry = shipped.get(MODEL)
    klass = device_class("cpu")
    if klass not in entry.profiles:
        pytest.skip(f"the shipped catalog is tuned for {sorted(entry.profiles)}, this CPU is {klass}")
    tuned = entry.tuned[klass]
    assert tuned.knee_tokens_per_s > 0 and tuned.tuned_at and tuned.versions


def test_resolver_picks_the_worker_device_class(tmp_path: Path):
    """runtimes.resolve on a real store: the profile of the worker's class, reported as such."""
    from fleet.config import load_settings
    from fleet.pull import ensure_model
    from fleet.store import Store
    from fleet.runtimes.device import device_class
    from fleet.runtimes.resolve import store_resolver

    home = tmp_path / "home"
    settings = load_settings(home=str(home))
    ensure_model(Store(settings.store_path), MODEL, catalog=load_catalog(home))
    default_spec = store_resolver(settings, "cpu")(MODEL)
    klass = device_class("cpu")
    write_tuned_profile(home, MODEL, klass, Profile(max_batch_items=48, max_batch_tokens=6144, dtype="float32",
                                                    linger_ms=4.0), info())
    spec = store_resolver(settings, "cpu")(MODEL)
    assert spec.extra["profile"] == klass
    assert (spec.profile.max_batch_items, spec.profile.max_batch_tokens, spec.profile.dtype, spec.profile.linger_ms) \
        == (48, 6144, "float32", 4.0)
    # The shipped file may tune this class too: the overlay's measured profile wins.
    assert default_spec.extra["profile"] in ("default", klass)


def replace_profile(p: Profile, **kw) -> Profile:
    import msgspec

    return Profile(**{**msgspec.structs.asdict(p), **kw})


# ---- end to end: /v1/ps reports the profile in use ------------------------------------------


def test_ps_reports_the_tuned_profile_in_use(tmp_path: Path):
    from conftest import start_daemon
    from fleet.runtimes.device import device_class

    home = tmp_path / "home"
    home.mkdir()
    klass = device_class("cpu")
    # As `fleetctl tune` writes it: the engine named with its dtype.
    write_tuned_profile(home, MODEL, klass, Profile(max_batch_items=16, max_batch_tokens=2048, dtype="float32",
                                                    engine="torch", linger_ms=0.0), info())
    d = start_daemon(home)
    try:
        r = httpx.post(d.url + "/v1/embed", json={"model": MODEL, "inputs": ["hello", "world"]}, timeout=120)
        assert r.status_code == 200, r.text
        ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
        models = [w["models"][MODEL] for w in ps["workers"] if MODEL in w["models"]]
        assert models and models[0]["profile"] == klass
        assert models[0]["dtype"] == "float32"  # the tuned profile's explicit dtype, not the default's auto
        # What the measurer reads: exactly the engine and dtype the profile names, forced.
        assert served_engine(models[0]) == {"engine": "torch", "dtype": "float32", "by": "profile", "tokens_per_s": 0.0}
        assert models[0]["settings"]["engine"] == "torch"
        out = subprocess.run([sys.executable, "-m", "fleetctl", "ps"], env={**os.environ, "FLEET_URL": d.url, "COLUMNS": "250"},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "profile" in out.stdout and klass in out.stdout
    finally:
        d.stop()


# ---- the CLI refuses what it cannot tune, before starting anything --------------------------


def _tune(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_HOME": str(home)}
    env.pop("FLEET_URL", None)
    return subprocess.run([sys.executable, "-m", "fleetctl", "tune", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_refuses_unknown_models_bad_options_and_unbenchable_tasks(tmp_path: Path):
    home = tmp_path / "home"
    r = _tune(home, "no-such-model")
    assert r.returncode == 1 and "neither in the catalog nor in the store" in r.stderr
    r = _tune(home, "Bad/Name")
    assert r.returncode == 1 and "invalid model name" in r.stderr
    r = _tune(home, MODEL, "--budget-minutes", "0")
    assert r.returncode == 2
    classify = next(e.name for e in load_catalog(home).all() if e.task in ("classify", "extract"))
    r = _tune(home, classify)
    assert r.returncode == 1 and "the bench measures" in r.stderr
    assert not (home / "models.toml").exists()


def test_user_profile_keys_win_over_shipped_tuned_classes(tmp_path: Path):
    """An overlay's explicit `profile` keys apply on top of the shipped file's tuned classes."""
    home = tmp_path / "home"
    home.mkdir()
    shipped = tmp_path / "shipped.toml"
    shipped.write_text('[models."m"]\nsource = "path:/x"\ntask = "embed"\nruntime = "sentence-transformers"\n'
                       '[models."m".profile]\ndtype = "auto"\n'
                       '[models."m".profiles."cpu-x"]\ndtype = "bfloat16"\nmax_batch_items = 32\n')
    assert load_catalog(home, shipped=shipped).get("m").profiles["cpu-x"].dtype == "bfloat16"
    (home / "models.toml").write_text('[models."m".profile]\ndtype = "float32"\n')
    entry = load_catalog(home, shipped=shipped).get("m")
    assert entry.profiles["cpu-x"].dtype == "float32" and entry.profiles["cpu-x"].max_batch_items == 32
