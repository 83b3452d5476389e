"""Structured output and token bytes for generation, through llguidance.

A request's `format` (fleet.protocol.GenerateFormat: "json" for one JSON
object, or a JSON Schema) becomes an llguidance grammar, and each constrained
sequence holds its own `LLMatcher`, which follows the tokens the sequence
generates. Before every pick of a decode step, the rows that carry a matcher
get their allowed tokens in one parallel call (`LLExecutor`: Rust threads,
the GIL dropped) written into one int32 bitmask; the bitmask is expanded to a
boolean (rows, vocab) mask and applied with one `masked_fill`. Tokens that
cannot continue valid output get -inf, so greedy and sampled picks alike stay
inside the grammar, and EOS is allowed only where the output is complete.

The llguidance view of the tokenizer is built once per model, on the first
request that needs it; it also gives each token's exact bytes (logprobs).
"""

from __future__ import annotations

import json
from typing import Any

from fleet.errors import BadRequest

#: JSON written like OpenAI's JSON mode writes it: `{"a": 1, "b": [2, 3]}`. A
#: schema's own `x-guidance` options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: What `format: "json"` means: one JSON object (OpenAI's `json_object`, Ollama's "json").
ANY_OBJECT = {"type": "object"}
#: Longest schema taken (bytes of its JSON): compiling is bounded by it.
MAX_SCHEMA_BYTES = 64 << 10


class Grammars:
    """llguidance for one model: its tokenizer view, matchers for requests, and the
    batched token mask."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import torch

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # slow (Python) tokenizers have no serialised form to convert
            raise BadRequest(f"structured output and logprobs need a fast tokenizer: {exc}") from None
        self._llg = llguidance
        self._torch = torch
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        # As many mask threads as torch may use here (FLEET_CPU_THREADS), not 80 % of the box.
        self.executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        self._bits = torch.arange(32, dtype=torch.int32)
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes, filled as tokens are seen

    def matcher(self, fmt: str | dict | None, regex: str | None = None) -> Any:
        """A fresh matcher for `format` (or a `regex` the whole text must match);
        BadRequest when the schema or pattern is not one llguidance can enforce (the
        message says which part)."""
        if regex is not None:
            if len(regex) > MAX_SCHEMA_BYTES:
                raise BadRequest(f"`regex` is {len(regex)} characters; at most {MAX_SCHEMA_BYTES} are taken")
            return self._checked(self._llg.LLMatcher.grammar_from_regex(regex), "`regex`")
        schema = ANY_OBJECT if fmt == "json" else fmt
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_BYTES:
            raise BadRequest(f"`format`: the JSON Schema is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are taken")
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise BadRequest(f"`format` is not a usable JSON Schema: {exc}") from None
        return self._checked(grammar, "`format`")

    def _checked(self, grammar: str, field: str) -> Any:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequest(f"{field} is not one this server can enforce: {matcher.get_error()}")
        return matcher

    def mask(self, logits: Any, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in place, the logits of tokens `matchers[j]` does not allow
        next, for batch row `rows[j]`."""
        torch = self._torch
        n = len(rows)
        bitmask = torch.empty((n, self.words), dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)], bitmask.data_ptr(),
                                              self.words * 4, n)
        # `vocab_size` is the width of the model's logits (ids past the tokenizer's are never allowed).
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).view(n, -1)[:, :self.vocab_size].bool()
        blocked = ~allowed.to(logits.device)
        if n == logits.shape[0]:  # every row constrained (`rows` ascending): in place, no gather
            logits.masked_fill_(blocked, float("-inf"))
            return
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's exact bytes (a byte-level token may hold part of a character);
        kept per id, so the top tokens of every step cost a dict lookup."""
        known, decode = self._bytes, self.tokenizer.decode_bytes
        out = []
        for i in ids:
            b = known.get(i)
            if b is None:
                b = known[i] = decode([i])
            out.append(b)
        return out
