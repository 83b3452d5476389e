"""The shapes every route of the HTTP API shares: the error body (the contract's, and
OpenAI's with `type` and `param`) and token usage.

Apart from fleet/protocol.py and fleet/protocol_generate.py because both use them and
neither may import the other's module (fleet.protocol re-exports generation's types).
"""

from __future__ import annotations

import msgspec


class ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorReply(msgspec.Struct, frozen=True):
    error: ErrorBody


class OpenAIErrorBody(msgspec.Struct, frozen=True):
    """The error body on OpenAI-shaped routes: the contract's `code` and `message`
    plus OpenAI's `type` and `param` (the field at fault, or null)."""

    code: str
    message: str
    type: str
    param: str | None = None


class OpenAIErrorReply(msgspec.Struct, frozen=True):
    error: OpenAIErrorBody


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int = 0
    output_tokens: int = 0
