"""Contract types for the HTTP API (DESIGN.md, "Names fixed for clients").

Shared by the daemon (decode requests, encode replies) and the Python client.
Requests are plain msgspec Structs so decoding validates types in one pass; a
request decoded from a MessagePack body is forwarded to the worker as the very
same bytes (no re-encoding).
"""

from __future__ import annotations

import msgspec


class ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorReply(msgspec.Struct, frozen=True):
    error: ErrorBody


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int = 0
    output_tokens: int = 0


# ---- /v1/embed -------------------------------------------------------------

class EmbedRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    model: str
    inputs: list[str]
    normalize: bool = True
    truncate: bool = True
    timeout_ms: int | None = None


class EmbedReplyMsgpack(msgspec.Struct, frozen=True):
    """Tensor as raw little-endian float32 bytes plus shape and dtype."""

    model: str
    embeddings: bytes | msgspec.Raw
    shape: tuple[int, int]
    usage: Usage
    dtype: str = "float32"


class EmbedReplyJson(msgspec.Struct, frozen=True):
    model: str
    embeddings: list[list[float]]
    shape: tuple[int, int]
    usage: Usage


# ---- OpenAI /v1/embeddings --------------------------------------------------

class OpenAIEmbeddingsRequest(msgspec.Struct, frozen=True):
    model: str
    input: str | list[str]
    encoding_format: str = "float"  # float | base64
    dimensions: int | None = None
    user: str | None = None


class OpenAIEmbedding(msgspec.Struct, frozen=True):
    embedding: list[float] | str
    index: int
    object: str = "embedding"


class OpenAIUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingsReply(msgspec.Struct, frozen=True):
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage
    object: str = "list"


# ---- models -----------------------------------------------------------------

class ModelCard(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    task: str
    runtime: str
    object: str = "model"
    owned_by: str = "fleet"
    loaded: bool = False
    pinned: bool = False


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"
