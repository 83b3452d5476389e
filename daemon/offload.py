"""Work the API process does itself and that grows with the request: tokenizing
(TEI `/tokenize`), decoding token-id inputs back to text, building a large reply.

Each such job is bounded before it starts (a setting, refused with 413 naming it:
`too_large`) and runs here, off the event loop, on a pool of API_WORK_THREADS
threads: the loop keeps reading, answering and collecting results meanwhile, and
at most that many jobs hold their working memory at once (a 15 MB text held ~2.7 GB
while tokenized and turned into TEI's reply). Jobs beyond that wait for a thread,
holding only their request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from fleet.errors import PayloadTooLarge

P = ParamSpec("P")
T = TypeVar("T")

#: Threads for the API process's own work. Two: a job that holds the GIL (building
#: reply objects) then leaves the loop every other switch interval, and two jobs at
#: their bound stay within the API process's memory goal (issue 25: 600 MiB).
API_WORK_THREADS = 2

#: A job of at most this many units (characters to tokenize, ids to decode) runs on
#: the loop: it costs less than the hop to a thread (~0.1 ms), and a small request
#: never waits behind big ones for a thread.
INLINE_UNITS = 1024
#: A JSON reply of at most this many values (floats of embeddings) is built on the
#: loop (<= ~5 ms); a larger one (up to max_inputs rows: 2 048 x 1 024 floats took
#: 0.3 s to turn into lists and JSON) off it.
REPLY_INLINE_VALUES = 1 << 16

_pool = ThreadPoolExecutor(API_WORK_THREADS, thread_name_prefix="fleet-api-work")


async def off_loop(units: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)`, a job of `units` units: on the API work pool, awaited from
    the event loop; inline when it is small (INLINE_UNITS)."""
    if units <= INLINE_UNITS:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


async def build_reply(values: int, build: Callable[[], T]) -> T:
    """A reply `build()` makes from `values` floats (lists, JSON): off the loop when large."""
    if values <= REPLY_INLINE_VALUES:
        return build()
    return await asyncio.get_running_loop().run_in_executor(_pool, build)


def too_large(what: str, size: int, setting: str, limit: int, *, param: str | None = None) -> PayloadTooLarge:
    """The 413 of a request over one of the API process's own bounds, naming the setting and its value."""
    return PayloadTooLarge(f"{what} ({size}) is over what the API process takes per request: {setting} = {limit}; "
                           f"send less per request", param=param)


def text_bytes_over(texts: list[str], limit: int) -> int | None:
    """The UTF-8 size of `texts` when it is over `limit`, else None, without encoding
    texts that cannot be: a character is 1 to 4 bytes."""
    chars = sum(map(len, texts))
    if chars > limit:
        return chars if all(t.isascii() for t in texts) else sum(len(t.encode()) for t in texts)
    if 4 * chars <= limit:
        return None
    size = sum(len(t.encode()) for t in texts)
    return size if size > limit else None
