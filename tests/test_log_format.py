"""One log format: a real daemon's stderr (not a terminal) and its log file are JSON lines
only, from the API process and its workers alike, with no progress bar and nothing a
library printed its own way; a SIGTERM ends it without a C++ abort message; `fleetctl
logs` reads the file (and follows it across a rotation). Libraries' loggers and
`warnings` go through the same handlers (in-process).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx

from fleet.daemon.logs import setup_logging
from fleet.logs import LOG_FILE
from fleetctl.commands.logs import log_file, readable
from tests.conftest import DEFAULT_MODEL, start_daemon


def records(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line[:300]!r}") from None
    return out


def test_daemon_logs_json_lines_only_and_stops_cleanly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    try:
        for i in range(4):
            r = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [f"log {i}"]}, timeout=60)
            assert r.status_code == 200
        api_pid = httpx.get(d.url + "/v1/ps", timeout=10).json()["pid"]
    finally:
        d.stop()
    stderr = d.log()
    assert "terminate called" not in stderr  # a C++ thread left joinable at a worker's exit
    assert "it/s]" not in stderr and "Loading weights" not in stderr  # no progress bars
    lines = records(stderr)
    pids = {r["pid"] for r in lines}
    assert api_pid in pids and len(pids) >= 2  # the workers' lines too
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in lines)
    # The foreground daemon's file: the same records (API and workers), JSON lines.
    kept = records((home / LOG_FILE).read_text())
    assert {r["msg"] for r in kept} >= {r["msg"] for r in lines if r["pid"] in pids}
    # `fleetctl logs --file` reads it; piped, the lines stay JSON.
    out = subprocess.run([sys.executable, "-m", "fleetctl", "logs", "--file", "-n", "3"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "FLEET_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert records(out.stdout) == kept[-3:]


def test_libraries_and_warnings_go_through_the_handlers() -> None:
    import huggingface_hub.utils.logging  # noqa: F401 (installs its own stderr handler at import)

    buf = io.StringIO()
    try:
        setup_logging("info", stream=buf, json=True)
        assert not logging.getLogger("huggingface_hub").handlers
        logging.getLogger("huggingface_hub.file_download").warning("hub says %s", "hi")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
        got = records(buf.getvalue())
        assert {"logger": "huggingface_hub.file_download", "msg": "hub says hi"}.items() <= got[0].items()
        assert got[1]["logger"] == "py.warnings" and "a library's warning" in got[1]["msg"]
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TQDM_DISABLE"] == "1"
    finally:
        logging.captureWarnings(False)
        setup_logging("warning", stream=io.StringIO())


def test_follow_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / LOG_FILE
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"msg": f"old {i}"}) + "\n" for i in range(5)))
    seen: list[str] = []
    reader = log_file(tmp_path, 2, True)

    def read() -> None:
        for line in reader:
            seen.append(line)
            if len(seen) == 5:
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    time.sleep(0.5)
    with path.open("a") as f:
        f.write(json.dumps({"msg": "new 0"}) + "\n")
    time.sleep(0.5)
    path.rename(path.with_name("fleetd.log.1"))  # what RotatingFileHandler does
    path.write_text(json.dumps({"msg": "rotated 0"}) + "\n" + json.dumps({"msg": "rotated 1"}) + "\n")
    t.join(10)
    assert [json.loads(s)["msg"] for s in seen] == ["old 3", "old 4", "new 0", "rotated 0", "rotated 1"]


def test_readable_line() -> None:
    line = json.dumps({"ts": "2026-12-04T05:00:01.250Z", "level": "error", "logger": "fleet.worker", "msg": "boom",
                       "pid": 7, "request_id": "abc", "exc": "Traceback ..."})
    assert readable(line) == "05:00:01.250 ERROR   fleet.worker[7] [abc] boom\nTraceback ..."
    assert readable("-- No entries --") == "-- No entries --"
