"""What the encoder adapters share: loading, dtype choice, length-sorted micro-batches.

Imported only inside worker processes (it imports torch lazily, but numpy and
the adapters that use it are worker-side anyway). Every task adapter in
`runtimes/` runs its batch the same way:

1. flatten the batch's requests into one list of inputs (texts or pairs),
2. cut it into micro-batches of similar length (`micro_batches`): padding is
   paid per micro-batch, so sorting by length cuts wasted compute,
3. run each micro-batch in one forward pass and scatter the outputs back to
   input order with one fancy-indexed assignment,
4. split per request (counts -> offsets) and build one result per request.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import WorkError
from fleet.runtimes import kept
from fleet.runtimes.base import ModelSpec
from fleet.runtimes.device import device_class, fast_dtypes

log = logging.getLogger("fleet.worker")

#: Texts used at load to check that a reduced-precision dtype keeps the answers:
#: varied lengths and topics, so a dtype that only works on short inputs fails.
CHECK_SET = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Invoices must be paid within thirty days of receipt unless agreed otherwise in writing.",
    "GPU memory is managed per device: pinned models stay resident, others are evicted LRU.",
    "¿Dónde está la biblioteca? Está al lado del museo de historia natural.",
    "def add(a, b):\n    return a + b",
    "Patient presented with mild fever, cough and fatigue for three days; no travel history.",
    "The central bank raised interest rates by 25 basis points to curb persistent inflation, "
    "citing strong labour markets and rising services prices across the euro area.",
    "a",
    "Tokyo, Paris, Nairobi, Lima and Sydney are capitals or major cities on five continents.",
    "Reranking improves retrieval quality by scoring each query-document pair jointly.",
    "Error 0x80070005: access is denied when writing to the configuration directory.",
    "Angela Merkel met Emmanuel Macron in Berlin on Tuesday to discuss Airbus and Siemens.",
]

#: A reduced-precision dtype check: (fp32 outputs, candidate outputs) -> (keep?, detail for the log).
Agreement = Callable[[np.ndarray, np.ndarray], tuple[bool, str]]


# ---- loading --------------------------------------------------------------------

def load_transformers(spec: ModelSpec, device: str, auto_class: str) -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer) of a transformers folder.

    Safetensors only and local files only: the store already refused pickle
    weights, and a worker never reaches the network. A model whose code is not
    in transformers loads only if its catalog entry sets trust_remote_code.
    """
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(spec.path), local_files_only=True, trust_remote_code=spec.trust_remote_code,
        )
        model = getattr(transformers, auto_class).from_pretrained(
            str(spec.path), local_files_only=True, trust_remote_code=spec.trust_remote_code,
            use_safetensors=True,
        )
    except FleetError:
        raise
    except Exception as exc:  # the library raises many types for bad folders
        raise ModelLoadFailed(f"cannot load {spec.name!r} as {auto_class}: {exc}") from exc
    return model.to(device).eval(), tokenizer


def max_length(spec: ModelSpec, tokenizer: Any, config: Any) -> int:
    """Tokens per input: the catalog's max_seq_len, else the smaller of the
    tokenizer's limit and the model's position table (tokenizers often say 1e30)."""
    if spec.max_seq_len:
        return int(spec.max_seq_len)
    limits = [int(tokenizer.model_max_length)] if 0 < tokenizer.model_max_length < 1_000_000 else []
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        limits.append(int(positions))
    return min(limits) if limits else 512


def footprint_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in chain(model.parameters(), model.buffers()))


def to_device(features: dict[str, Any], device: str) -> dict[str, Any]:
    # non_blocking: from pinned host memory (`pinned`) the copy is queued on the
    # stream and overlaps host work; from pageable memory torch copies synchronously.
    non_blocking = device.startswith("cuda")
    return {k: (v.to(device, non_blocking=non_blocking) if hasattr(v, "to") else v) for k, v in features.items()}


def pinned(features: dict[str, Any], device: str) -> dict[str, Any]:
    """Host tensors in page-locked memory when `device` is CUDA (async copies need
    it); unchanged elsewhere (pinning costs a copy that only pays for DMA)."""
    if not device.startswith("cuda"):
        return features
    return {k: (v.pin_memory() if hasattr(v, "pin_memory") else v) for k, v in features.items()}


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
        from tokenizers import Tokenizer

        spec = tokenizer.backend_tokenizer.to_str()
        self._cut = Tokenizer.from_str(spec)
        self._whole = Tokenizer.from_str(spec)
        for copy_ in (self._cut, self._whole):
            copy_.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
            copy_.no_truncation()
            copy_.no_padding()
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
        import torch

        encodings = self._encode_cut(inputs)
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        width = int(lengths.max(initial=0))
        columns = np.arange(width)
        mask = columns >= (width - lengths)[:, None] if self._left else columns < lengths[:, None]
        read = ("ids", "type_ids") if self._single_types or (inputs and not isinstance(inputs[0], str)) else ("ids",)
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


# ---- batching -------------------------------------------------------------------

def input_too_long(model: str, what: str, size: int, limit: int, unit: str = "tokens") -> WorkError:
    """The one `input_too_long` answer: which input, its size, the model's limit, the fix."""
    return WorkError("input_too_long", f"{what} has {size} {unit}; {model} takes at most {limit} {unit} "
                                       "(send truncate=true to cut it)")


#: Characters a text keeps per token the model reads, cut before tokenizing: fast
#: tokenizers normalise and split the whole string before they truncate, so a 15 MB
#: text cost ~20 s of a worker and GBs of RSS for 256 tokens. A token rarely spans
#: more than a word (WordPiece turns a word over 100 characters into one [UNK]); 32
#: per token on average leaves what the model sees unchanged on any real text.
CHARS_PER_TOKEN = 32


def char_bound(max_tokens: int) -> int:
    return max_tokens * CHARS_PER_TOKEN


def cut_to_bound(texts: list[str], max_tokens: int) -> list[str]:
    """`texts`, each cut to `char_bound(max_tokens)` characters (uncut ones are not copied)."""
    bound = char_bound(max_tokens)
    return [t if len(t) <= bound else t[:bound] for t in texts]


def over_char_bound(model: str, texts: Sequence[str], max_tokens: int, what: str = "input") -> WorkError | None:
    """With truncate=false: a text over the character bound is refused before any
    tokenizing (its token count is not worth computing; the answer names characters)."""
    bound = char_bound(max_tokens)
    for i, t in enumerate(texts):
        if len(t) > bound:
            return input_too_long(model, f"{what} {i}", len(t), bound, unit="characters")
    return None


def split_refused(requests: Sequence[Any], refuse: Callable[[Any], Any]) -> tuple[list[Any], list[int]]:
    """Step 1 of every batch: (results with each refused request's WorkError in
    its place, indices of the requests that run). A refused request fails alone."""
    results = [refuse(r) for r in requests]
    return results, [i for i, r in enumerate(results) if r is None]


def micro_batches(lengths: np.ndarray, step: int, fixed: float = 0.0) -> Iterator[np.ndarray]:
    """Input indices in micro-batches of at most `step`, shortest inputs first.

    `lengths` is any per-input size proxy (characters are enough: the order
    only has to group similar lengths). Stable, so equal lengths keep input order.
    `fixed`: a forward's fixed cost in the units of `lengths` (`Adapter.fixed_chars`):
    the sorted inputs are cut where padding them to one length would cost more
    than another forward (`padding_cuts`); 0 cuts by count alone.
    """
    order = np.argsort(lengths, kind="stable")
    n, step = len(order), max(1, step)
    bounds = padding_cuts(lengths[order], step, fixed) if fixed > 0 and n > 1 else [*range(0, n, step), n]
    for k in range(len(bounds) - 1):
        yield order[bounds[k] : bounds[k + 1]]


def padding_cuts(lengths: np.ndarray, step: int, fixed: float) -> list[int]:
    """Bounds (0, ..., n) cutting ascending `lengths` into runs of at most `step`
    whose predicted forward time, the sum over runs of `fixed` + items x longest
    (each run padded to its longest), is least: one pass of dynamic programming
    over at most `step` starts per end (a few us each: ~1 ms for 256 inputs).

    A request's texts vary in length: one micro-batch of 32 random corpus texts
    pads 53 % of its forward; cut where it pays, the same texts run 1.3-1.5x
    faster (bench/README, issue 27). Ties cut as count alone would (runs of `step`
    from the shortest)."""
    n = len(lengths)
    size = lengths.astype(np.float64)
    ends = np.arange(n + 1, dtype=np.float64)
    best = np.zeros(n + 1)
    back = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        lo = max(0, j - step)
        cost = best[lo:j] + (j - ends[lo:j]) * size[j - 1]
        k = len(cost) - 1 - int(cost[::-1].argmin())  # a tie: the latest start
        best[j] = cost[k] + fixed
        back[j] = lo + k
    bounds = [n]
    while bounds[-1]:
        bounds.append(int(back[bounds[-1]]))
    return bounds[::-1]


def offsets(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of each request's slice in the flattened inputs."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    return ends - np.asarray(counts, dtype=np.int64), ends


def first_too_long(lengths: Sequence[int], limit: int) -> tuple[int, int] | None:
    """(index, tokens) of the first input over `limit` tokens, or None."""
    over = np.flatnonzero(np.asarray(lengths, dtype=np.int64) > limit)
    if not len(over):
        return None
    return int(over[0]), int(lengths[int(over[0])])


# ---- dtype ----------------------------------------------------------------------

def choose_dtype(model: Any, *, name: str, wanted: str, device: str,
                 run: Callable[[Any], np.ndarray], agree: Agreement, kept_in: Path | None = None) -> tuple[Any, str]:
    """(model to serve, dtype name).

    An explicit profile dtype is obeyed. `auto` tries this device's fast dtypes
    (`runtimes.device.fast_dtypes`), fastest first, on a copy of the model and
    keeps the first whose outputs on the check set `agree` with fp32; else fp32.
    `run(model)` returns the task's outputs on the check set as float32.
    `kept_in`: the model's folder: the verdict is kept beside it (runtimes.kept)
    and a reload serves it without checking again.
    """
    import torch

    if wanted not in ("auto", "float32"):
        return model.to(getattr(torch, wanted)), wanted
    fast = fast_dtypes(device)
    if wanted == "float32" or not fast:
        return model, "float32"
    note = f"dtype-{device_class(device)}"
    under = kept.key(kept_in, device, torch, candidates=",".join(fast))
    verdict = kept.recall(kept_in, note, under) if kept_in is not None else None
    if verdict is not None and verdict.get("dtype") in ("float32", *fast):
        dtype = verdict["dtype"]
        log.info("dtype check %s: %s (kept verdict: %s)", name, dtype, verdict.get("detail", ""))
        return (model if dtype == "float32" else model.to(getattr(torch, dtype))), dtype
    reference = run(model)
    details = []
    for dtype in fast:
        candidate = copy.deepcopy(model).to(getattr(torch, dtype))
        ok, detail = agree(reference, run(candidate))
        log.info("dtype check %s %s: %s -> %s", name, dtype, detail, "keep" if ok else "fp32")
        details.append(f"{dtype}: {detail}")
        if ok:
            if kept_in is not None:
                kept.keep(kept_in, note, under, {"dtype": dtype, "detail": "; ".join(details)})
            return candidate, dtype
        del candidate
    if kept_in is not None:
        kept.keep(kept_in, note, under, {"dtype": "float32", "detail": "; ".join(details)})
    return model, "float32"


def min_cosine(min_cos: float) -> Agreement:
    """Embeddings: every check row keeps its direction (rows are unit vectors)."""

    def agree(ref: np.ndarray, got: np.ndarray) -> tuple[bool, str]:
        cosine = float(np.min(np.sum(got * ref, axis=1)))
        return cosine >= min_cos, f"min cosine {cosine:.6f} (need {min_cos})"

    return agree


def scores_agree(max_rel_diff: float = 0.01, min_order: float = 0.99) -> Agreement:
    """Scores that rank (rerank): every score within `max_rel_diff` of the fp32
    score range, and at least `min_order` of all pairs ordered as fp32 orders them."""

    def agree(ref: np.ndarray, got: np.ndarray) -> tuple[bool, str]:
        ref, got = ref.ravel(), got.ravel()
        spread = max(float(ref.max() - ref.min()), 1e-6)
        diff = float(np.max(np.abs(got - ref))) / spread
        order = pair_order_agreement(ref, got)
        return diff <= max_rel_diff and order >= min_order, f"max diff {diff:.4f} of range, order {order:.4f}"

    return agree


def labels_agree(max_prob_diff: float = 0.01, min_same: float = 1.0) -> Agreement:
    """Probabilities over labels, rows (..., labels) (classify, extract): the
    top label the same on at least `min_same` of rows, every probability within
    `max_prob_diff` of fp32."""

    def agree(ref: np.ndarray, got: np.ndarray) -> tuple[bool, str]:
        same = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
        diff = float(np.max(np.abs(got - ref)))
        return same >= min_same and diff <= max_prob_diff, f"same top label {same:.4f}, max prob diff {diff:.4f}"

    return agree


def pair_order_agreement(ref: np.ndarray, got: np.ndarray) -> float:
    """Fraction of pairs (i < j) that `got` orders like `ref` (ties in `ref` count as agreeing)."""
    n = len(ref)
    if n < 2:
        return 1.0
    dr = np.sign(ref[:, None] - ref[None, :])
    dg = np.sign(got[:, None] - got[None, :])
    upper = np.triu(np.ones((n, n), dtype=bool), k=1)
    return float(np.mean(((dr == dg) | (dr == 0))[upper]))


# ---- CUDA graphs ----------------------------------------------------------------

#: Micro-batch shapes (rows, tokens) captured as CUDA graphs: every pair of these
#: within the model's length and GRAPH_MAX_TOKENS. A BERT forward is ~200 kernel
#: launches, each a few us of the host thread's CPU; a graph replays them as one
#: launch. Graphs up to 8 x 128 left the common micro-batches eager (a GPU cuts
#: by count: `micro_batch_items`, 64, texts of 32-text requests): on the H200 run
#: the host thread was busy 96-100 % with the SM busy 5-15 % (issue 34). A
#: micro-batch is padded up to the smallest captured shape that holds it.
GRAPH_ROWS = (1, 2, 4, 8, 16, 32, 64)
GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
#: Padded tokens of the largest graph (64 x 256, 32 x 512): the graphs share one
#: memory pool, whose size is the largest graph's activations.
GRAPH_MAX_TOKENS = 16_384


def graph_shapes(max_tokens: int) -> tuple[tuple[int, int], ...]:
    """The (rows, tokens) shapes captured for a model of `max_tokens` positions."""
    return tuple((r, t) for r in GRAPH_ROWS for t in GRAPH_TOKENS if t <= max_tokens and r * t <= GRAPH_MAX_TOKENS)


#: What a model of 512 positions captures (the shapes `graph_shape` picks among by default).
DEFAULT_GRAPH_SHAPES = graph_shapes(512)


def graph_shape(rows: int, tokens: int, shapes: Sequence[tuple[int, int]] = DEFAULT_GRAPH_SHAPES,
                ) -> tuple[int, int] | None:
    """The smallest captured (rows, tokens) holding a micro-batch (fewest padded
    tokens, then fewest rows), or None (run it eagerly)."""
    return min(((r, t) for r, t in shapes if r >= rows and t >= tokens), key=lambda s: (s[0] * s[1], s[0]),
               default=None)


def fill_padded(static: dict[str, Any], features: dict[str, Any]) -> dict[str, Any]:
    """Write `features` (2-D token tensors, (r, t) each) into the top-left of the
    larger tensors in `static`, in place; the rest is padding: zero ids, mask 0.
    Each padding row attends to its first position (a row that attends to
    nothing gives NaN in SDPA; padding rows are dropped, real rows never see them).
    Returns `static`."""
    for key, buf in static.items():
        if not hasattr(buf, "shape"):
            continue  # a tag such as `modality`: the same for every micro-batch
        src = features[key]
        r, t = src.shape
        buf.zero_()
        buf[:r, :t].copy_(src, non_blocking=True)
        if key == "attention_mask":
            buf[r:, 0] = 1
    return static


def padded_to(features: dict[str, Any], rows: int, tokens: int) -> dict[str, Any]:
    """`features` padded to (rows, tokens) in new tensors (what a graph's static inputs hold);
    entries that are not tensors are kept as they are."""
    import torch

    return fill_padded({k: (torch.zeros((rows, tokens), dtype=v.dtype, device=v.device) if hasattr(v, "shape") else v)
                        for k, v in features.items()}, features)


def sliced(features: dict[str, Any], rows: int, tokens: int) -> dict[str, Any]:
    """The first `rows` texts and `tokens` positions of token tensors (other entries as they are)."""
    return {k: (v[:rows, :tokens] if hasattr(v, "shape") else v) for k, v in features.items()}


class GraphedForward:
    """CUDA graphs of `forward` (token tensors -> (rows, d) tensor) for every
    shape of `graph_shapes(max_tokens)`, captured at load from `example` (host
    token tensors of at least max(GRAPH_ROWS) texts: slices of it fill each shape).

    Kept only if every graph's replay agrees with the eager forward on the same
    inputs (`agree`, on unit rows); a failed capture or check leaves the model
    eager and says why in the log. CUDA only: `device` must be a CUDA device.
    """

    def __init__(self, forward: Callable[[dict[str, Any]], Any], example: dict[str, Any], device: str,
                 max_tokens: int, agree: Agreement, name: str) -> None:
        import torch

        self._forward = forward
        self._device = device
        self.shapes = graph_shapes(max_tokens)
        self.graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}
        try:
            self._capture_all(torch, example, device)
            detail = self._check(torch, example, agree)
        except Exception as exc:  # capture refuses host syncs and some kernels: eager is always correct
            self.graphs.clear()
            log.warning("cuda graphs %s: capture failed (%s); running eagerly", name, exc)
            return
        if detail is not None:
            self.graphs.clear()
            log.warning("cuda graphs %s: %s", name, detail)
            return
        log.info("cuda graphs %s: %d shapes captured, replay agrees with eager", name, len(self.graphs))

    def _capture_all(self, torch: Any, example: dict[str, Any], device: str) -> None:
        pool = torch.cuda.graph_pool_handle()  # one memory pool: graphs replay one at a time
        side = torch.cuda.Stream(device)
        example = to_device(example, device)
        # Largest first: the pool is sized by the first capture, the others fit in it.
        for rows, tokens in sorted(self.shapes, key=lambda s: -s[0] * s[1]):
            static = padded_to(sliced(example, rows, tokens), rows, tokens)
            # Warm-up on a side stream before capture (lazy init, library handles, autotuning).
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(dict(static))
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # The load captures on its own thread while the step loop serves other models
            # (runtimes.loading): only the capturing thread is held to capture's rules
            # (the default, "global", refuses other threads' allocations and syncs meanwhile).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(dict(static))
            self.graphs[(rows, tokens)] = (graph, static, out)

    def _check(self, torch: Any, example: dict[str, Any], agree: Agreement) -> str | None:
        """None if every graph agrees with the eager forward, else why not."""
        example = to_device(example, self._device)
        for (rows, tokens), (graph, static, out) in self.graphs.items():
            fill_padded(static, sliced(example, rows, tokens))
            ref = torch.nn.functional.normalize(self._forward(dict(static)).float(), dim=1)
            graph.replay()
            got = torch.nn.functional.normalize(out.float(), dim=1)
            ok, detail = agree(ref.cpu().numpy(), got.cpu().numpy())
            if not ok:
                return f"shape {rows}x{tokens} disagrees with eager ({detail}); running eagerly"
        return None

    def __call__(self, features: dict[str, Any]) -> Any | None:
        """The forward's output for `features` (host or device tensors) by graph
        replay, or None when no captured shape holds them."""
        rows, tokens = features["attention_mask"].shape
        shape = graph_shape(rows, tokens, self.shapes)
        entry = self.graphs.get(shape) if shape else None
        if entry is None:
            return None
        graph, static, out = entry
        fill_padded(static, features)
        graph.replay()
        return out[:rows].clone()  # the graph's output buffer is overwritten by its next replay
