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

Limits. Compiling a grammar is cheap even when following it is not: the
engine builds its lexer lazily, as tokens are matched, and stops at its limits
(`a{1000000000}` compiles in a millisecond and fails on its first token). A
matcher that hits one enters an error state (it never raises) in which only EOS
is allowed. So a request's grammar is compiled and run one token ahead, on a
copy, at admission (`Grammars.matcher`: a 400 naming the limit, before the
request joins a batch); a limit hit later fails that sequence alone
(`Grammars.mask` reports the rows whose matcher failed, `row_error` says why),
never with EOS as if its output were complete, and never the batch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fleet.errors import BadRequest
from fleet.messages import WorkError

#: JSON written like OpenAI's JSON mode writes it: `{"a": 1, "b": [2, 3]}`. A
#: schema's own `x-guidance` options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: What `format: "json"` means: one JSON object (OpenAI's `json_object`, Ollama's "json").
ANY_OBJECT = {"type": "object"}
#: Longest schema taken (bytes of its JSON): compiling is bounded by it.
MAX_SCHEMA_BYTES = 64 << 10
#: How the engine's error begins when a matcher refused a token (not a limit).
REFUSED_TOKEN = "Parser Error: token"


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
        self.eos = eos
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

    def lark(self, text: str, field: str) -> Any:
        """A fresh matcher for an llguidance lark grammar fleet built from the request's
        `field` (tool calls: runtimes.adapters.tools); BadRequest naming the field when a schema
        in it is not one llguidance can enforce."""
        if len(text) > MAX_SCHEMA_BYTES:
            raise BadRequest(f"{field}: the grammar they make is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} "
                             "are taken")
        try:
            grammar = self._llg.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise BadRequest(f"{field} cannot be enforced: {exc}") from None
        return self._checked(grammar, field)

    def _checked(self, grammar: str, field: str) -> Any:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequest(f"{field} is not one this server can enforce: {matcher.get_error()}")
        self._probe(matcher, field)
        return matcher

    def _probe(self, matcher: Any, field: str) -> None:
        """Refuse a grammar that hits the engine's limits on its first two tokens: the
        first mask, the first token it allows (EOS aside), the mask after it, on a copy
        of `matcher`. The lexer states this builds are the engine's, shared with
        `matcher`: its first step finds them made."""
        probe = matcher.deep_copy()
        allowed = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")
        allowed[self.eos] = 0
        first = np.flatnonzero(allowed[:self.vocab_size])
        if len(first) and not probe.is_error() and probe.consume_token(int(first[0])):
            probe.compute_bitmask()
        if probe.is_error():
            raise BadRequest(f"{field} is past a limit of the grammar engine on its first tokens "
                             f"({engine_error(probe)}); send a simpler one")

    def row_error(self, matcher: Any, tokens: int) -> WorkError:
        """Why a sequence whose matcher is in its error state fails (the sequence
        alone: the batch goes on). `tokens`: the tokens it generated."""
        error = engine_error(matcher)
        if error.startswith(REFUSED_TOKEN):  # a token its own mask allowed
            return WorkError("inference_failed", f"the grammar refused a token its own mask allowed ({error}); "
                                                 "this is a bug")
        return WorkError("bad_request", f"the output grammar hit a limit of the grammar engine after {tokens} "
                                        f"tokens ({error}); send a simpler one")

    def mask(self, logits: Any, rows: list[int], matchers: list[Any]) -> list[int]:
        """Set to -inf, in place, the logits of tokens `matchers[j]` does not allow
        next, for batch row `rows[j]`. Returns the j whose matcher is in its error
        state (a limit hit while computing its mask, or before): their rows must not
        take the token picked (only EOS was allowed)."""
        torch = self._torch
        n = len(rows)
        bitmask = torch.empty((n, self.words), dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)], bitmask.data_ptr(),
                                              self.words * 4, n)
        failed = [j for j, m in enumerate(matchers) if m.is_error()]
        # `vocab_size` is the width of the model's logits (ids past the tokenizer's are never allowed).
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).view(n, -1)[:, :self.vocab_size].bool()
        blocked = ~allowed.to(logits.device)
        if n == logits.shape[0]:  # every row constrained (`rows` ascending): in place, no gather
            logits.masked_fill_(blocked, float("-inf"))
            return failed
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))
        return failed

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


def engine_error(matcher: Any) -> str:
    """The first line of a matcher's error: what failed, in the engine's words (the
    lines after it dump the parser's state and the grammar)."""
    return matcher.get_error().split("\n", 1)[0]
