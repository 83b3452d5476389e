"""Where one `POST /v1/embed` goes in the API process: the project files it enters, in order.

Usage:
  python -m fleet.bench request-path [--requests 3] [--json] [--out FILE]

It builds bench.host_path's tiny embedder (one BERT layer, MiniLM's tokenizer), pulls it
into a temporary FLEET_HOME, and runs the daemon's app in this process the way `fleetctl
serve` builds it (the hot routes in front of the Litestar app) with its real worker
processes. After warm-up requests it traces requests with `sys.setprofile`: a call of a
project function from a frame in another file (or from the event loop, when a coroutine
of the project is resumed after an await) is an entry into that file. It reports each
traced request's stops in order and the entries per file, and the most-entered file: the
request path goes straight when no file is entered more than twice.

Two rules keep the count the request's own. A frame is started once: a generator's or a
coroutine's frame that goes on after a yield or an await is a resumption, told by the
instruction it stands at (a fresh frame stands at its first RESUME), not by its id(),
which a new frame takes over once an old one is freed (counted by id(), a context
manager's second use, like the collect's `no_wait`, passed for a resumption). And work of
the tasks that ran before the request came (the gauges' refresh every METRICS_REFRESH_S,
the batch promotion loop) is not its path: those stops are marked `(background)` and
counted apart (`entries_per_file_all` counts them in).

Only the API process is traced; the worker's side is bench.host_path's timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import inspect
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from fleet.bench.cli import JSON, OUT, REQUESTS, bench, option

ROOT = Path(__file__).resolve().parents[1]
#: The project's folders (fleet.* and fleetctl); everything else (asyncio, litestar, msgspec) is not a stop.
PROJECT = tuple(str(ROOT / d) + os.sep for d in ("fleet", "daemon", "runtimes", "local_queue", "fleetctl"))


#: Code objects whose frames suspend and resume (coroutines, generators, async generators).
SUSPENDS = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_RESUME = dis.opmap["RESUME"]


def project_file(filename: str) -> str | None:
    return str(Path(filename).relative_to(ROOT)) if filename.startswith(PROJECT) else None


def resumes(frame: Any) -> bool:
    """A generator's or coroutine's frame going on after a yield or an await (a fresh one
    stands at its first instruction, `RESUME 0`)."""
    code = frame.f_code.co_code
    return not (code[frame.f_lasti] == _RESUME and code[frame.f_lasti + 1] == 0)


def in_background(background: Collection[asyncio.Task]) -> bool:
    try:
        return asyncio.current_task() in background
    except RuntimeError:  # no loop runs
        return False


def trace(run: Any, background: Collection[asyncio.Task] = ()) -> tuple[list[tuple[str, str]], int]:
    """(file, function) of each call into a project file from another file (or from the
    event loop) while `run()` runs, and how many times a coroutine was resumed after an
    await: a resumption is the same frame going on, not another stop. A stop made while
    one of the `background` tasks runs is marked `(background)`."""
    stops: list[tuple[str, str]] = []
    resumed = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal resumed
        if event != "call":
            return
        here = project_file(frame.f_code.co_filename)
        if here is None:
            return
        if frame.f_code.co_flags & SUSPENDS and resumes(frame):
            resumed += 1
            return
        aside = bool(background) and in_background(background)
        back = frame.f_back
        caller = project_file(back.f_code.co_filename) if back is not None else None
        if caller != here:
            # Doubling back: the file is entered again while one of its frames still waits
            # further down the stack (A -> B -> A), not merely called again after returning.
            outer = back
            while outer is not None and project_file(outer.f_code.co_filename) != here:
                outer = outer.f_back
            stops.append((here, frame.f_code.co_qualname + (" (back)" if outer is not None else "")
                          + (" (background)" if aside else "")))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return stops, resumed


class InProcess:
    """The daemon's ASGI app in this process: lifespan started, requests called directly."""

    def __init__(self, home: Path) -> None:
        os.environ["FLEET_HOME"] = str(home)
        from fleet.config import load_settings
        from fleet.daemon.app import create_app
        from fleet.daemon.controllers.embed import embed_exchange
        from fleet.daemon.core import Daemon
        from fleet.daemon.hot import HotRoutes

        self.loop = asyncio.new_event_loop()
        self.daemon = Daemon(load_settings())
        litestar = create_app(self.daemon)
        self.app = HotRoutes(litestar, self.daemon, embed_exchange)
        self.daemon.dispatch = self.app
        self.daemon.is_serving = lambda: True
        self._lifespan_in: asyncio.Queue = asyncio.Queue()
        self._lifespan_out: asyncio.Queue = asyncio.Queue()
        self.loop.run_until_complete(self._start(litestar))

    async def _start(self, litestar: Any) -> None:
        async def receive() -> dict:
            return await self._lifespan_in.get()

        async def send(message: dict) -> None:
            await self._lifespan_out.put(message)

        self._lifespan = asyncio.ensure_future(litestar({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                        receive, send))
        await self._lifespan_in.put({"type": "lifespan.startup"})
        started = await self._lifespan_out.get()
        if started["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {started}")

    def stop(self) -> None:
        async def stop() -> None:
            await self._lifespan_in.put({"type": "lifespan.shutdown"})
            await self._lifespan_out.get()
            await self._lifespan

        self.loop.run_until_complete(stop())
        self.loop.close()

    def call(self, path: str, body: bytes, *, method: str = "POST") -> tuple[int, bytes]:
        headers = [(b"host", b"127.0.0.1:7744"), (b"content-type", b"application/msgpack"),
                   (b"accept", b"application/msgpack"), (b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 7744), "state": {}}
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)  # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        self.loop.run_until_complete(self.app(scope, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.loop.run_until_complete(self.daemon.readiness())[0]:
                return
            self.loop.run_until_complete(asyncio.sleep(0.2))
        raise RuntimeError(f"the daemon was not ready in {timeout_s:g} s")


@bench("request-path", REQUESTS.but(default=3, help="traced requests (after 5 untraced)"),
       option("--texts", type=int, default=4, help="texts per request"), JSON,
       OUT.but(help="also write the JSON document here"))
def main(args: argparse.Namespace) -> None:
    from fleet.bench import report
    from fleet.bench.host_path import MODEL, build_model
    from fleet.bench.models import make_home
    from fleet.bench.tokens import package_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = build_model(work / "models", package_model_dir())
        home = make_home(work / "home", {MODEL: folder}, {MODEL: (MODEL, "embed", "sentence-transformers", "")},
                         "auto")
        os.environ.update({"FLEET_PRELOAD": MODEL, "FLEET_WORKERS": "1", "FLEET_ACCESS_LOG": "false"})
        daemon = InProcess(home)
        try:
            daemon.wait_ready()
            body = msgspec.msgpack.encode({"model": MODEL, "inputs": [f"text {i} of a request" for i in
                                                                        range(args.texts)]})
            for _ in range(5):
                status, _ = daemon.call("/v1/embed", body)
                if status != 200:
                    raise RuntimeError(f"warm-up answered {status}")
            traced = []
            answers: list[int] = []
            for _ in range(args.requests):
                stops, resumed = trace(lambda: answers.append(daemon.call("/v1/embed", body)[0]),
                                       background=asyncio.all_tasks(daemon.loop))
                traced.append((stops, resumed))
            if answers != [200] * args.requests:
                raise RuntimeError(f"the traced requests answered {answers}")
        finally:
            daemon.stop()

    runs = []
    for every, resumed in traced:
        stops = [(f, fn) for f, fn in every if not fn.endswith(" (background)")]
        per_file = Counter(f for f, _ in stops)
        back = Counter(f for f, fn in stops if fn.endswith(" (back)"))
        runs.append({"stops": len(stops), "files": len(per_file), "resumed": resumed, "doubling_back": dict(back),
                     "entries_per_file": dict(per_file.most_common()), "path": [f"{f}:{fn}" for f, fn in stops],
                     "background_stops": len(every) - len(stops),
                     "entries_per_file_all": dict(Counter(f for f, _ in every).most_common())})
    doc = report.document("request-path", "fleet.bench", args.argv) | {
        "requests": runs, "most_entered": max((max(r["entries_per_file"].values()) for r in runs), default=0)}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    last = runs[-1]
    print(f"POST /v1/embed in the API process: {last['stops']} stops in {last['files']} files "
          f"(most entered: {doc['most_entered']}; {last['resumed']} resumptions after an await)")
    print(f"entered again while still inside (A -> B -> A): {last['doubling_back'] or 'none'}; "
          f"{last['background_stops']} stops of background tasks meanwhile, not counted")
    for f, n in last["entries_per_file"].items():
        print(f"  {n:3d}  {f}")
    print("path:")
    for stop in last["path"]:
        print(f"  {stop}")
