"""One request's timeline, on request: `X-Fleet-Timeline: 1`.

A request that carries the header gets back `X-Fleet-Timeline` with a
CLOCK_MONOTONIC stamp (ns) per stage it passed, API and worker alike: every
process on the box reads the same clock, so a client on the box subtracts its
own send and receive stamps too (`bench/timeline.py`). A request without the
header pays one context-variable read per stamp point and nothing else.

The stamps are a list in a context variable, `STAMPS`. The hot path's stamp points (the
broker's `put`, `collected`, `resumed` and the worker's stamps, the embed route's
`checked`) append to it where they stand, `if (stamps := STAMPS.get()) is not None`, so a
request enters this module twice, at `begin` and at `finish`; the rarer points call
`stamp`.

Daemon stages, in order: `handler` (the route's code starts: HTTP parsed and
routed), `checked` (body read, decoded, model checked), `put` (the item is in its lane),
then the worker's (fleet.messages.WORKER_STAGES), then `collected` (the
event loop collected the batch of results that held it), `resumed` (the request's
coroutine runs again on the loop) and `encoded` (the reply body is built).
"""

from __future__ import annotations

import time
from contextvars import ContextVar


HEADER = "X-Fleet-Timeline"

#: The stamps of the request this task serves; None when it did not ask (and is not traced).
STAMPS: ContextVar[list[tuple[str, int]] | None] = ContextVar("fleet_timeline", default=None)
#: The request asked for its timeline in the reply (a traced one is stamped without it).
_shown: ContextVar[bool] = ContextVar("fleet_timeline_shown", default=False)


def begin(asked: str | bytes | None) -> None:
    """Start a timeline for this request when it asks for one (its `X-Fleet-Timeline`
    header's value, None when absent): the `handler` stamp."""
    if asked:
        STAMPS.set([("handler", time.monotonic_ns())])
        _shown.set(True)


def begin_traced() -> None:
    """Stamp this request for its trace (daemon.tracing builds spans from the stamps),
    without the reply header unless it asks for that too."""
    STAMPS.set([("handler", time.monotonic_ns())])


def current() -> list[tuple[str, int]] | None:
    return STAMPS.get()


def stamp(stage: str, ns: int | None = None) -> None:
    if (stamps := STAMPS.get()) is not None:
        stamps.append((stage, time.monotonic_ns() if ns is None else ns))


def finish(headers: dict[str, str]) -> None:
    """Stamp `encoded` (the reply body is built) and add the header to the reply's
    `headers`, when asked."""
    if (stamps := STAMPS.get()) is not None:
        stamps.append(("encoded", time.monotonic_ns()))
        if _shown.get():
            headers[HEADER] = ",".join(f"{stage}={ns}" for stage, ns in stamps)
