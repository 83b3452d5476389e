"""The last step of every dense embedder (sentence-transformers, clip): each
request's vectors cut to its `dimensions`, made unit length when it normalises,
in its `output_dtype` (fleet.vectors), one EmbedResult per request.

sentence-transformers' order: truncate (`truncate_dim`), then normalise, then
quantize (`precision`). Quantizing here, in the worker, sends the compact bytes
through the queue (an int8 row is a quarter of a float32 one, a binary row a
thirty-second). Each request's rows are finished by themselves: nothing a row
gets depends on the other requests of its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fleet.messages import EmbedResult, WorkError
from fleet.protocol import EmbedRequest
from fleet.vectors import quantize
from runtimes.hf_common import offsets


def too_wide(name: str, req: EmbedRequest, width: int) -> WorkError | None:
    """Why `req` asks more dimensions than the model gives, or None."""
    if req.dimensions is not None and req.dimensions > width:
        return WorkError("bad_request", f"dimensions {req.dimensions} is more than {name} gives: its vectors "
                                        f"have {width} dimensions")
    return None


def finish_dense(vectors: np.ndarray, tokens: np.ndarray, requests: Sequence[EmbedRequest], live: list[int],
                 results: list[Any]) -> None:
    """Fill `results[i]` for each request in `live` from its rows of `vectors`
    ((rows, width) float32, the live requests' inputs in order) and `tokens` (per row).

    1. Rows of requests that normalise are divided by their norm, in one pass.
    2. Per request: its rows cut to `dimensions` (and made unit length again
       when it normalises), then converted to its `output_dtype`.
    """
    width = vectors.shape[1]
    counts = np.fromiter((len(requests[i].inputs) for i in live), dtype=np.int64, count=len(live))
    want_norm = np.repeat(np.fromiter((requests[i].normalize for i in live), dtype=bool, count=len(live)), counts)
    if want_norm.any():
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        np.maximum(norms, 1e-12, out=norms)
        vectors = np.where(want_norm[:, None], vectors / norms, vectors)
    token_sums = np.add.reduceat(tokens, offsets(counts)[0]) if len(tokens) else tokens
    starts, ends = offsets(counts)
    for k, i in enumerate(live):
        req = requests[i]
        a, b = int(starts[k]), int(ends[k])
        rows = vectors[a:b]
        dims = width if req.dimensions is None else req.dimensions
        if dims < width:
            rows = rows[:, :dims]
            if req.normalize:
                rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        out = to_float16(rows) if req.output_dtype == "float16" else quantize(rows, req.output_dtype)
        results[i] = EmbedResult(out.tobytes(), out.shape, int(token_sums[k]), req.output_dtype, dims)


#: Values from which torch casts to float16 (its cast uses the CPU's conversion
#: instructions: 5 us for 32 x 384 values where numpy's takes 38 us, but it costs
#: ~10 us to call); below, numpy's cast (~3 ns a value). Both round to nearest even.
TORCH_FLOAT16_FROM = 4096


def to_float16(rows: np.ndarray) -> np.ndarray:
    if rows.size < TORCH_FLOAT16_FROM:
        return rows.astype("<f2")
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows)).half().numpy()
