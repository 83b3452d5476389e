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
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import WorkError
from runtimes.base import ModelSpec
from runtimes.device import fast_dtypes

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
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in features.items()}


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


def micro_batches(lengths: np.ndarray, step: int) -> Iterator[np.ndarray]:
    """Input indices in micro-batches of at most `step`, shortest inputs first.

    `lengths` is any per-input size proxy (characters are enough: the order
    only has to group similar lengths). Stable, so equal lengths keep input order.
    """
    order = np.argsort(lengths, kind="stable")
    step = max(1, step)
    for lo in range(0, len(order), step):
        yield order[lo : lo + step]


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
                 run: Callable[[Any], np.ndarray], agree: Agreement) -> tuple[Any, str]:
    """(model to serve, dtype name).

    An explicit profile dtype is obeyed. `auto` tries this device's fast dtypes
    (`runtimes.device.fast_dtypes`), fastest first, on a copy of the model and
    keeps the first whose outputs on the check set `agree` with fp32; else fp32.
    `run(model)` returns the task's outputs on the check set as float32.
    """
    import torch

    if wanted not in ("auto", "float32"):
        return model.to(getattr(torch, wanted)), wanted
    if wanted == "float32":
        return model, "float32"
    reference = run(model)
    for dtype in fast_dtypes(device):
        candidate = copy.deepcopy(model).to(getattr(torch, dtype))
        ok, detail = agree(reference, run(candidate))
        log.info("dtype check %s %s: %s -> %s", name, dtype, detail, "keep" if ok else "fp32")
        if ok:
            return candidate, dtype
        del candidate
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
