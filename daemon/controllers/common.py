"""What the task controllers share: one decode of the body, the payload to queue,
and the request with its model filled in when it names none (daemon.defaults)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from litestar import Request

from fleet.daemon import codec
from fleet.daemon.core import Daemon
from fleet.daemon.defaults import default_model
from fleet.daemon.http import body_is_msgpack

T = TypeVar("T")


async def decode_request(request: Request, type_: type[T]) -> tuple[T, bytes]:
    """(validated request, its MessagePack payload for the queue).

    For MessagePack clients the payload is the body exactly as received (no
    re-encoding); JSON bodies are encoded once. A request without `model` gets
    its task's default (`with_model`), and is then encoded once with it.
    """
    body = await request.body()
    msgpack_in = body_is_msgpack(request)
    req = codec.decode(body, type_, msgpack=msgpack_in)
    return req, (body if msgpack_in else codec.encode_msgpack(req))


def with_model(daemon: Daemon, task: str, req: T, payload: bytes) -> tuple[T, bytes]:
    """`req` and its payload with `model` filled in when the request left it out."""
    if req.model:  # type: ignore[attr-defined]
        return req, payload
    req = msgspec.structs.replace(req, model=default_model(daemon, task))  # type: ignore[type-var]
    return req, codec.encode_msgpack(req)
