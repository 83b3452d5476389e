"""Replies of per-token vectors (`output: "tokens"` on `/v1/embed`, bge-m3's ColBERT
vectors among them, and TEI's `/embed_all`): bounded before the work, built off the
event loop.

A request within `max_inputs` and `max_request_tokens` may ask for one vector per
token: 2 048 inputs of 256 tokens of a 384-wide model are 201 M values, 4 GB of
JSON text (~21 bytes a value) built from ~6 GB of Python lists, in the API process.
So:

1. Before anything is queued (`check_before`): the tokens the request's inputs
   come to (~4 characters a token plus two special tokens, at most the model's
   max_seq_len when it cuts, as daemon.pieces estimates them) x the model's width
   (its config's hidden size) x the bytes a value takes in the reply's format
   (`VALUE_BYTES`) over `max_token_vector_bytes` is refused (413 naming the
   setting).
2. When the worker has answered (`check_after`): the same product with the exact
   token counts, before any reply is built (an estimate can be low: "a b c" reads
   as a token per 2 characters).
3. A JSON (or list-MessagePack) reply is built one input's block at a time, so
   only one block's Python lists live at once (`encoded_blocks`), on the API work
   pool when large (daemon.offload.build_reply).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from fleet.errors import ModelNotFound, PayloadTooLarge
from fleet.messages import TokenEmbedResult
from fleet.protocol import EmbedRequest
from fleet.store import Manifest, Store

from fleet.daemon.core import Daemon

#: Bytes one value of a per-token vector takes in a reply: MessagePack carries raw
#: float32; JSON text of a float32 read as a double is ~21 characters with its
#: separator (measured over unit vectors: 20.9); MessagePack lists (TEI's shape) 9.
VALUE_BYTES = {"raw": 4, "json": 21, "lists": 9}
FORMAT_NAMES = {"raw": "MessagePack", "json": "JSON", "lists": "MessagePack lists"}
#: Config keys that hold a transformer's hidden size (BERT-likes, T5/BART, DistilBERT, GPT-2).
WIDTH_KEYS = ("hidden_size", "d_model", "dim", "n_embd")
#: Tokens an image input is counted as (daemon.tasks.IMAGE_TOKENS: a ViT-B/16 sees 197).
IMAGE_TOKENS = 256

#: (model, created_at) -> its token vectors' width (None: its config does not say).
_widths: dict[tuple[str, str], int | None] = {}


def token_width(store: Store, manifest: Manifest) -> int | None:
    """Values per token vector of a stored model: its config's hidden size (the
    transformer's token states; bge-m3's ColBERT head keeps that width)."""
    key = (manifest.name, manifest.created_at)
    if key in _widths:
        return _widths[key]
    try:
        config = json.loads((store.path(manifest.name) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    width = next((v for k in WIDTH_KEYS if isinstance(v := config.get(k), int) and v > 0), None)
    _widths[key] = width
    return width


def estimated_tokens(req: EmbedRequest, cap: int | None) -> int:
    """Tokens the model reads for `req.inputs`: ~4 characters a token plus two special
    tokens per text, at most `cap`; an image IMAGE_TOKENS."""
    lengths = np.fromiter((len(x) if x.__class__ is str else -1 for x in req.inputs), dtype=np.int64,
                          count=len(req.inputs))
    costs = lengths // 4 + 2
    if cap:
        costs = np.minimum(costs, cap)
    return int(np.where(lengths < 0, IMAGE_TOKENS, costs).sum())


def refusal(model: str, tokens: int, width: int, fmt: str, limit: int, *, about: bool) -> PayloadTooLarge:
    size = tokens * width * VALUE_BYTES[fmt]
    other = "" if fmt == "raw" else f", or ask for MessagePack ({VALUE_BYTES['raw']} bytes a value)"
    return PayloadTooLarge(
        f"the token vectors of this request come to {'about ' if about else ''}{tokens} tokens x {width} values "
        f"x {VALUE_BYTES[fmt]} bytes ({FORMAT_NAMES[fmt]}) = {size} bytes as {model} answers; "
        f"max_token_vector_bytes = {limit} per reply: send fewer or shorter inputs per request{other}",
        hint="raise max_token_vector_bytes in config.toml (FLEET_MAX_TOKEN_VECTOR_BYTES) to allow more")


def check_before(daemon: Daemon, req: EmbedRequest, fmt: str) -> None:
    """Refuse a request whose token vectors would be over `max_token_vector_bytes` in
    format `fmt` (a key of VALUE_BYTES), before it is queued. A model this box does
    not store, or whose width its config does not say, is checked by `check_after`."""
    limit = daemon.settings.max_token_vector_bytes
    if req.output != "tokens" or limit <= 0:
        return
    try:
        manifest = daemon.manifest(req.model, "embed")
        if manifest.base:  # a LoRA adapter answers with its base's width
            manifest = daemon.manifest(manifest.base, "embed")
    except ModelNotFound:
        return
    width = token_width(daemon.store, manifest)
    if width is None:
        return
    tokens = estimated_tokens(req, manifest.max_seq_len if req.truncate else None)
    if tokens * width * VALUE_BYTES[fmt] > limit:
        raise refusal(req.model, tokens, width, fmt, limit, about=True)


def check_after(daemon: Daemon, model: str, shapes: list[tuple[int, int]], fmt: str) -> int:
    """The values of a worker's per-token answer (`shapes`: (tokens, width) per input);
    refused when over `max_token_vector_bytes` in format `fmt`, before a reply is built."""
    limit = daemon.settings.max_token_vector_bytes
    if not shapes:
        return 0
    tokens = sum(s[0] for s in shapes)
    width = shapes[0][1]
    if 0 < limit < tokens * width * VALUE_BYTES[fmt]:
        raise refusal(model, tokens, width, fmt, limit, about=False)
    return tokens * width


def encoded_blocks(res: TokenEmbedResult, encode: Callable[[Any], bytes]) -> list[msgspec.Raw]:
    """Each input's (tokens, width) block as nested lists, encoded by `encode` on its
    own: a list of Raw values that msgspec splices into the reply, so only one
    block's Python lists are alive at a time."""
    return [msgspec.Raw(encode(np.frombuffer(b, dtype="<f4").reshape(shape).tolist()))
            for b, shape in zip(res.data, res.shapes)]
