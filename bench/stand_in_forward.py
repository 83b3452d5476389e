"""The stand-in forward of bench.stand_in, in the worker process only (it imports torch)."""

from __future__ import annotations

import time
from typing import Any

from concurrent.futures import ThreadPoolExecutor

from fleet.bench.stand_in import ENV, forward_costs
from fleet.runtimes.adapters.tokenizing import tokenize_threads
from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder


class StandInForward:
    """Sleeps what the forward would take on the device, GIL released, and returns
    rows of ones of the model's width: `SentenceTransformerEmbedder.compiled`'s call."""

    def __init__(self, torch: Any, dim: int, fixed_us: float, per_token_us: float) -> None:
        self._torch, self._dim = torch, dim
        self._fixed_s, self._per_token_s = fixed_us / 1e6, per_token_us / 1e6

    def __call__(self, host: dict[str, Any]) -> Any:
        rows, tokens = host["attention_mask"].shape
        time.sleep(self._fixed_s + self._per_token_s * rows * tokens)
        return self._torch.ones((rows, self._dim))

    def info(self) -> dict[str, Any]:
        """What `/v1/ps` shows as the model's forward."""
        return {"traced": False, "stand_in": {"fixed_us": self._fixed_s * 1e6, "per_token_us": self._per_token_s * 1e6}}


class StandInEmbedder(SentenceTransformerEmbedder):
    """The real adapter; after its load, the forward is `StandInForward`."""

    def load(self) -> None:
        super().load()
        self.compiled = StandInForward(self._torch, self.dim, *forward_costs())
        self.traced_why = f"stand-in forward ({ENV})"
        # Tokenizer threads as on an accelerator: the forward no longer holds the cores.
        self.tokenize_ahead.shutdown(wait=True)
        self.tokenize_depth = tokenize_threads(self._torch, self.direct, "cuda")
        self.tokenize_ahead = ThreadPoolExecutor(self.tokenize_depth, thread_name_prefix=f"tokenize-{self.spec.name}")
