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
def runner(*argv: str) -> subprocess.CompletedProcess:
    # A process of its own: listing imports every bench module, and bench.queue_bench
    # puts the repository's root on sys.path (its --against mode) for good.
    return subprocess.run([sys.executable, "-m", "fleet.bench", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


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
