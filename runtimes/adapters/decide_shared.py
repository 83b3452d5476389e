"""Typed decisions from a stored generator, read from the weights its worker already
holds (no second copy): a generator's lane carries its decision requests beside its
generation requests, and the generator's adapter (runtimes/adapters/generate.py) answers them
in batches beside its rounds (runtimes/continuous.py), through a `SharedDecisions`:
runtimes/adapters/decide.py's `DecisionLM` over the generator's model, tokenizer and LoRA bank.

So a decision on `qwen3-0.6b` equals one on `qwen3-0.6b-decide` (the same weights
stored as a decision model) while the box holds the weights once. What it adds to
the generator is its states' key/value caches kept between batches: the bytes they
hold now count in the generator's reserve (`held_bytes`; `/v1/ps` and the device
budget see them), at most min(PREFIX_CACHE_BYTES, the weights).

The model is the generator's as loaded: its dtype (the same rule as a decision
model's: `device.causal_lm_dtype`) and its attention (SDPA takes the packs' mask as
booleans, an eager attention adds it: DecisionLM reads which). Temperatures are the
generator's entry's calibration, if any (runtimes.resolve puts it in the spec).
"""

from __future__ import annotations

from typing import Any

from fleet.runtimes.adapters.decide import PREFIX_CACHE_BYTES, DecisionLM
from fleet.runtimes.adapters.hf_common import footprint_bytes


class SharedDecisions(DecisionLM):
    """DecisionLM reading a loaded generator's weights: built on the generator's first
    decision batch (its warm-up decision then), dropped when the generator unloads.
    Its LoRA adapters are the generator's (one bank, attached by the worker as for
    generation), so a decision with an adapter reads that adapter's weights."""

    def __init__(self, generator: Any) -> None:
        super().__init__(generator.spec, generator.device)
        self._torch = generator._torch
        self.dtype = generator.dtype
        self.loras = generator.loras
        self.read_with(generator.tokenizer, generator.base, min(PREFIX_CACHE_BYTES, footprint_bytes(generator.base)))

    def load(self) -> None:
        raise RuntimeError("SharedDecisions reads a loaded generator and loads nothing; this is a bug")

    def footprint_bytes(self) -> int:
        return self.held_bytes()

    def held_bytes(self) -> int:
        """Bytes its kept states' caches hold now (the weights are the generator's)."""
        return self.prefixes.used

    def unload(self) -> None:
        self.prefixes.clear()
        self.model = self.loras = None
