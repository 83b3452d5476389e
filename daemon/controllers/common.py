"""What the task controllers share: one decode of the body, the payload to queue."""

from __future__ import annotations

from typing import TypeVar

from litestar import Request

from daemon import codec

T = TypeVar("T")


async def decode_request(request: Request, type_: type[T]) -> tuple[T, bytes]:
    """(validated request, its MessagePack payload for the queue).

    For MessagePack clients the payload is the body exactly as received (no
    re-encoding); JSON bodies are encoded once.
    """
    body = await request.body()
    msgpack_in = codec.is_msgpack(request.headers.get("content-type"))
    req = codec.decode(body, type_, msgpack=msgpack_in)
    return req, (body if msgpack_in else codec.encode_msgpack(req))
