"""bench.request_path's tracer: what it counts as a stop, a resumption and a doubling back.

The bench itself (a daemon in process, traced requests) is run by hand; here the counting
rules are checked on the project's own functions, which is what the bench reports on.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

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


def test_a_context_manager_used_twice_is_two_stops() -> None:
    """A generator's frame is fresh or resumed by where it stands, not by its id(): the
    second `no_wait()` frame may take the first one's freed address (counted by id() it
    passed for a resumption)."""
    from fleet.local_queue import LocalQueue

    q = LocalQueue.create(slots=8, slab_bytes=4096, max_lanes=1, max_workers=1)
    try:
        def twice() -> None:
            for _ in range(2):
                with q.no_wait():
                    pass

        stops, resumed = trace(twice)
    finally:
        q.close()
        q.unlink()
    assert stops == [("local_queue/queue.py", "LocalQueue.no_wait")] * 2
    assert resumed == 2  # each frame goes on once after its yield


def test_stops_of_a_task_running_before_the_request_are_marked_background() -> None:
    """The gauges' refresh runs in a task of its own while a request waits: its stops are
    not the request's path."""
    loop = asyncio.new_event_loop()

    async def ticker() -> None:
        while True:
            codec.encode_msgpack(1)
            await asyncio.sleep(0)

    async def request() -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        codec_roundtrip_now()

    try:
        bg = loop.create_task(ticker())
        stops, _ = trace(lambda: loop.run_until_complete(request()), background={bg})
        bg.cancel()
    finally:
        loop.close()
    mine = [s for s in stops if not s[1].endswith(" (background)")]
    assert mine == [("daemon/codec.py", "encode_msgpack"), ("daemon/codec.py", "decode")]
    assert ("daemon/codec.py", "encode_msgpack (background)") in stops


def codec_roundtrip_now() -> None:
    codec.decode(codec.encode_msgpack({"model": "m"}), dict, msgpack=True)


@pytest.mark.slow
def test_a_traced_embed_request_enters_no_project_file_more_than_twice(tmp_path, monkeypatch) -> None:
    """The request path goes straight (issue 35): one `POST /v1/embed`, MessagePack in and
    out, traced in the API process of a daemon with its real worker, enters no file of
    the project more than twice (the gauges' refresh, a task of its own, is not its path)."""
    import msgspec

    from fleet.bench.host_path import MODEL, build_model
    from fleet.bench.models import make_home
    from fleet.bench.request_path import InProcess
    from fleet.bench.tokens import package_model_dir

    folder = build_model(tmp_path / "models", package_model_dir())
    home = make_home(tmp_path / "home", {MODEL: folder}, {MODEL: (MODEL, "embed", "sentence-transformers", "")},
                     "auto")
    for key, value in {"FLEET_HOME": str(home), "FLEET_PRELOAD": MODEL, "FLEET_WORKERS": "1",
                       "FLEET_ACCESS_LOG": "false"}.items():
        monkeypatch.setenv(key, value)  # restored after the test, whatever InProcess sets
    daemon = InProcess(home)
    try:
        daemon.wait_ready()
        body = msgspec.msgpack.encode({"model": MODEL, "inputs": ["a text", "another text"]})
        assert daemon.call("/v1/embed", body)[0] == 200  # warm: the lane exists, the model runs
        answers: list[int] = []
        stops, _ = trace(lambda: answers.append(daemon.call("/v1/embed", body)[0]),
                         background=asyncio.all_tasks(daemon.loop))
    finally:
        daemon.stop()
    assert answers == [200]
    entries = Counter(f for f, fn in stops if not fn.endswith(" (background)"))
    assert entries["daemon/hot.py"] and entries["local_queue/slab.py"]  # the whole path was traced
    assert {f: n for f, n in entries.items() if n > 2} == {}
