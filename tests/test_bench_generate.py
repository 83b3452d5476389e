"""`fleetctl bench --task generate` end to end: the real CLI process streams completions
from a real daemon serving a tiny generator (CPU, seconds) and reports the generation
numbers (output tokens/s, time to first token, inter-token gaps) at the knee, as the
embed bench does: JSON under the results folder (or --out), tables of 80 columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import start_daemon
from tests.gen_models import build_llama, never_ending, pull

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-gen"


@pytest.fixture(scope="module")
def gen_url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("bench-gen")
    # Never ends early: every request yields exactly --max-tokens tokens to count.
    folder = never_ending(build_llama(root / MODEL))
    pull(root / "home", folder, MODEL)
    d = start_daemon(root / "home", extra_env={"FLEET_PRELOAD": MODEL, "FLEET_CPU_THREADS": "1"},
                     args=["--workers", "1"])
    yield d.url
    d.stop()


def fleetctl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    env.pop("FLEET_URL", None)
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_generate_bench_reports_ttft_and_inter_token_at_the_knee(gen_url: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nhello world, this is fleet serving small models from one box\n")
    out = tmp_path / "gen.json"
    r = fleetctl("bench", "--task", "generate", "--url", gen_url, "--model", MODEL, "--inputs", str(prompts),
                 "--max-tokens", "8", "--requests", "2", "--concurrency", "1,2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "generate-fleet" and doc["command"][:3] == ["fleetctl", "bench", "--task"]
    assert doc["machine"]["cpus_logical"] >= 1 and doc["versions"]["fleet"]
    fleet = doc["targets"]["fleet"]
    assert [s["clients"] for s in fleet["steps"]] == [1, 2]
    for s in fleet["steps"]:
        # Every request streamed its 8 tokens: none lost, none failed.
        assert s["errors"] == 0 and s["requests"] == 2 * s["clients"]
        assert s["output_tokens"] == 8 * s["requests"] and s["output_tokens_per_s"] > 0
        assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p95"] <= s["latency_ms_p95"]
        assert 0 < s["itl_ms_p50"] <= s["itl_ms_p95"]
    assert fleet["knee_clients"] in (1, 2) and fleet["knee"]["output_tokens_per_s"] > 0
    assert fleet["ttft_ms_longest_prompt_alone"] > 0
    # The tables fit 80 columns even where the terminal is wider.
    lines = r.stdout.splitlines()
    assert "generation at the knee" in r.stdout and "TTFT p50/95 ms" in r.stdout
    assert max(map(len, lines)) <= 80, r.stdout


@pytest.mark.slow
def test_generate_bench_of_a_model_the_daemon_lacks_says_so(gen_url: str, tmp_path: Path) -> None:
    r = fleetctl("bench", "--task", "generate", "--url", gen_url, "--model", "no-such-model", "--max-tokens", "4",
                 "--requests", "1", "--concurrency", "1", "--out", str(tmp_path / "missing.json"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "HTTP 404" in r.stderr and "no-such-model" in r.stderr and "fleetctl list" in r.stderr
    assert not (tmp_path / "missing.json").exists()
