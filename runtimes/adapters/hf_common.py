"""What the model adapters share at load: reading a transformers folder, the
check set, and choosing a dtype that keeps the answers.

Imported only inside worker processes (it imports torch lazily, but numpy and
the adapters that use it are worker-side anyway). Beside it, each a concern of
its own: how a batch is shaped (runtimes/adapters/batching.py), tokenizing and
tokenizing ahead (runtimes/adapters/tokenizing.py), CUDA-graph replay
(runtimes/adapters/cuda_graphs.py).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.runtimes.adapters import kept
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


# ---- dtype ----------------------------------------------------------------------

def choose_dtype(model: Any, *, name: str, wanted: str, device: str,
                 run: Callable[[Any], np.ndarray], agree: Agreement, kept_in: Path | None = None) -> tuple[Any, str]:
    """(model to serve, dtype name).

    An explicit profile dtype is obeyed. `auto` tries this device's fast dtypes
    (`runtimes.device.fast_dtypes`), fastest first, on a copy of the model and
    keeps the first whose outputs on the check set `agree` with fp32; else fp32.
    `run(model)` returns the task's outputs on the check set as float32.
    `kept_in`: the model's folder: the verdict is kept beside it (runtimes.adapters.kept)
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
