"""One generated sequence's state, and the pure rules over sequences (task `generate`).

Split from runtimes/adapters/generate.py so that the batcher there reads as its step
loop: what a row of the batch holds (`Sequence`), how much key/value cache a
set of rows reserves and how many to shed when a step runs out of memory,
where a stop string cuts the text and how much of it may stream, and how two
caches are padded on the left to merge. Plain functions over plain data (torch
only inside the padding helpers), tested without a model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from fleet.errors import ModelLoadFailed
from fleet.messages import WorkError
from fleet.runtimes.adapters.tools import Caller

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


def cache_keyword(model: Any) -> str:
    """The keyword `model.forward` takes its KV cache by, also the output's field:
    `cache` (transformers 5.2x) or `past_key_values` (earlier releases)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(slots=True)
class Sequence:
    key: Any
    prompt_ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    generator: Any  # torch.Generator, or None for greedy rows
    stop: tuple[str, ...]
    stream: bool
    lora: str  # peft adapter name, BASE_ROW for the base model
    matcher: Any = None  # llguidance matcher of `format` or of tool calls; None = free text
    top_logprobs: int = -1  # -1: no logprobs; k >= 0: the chosen token's and the k most likely
    ids: list[int] = field(default_factory=list)  # generated tokens (no EOS)
    sent: int = 0  # characters already streamed
    finish: str = ""
    text: str = ""
    cut: bool = False  # the text was cut before a stop string
    step_lp: tuple | None = None  # this step's (logprob, top ids, top logprobs), kept with its token
    lps: list = field(default_factory=list)  # (logprob, top ids, top logprobs) per token of `ids`
    lp_bytes: list = field(default_factory=list)  # each token of `ids`, as bytes (logprob rows only)
    lp_ends: list = field(default_factory=list)  # characters of the text once each token was added
    lp_sent: int = 0  # logprobs already streamed
    error: WorkError | None = None  # its grammar failed: the row leaves with this answer
    #: Open-ended (no max_tokens of its client's): `max_new` is the context's room, and the
    #: cache is reserved `reserve` tokens wide, grown as the row reaches it.
    open_ended: bool = False
    reserve: int = 0
    length_limit: str = ""  # the server's limit that ended it: "context" | "memory"
    admitted_ns: int = 0  # perf_counter_ns at admission
    first_ns: int = 0  # perf_counter_ns when its first token was picked (0: not yet)
    caller: Caller | None = None  # the request's tools: its calls are parsed out of the text
    call_sent: list[int] = field(default_factory=list)  # characters of each call's arguments streamed

    @property
    def final_len(self) -> int:
        """Tokens the row's cache is reserved for: prompt + max_tokens, or an
        open-ended row's reserve so far."""
        return self.reserve if self.open_ended else len(self.prompt_ids) + self.max_new

    def held(self) -> int:
        """Tokens the row's cache holds after its next decode step (which feeds its
        newest token)."""
        return len(self.prompt_ids) + len(self.ids)

    def context(self) -> list[int]:
        """What a prefill feeds: the prompt, and what was generated before the row was shed."""
        return self.prompt_ids + self.ids if self.ids else self.prompt_ids


def kv_reserve(token_bytes: int, rows: int, widest: int) -> int:
    """Bytes a padded cache of `rows` rows, each at most `widest` tokens, can reach."""
    return token_bytes * rows * widest


def shed_count(rows: int) -> int:
    """Rows to shed after a decode step ran out of memory: the newest half (they
    have the least to prefill again); none of a lone row (it fails instead)."""
    return rows // 2


def stop_cut(text: str, stops: tuple[str, ...], from_char: int) -> int:
    """Index of the first stop string in `text` found at or after `from_char`, else -1."""
    best = -1
    for s in stops:
        i = text.find(s, from_char)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def streamable_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` is safe to stream now: not a trailing partial character,
    not a suffix that could still become a stop string."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    hold = 0  # the longest suffix that is a proper prefix of some stop string
    for s in stops:
        for k in range(min(len(s) - 1, end), hold, -1):
            if text.endswith(s[:k], 0, end):
                hold = k
                break
    return end - hold


def pad_left(t, n: int):
    """Zeros before the sequence axis (-2) of a (batch, heads, seq, dim) tensor."""
    if not n:
        return t
    import torch

    return torch.nn.functional.pad(t, (0, 0, n, 0))


def pad_left_2d(t, n: int):
    if not n:
        return t
    import torch

    return torch.nn.functional.pad(t, (n, 0))


def check_cache(cache: Any) -> None:
    """The batcher pads and merges plain growing caches only."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise ModelLoadFailed(f"continuous batching needs full-attention key/value caches; this model uses "
                              f"{', '.join(kinds)}")
