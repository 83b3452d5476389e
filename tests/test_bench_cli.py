"""`fleetctl bench` end to end: the real CLI process against the real daemon (short mode).

The daemon is the shared session fixture from conftest (a real `fleetctl
serve` on a free loopback port). The bench runs as its own process, as a user
would run it, and its JSON, PNG and exit codes are checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.bench.daemon import free_port
from fleet.bench.peers import INFINITY_VENV

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--duration", "1.5", "--batch", "4", "--max-steps", "3", "--min-requests", "5", "--warmup", "1", "--quiet"]


def fleetctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("FLEET_URL", None)
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_against_the_daemon_writes_results_and_plot(daemon, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra: pip install -e '.[bench]'")
    out, png = tmp_path / "r.json", tmp_path / "knee.png"
    r = fleetctl("bench", "--url", daemon.url, *SHORT, "--out", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "knee per target" in r.stdout
    assert "tokens/text" in r.stderr  # the token-length distribution is shown before the run
    doc = json.loads(out.read_text())
    assert doc["command"][1:3] == ["bench", "--url"]
    assert doc["machine"]["cpus_logical"] >= 1 and "load_avg_1_5_15" in doc["machine"]
    assert doc["versions"]["fleet"] and "torch" in doc["versions"]
    (target,) = doc["targets"]
    assert target["name"] == "fleet" and target["warmup"]["ok"] > 0
    # What served the model, read from /v1/ps after the warm-up loaded it: the numbers
    # depend on the engine and dtype the daemon chose.
    assert target["served"] and {"worker", "dtype"} <= set(target["served"][0])
    assert target["served"][0]["dtype"] in ("float32", "bfloat16", "float16")
    assert len(target["steps"]) == 3
    offered = [s["offered"] for s in target["steps"]]
    assert offered == sorted(offered) and len(set(offered)) == 3
    for s in target["steps"]:
        assert s["ok"] > 0 and s["errors"] == 0
        # Our up-front tokenizer count is the daemon's own usage.input_tokens, request for request.
        assert s["server_tokens"] == s["tokens"] > 0
        assert s["box"]["cpu_pct"]["fleet:server"] > 0
        # The daemon's own X-Queue-Ms / X-Inference-Ms are recorded per step.
        assert s["server_queue_p50_ms"] >= 0 and s["server_inference_p50_ms"] > 0
    assert target["knee"] is not None and target["knee"]["tokens_per_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_compare_runs_targets_interleaved_with_ratios(daemon, tmp_path):
    targets = ["fleet", "st-fp32"]
    out = tmp_path / "cmp.json"
    r = fleetctl("bench", "--url", daemon.url, "--compare", "--targets", ",".join(targets), *SHORT,
                 "--max-steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [t["name"] for t in doc["targets"]] == targets
    for t in doc["targets"]:
        assert t["steps"] and all(s["ok"] > 0 for s in t["steps"])
        assert t["knee"]["tokens_per_s"] > 0
    fleet, st = doc["targets"]
    assert st["mode"] == "closed" and len(st["steps"]) == 3 and st["dtype"] == "fp32"
    # The in-process target runs torch's OpenMP as fleet's workers do (bench/st_local.py).
    assert st["process"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    # Interleaved: the in-process target's steps run between fleet's, not after them all.
    assert min(s["started_unix"] for s in st["steps"]) < max(s["started_unix"] for s in fleet["steps"])
    ratios = doc["ratios_tokens_per_s"]
    assert set(ratios) == set(targets)
    assert ratios["fleet"]["st-fp32"] == pytest.approx(1 / ratios["st-fp32"]["fleet"], rel=0.01)
    # The side-by-side table shows the same ratio.
    assert f"{ratios['fleet']['st-fp32']:.2f}x" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(not (INFINITY_VENV / "bin" / "infinity_emb").is_file(),
                    reason="the infinity-emb peer is not built: run bench/setup_infinity.sh")
def test_compare_starts_the_infinity_peer_on_loopback(daemon, tmp_path):
    out = tmp_path / "inf.json"
    r = fleetctl("bench", "--url", daemon.url, "--compare", "--targets", "fleet,infinity", *SHORT,
                 "--max-steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    fleet, inf = doc["targets"]
    assert inf["kind"] == "infinity" and inf["url"].startswith("http://127.0.0.1:")
    assert inf["steps"] and all(s["ok"] > 0 and s["errors"] == 0 for s in inf["steps"])
    assert doc["versions"]["infinity_emb"] == "0.0.78"
    # The peer was sampled as its own server process while it ran.
    assert all(s["box"]["cpu_pct"]["infinity:server"] > 0 for s in inf["steps"])


@pytest.mark.slow
def test_compare_speaks_tei_and_ollama_and_says_which_peers_it_skipped(daemon, tmp_path):
    """fleet answers TEI's `/embed` and Ollama's `/api/embed` on its own port, so the bench's
    tei and ollama targets run here against those real routes (KIND=URL). The peers the
    bench would start itself run where their setup script was run, and are otherwise
    reported as skipped, with the script, in the table and the JSON: never just absent."""
    from fleet.bench import peers

    out = tmp_path / "peers.json"
    # (infinity, started where it is built, has its own test above.)
    targets = [f"tei={daemon.url}", f"ollama={daemon.url}", "tei", "ollama"]
    r = fleetctl("bench", "--url", daemon.url, "--compare", "--targets", ",".join(targets), *SHORT,
                 "--max-steps", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    port = daemon.url.rsplit(":", 1)[1]
    by_name = {t["name"]: t for t in doc["targets"]}
    for kind in ("tei", "ollama"):
        t = by_name[f"{kind}@127.0.0.1:{port}"]
        assert t["kind"] == kind and t["steps"] and all(s["ok"] > 0 and s["errors"] == 0 for s in t["steps"])
    # Ollama's reply counts the prompt's tokens: the daemon's count is the bench's, request for request.
    assert all(s["server_tokens"] == s["tokens"] > 0 for s in by_name[f"ollama@127.0.0.1:{port}"]["steps"])
    for peer in ("tei", "ollama"):
        if peers.program(peer) is not None:
            assert peer in by_name and peer not in doc["skipped"]
            continue
        why = doc["skipped"][peer]
        assert why.endswith(f"run bench/setup_{peer}.sh") and peer not in by_name
        assert f"{peer}: skipped: {why}" in r.stderr
        assert any(line.strip("│ ").split("│")[0].strip() == peer and why in line for line in r.stdout.splitlines())
    assert "skipped (not run here)" in r.stdout or not doc["skipped"]


@pytest.mark.slow
def test_compare_runs_the_offline_limit_and_openvino_or_says_it_skipped(tmp_path):
    """In-process targets need no daemon: sorted batches in torch fp32, and OpenVINO
    through fleet's adapter when installed, else one line saying why it did not run."""
    out = tmp_path / "local.json"
    r = fleetctl("bench", "--url", f"http://127.0.0.1:{free_port()}", "--compare",
                 "--targets", "sorted-st-fp32,ov-fp32,ov-best", *SHORT, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    by_name = {t["name"]: t for t in doc["targets"]}
    lim = by_name["sorted-st-fp32"]
    assert (lim["engine"], lim["dtype"], lim["batches"]) == ("torch", "fp32", "length-sorted")
    assert len(lim["steps"]) == 3 and all(s["ok"] > 0 and s["errors"] == 0 for s in lim["steps"])
    # Batches of 4 shortest first: the tokens per call stay within the corpus' bounds x 4.
    assert all(4 * 10 <= s["tokens"] / s["ok"] <= 4 * 80 for s in lim["steps"])
    if importlib.util.find_spec("openvino") is None:
        assert list(by_name) == ["sorted-st-fp32"]
        assert "ov-fp32: skipped: openvino is not installed (pip install 'fleet-serve[openvino]')" in r.stderr
        assert "ov-best: skipped" in r.stderr
        assert doc["skipped"] == {name: "openvino is not installed (pip install 'fleet-serve[openvino]')"
                                  for name in ("ov-fp32", "ov-best")}
    else:
        ov = by_name["ov-fp32"]
        assert (ov["engine"], ov["batches"], ov["process"]["choice"]["engine"]) == ("openvino", "request windows", "openvino")
        assert all(s["ok"] > 0 and s["errors"] == 0 for s in ov["steps"])
        assert "ov-best is ov-" in r.stderr
    assert set(doc["ratios_tokens_per_s"]) == (set(by_name) if len(by_name) > 1 else set())


def test_usage_errors_exit_2():
    for args in (["--task", "nope"], ["--rates", "1,2", "--concurrency", "1,2"], ["--rates", "fast"],
                 ["--compare", "--targets", "fleet,mystery"], ["--compare", "--targets", "st-fp32,sorted-fleet"]):
        r = fleetctl("bench", *args, timeout=120)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


def test_no_daemon_is_a_clear_failure():
    r = fleetctl("bench", "--url", f"http://127.0.0.1:{free_port()}", "--quiet", timeout=120)
    assert r.returncode == 1
    assert "nothing answers at" in r.stderr and "fleetctl serve" in r.stderr


@pytest.mark.slow
def test_embed_compare_measures_all_three_sides_in_one_run(daemon, tmp_path):
    out = tmp_path / "ec.json"
    r = subprocess.run([sys.executable, "-m", "fleet.bench", "embed-compare", "--url", daemon.url, "--rounds", "1",
                        "--duration", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    s = doc["summary"]
    for key in ("a_st_fp32_tokens_per_s", "b_st_bf16_tokens_per_s", "c_fleet_tokens_per_s"):
        assert s[key] > 0
    (rnd,) = doc["rounds"]
    # One round: the per-round ratio is that round's ratio.
    assert s["c_over_a"] == pytest.approx(rnd["c_fleet"]["tokens_per_s"] / rnd["a_st_fp32"]["tokens_per_s"])
    assert set(s["goals"]) == {"c_ge_2x_a", "c_ge_0.9x_b", "added_p50_le_1ms", "added_p99_le_3ms"}
    # Saturation doubles the clients until tokens/s stops growing.
    clients = [c["clients"] for c in rnd["c_steps"]]
    assert clients == [2 ** i for i in range(len(clients))] and len(clients) >= 2
    # Every fleet reply counted the tokens we counted.
    assert rnd["c_fleet"]["server_tokens"] == rnd["c_fleet"]["tokens"]
    assert s["short_fleet_p50_ms"] > 0 and s["short_local_p50_ms"] > 0
    assert s["added_p99_ms"] == pytest.approx(rnd["short_fleet"]["p99_ms"] - rnd["short_local"]["p99_ms"])
    # The box's load is printed next to the latency figures (and kept per round).
    assert len(rnd["load_avg_start"]) == 3 and s["load_avg_1m_max"] >= s["load_avg_1m_min"] >= 0
    assert "goal added_p50_le_1ms" in r.stdout and "goal added_p99_le_3ms" in r.stdout
    assert "load average (1 min) during the rounds" in r.stdout
