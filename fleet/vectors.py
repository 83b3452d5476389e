"""Compact dense vectors: the `output_dtype`s of every embed route.

sentence-transformers' `quantize_embeddings` is the reference, with one rule of
fleet's own: int8 and uint8 use one fixed range, [-1, 1] on every dimension,
never ranges computed from the batch (the reference's default computes them
from the vectors it is given, so a row would depend on the other requests that
shared its batch). Unit vectors lie inside that range, so nothing is clipped;
`quantize_embeddings(x, "int8", ranges=scalar_ranges(d))` gives exactly what
`quantize(x, "int8")` gives. Each row is quantized alone.

| dtype | per value | a row of d dimensions |
| --- | --- | --- |
| float32 | as computed | d x 4 bytes |
| float16 | rounded to the nearest float16 | d x 2 bytes |
| uint8 | q = clip(floor((x + 1) / (2 / 255)), 0, 255) | d bytes |
| int8 | q - 128 | d bytes |
| ubinary | bit = x > 0, packed 8 per byte, first dimension in the high bit (numpy.packbits) | ceil(d / 8) bytes |
| binary | the ubinary byte - 128, as int8 | ceil(d / 8) bytes |

numpy only: the daemon uses it for Cohere requests that ask several types at once.
"""

from __future__ import annotations

import numpy as np

OUTPUT_DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
#: Each output's numpy dtype on the wire (little-endian where it matters).
WIRE_DTYPES = {"float32": "<f4", "float16": "<f2", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}
#: Outputs that need unit vectors (their fixed range is [-1, 1]).
SCALAR = frozenset({"int8", "uint8"})
PACKED = frozenset({"binary", "ubinary"})

#: The fixed int8/uint8 range of every dimension, and its step (float32, as the reference computes it).
RANGE_START = np.float32(-1.0)
RANGE_END = np.float32(1.0)
STEP = (RANGE_END - RANGE_START) / np.float32(255)


def scalar_ranges(dimensions: int) -> np.ndarray:
    """The `ranges` argument (2, d) of sentence-transformers' `quantize_embeddings`
    that gives fleet's int8 and uint8."""
    return np.array([[RANGE_START] * dimensions, [RANGE_END] * dimensions], dtype=np.float32)


def quantize(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """(n, d) float32 vectors as `dtype` (a new C-order array; float32 as it is)."""
    if dtype == "float32":
        return vectors
    if dtype == "float16":
        return vectors.astype("<f2")
    if dtype in SCALAR:
        q = np.floor((vectors - RANGE_START) / STEP)
        np.clip(q, 0, 255, out=q)
        return q.astype(np.uint8) if dtype == "uint8" else (q - 128).astype(np.int8)
    if dtype in PACKED:
        bits = np.packbits(vectors > 0, axis=-1)
        # binary = ubinary - 128 as int8 (the reference's arithmetic, wrapped): flipping the high bit.
        return bits if dtype == "ubinary" else (bits ^ np.uint8(0x80)).view(np.int8)
    raise ValueError(f"unknown output dtype {dtype!r}")


def from_wire(data: bytes, shape: tuple[int, int], dtype: str) -> np.ndarray:
    """A dense result's bytes as its (n, width) array (a view, no copy)."""
    return np.frombuffer(data, dtype=WIRE_DTYPES[dtype]).reshape(shape)
