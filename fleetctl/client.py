"""Python client for a fleet daemon: MessagePack transport, numpy arrays out,
typed errors from the contract's codes. The CLI talks to the daemon through it.

    from fleetctl.client import Client
    with Client() as fleet:
        vectors = fleet.embed("all-minilm-l6-v2", ["hello", "world"])   # (2, 384) float32
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import msgspec

from fleetctl.config import client_url
from fleetctl.errors import FleetError, Unavailable, from_code
from fleetctl.protocol import EmbedReplyMsgpack, ErrorReply

MSGPACK = "application/msgpack"

_encode = msgspec.msgpack.Encoder().encode
_errors = msgspec.msgpack.Decoder(ErrorReply)
_embed_reply = msgspec.msgpack.Decoder(EmbedReplyMsgpack)
_any = msgspec.msgpack.Decoder()


class Client:
    def __init__(self, url: str | None = None, *, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        self.url = (url or client_url()).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("FLEET_API_KEY", "")
        headers = {"Accept": MSGPACK}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, body: Any = None) -> bytes:
        content = None if body is None else _encode(body)
        headers = {"Content-Type": MSGPACK} if content is not None else None
        try:
            resp = self._http.request(method, path, content=content, headers=headers)
        except httpx.TransportError as exc:
            raise Unavailable(
                f"cannot reach the fleet daemon at {self.url}: {exc}",
                hint="start it with `fleetctl serve`, or point FLEET_URL at it",
            ) from None
        if resp.status_code >= 400:
            raise self._error(resp)
        return resp.content

    @staticmethod
    def _error(resp: httpx.Response) -> FleetError:
        try:
            body = _errors.decode(resp.content)
            return from_code(body.error.code, body.error.message)
        except msgspec.DecodeError:
            return FleetError(f"HTTP {resp.status_code}: {resp.text[:200]}")

    def get(self, path: str) -> Any:
        return _any.decode(self.request("GET", path))

    def post(self, path: str, body: Any = None) -> Any:
        return _any.decode(self.request("POST", path, body if body is not None else {}))

    def embed(self, model: str, inputs: list[str], *, normalize: bool = True, truncate: bool = True):
        import numpy as np

        raw = self.request("POST", "/v1/embed", {"model": model, "inputs": inputs, "normalize": normalize,
                                                 "truncate": truncate})
        reply = _embed_reply.decode(raw)
        return np.frombuffer(reply.embeddings, dtype="<f4").reshape(reply.shape)

    def ps(self) -> dict[str, Any]:
        return self.get("/v1/ps")
