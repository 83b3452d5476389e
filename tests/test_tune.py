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

from bench.tune import (
    DIMS, Candidate, Measurement, Space, coordinate_search, default_space, dtype_checks, start_point,
)
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

        def measure(c):
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
    from runtimes.device import device_class

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
    from runtimes.device import device_class
    from runtimes.resolve import store_resolver

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
    from runtimes.device import device_class

    home = tmp_path / "home"
    home.mkdir()
    klass = device_class("cpu")
    write_tuned_profile(home, MODEL, klass, Profile(max_batch_items=16, max_batch_tokens=2048, dtype="float32",
                                                    linger_ms=0.0), info())
    d = start_daemon(home)
    try:
        r = httpx.post(d.url + "/v1/embed", json={"model": MODEL, "inputs": ["hello", "world"]}, timeout=120)
        assert r.status_code == 200, r.text
        ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
        models = [w["models"][MODEL] for w in ps["workers"] if MODEL in w["models"]]
        assert models and models[0]["profile"] == klass
        assert models[0]["dtype"] == "float32"  # the tuned profile's explicit dtype, not the default's auto
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
