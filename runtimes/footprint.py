"""What a model will cost on its device: the footprint estimate and its correction.

Pure sizing over a model folder's safetensors headers and configs (no weights
read, no torch): `estimate_footprint` (weights by dtype, plus an activation
allowance from the batch budget; for a generator, one step of its continuous
batcher: `decoder_step`), and `Estimates`, which corrects the header estimate by
what each load measured. Apart from the placement policy (runtimes.memory), which
reads a `Footprint` and never a folder.

Units: bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.weights import read_header

log = logging.getLogger("fleet.worker")

#: safetensors dtype tag -> bytes per element.
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}
_PROFILE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Footprint:
    """What one model holds on its device: weights (resident) and an activation
    allowance (the largest batch its profile allows, shared per worker). A
    generator's key/value cache is not part of it: its sequences reserve their
    cache as they are admitted and wait for room (runtimes.adapters.generate
    `reserved_bytes`, counted with its weights once it is resident)."""

    weights_bytes: int
    activation_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes


def safetensors_tensors(path: Path) -> Iterator[tuple[str, list[int]]]:
    """(dtype tag, shape) of each tensor in a safetensors file, from its header only."""
    yield from read_header(path).values()


def weights_bytes(folder: Path, dtype: str = "auto") -> int:
    """Bytes the weights take once loaded: every safetensors file under `folder`,
    float tensors counted at `dtype` (a profile dtype; `auto` = as stored)."""
    cast = _PROFILE_BYTES.get(dtype)
    total = 0
    for path in sorted(folder.rglob("*.safetensors")):
        for tag, shape in safetensors_tensors(path):
            n = 1
            for d in shape:
                n *= d
            per = cast if cast is not None and tag in _FLOAT_TAGS else DTYPE_BYTES.get(tag, 4)
            total += n * per
    return total


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def encoder_shape(folder: Path) -> dict[str, int]:
    """hidden size, intermediate size, heads and longest sequence of a transformers encoder folder."""
    cfg = _read_json(folder / "config.json")
    st = _read_json(folder / "sentence_bert_config.json")
    hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim") or 768)
    return {
        "hidden": hidden,
        "intermediate": int(cfg.get("intermediate_size") or cfg.get("hidden_dim") or 4 * hidden),
        "heads": int(cfg.get("num_attention_heads") or cfg.get("n_heads") or 12),
        "seq": int(st.get("max_seq_length") or cfg.get("max_position_embeddings") or 512),
    }


def activation_allowance(runtime: str, shape: dict[str, int], *, max_batch_tokens: int, micro_batch_items: int,
                         max_seq_len: int | None, dtype_bytes: int) -> int:
    """Peak bytes of one forward pass at the profile's largest micro-batch.

    Encoders (every runtime but the decoders of `estimate_footprint`): a micro-batch is at most
    `micro_batch_items` inputs padded to the longest sequence, capped by the
    batch token budget. Per padded token, one layer at its peak holds a few
    hidden-size tensors (residual, q/k/v, output), the feed-forward
    intermediate, and its row of attention scores before and after softmax
    (heads x seq, twice); layers run one after another, so one layer's peak
    is the model's.
    """
    seq = min(shape["seq"], max_seq_len) if max_seq_len else shape["seq"]
    tokens = min(max_batch_tokens, micro_batch_items * seq)
    per_token = 4 * shape["hidden"] + shape["intermediate"] + 2 * shape["heads"] * seq
    return tokens * per_token * dtype_bytes


#: Context a causal LM's config that names none gets (runtimes.adapters.generate's default).
DEFAULT_CONTEXT = 2048


def decoder_shape(folder: Path) -> dict[str, int]:
    """What sizes one step of a causal LM, from its config.json (a multimodal config's
    `text_config`): widths, heads, layers, vocabulary and position table."""
    cfg = _read_json(folder / "config.json")
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 768)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 12)
    return {
        "hidden": hidden,
        "intermediate": int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden),
        "heads": heads,
        "kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "layers": int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 12),
        "vocab": int(cfg.get("vocab_size") or 32000),
        "positions": int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or DEFAULT_CONTEXT),
    }


def kv_token_bytes(shape: dict[str, int], dtype_bytes: int) -> int:
    """Bytes one token takes in a causal LM's key/value cache: keys and values of every layer."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype_bytes


def decoder_step(shape: dict[str, int], *, rows: int, max_batch_tokens: int, max_seq_len: int | None,
                 dtype_bytes: int) -> tuple[int, int]:
    """(tokens, peak activation bytes) of one forward of a causal LM over a step's rows.

    The tokens a step admits: at most `rows` sequences of at most the context
    (`max_seq_len`, never past the position table: runtimes.adapters.generate's `max_len`),
    cut to `max_batch_tokens` (a prefill group's budget). Attention is SDPA, which
    holds no seq x seq score matrix (measured: one 16 384-token row on the CPU held
    ~80 KB a token, where materialised scores would take 14 heads x 16 384 x 4 bytes
    = 900 KB a token); a padded prefill of two rows or more carries a boolean mask
    of rows x width x width. Per token, one layer at its peak holds four hidden-size
    tensors (residual, normed input, attention and MLP outputs), three intermediate
    (gate, up, their product), queries, keys and values twice (projected, rotated),
    and two hidden-size vectors in fp32 (normalisation); layers run one after
    another, so one layer's peak is the step's. The logits are the last position's
    only (`logits_to_keep=1`), upcast to fp32 for the pick. Checked against peak RSS
    of real prefills (2 x 8 192 padded tokens, bf16): Qwen2 0.90, Qwen3 0.78, Gemma-3
    0.92, Phi-3 0.75 of this estimate.
    """
    context = min(max_seq_len, shape["positions"]) if max_seq_len else shape["positions"]
    tokens = min(rows * context, max_batch_tokens)
    width = min(context, tokens // 2) if rows > 1 else 0  # the widest padded prefill of two rows or more
    qkv = shape["heads"] * shape["head_dim"] + 2 * shape["kv_heads"] * shape["head_dim"]
    per_token = (4 * shape["hidden"] + 3 * shape["intermediate"] + 2 * qkv) * dtype_bytes + 2 * 4 * shape["hidden"]
    logits = rows * shape["vocab"] * (dtype_bytes + 4)
    return tokens, tokens * (per_token + width) + logits


def estimate_footprint(folder: Path, runtime: str, *, task: str = "", dtype: str = "auto",
                       max_batch_tokens: int = 16384, max_batch_items: int = 64, micro_batch_items: int = 64,
                       max_seq_len: int | None = None) -> Footprint:
    """Footprint of the model in `folder` before loading it: headers and configs only.

    A generator (task `generate`) is sized as one step of its continuous batcher:
    `max_batch_items` rows and the tokens `decoder_step` admits. Its key/value
    cache is reserved as sequences are admitted, bounded by the room left
    (runtimes.adapters.generate: a sequence waits for room, and one that could never fit
    is refused), so neither a long context window nor a full step's cache refuses
    a model that can answer one request. An LLM reranker (runtime `llm-rerank`) runs the same decoder over
    micro-batches, without a cache. Every other runtime is an encoder
    (`activation_allowance`)."""
    weights = weights_bytes(folder, dtype)
    act_bytes = _PROFILE_BYTES.get(dtype, 4)
    if task == "generate" or runtime == "llm-rerank":
        shape = decoder_shape(folder)
        rows = max_batch_items if task == "generate" else micro_batch_items
        _, activation = decoder_step(shape, rows=rows, max_batch_tokens=max_batch_tokens,
                                     max_seq_len=max_seq_len, dtype_bytes=act_bytes)
        return Footprint(weights, activation)
    activation = activation_allowance(runtime, encoder_shape(folder), max_batch_tokens=max_batch_tokens,
                                      micro_batch_items=micro_batch_items, max_seq_len=max_seq_len,
                                      dtype_bytes=act_bytes)
    return Footprint(weights, activation)


#: A model's measured/estimated weight bytes outside these bounds say its headers did
#: not describe what loaded (a checkpoint that lacks most of its architecture's
#: weights), not how its runtime stores weights: that ratio corrects no other model's
#: estimate. Within them: a dtype changed at load (bf16 or fp16 stored, fp32 loaded:
#: 2; 8-bit stored, fp32 loaded: 4) or buffers the headers do not list.
RATIO_BOUNDS = (0.25, 4.0)


@dataclass
class Estimates:
    """Footprint estimates, corrected by measurement.

    After a load, the measured weight bytes of that model replace its header
    estimate (a reload is then exact), and the models' measured/estimated ratios
    within RATIO_BOUNDS scale the header estimates of the runtime's models not yet
    loaded, by their median: one model's measurement never scales another's
    estimate past the bounds, and one odd model among several moves it little.
    """

    measured: dict[str, int] = field(default_factory=dict)
    #: runtime -> model -> its measured/estimated weight ratio (within RATIO_BOUNDS).
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)

    def ratio(self, runtime: str) -> float:
        """What scales the runtime's header estimates: the median of its models' ratios (1 with none)."""
        seen = sorted(self.ratios.get(runtime, {}).values())
        if not seen:
            return 1.0
        mid = len(seen) // 2
        return seen[mid] if len(seen) % 2 else (seen[mid - 1] + seen[mid]) / 2

    def estimate(self, name: str, runtime: str, header: Footprint) -> Footprint:
        if name in self.measured:
            return dataclasses.replace(header, weights_bytes=self.measured[name])
        return dataclasses.replace(header, weights_bytes=int(header.weights_bytes * self.ratio(runtime)))

    def record(self, name: str, runtime: str, header: Footprint, measured_bytes: int) -> None:
        self.measured[name] = measured_bytes
        mine = self.ratios.setdefault(runtime, {})
        mine.pop(name, None)
        if header.weights_bytes <= 0:
            return
        ratio = measured_bytes / header.weights_bytes
        low, high = RATIO_BOUNDS
        if low <= ratio <= high:
            mine[name] = ratio
        else:
            log.warning("%s measured %d bytes against %d estimated from its headers: not used to size other "
                        "%s models", name, measured_bytes, header.weights_bytes, runtime)
