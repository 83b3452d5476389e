"""One log format for every fleet process: the API process and its workers.

Off a terminal (systemd, a pipe, the log file) every record is one JSON object on one
line (`JsonFormatter`); at a terminal, a readable line. What libraries say goes the same
way: `warnings` through logging (`py.warnings`), the loggers of transformers and
huggingface_hub (which install their own stderr handlers) propagated to the root
handlers instead, and their progress bars off (`quiet_libraries`: the environment
switches they read, set before they are imported; a value already set is kept).

Where a foreground daemon logs: stderr, and FLEET_HOME/logs/fleetd.log (JSON lines,
rotated at ROTATE_BYTES, ROTATE_KEEP old files) that `fleetctl logs` reads. Under
systemd the journal keeps the log and no file is written (`journalctl -u fleetd`).
The API process rotates the file; workers append to it and reopen it when it was
rotated (WatchedFileHandler); each record is one write under PIPE_BUF, so lines of
different processes do not interleave.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import msgspec

#: The log file of a foreground daemon, under FLEET_HOME.
LOG_FILE = Path("logs") / "fleetd.log"
ROTATE_BYTES = 10 << 20
ROTATE_KEEP = 5
#: Libraries that put their own handler on their logger: routed to the root's.
LIBRARY_LOGGERS = ("transformers", "huggingface_hub", "sentence_transformers", "peft", "torch", "urllib3", "httpx")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id",
                                                                            "_fleet_json"}
_encoder = msgspec.json.Encoder(enc_hook=repr)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, request_id?, pid, extras, exc?."""

    def format(self, record: logging.LogRecord) -> str:
        # Encoded once per record: the stream and the file handler (and a rotation's size
        # check) write the same line, and this is the costly part of a record (daemon.access).
        cached = record.__dict__.get("_fleet_json")
        if cached is not None:
            return cached
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        out["pid"] = record.process
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        record._fleet_json = text = _encoder.encode(out).decode()
        return text


class LineFormatter(logging.Formatter):
    """A readable line for a terminal: time, level, logger and pid, message."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s[%(process)d] %(message)s", "%H:%M:%S")


def under_systemd() -> bool:
    """Started by systemd with its output in the journal (which then keeps the log)."""
    return bool(os.environ.get("INVOCATION_ID")) and bool(os.environ.get("JOURNAL_STREAM"))


def log_path(home: str | Path) -> Path:
    return Path(home) / LOG_FILE


def quiet_libraries() -> None:
    """No progress bars from huggingface_hub, transformers (which follows it) or tqdm;
    read by those libraries at import, so set before them (children inherit them)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.captureWarnings(True)


def route_library_logs() -> None:
    """Send what the libraries log through the root's handlers (one format): their own
    stderr handlers are removed and their loggers propagate. Run after they are imported
    (transformers and huggingface_hub add their handler at import); transformers is
    only touched where it is imported already (never in the API process)."""
    if (tl := sys.modules.get("transformers.utils.logging")) is not None:
        tl.disable_default_handler()  # its module-level handler, which it re-adds unless told
        tl.enable_propagation()
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        for h in [h for h in lg.handlers if not getattr(h, "_fleet", False)]:
            lg.removeHandler(h)
        lg.propagate = True


def stream_handler(stream: IO[str] | None = None, *, json: bool | None = None) -> logging.Handler:
    """JSON lines off a terminal, readable lines on one (`json` None: by `stream.isatty()`)."""
    stream = stream if stream is not None else sys.stderr
    use_json = json if json is not None else not (hasattr(stream, "isatty") and stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if use_json else LineFormatter())
    return handler


class SizeRotatingHandler(logging.handlers.RotatingFileHandler):
    """Rotates once the file has reached its size, read from the open file's position:
    the standard check stats the path twice and formats each record once more, per record."""

    def shouldRollover(self, record: logging.LogRecord) -> bool:
        if self.stream is None:
            self.stream = self._open()
        return self.maxBytes > 0 and self.stream.tell() >= self.maxBytes


def file_handler(home: str | Path, *, rotate: bool) -> logging.Handler:
    """FLEET_HOME/logs/fleetd.log in JSON lines: the API process rotates it (`rotate`),
    workers only append and follow a rotation."""
    path = log_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler: logging.Handler
    if rotate:
        handler = SizeRotatingHandler(path, maxBytes=ROTATE_BYTES, backupCount=ROTATE_KEEP, encoding="utf-8")
    else:
        handler = logging.handlers.WatchedFileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    return handler


def install(handlers: list[logging.Handler], level: str | int) -> None:
    """Make `handlers` the root's fleet handlers (idempotent: earlier fleet handlers go)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_fleet", False)]:
        root.removeHandler(old)
        old.close()
    for h in handlers:
        h._fleet = True  # type: ignore[attr-defined]  # marks ours
        root.addHandler(h)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def setup_worker(level: str, home: str | Path) -> None:
    """A worker's logging: the daemon's stderr in the same format, and the daemon's log
    file (unless under systemd)."""
    quiet_libraries()
    handlers = [stream_handler()]
    if not under_systemd():
        handlers.append(file_handler(home, rotate=False))
    install(handlers, level)
