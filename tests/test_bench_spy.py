"""bench/spy.py: py-spy's collapsed stacks read into each thread's busy share and frames."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from fleet.bench import spy

RAW = """thread (11): MainThread;run (worker.py:10);step (worker.py:20);forward (st.py:5) 60
thread (11): MainThread;run (worker.py:10);step (worker.py:20);pool (st.py:9) 20
thread (12): tokenize-0;run (threading.py:1);encode (tok.py:3) 50
garbage line
thread (13): ;wait (futex.py:59) notanumber
thread (14);<module> (x.py:1) 10
"""


def test_summary_gives_each_threads_busy_share_and_its_frames():
    got = spy.summarise(RAW, seconds=1.0, rate=100)["threads"]
    assert list(got) == ["MainThread (11)", "tokenize-0 (12)", "thread (14)"]  # busiest first; malformed skipped
    main = got["MainThread (11)"]
    assert main["busy"] == 0.8 and main["samples"] == 80
    assert main["self"] == [["forward (st.py:5)", 0.75], ["pool (st.py:9)", 0.25]]
    assert dict(map(tuple, main["total"]))["step (worker.py:20)"] == 1.0
    assert got["tokenize-0 (12)"]["busy"] == 0.5


@pytest.mark.skipif(spy.available() is not None, reason="py-spy is not installed (the bench extra installs it)")
def test_a_running_process_is_recorded_and_summarised(tmp_path):
    code = "import time\nt = time.time()\nwhile time.time() - t < 8: sum(range(1000))\n"
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        got = spy.finish(spy.start({busy.pid: "busy"}, 2.0, tmp_path, "t"), 2.0)
    finally:
        busy.kill()
        busy.wait()
    summary = got[f"busy/{busy.pid}"]
    if "error" in summary and any(w in summary["error"] for w in ("ermission", "not permitted", "ptrace")):
        pytest.skip(f"py-spy may not attach on this box (no ptrace here): {summary['error']}")
    assert (tmp_path / summary["file"]).exists()
    (thread, stats), = summary["threads"].items()
    assert thread == f"thread ({busy.pid})" and stats["busy"] > 0.3  # no name: it never imported threading
    assert any("<module>" in frame for frame, _ in stats["total"])
