"""CUDA-graph replay of an encoder's forward (`GraphedForward`), and the shapes it captures.

Split from runtimes/adapters/hf_common.py: on a GPU a BERT forward is ~200 kernel
launches of the host thread, and replaying them as one graph is what keeps the
host from bounding the device (issue 34). CUDA only; the CPU's recorded forward
is runtimes/adapters/traced.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fleet.runtimes.adapters.hf_common import Agreement, to_device

log = logging.getLogger("fleet.worker")


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


def pool_bytes(torch: Any, pool: Any) -> int | None:
    """Bytes of the allocator's segments in graph memory pool `pool`, or None where the
    snapshot does not say (its format is the allocator's, not a stable API)."""
    try:
        want = tuple(pool)
        return sum(int(seg["total_size"]) for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id") or ()) == want)
    except Exception as exc:  # noqa: BLE001 (a measurement: the graphs serve without it)
        log.info("cuda graphs: the pool's size is unknown (%s)", exc)
        return None


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
        #: Bytes the graphs' memory pool holds while they are kept (None: the allocator did
        #: not say). Held as long as the model is: not in its footprint yet, which counts
        #: weights and one forward's activations (bench/README, "The next GPU session").
        self.pool_bytes: int | None = None
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
        self.pool_bytes = pool_bytes(torch, self._pool)
        log.info("cuda graphs %s: %d shapes captured, replay agrees with eager; pool %s", name, len(self.graphs),
                 "unknown" if self.pool_bytes is None else f"{self.pool_bytes >> 20} MiB")

    def _capture_all(self, torch: Any, example: dict[str, Any], device: str) -> None:
        pool = self._pool = torch.cuda.graph_pool_handle()  # one memory pool: graphs replay one at a time
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
