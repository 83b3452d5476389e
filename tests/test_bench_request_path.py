"""bench.request_path's tracer: what it counts as a stop, a resumption and a doubling back.

The bench itself (a daemon in process, traced requests) is run by hand; here the counting
rules are checked on the project's own functions, which is what the bench reports on.
"""

from __future__ import annotations

import asyncio

from fleet.bench.request_path import trace
from fleet.daemon import codec


def test_a_call_into_a_project_file_is_one_stop_and_others_are_not() -> None:
    stops, resumed = trace(lambda: codec.encode_msgpack({"a": [1, 2]}))
    assert stops == [("daemon/codec.py", "encode_msgpack")] and resumed == 0


def test_a_resumed_coroutine_is_not_another_stop() -> None:
    from fleet.daemon import timeline

    async def wait_then_stamp() -> None:
        await asyncio.sleep(0)
        timeline.stamp("x")

    async def outer() -> None:
        await asyncio.gather(codec_roundtrip(), wait_then_stamp())

    stops, resumed = trace(lambda: asyncio.run(outer()))
    files = [f for f, _ in stops]
    assert files.count("daemon/codec.py") == 2 and files.count("daemon/timeline.py") == 1
    assert resumed == 0  # the coroutines above live in tests/, not in the project


async def codec_roundtrip() -> None:
    codec.decode(codec.encode_msgpack({"model": "m"}), dict, msgpack=True)


def test_entering_a_file_still_on_the_stack_is_marked_as_doubling_back() -> None:
    """AliasScope (daemon/aliases.py) runs the app it wraps: an app that calls back into
    aliases.py enters it again below AliasScope's frame (a doubling back); one that
    calls only codec does not."""
    from fleet.daemon import aliases
    from fleet.daemon.aliases import AliasScope

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        return None

    async def plain(scope, receive, send) -> None:
        codec.encode_msgpack(scope["type"])

    async def back(scope, receive, send) -> None:
        aliases.rolled_back("a", by="test")

    for app, doubled in ((plain, []), (back, [("daemon/aliases.py", "rolled_back (back)")])):
        stops, _ = trace(lambda app=app: asyncio.run(AliasScope(app)({"type": "lifespan"}, receive, send)))
        assert ("daemon/aliases.py", "AliasScope.__call__") in stops
        assert [s for s in stops if s[1].endswith(" (back)")] == doubled
