"""`fleetctl logs`: the daemon's log, wherever it runs.

The systemd service logs to the journal (`journalctl -u fleetd`); a foreground
`fleetctl serve` to FLEET_HOME/logs/fleetd.log as well as its stderr (fleet.logs).
Without `--service` / `--file`, the journal is read when the fleetd unit is active,
else the file. Records are JSON lines; at a terminal they are printed as readable
lines, piped they stay JSON (`--json` keeps them JSON at a terminal too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import typer

from fleet.errors import BadRequest, FleetError

UNIT = "fleetd"
#: How often a followed file is looked at for new lines, seconds.
POLL_S = 0.25


def register(app: typer.Typer) -> None:
    @app.command()
    def logs(follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
             lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines of the past to print first."),
             service: bool = typer.Option(None, "--service/--file",
                                          help="The systemd service's journal, or the foreground daemon's log file "
                                               "(default: the journal when the fleetd unit is active)."),
             as_json: bool = typer.Option(False, "--json", help="Print the JSON records as they are.")) -> None:
        """Show the daemon's log (journalctl -u fleetd, or FLEET_HOME/logs/fleetd.log)."""
        from fleet.config import load_settings

        pretty = sys.stdout.isatty() and not as_json
        if service is None:
            service = unit_active()
        source = journal(lines, follow) if service else log_file(load_settings().home_path, lines, follow)
        try:
            for line in source:
                print(readable(line) if pretty else line, flush=follow)
        except KeyboardInterrupt:
            return


def unit_active() -> bool:
    """Is the fleetd unit running? False where systemd is not the init system (a
    container, WSL): systemctl would only print why it cannot ask."""
    if shutil.which("systemctl") is None or not Path("/run/systemd/system").is_dir():
        return False
    return subprocess.run(["systemctl", "is-active", "--quiet", UNIT], check=False,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def journal(lines: int, follow: bool) -> Iterator[str]:
    if shutil.which("journalctl") is None:
        raise FleetError("journalctl is not installed: the service's log is in the journal",
                         hint="read a foreground daemon's log with `fleetctl logs --file`")
    cmd = ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager", "-n", str(lines), *(["-f"] if follow else [])]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                yield line.rstrip("\n")
        finally:
            proc.terminate()


def log_file(home: Path, lines: int, follow: bool) -> Iterator[str]:
    """The last `lines` lines of FLEET_HOME/logs/fleetd.log, then (`follow`) what is
    appended, across rotations (the file is renamed and a new one started)."""
    from fleet.logs import log_path

    path = log_path(home)
    if not path.is_file():
        raise BadRequest(f"no log file at {path}: no daemon has run in the foreground with this FLEET_HOME",
                         hint="a daemon run as the systemd service logs to the journal: fleetctl logs --service")
    f = path.open("r", encoding="utf-8", errors="replace")
    try:
        yield from deque((line.rstrip("\n") for line in f), maxlen=lines) if lines else ()
        if not follow:
            return
        inode = os.fstat(f.fileno()).st_ino
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
                continue
            time.sleep(POLL_S)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                continue  # between the rename and the new file
            if now.st_ino != inode or now.st_size < f.tell():
                f.close()
                f = path.open("r", encoding="utf-8", errors="replace")
                inode = os.fstat(f.fileno()).st_ino
    finally:
        f.close()


def readable(line: str) -> str:
    """A JSON record as `time level logger[pid] [request id] message`, its traceback
    after it; other lines (the journal's own) as they are."""
    try:
        r = json.loads(line)
    except ValueError:
        return line
    if not isinstance(r, dict) or "msg" not in r:
        return line
    ts = str(r.get("ts", ""))[11:23]
    rid = f" [{r['request_id']}]" if r.get("request_id") else ""
    text = f"{ts} {str(r.get('level', '')).upper():<7} {r.get('logger', '')}[{r.get('pid', '')}]{rid} {r['msg']}"
    if r.get("exc"):
        text += "\n" + r["exc"]
    return text
