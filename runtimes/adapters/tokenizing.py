"""Tokenizing for the encoder adapters: a model's Rust tokenizer called directly
(`DirectTokenizer`), and micro-batches tokenized ahead of the forward
(`prefetched`, `tokenize_threads`).

Split from runtimes/adapters/hf_common.py: tokenizing is the host's share of a batch
(on a GPU it bounded the tokens a second a model serves, issue 34), and the
direct tokenizer carries its own probes and checks against the model's own
tokenization; loading and dtype choice stay in hf_common.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np

from fleet.runtimes.adapters.hf_common import CHECK_SET

log = logging.getLogger("fleet.worker")


T = TypeVar("T")
U = TypeVar("U")


#: Tokenizer threads one adapter keeps at most (`tokenize_threads`): each holds the
#: GIL for ~0.23 of its ~1.8 CPU-us a token (the encodings' lists turned into
#: arrays; all-MiniLM-L6-v2's tokenizer on the bench corpus), so past about 1.8 /
#: 0.23 threads the GIL, not the cores, would bound them.
TOKENIZE_THREADS_MAX = 8


def tokenize_threads(torch: Any, direct: Any, device: str) -> int:
    """Threads that tokenize an adapter's micro-batches ahead of its forward. On an
    accelerator, one per core torch may use (its intra-op threads: the worker's share
    of the box), at most TOKENIZE_THREADS_MAX, when the tokenizer is a
    `DirectTokenizer` (safe to call from several threads at once): one thread
    tokenizing every micro-batch is a ceiling of ~0.6 M tokens/s a model whatever the
    device (issue 34). On the CPU the forward's own threads hold the cores: one
    (two on the 2-vCPU box cost the tiny model's forward 0-10 % of its tokens/s,
    bench.host_path)."""
    if direct is None or device == "cpu":
        return 1
    return max(1, min(TOKENIZE_THREADS_MAX, torch.get_num_threads()))


def prefetched(items: Sequence[T], prepare: Callable[[T], U], pool: ThreadPoolExecutor | None, depth: int = 1,
               ) -> Iterator[tuple[T, U]]:
    """`(item, prepare(item))` in order. With `pool`, items k+1 .. k+`depth` are
    prepared in the pool's threads while the caller works on item k: tokenizing
    (the Rust tokenizer releases the GIL) overlaps the forward pass (torch releases
    it too), and with `depth` threads scales with the cores instead of one thread
    carrying every micro-batch's tokens (issue 34). `depth` > 1 only where
    `prepare` may run in several threads at once (a `DirectTokenizer`:
    transformers' own tokenizer re-configures itself on every call).

    Closing the iterator early waits for the pending `prepare`s: the caller's
    next batch may use the same tokenizer.
    """
    if pool is None or len(items) < 2:
        for item in items:
            yield item, prepare(item)
        return
    depth = max(1, depth)
    pending: deque[Future] = deque(pool.submit(prepare, item) for item in items[:depth])
    try:
        for k, item in enumerate(items):
            ready = pending.popleft().result()
            if k + depth < len(items):
                pending.append(pool.submit(prepare, items[k + depth]))
            yield item, ready
    finally:
        for future in pending:
            future.exception()  # wait; its result is not wanted


# ---- tokenizing -----------------------------------------------------------------

#: Inputs on which a private copy of a model's Rust tokenizer must give exactly
#: what the model's own tokenization gives before it replaces it
#: (`direct_tokenizer`): empty, accents and case, scripts without spaces, emoji
#: sequences, spaces at the ends, control and zero-width characters, the special
#: tokens' own strings, a word over WordPiece's 100 characters. `tokenize_probes`
#: adds a text longer than the model's limit.
TOKENIZE_PROBES = [
    *CHECK_SET,
    "",
    " ",
    "  leading and trailing spaces  ",
    "ÉCOLE élève Ñandú straße İstanbul ǅemal Å̊ e\u0301 ﬁne ＦＵＬＬ ｗｉｄｔｈ",
    "東京は日本の首都です。北京欢迎你！서울은 한국의 수도입니다.",
    "I ❤️ 🍕 and 👩‍👩‍👧‍👦 families 🇫🇷🇯🇵 👍🏽 ©™",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "\t tabs\r\nand\nnewlines\u00a0nbsp\u200bzero\u200dwidth\ufeffbom \x00\x07\x1b[0m",
    "[CLS] [SEP] [PAD] [MASK] [UNK] <s> </s> <pad> <unk> <mask> <|endoftext|> <|im_start|>",
    "x" * 150 + " supercalifragilisticexpialidocious antidisestablishmentarianism",
    "3.14159 — “quotes” ‘single’ … ½ ² ∑∫ √2 ≠ ∞ $100 €5 ¥3 #tag @user http://example.com/a?b=c&d",
]


def tokenize_probes(max_tokens: int) -> list[str]:
    """TOKENIZE_PROBES plus one text of more than `max_tokens` tokens: it has
    more words than that, and every tokenizer gives a word at least one token."""
    words = " ".join(CHECK_SET).split()
    return [*TOKENIZE_PROBES, " ".join(words[i % len(words)] for i in range(max_tokens + 8))]


#: The encoding each feature of a tokenizer's output is read from.
ENCODING_FIELDS = {"input_ids": "ids", "token_type_ids": "type_ids", "attention_mask": "attention_mask"}


def bare_copies(tokenizer: Any) -> tuple[Any, Any]:
    """Two Rust `tokenizers.Tokenizer`s of transformers' fast `tokenizer`, splitting
    special tokens as it does, with no truncation and no padding: the caller sets its own."""
    from tokenizers import Tokenizer

    spec = tokenizer.backend_tokenizer.to_str()
    copies = Tokenizer.from_str(spec), Tokenizer.from_str(spec)
    for copy_ in copies:
        copy_.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        copy_.no_truncation()
        copy_.no_padding()
    return copies


class DirectTokenizer:
    """A model's Rust tokenizer called directly: one `encode_batch_fast` and one
    numpy array per feature, instead of transformers' Python around the same
    call (keyword resolution, a dict per encoding, BatchEncoding's conversion).
    One short text on the 2-core box: ~115 us through sentence-transformers'
    preprocess when the CPU is hot, ~815 us right after a 20 ms idle gap (a lone
    client's next request); ~45 / ~335 us here.

    Private copies (`Tokenizer.from_str`): transformers re-configures its
    backend's truncation and padding on every call, so the shared one is not
    ours to configure. Each copy is configured once and never changed after, so
    the tokenize-ahead threads and the batch thread call them without a lock.
    Build it only through `direct_tokenizer`, which checks it first.

    The Rust side only truncates; padding is numpy's. Each encoding's Python
    lists are the part that holds the GIL (all a thread pool of tokenizers
    cannot run at once): the ids of the real tokens are read once, flat, and
    scattered into the padded array, the mask is the lengths', and a single
    input's type ids (its post-processor's template, the same for every text)
    are not read when the template's are zero. All-MiniLM-L6-v2's tokenizer on
    the bench corpus, 32 texts a call: 0.37 -> 0.19 CPU-us a token converting,
    2.9 -> 2.6 in all (issue 34).
    """

    def __init__(self, tokenizer: Any, max_tokens: int, example: dict[str, Any]) -> None:
        """`example`: the model's own features for some inputs; the same keys come
        back in the same order (token tensors read from the encodings, other
        entries, such as sentence-transformers' `modality`, as they are)."""
        self._cut, self._whole = bare_copies(tokenizer)
        self._cut.enable_truncation(max_tokens, strategy="longest_first", direction=tokenizer.truncation_side)
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no padding token")
        #: What padding positions read: (input id, type id); left or right of the tokens.
        self._pad = {"ids": int(tokenizer.pad_token_id), "type_ids": int(tokenizer.pad_token_type_id)}
        self._left = tokenizer.padding_side == "left"
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which nothing here reads.
        self._encode_cut = getattr(self._cut, "encode_batch_fast", self._cut.encode_batch)
        self._encode_whole = getattr(self._whole, "encode_batch_fast", self._whole.encode_batch)
        self._single_types = any(self._whole.encode("a").type_ids)
        unknown = [k for k, v in example.items() if hasattr(v, "shape") and k not in ENCODING_FIELDS]
        if unknown:
            raise ValueError(f"features {unknown} are not read from an encoding")
        #: (key, encoding field or None, the value when None)
        self.layout = [(k, ENCODING_FIELDS[k], None) if hasattr(v, "shape") else (k, None, v)
                       for k, v in example.items()]

    def __call__(self, inputs: list[Any]) -> dict[str, Any]:
        """Features of texts (or (text, text) pairs), truncated to `max_tokens`
        (pairs: the longer side first) and padded to the longest: int64 tensors
        (rows, tokens) over numpy arrays."""
        return self.features(self.encode(inputs), pairs=bool(inputs) and not isinstance(inputs[0], str))

    def encode(self, inputs: list[Any]) -> list[Any]:
        """The Rust encodings of `inputs`, truncated to `max_tokens`: their lengths are
        the tokens the forward reads (`len(encoding)`); `features` pads any of them."""
        return self._encode_cut(inputs)

    def features(self, encodings: Sequence[Any], *, pairs: bool = False) -> dict[str, Any]:
        """`__call__`'s features of encodings from `encode` (of pairs, with `pairs`)."""
        import torch

        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        width = int(lengths.max(initial=0))
        columns = np.arange(width)
        mask = columns >= (width - lengths)[:, None] if self._left else columns < lengths[:, None]
        read = ("ids", "type_ids") if self._single_types or pairs else ("ids",)
        out: dict[str, Any] = {}
        for key, field, value in self.layout:
            if field is None:
                out[key] = value
                continue
            if field == "attention_mask":
                array = mask.astype(np.int64)
            else:
                array = np.full(mask.shape, self._pad[field], dtype=np.int64)
                # Row by row, the real tokens' places in the padded array are the flat list's order.
                array[mask] = (np.fromiter(chain.from_iterable(map(attrgetter(field), encodings)), dtype=np.int64,
                                           count=int(lengths.sum())) if field in read else 0)
            out[key] = torch.from_numpy(array)
        return out

    def lengths(self, inputs: list[Any]) -> np.ndarray:
        """Tokens of each input with the special tokens, not truncated (int64)."""
        return np.fromiter(map(len, self._encode_whole(inputs)), dtype=np.int64, count=len(inputs))


def direct_tokenizer(tokenizer: Any, max_tokens: int, reference: Callable[[list[Any]], dict[str, Any]], name: str,
                     *, lengths: Callable[[list[Any]], Sequence[int]] | None = None,
                     pairs: bool = False) -> DirectTokenizer | None:
    """A DirectTokenizer that gives exactly what `reference` (the model's own
    tokenization of a list of texts, or of (text, text) pairs with `pairs`)
    gives, or None.

    Checked on `tokenize_probes` (as pairs: each with another, and the long
    one with itself, so both sides are cut), each alone and all in one padded
    batch: same keys in the same order, same tensor shapes, dtypes and values;
    with `lengths` (the model's own untruncated token counts), the same counts. Any
    difference (a tokenizer that works in Python, a module that lowercases or
    prepends in Python, other padding) keeps `reference`, said once in the log.
    """
    why = direct_refusal(tokenizer)
    direct = None
    if why is None:
        probes: list[Any] = tokenize_probes(max_tokens)
        if pairs:
            probes = [*((q, probes[(i + 3) % len(probes)]) for i, q in enumerate(probes)), (probes[-1], probes[-1])]
        try:
            direct = DirectTokenizer(tokenizer, max_tokens, reference(probes[:1]))
            why = next(filter(None, (features_differ(reference(batch), direct(batch))
                                     for batch in [*([p] for p in probes), probes])), None)
            if why is None and lengths is not None and list(lengths(probes)) != direct.lengths(probes).tolist():
                why = "untruncated token counts differ"
        except Exception as exc:  # a tokenizer or module this copy cannot mirror
            why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        log.info("direct tokenizer %s: off (%s); tokenizing through the model's own code", name, why)
        return None
    log.info("direct tokenizer %s: on (%d probe inputs agree)", name, len(probes))
    return direct


def direct_refusal(tokenizer: Any) -> str | None:
    """Why `tokenizer` cannot be mirrored by its Rust tokenizer alone, or None:
    not a fast tokenizer, no padding token, or a class that changes the call
    path in Python (transformers' own base classes only call the backend)."""
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        return f"{type(tokenizer).__name__} is not a fast tokenizer"
    if tokenizer.pad_token is None:
        return "no padding token"
    for method in ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "batch_encode_plus",
                   "_convert_encoding", "set_truncation_and_padding"):
        fn = getattr(type(tokenizer), method, None)
        if fn is not None and not getattr(fn, "__module__", "").startswith("transformers.tokenization_utils"):
            return f"{type(tokenizer).__name__}.{method} is its own"
    return None


def features_differ(want: dict[str, Any], got: dict[str, Any]) -> str | None:
    """What differs between two feature dicts (keys and their order, tensor
    shape, dtype and values, other entries by ==), or None."""
    if list(want) != list(got):
        return f"keys {list(got)} instead of {list(want)}"
    for key, w in want.items():
        g = got[key]
        if hasattr(w, "shape") != hasattr(g, "shape"):
            return f"{key} is {type(g).__name__} instead of {type(w).__name__}"
        if hasattr(w, "shape"):
            if w.dtype != g.dtype or tuple(w.shape) != tuple(g.shape) or not bool((w == g).all()):
                return f"{key} {g.dtype}{tuple(g.shape)} instead of {w.dtype}{tuple(w.shape)} or other values"
        elif w != g:
            return f"{key} {g!r} instead of {w!r}"
    return None
