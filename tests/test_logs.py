"""Structured logs: JSON line shape off a TTY, request ids on every line of a request.

Requests are bound to their ids the way the daemon binds them: through
`RequestIdMiddleware`, with the id sent as `X-Request-Id`."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleet.daemon.logs import REQUEST_ID, RequestIdMiddleware, new_request_id, setup_logging
from fleet.errors import BadRequest

ROOT = Path(__file__).resolve().parents[1]


async def as_request(rid: str, handle) -> list[dict]:
    """Run `handle()` as the handler of one HTTP request carrying `X-Request-Id: rid`;
    the messages it sent (the response start carries the echoed id)."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        await handle()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": [(b"x-request-id", rid.encode())]}
    await RequestIdMiddleware(app)(scope, None, send)
    return sent


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_daemon_process_writes_json_lines_to_piped_stderr():
    # A real process whose stderr is a pipe, as under systemd.
    code = textwrap.dedent(
        """
        import asyncio, logging
        from fleet.daemon.logs import RequestIdMiddleware, setup_logging
        setup_logging("info")
        log = logging.getLogger("fleet.daemon")
        log.info("starting on %s", "127.0.0.1:7744")
        log.debug("hidden")

        async def embed(scope, receive, send):
            log.info("embed", extra={"model": "all-minilm-l6-v2", "items": 3})
            try:
                1 / 0
            except ZeroDivisionError:
                log.exception("failed")

        async def send(message):
            pass

        request = {"type": "http", "headers": [(b"x-request-id", b"r-1")]}
        asyncio.run(RequestIdMiddleware(embed)(request, None, send))
        log.warning("after")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, check=True,
    )
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [r["msg"] for r in records] == ["starting on 127.0.0.1:7744", "embed", "failed", "after"]
    first, embed, failed, after = records
    assert set(first) == {"ts", "level", "logger", "msg", "pid"}
    assert first["level"] == "info" and first["logger"] == "fleet.daemon"
    assert first["ts"].endswith("Z") and first["ts"][10] == "T"
    assert first["pid"] == embed["pid"] > 0
    assert embed["request_id"] == failed["request_id"] == "r-1"
    assert embed["model"] == "all-minilm-l6-v2" and embed["items"] == 3
    assert "ZeroDivisionError" in failed["exc"] and failed["level"] == "error"
    assert "request_id" not in after


def test_concurrent_requests_keep_their_own_ids(restore_root):
    buf = io.StringIO()
    setup_logging("debug", stream=buf)
    log = logging.getLogger("fleet.test")

    async def handle() -> None:
        log.debug("queued")
        await asyncio.sleep(0.01)
        await asyncio.to_thread(log.debug, "in thread")
        log.debug("answered")

    async def main() -> list[list[dict]]:
        return await asyncio.gather(*(as_request(f"r{i}", handle) for i in range(5)))

    replies = asyncio.run(main())
    assert [dict(sent[0]["headers"])[b"x-request-id"] for sent in replies] == [f"r{i}".encode() for i in range(5)]
    records = [r for r in lines(buf) if r["logger"] == "fleet.test"]
    assert len(records) == 15
    by_id: dict[str, list[str]] = {}
    for r in records:
        by_id.setdefault(r["request_id"], []).append(r["msg"])
    assert by_id == {f"r{i}": ["queued", "in thread", "answered"] for i in range(5)}
    assert REQUEST_ID.get() is None


def test_level_filters_and_setup_is_idempotent(restore_root):
    first, second = io.StringIO(), io.StringIO()
    setup_logging("warning", stream=first)
    setup_logging("warning", stream=second)
    log = logging.getLogger("fleet.test")
    log.info("dropped")
    log.warning("kept")
    assert first.getvalue() == ""  # the first handler was replaced, not stacked
    assert [r["msg"] for r in lines(second)] == ["kept"]


def test_terminal_gets_rich_not_json(restore_root):
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        setup_logging("info", stream=tty)
        async def hello() -> None:
            logging.getLogger("fleet.test").info("hello from a terminal")

        asyncio.run(as_request("r-tty", hello))
        tty.flush()
        out = os.read(master, 65536).decode()
    os.close(master)
    assert "hello from a terminal" in out and "r-tty" in out
    assert not out.lstrip().startswith("{")


def test_unknown_level_is_refused():
    with pytest.raises(BadRequest, match="unknown log level 'loud'"):
        setup_logging("loud", stream=io.StringIO())


def test_request_ids_are_fresh():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 for i in ids)
