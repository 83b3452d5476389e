"""bench/gpu_check.py cannot rot: its CPU run (`--device cpu`, small sizes) passes
end to end through real daemons, and its goal and MFU arithmetic is right.

No GPU is lent to CI: the CUDA-only checks (cuda-graphs, nvml-budget) and the goals
say SKIP on CPU, and this test asserts they do rather than pass silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.bench.acceptance import CPU, Check
from fleet.bench.gpu_capacity import flops_per_token, peak_tflops
from fleet.bench.gpu_check import GOAL_P95_MS, GOAL_TOKENS_PER_S, goal_checks

PARITY = ["parity/embed", "parity/rerank", "parity/classify", "parity/extract", "parity/generate",
          "parity/lora-mixed"]


@pytest.mark.slow
def test_the_cpu_run_passes_every_check_and_writes_its_json(tmp_path: Path):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "fleet.bench", "gpu-check", "--device", "cpu", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    checks = {c["name"]: c for c in result["checks"]}
    # One line per check on stdout, in the JSON's order.
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert [line.split("] ", 1)[1].split(" ", 2)[1].rstrip(":") for line in lines] == list(checks)
    assert result["failed"] == []
    for name in [*PARITY, "two-workers", "vram-budget", "knee/bert-base-random", "knee/all-minilm-l6-v2"]:
        assert checks[name]["ok"] is True, checks[name]
    assert checks["parity/embed"]["data"]["min_cosine"] >= 0.9999
    assert checks["two-workers"]["data"]["workers"] == 2
    assert checks["vram-budget"]["data"]["violations"] == [] and checks["vram-budget"]["data"]["non_200"] == []
    for model in ("bert-base-random", "all-minilm-l6-v2"):
        knee = checks[f"knee/{model}"]["data"]
        assert knee["tokens_per_s"] > 0 and knee["errors"] == 0 and knee["mfu"] is None  # no CPU peak in the table
        assert len(knee["steps"]) == len(CPU.clients)
    for name in ("cuda-graphs", "nvml-budget", "goal/tokens-per-s", "goal/p95"):
        assert checks[name]["ok"] is None, checks[name]  # CUDA / H200 only: skipped, and says so


def knee(tokens_per_s: float, p95_ms: float) -> Check:
    return Check("knee/bert-base-random", True, "", {"tokens_per_s": tokens_per_s, "p95_ms": p95_ms})


@pytest.mark.parametrize(("tps", "p95", "met"), [
    (1_200_000, 40.0, (True, True)), (900_000, 40.0, (False, True)), (1_000_000, 50.0, (True, True)),
    (1_500_000, 51.0, (True, False)),
])
def test_goals_are_judged_on_an_h200(tps, p95, met):
    got = goal_checks(knee(tps, p95), "NVIDIA H200")
    assert tuple(c.ok for c in got) == met
    assert str(GOAL_TOKENS_PER_S)[:1] in got[0].detail and f"{GOAL_P95_MS:g}" in got[1].detail


@pytest.mark.parametrize("name", [None, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA L4"])
def test_goals_elsewhere_are_not_judged(name):
    assert [c.ok for c in goal_checks(knee(5e6, 1.0), name)] == [None, None]


def test_peaks_match_the_most_specific_name_first():
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA L40S") == 362.0 and peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("Some Future GPU") is None and peak_tflops(None) is None


def test_bert_base_costs_about_twice_its_layer_weights_per_token():
    cfg = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072)
    layer_weights = 12 * (4 * 768 * 768 + 2 * 768 * 3072)  # ~85M: BERT-base without embeddings
    assert flops_per_token(cfg, 0) == 2 * layer_weights
    # 128 tokens of attention add 4 x 768 x 128 per layer.
    assert flops_per_token(cfg, 128) - flops_per_token(cfg, 0) == 12 * 4 * 768 * 128
