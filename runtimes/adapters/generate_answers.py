"""From a decode step's logits to each row's next token, its chunks and its answer.

The part of `runtimes.adapters.generate.CausalLM` that works per row, split from it so
that generate.py keeps the cache, memory and admission bookkeeping: `_pick`
chooses each row's token (grammar mask, greedy or sampled, the logprobs asked
for), `_settle` appends it and ends rows (EOS, grammar, max_tokens, stop
strings), streams what is safe to stream, splits tool calls out of the text and
places each token's logprob in it. A mixin: `CausalLM` holds the state it reads
(the rows, the step's picked tokens, the tokenizer and grammars).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.messages import GenerateChunk, GenerateResult, TokenLogprob, WorkError
from fleet.runtimes.adapters.generate_rows import Sequence, stop_cut, streamable_end

NEG_INF = float("-inf")


class RowAnswers:
    """Per-row picking and settling of `runtimes.adapters.generate.CausalLM` (see the module docstring)."""

    #: Set by CausalLM: torch, the tokenizer, the grammar engine (runtimes.adapters.grammar.Grammars),
    #: the rows of the batch in cache order, their tokens picked by the last step
    #: (a (rows,) tensor) and the end-of-sequence ids (a tensor).
    _torch: Any
    tokenizer: Any
    grammars: Any
    rows: list[Sequence]
    last: Any
    eos: Any
    #: CausalLM's: the rows at these indices stay in the batch (cache columns cut to them).
    _keep_rows: Callable[[list[int]], None]

    def _pick(self, logits, rows: list[Sequence]):
        """Next token per row: the grammar mask first (constrained rows); argmax for
        greedy rows; for the others, temperature, then top-p (nucleus) over the
        sorted distribution, then one draw from the row's own generator (seeded
        requests repeat whatever batch they share); then the logprobs asked for."""
        constrained = [i for i, s in enumerate(rows) if s.matcher is not None]
        if constrained:
            for j in self.grammars.mask(logits, constrained, [rows[i].matcher for i in constrained]):
                s = rows[constrained[j]]
                s.error = s.error or self.grammars.row_error(s.matcher, len(s.ids))
        out = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(rows) if s.generator is not None]
        if sampled:
            self._sample(logits, rows, sampled, out)
        wanted = [i for i, s in enumerate(rows) if s.top_logprobs >= 0]
        if wanted:
            self._logprobs(logits, rows, wanted, out)
        return out

    def _logprobs(self, logits, rows: list[Sequence], wanted: list[int], out) -> None:
        """Each wanted row's chosen-token logprob and its top ones, with batch ops and
        one transfer (set on the row as `step_lp`, kept with the token in _settle)."""
        torch = self._torch
        idx = torch.tensor(wanted, dtype=torch.long, device=logits.device)
        logp = torch.log_softmax(logits[idx], dim=-1)
        chosen = logp.gather(1, out[idx][:, None]).squeeze(1).tolist()
        k = max(rows[i].top_logprobs for i in wanted)
        top_lp, top_id = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        top_lp, top_id = top_lp.tolist(), top_id.tolist()
        for j, i in enumerate(wanted):  # per row: its own k of the one top-k, never a masked token
            k_row = min(rows[i].top_logprobs, sum(lp > NEG_INF for lp in top_lp[j][:rows[i].top_logprobs]))
            rows[i].step_lp = (chosen[j], top_id[j][:k_row], top_lp[j][:k_row])

    def _sample(self, logits, rows: list[Sequence], sampled: list[int], out) -> None:
        torch = self._torch
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        temps = torch.tensor([rows[i].temperature for i in sampled], device=logits.device)
        top_p = torch.tensor([rows[i].top_p for i in sampled], device=logits.device)
        probs = torch.softmax(logits[idx] / temps[:, None], dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always).
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p[:, None], 0.0)
        # One draw per row: each row's generator is its own (a batch op cannot take several).
        picks = torch.cat([torch.multinomial(sorted_p[j], 1, generator=rows[i].generator)
                           for j, i in enumerate(sampled)])
        out[idx] = order.gather(1, picks[:, None]).squeeze(1)

    def _settle(self) -> tuple[list, list]:
        torch = self._torch
        last = self.last.tolist()
        is_eos = torch.isin(self.last, self.eos).tolist() if len(self.eos) else [False] * len(last)
        # 1. Append each row's new token (and its logprob); EOS (where its grammar
        #    accepts), the end of the row's grammar and max_tokens end a row; a failed
        #    grammar ends it with its error.
        for s, tok, eos in zip(self.rows, last, is_eos):
            if eos and s.matcher is not None and s.error is None and not s.matcher.is_accepting():
                s.error = self.grammars.row_error(s.matcher, len(s.ids)) if s.matcher.is_error() else \
                    WorkError("inference_failed", "EOS was picked before the grammar accepted the output; this is a bug")
            if s.error is not None:
                s.finish = "error"
                continue
            if eos:
                s.finish = "stop"
                continue
            s.ids.append(tok)
            if s.top_logprobs >= 0:
                s.lps.append(s.step_lp)
                s.lp_bytes.append(self.grammars.token_bytes([tok])[0])
            if s.matcher is not None:
                if not s.matcher.consume_token(tok):  # a limit hit advancing it, or a bug (row_error says)
                    s.error, s.finish = self.grammars.row_error(s.matcher, len(s.ids) - 1), "error"
                    continue
                if s.matcher.is_stopped():  # the output is complete: nothing but EOS may follow
                    s.finish = "stop"
                    continue
            if len(s.ids) >= s.max_new:
                s.finish = "length"
                if s.open_ended:
                    s.length_limit = "context"
        # 2. Rows that need their text now (stop strings, streaming, logprobs, finished):
        #    one batch decode. Logprob rows note where the text ends after their new
        #    token (characters, before any stop cut): it places each token in the text.
        #    A row with tools finds stop strings in its text before a call only.
        need = [s for s in self.rows if (s.stop or s.stream or s.finish or s.top_logprobs >= 0) and s.error is None]
        if need:
            for s, text in zip(need, self._texts(need)):
                if len(s.lp_ends) < len(s.lps):
                    s.lp_ends.append(len(text))
                if s.stop:
                    prose = text if s.caller is None else text[:s.caller.call_start(text)]
                    cut = stop_cut(prose, s.stop, max(0, len(s.text) - max(map(len, s.stop))))
                    if cut != -1:
                        text, s.finish, s.cut = text[:cut], "stop", True
                s.text = text
        partials, finished, keep = [], [], []
        for i, s in enumerate(self.rows):
            if s.error is not None:
                finished.append((s.key, s.error))
                continue
            if s.finish:
                finished.append((s.key, self._result(s, s.text)))
                continue
            keep.append(i)
            if s.stream:
                end = streamable_end(s.text, s.stop)
                calls = []
                if s.caller is not None:  # never a call's markup, nor the blank before one: its pieces
                    end = len(s.text[:min(end, s.caller.call_start(s.text))].rstrip())
                    calls = s.caller.call_pieces(s.text, s.call_sent)
                if end > s.sent or calls:
                    end = max(end, s.sent)
                    partials.append((s.key, GenerateChunk(s.sent, s.text[s.sent:end], self._streamed_logprobs(s, end),
                                                          calls)))
                    s.sent = end
        # 3. Finished rows leave the batch; leading columns that became all padding go too.
        if len(keep) < len(self.rows):
            self._keep_rows(keep)
        return partials, finished

    def _texts(self, rows: list[Sequence]) -> list[str]:
        """Each row's generated text, in one batch decode; with special tokens for rows
        whose call markers are special tokens (runtimes.adapters.tools strips the others)."""
        kept = [s.caller is not None and s.caller.keeps_special for s in rows]
        texts = self.tokenizer.batch_decode([s.ids for s, k in zip(rows, kept) if not k], skip_special_tokens=True)
        if not any(kept):
            return texts
        special = iter(self.tokenizer.batch_decode([s.ids for s, k in zip(rows, kept) if k],
                                                   skip_special_tokens=False))
        plain = iter(texts)
        return [next(special) if k else next(plain) for k in kept]

    def _result(self, s: Sequence, text: str) -> GenerateResult:
        """A finished row's answer: with tools, its text beside the calls and the calls
        (finish_reason "tool_calls" when it ended after them)."""
        finish, calls = s.finish, []
        if s.caller is not None:
            text, calls = s.caller.split(text)
            if calls and finish == "stop":
                finish = "tool_calls"
        return GenerateResult(text, finish, len(s.prompt_ids), len(s.ids), self._final_logprobs(s),
                              s.length_limit if s.finish == "length" else "", calls,
                              (s.first_ns - s.admitted_ns) / 1e6 if s.first_ns else 0.0)

    def _token_logprobs(self, s: Sequence, start: int, stop: int) -> list[TokenLogprob]:
        token_bytes = self.grammars.token_bytes
        return [TokenLogprob(s.lp_bytes[j], lp, token_bytes(top_ids), top_lps, s.ids[j], top_ids)
                for j, (lp, top_ids, top_lps) in enumerate(s.lps[start:stop], start)]

    def _streamed_logprobs(self, s: Sequence, end: int) -> list[TokenLogprob] | None:
        """The logprobs of the tokens whose text ends within the first `end` characters
        and were not streamed yet."""
        if s.top_logprobs < 0:
            return None
        start = s.lp_sent
        while s.lp_sent < len(s.lp_ends) and s.lp_ends[s.lp_sent] <= end:
            s.lp_sent += 1
        return self._token_logprobs(s, start, s.lp_sent)

    def _final_logprobs(self, s: Sequence) -> list[TokenLogprob] | None:
        """Every token's logprob; with the text cut before a stop string, the tokens
        that begin before the cut."""
        if s.top_logprobs < 0:
            return None
        n = len(s.lps)
        if s.cut:
            n = 0
            while n < len(s.lp_ends) and (s.lp_ends[n - 1] if n else 0) < len(s.text):
                n += 1
        return self._token_logprobs(s, 0, n)
