"""The bench runner (bench/cli.py): every bench is one function behind
`python -m fleet.bench NAME`, listed with its purpose, its options parsed once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.bench import cli

ROOT = Path(__file__).resolve().parents[1]
#: Every module that had its own `main` and argparse before the runner, and the benches
#: it registers now (fairness's four scenarios are four benches); then those added since.
BENCHES = {
    "access_log": {"access-log"}, "asgi_cold": {"asgi-cold"}, "batch_memory": {"batch-memory"},
    "batch_priority": {"batch-priority"}, "corpus": {"corpus"}, "decide": {"decide"},
    "decide_split": {"decide-split"}, "embed_compare": {"embed-compare"}, "embed_controls": {"embed-controls"},
    "embed_kinds": {"embed-kinds"}, "engines_heads": {"engines-heads"},
    "fairness": {"fairness-big", "fairness-flood", "fairness-floods", "fairness-burst"},
    "generate_compare": {"generate-compare"}, "generate_engines": {"generate-engines"},
    "gpu_check": {"gpu-check"}, "gpu_llamacpp": {"gpu-llamacpp"}, "gpu_prepare": {"gpu-prepare"},
    "host_path": {"host-path"}, "inference_compare": {"inference-compare"},
    "memory_load": {"memory-load"}, "micro_batches": {"micro-batches"}, "nats_compare": {"nats-compare"},
    "query_check": {"query-check"}, "queue_bench": {"queue-bench"}, "request_merging": {"request-merging"},
    "request_path": {"request-path"},
    "saturation": {"saturation"}, "simulate": {"simulate"}, "synthetic": {"synthetic"},
    "timeline": {"timeline"}, "traced_heads": {"traced-heads"}, "wakeups": {"wakeups"},
}


def runner(*argv: str) -> subprocess.CompletedProcess:
    # A process of its own: listing imports every bench module, and bench.queue_bench
    # puts the repository's root on sys.path (its --against mode) for good.
    return subprocess.run([sys.executable, "-m", "fleet.bench", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_the_runner_lists_every_bench_with_its_purpose() -> None:
    done = runner("--help")
    assert done.returncode == 0, done.stderr
    assert set(cli.MODULES) == set(BENCHES)
    # A name at 4 spaces; its purpose beside it or wrapped deeper.
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("    ") and line[4] != " "}
    assert listed == set().union(*BENCHES.values())
    for line in ("Pull vs push at scale, simulated", "One prepared acceptance run of fleet's GPU path"):
        assert line in " ".join(done.stdout.split())  # the module docstring's first paragraph


def test_no_bench_module_keeps_a_main_of_its_own() -> None:
    # Every bench module registers through the runner and is listed there. bench.stand_in
    # stays a process entry (`python -m fleet.bench.stand_in serve`: the daemon
    # bench.daemon.LocalDaemon starts with a stand-in forward), not a bench.
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name in ("cli.py", "__main__.py", "stand_in.py"):
            continue
        text = path.read_text()
        assert '__name__ == "__main__"' not in text and "ArgumentParser(" not in text, path.name
        assert ("\n@bench(" in text) == (path.stem in cli.MODULES), path.name


def test_options_that_do_not_go_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.run(["host_path", "--url", "http://127.0.0.1:9"])  # the module's name works too
    assert exit_.value.code == 2 and "--url needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.run(["timeline", "--url", "http://127.0.0.1:9", "--start"])
    assert exit_.value.code == 2 and "not allowed with argument --url" in capsys.readouterr().err


def test_a_bench_runs_end_to_end_through_the_runner(tmp_path: Path) -> None:
    out = tmp_path / "wakeups.json"
    argv = ["wakeups", "--rounds", "20", "--gap-ms", "1", "--out", str(out)]
    done = runner(*argv)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    # The record names the command that reruns it.
    assert doc["kind"] == "wakeups" and doc["command"][1:] == ["-m", "fleet.bench", *argv]
    assert doc["settings"] == {"rounds": 20, "gap_ms": 1.0}
    assert {r["mechanism"] for r in doc["rows"]} == {"futex", "pipe", "tcp"}
    assert done.stdout.startswith("mechanism")
