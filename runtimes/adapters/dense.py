"""What a dense text embedder refuses (sentence-transformers, BGE-M3: `dense_refusal`),
and the last step of every dense embedder (sentence-transformers, clip): each
request's vectors cut to its `dimensions`, made unit length when it normalises,
in its `output_dtype` (fleet.vectors), one EmbedResult per request.

sentence-transformers' order: truncate (`truncate_dim`), then normalise, then
quantize (`precision`). Quantizing here, in the worker, sends the compact bytes
through the queue (an int8 row is a quarter of a float32 one, a binary row a
thirty-second). Each request's rows are finished by themselves: nothing a row
gets depends on the other requests of its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fleet.messages import EmbedResult, WorkError
from fleet.protocol import EmbedRequest
from fleet.runtimes.adapters.batching import prompted, text_only, too_long
from fleet.vectors import quantize


def too_wide(name: str, req: EmbedRequest, width: int) -> WorkError | None:
    """Why `req` asks more dimensions than the model gives, or None."""
    if req.dimensions is not None and req.dimensions > width:
        return WorkError("bad_request", f"dimensions {req.dimensions} is more than {name} gives: its vectors "
                                        f"have {width} dimensions")
    return None


def dense_refusal(name: str, req: EmbedRequest, prompt_of: Callable[[EmbedRequest], str | WorkError], width: int,
                  max_tokens: int, lengths: Callable[[Any], Sequence[int]]) -> WorkError | None:
    """Why a text embedder of `width`-wide vectors that reads `max_tokens` cannot answer
    `req` (it then fails alone), or None: an image, an unknown prompt, more dimensions
    than it gives, or, with `truncate: false`, an input past `max_tokens` with its prompt."""
    if refused := text_only(name, req.inputs):
        return refused
    prompt = prompt_of(req)
    if prompt.__class__ is WorkError:
        return prompt
    if (wide := too_wide(name, req, width)) is not None:
        return wide
    if req.truncate:
        return None
    return too_long(name, prompted(req.inputs, prompt), max_tokens, lengths)


def finish_dense(vectors: np.ndarray, tokens: np.ndarray, requests: Sequence[EmbedRequest], live: list[int],
                 results: list[Any], *, unit: bool = False, model_unit: bool = False) -> None:
    """Fill `results[i]` for each request in `live` from its rows of `vectors`
    ((rows, width) float32, the live requests' inputs in order) and `tokens` (per row).
    `unit`: the rows are unit length already (the adapter normalised them on the
    device, where its kernels are warm: every live request normalises).
    `model_unit`: the model's own last module makes its output unit length
    (sentence-transformers' Normalize): every row is unit length before it is cut,
    `normalize: false` included, as the reference's `normalize_embeddings=False` is.

    1. Rows of requests that normalise are divided by their norm, in one pass.
    2. Per request: its rows cut to `dimensions` (and made unit length again
       when it normalises), then converted to its `output_dtype`.

    A lone short request reaches this on a CPU whose caches the forward just
    flushed, where each numpy call costs 20-80 us: the bookkeeping (counts,
    offsets, token sums) is plain Python over the requests, and the common batch
    (every request normalises, or none does) makes one numpy pass or none.
    """
    width = vectors.shape[1]
    reqs = [requests[i] for i in live]
    norms = [r.normalize or model_unit for r in reqs]
    if not unit and any(norms):
        unit_rows = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        if all(norms):
            vectors = unit_rows
        else:
            want = np.repeat(np.array(norms), [len(r.inputs) for r in reqs])
            vectors = np.where(want[:, None], unit_rows, vectors)
    used = tokens.tolist()
    a = 0
    for i, req in zip(live, reqs):
        b = a + len(req.inputs)
        rows = vectors[a:b]
        dims = width if req.dimensions is None else req.dimensions
        if dims < width:
            rows = rows[:, :dims]
            if req.normalize:
                rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        out = to_float16(rows) if req.output_dtype == "float16" else quantize(rows, req.output_dtype)
        results[i] = EmbedResult(out.tobytes(), out.shape, sum(used[a:b]), req.output_dtype, dims)
        a = b


#: Values from which torch casts to float16 (its cast uses the CPU's conversion
#: instructions: 5 us for 32 x 384 values where numpy's takes 38 us, but it costs
#: ~10 us to call); below, numpy's cast (~3 ns a value). Both round to nearest even.
TORCH_FLOAT16_FROM = 4096


def to_float16(rows: np.ndarray) -> np.ndarray:
    if rows.size < TORCH_FLOAT16_FROM:
        return rows.astype("<f2")
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows)).half().numpy()
