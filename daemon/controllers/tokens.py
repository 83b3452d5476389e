"""A model's own tokenizer in the API process, for what needs no model run:
reading token-id inputs (OpenAI `input` as ids) and TEI's `POST /tokenize`.

The `tokenizers` library (Rust, no torch) reads the model's `tokenizer.json`
from the store after checking it against the sha256 its manifest recorded.
Token ids are read in the model's own vocabulary: they are decoded to text
here and the worker tokenizes that text again, so the worker's one request
path (texts in) stays the only one; for WordPiece and BPE tokenizers that
round trip gives back the same ids, apart from spacing that their decoders
normalise.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fleet.errors import BadRequest, IntegrityError, ModelLoadFailed
from fleet.store import Manifest, Store

from fleet.daemon.offload import off_loop, too_large

TOKENIZER_FILE = "tokenizer.json"

#: name -> (sha256 of its tokenizer.json, tokenizer); a re-pulled model has a new sha.
_cache: dict[str, tuple[str, Any]] = {}


def tokenizer_file(manifest: Manifest) -> Any:
    """The manifest's entry for the model's `tokenizer.json` (at the top, else the shallowest)."""
    entries = [f for f in manifest.files if f.path == TOKENIZER_FILE or f.path.endswith("/" + TOKENIZER_FILE)]
    if not entries:
        raise BadRequest(f"model {manifest.name!r} ships no {TOKENIZER_FILE}: send text, not token ids")
    return min(entries, key=lambda f: f.path.count("/"))


def load_tokenizer(store: Store, manifest: Manifest) -> Any:
    """The model's tokenizer, unpadded and untruncated (callers decide both); a
    LoRA adapter's is its base's (its runtime reads text with it)."""
    from tokenizers import Tokenizer

    if manifest.base:
        manifest = store.get(manifest.base)
    entry = tokenizer_file(manifest)
    cached = _cache.get(manifest.name)
    if cached is not None and cached[0] == entry.sha256:
        return cached[1]
    raw = (store.path(manifest.name) / entry.path).read_bytes()
    if hashlib.sha256(raw).hexdigest() != entry.sha256:
        raise IntegrityError(f"model {manifest.name!r}: {entry.path} does not match its recorded sha256",
                             hint=f"re-pull it: `fleetctl pull {manifest.name} --force`")
    try:
        tokenizer = Tokenizer.from_str(raw.decode())
    except Exception as exc:  # the library raises its own types for a file it cannot read
        raise ModelLoadFailed(f"cannot read the tokenizer of {manifest.name!r}: {exc}") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    _cache[manifest.name] = (entry.sha256, tokenizer)
    return tokenizer


def check_ids(ids: list[list[int]], vocab_size: int, model: str) -> None:
    """Every id must name a token of the model's vocabulary. Ids from another
    vocabulary (LangChain's OpenAIEmbeddings tokenizes with tiktoken by default)
    would embed other words: out-of-range ones are refused with the setting that
    makes LangChain send text."""
    if not all(ids):
        raise BadRequest("`input` holds an empty list of token ids", param="input")
    low, high = min(map(min, ids)), max(map(max, ids))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise BadRequest(
            f"token id {bad} is outside the vocabulary of {model!r} (ids 0..{vocab_size - 1}): token ids are read "
            f"in the model's own vocabulary. LangChain's OpenAIEmbeddings sends tiktoken ids by default: set "
            f"check_embedding_ctx_length=False so it sends the text", param="input")


async def ids_to_texts(store: Store, manifest: Manifest, ids: list[list[int]], max_ids: int) -> list[str]:
    """The texts the id lists spell, at most `max_ids` ids in all (`max_token_ids`,
    checked first). Loading the tokenizer, checking the ids and decoding (~0.1-0.3 ms
    per input: WordPiece joins and cleans up pieces) run off the event loop
    (daemon.offload): a request of a few hundred inputs must not stall every other
    request's I/O."""
    count = sum(map(len, ids))
    if count > max_ids:
        raise too_large("the token ids sent", count, "max_token_ids", max_ids, param="input")

    def decode() -> list[str]:
        tokenizer = load_tokenizer(store, manifest)
        check_ids(ids, tokenizer.get_vocab_size(with_added_tokens=True), manifest.name)
        return tokenizer.decode_batch(ids, skip_special_tokens=True)

    return await off_loop(count, decode)
