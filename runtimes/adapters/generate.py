"""Causal-LM generation with continuous batching and mixed-LoRA batches (task `generate`).

Requests of one model decode together, one token per worker step. A finished
sequence leaves the batch at once and a waiting one joins at the next step:
the worker admits new requests up to `free_slots()` between steps
(runtimes.base, "continuous adapters").

The batch is one padded KV cache. Rows are left-padded: every row's newest
token sits in the last column, so one decode step feeds one token per row.
Invariants kept after every step:
- `mask[i, j]` is 1 exactly for the cache columns that hold row i's tokens
  (prompt and generated, contiguous up to the last column); pad columns are 0
  and never attended to.
- `pos[i]` is the position id of row i's next input token: the number of its
  real tokens so far (so padding never shifts a row's positions, and greedy
  tokens are those of the row decoded alone).
- no column is padding in every row (leading all-pad columns are cut).

LoRA adapters of this model attach to it (`attach_lora`) and run per row
(runtimes.lora, shared with the encoders): each row carries its adapter, and
one forward pass runs every adapter of the batch with one gathered batched
matmul pair per LoRA layer, whatever the mix.

Memory. The padded cache of n sequences is at most n x (the longest prompt +
max_tokens among them) tokens wide, so that is what the batch reserves
(`reserved_bytes`, counted in the device budget by the worker). A request
whose reserve does not fit waits in its lane (`admit` raises NotNow) until a
sequence leaves; one that could not fit even alone fails `model_too_large`.
A request with no max_tokens (open-ended: it runs until the model stops or the
context is full) reserves ANSWER_RESERVE_TOKENS past what it holds, and grows
that reserve by as much each time it reaches it (`_grow_reserves`, before a
decode step; the worker refreshes `kv_limit_bytes` first, `needs_room`); when
the device has no room for the growth, the row ends there with finish_reason
"length" and `length_limit` "memory" (at the context's end: "context").
A step that runs out of memory anyway (other processes share the device) is
undone, and the newest half of the batch is shed: those sequences keep what
they generated and wait to be prefilled again, with it, once a sequence
leaves (`shed_count`); only a lone sequence that does not fit fails.

Per-row extras: a grammar matcher (structured output, runtimes.adapters.grammar) masks
the row's logits before its pick, and EOS ends the row only where the matcher
accepts; a matcher that fails (an engine limit hit mid-generation) fails its
own row (`Sequence.error`), which leaves the batch while the others go on.
`logprobs` records the chosen token's log-probability and the top ones, from
the distribution the pick used (after the grammar mask, before temperature and
top-p). A request with tools holds a `Caller` (runtimes.adapters.tools): the tools go
into its prompt, its calls' grammar is its matcher, a stream holds back what may
be a call, and the finished text is split into text and calls.

Beside this module: runtimes/adapters/generate_rows.py (a row's state and the pure rules
over rows) and runtimes/adapters/generate_answers.py (from a step's logits to each row's
token, chunks and answer: `RowAnswers`, a mixin of `CausalLM`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection
from typing import Any

from fleet.decisions import DecideRequest
from fleet.errors import BadRequest, FleetError, InputTooLong, ModelLoadFailed, ModelTooLarge
from fleet.messages import WorkError
from fleet.protocol import ANSWER_RESERVE_TOKENS, GenerateRequest
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.base import Adapter, BatchContext, ModelSpec, Steps
from fleet.runtimes.adapters.generate_answers import RowAnswers
from fleet.runtimes.adapters.generate_rows import (
    Sequence, cache_keyword, check_cache, kv_reserve, pad_left, pad_left_2d, shed_count,
)
from fleet.runtimes.adapters.grammar import Grammars
from fleet.runtimes.adapters.batching import char_bound
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.memory import NotNow, is_out_of_memory
from fleet.runtimes.adapters.tools import Caller, added_id, history_turns, template_messages

log = logging.getLogger("fleet.worker")

#: Most likely tokens returned per step with `logprobs` (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


class CausalLM(RowAnswers, LoraHost, Adapter):
    request_type = GenerateRequest
    continuous = True
    #: Typed decisions queued in this model's lane, answered in batches beside the
    #: rounds from the same weights (runtimes/adapters/decide_shared.py; `side_batch`).
    side_type = DecideRequest
    #: The decision reader over this model, built on the first decision batch.
    decider: Any = None

    # -- load ------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        dtype = causal_lm_dtype(self)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                str(self.spec.path), local_files_only=True, trust_remote_code=self.spec.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                str(self.spec.path), local_files_only=True, trust_remote_code=self.spec.trust_remote_code,
                use_safetensors=True, dtype=getattr(torch, dtype),
            )
        except FleetError:
            raise
        except Exception as exc:  # the library raises many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r}: {exc}") from exc
        self.base = model.to(self.device).eval()
        # The KV cache's keyword and output field: `cache` in transformers 5.2x,
        # `past_key_values` before (5.17 is what a CUDA image ships; `cache` is the
        # newer name, the older one deprecated there).
        self._cache_kw = cache_keyword(model)
        self.dtype = dtype
        config = model.config
        # Context (prompt + generated tokens): the store's limit, never past the model's positions.
        limits = [int(x) for x in (self.spec.max_seq_len, getattr(config, "max_position_embeddings", None)) if x]
        self.max_len = min(limits) if limits else 2048
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos = torch.tensor(sorted({eos} if isinstance(eos, int) else set(eos or ())), dtype=torch.long,
                                device=self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", 0) or config.vocab_size)
        self.grammars: Grammars | None = None  # built on the first request that needs it
        #: Bytes one token takes in the cache (all layers, keys and values), measured at warm-up.
        self.kv_token_bytes = 0
        #: The most the batch may reserve, set by the worker before each admission round (None: no bound).
        self.kv_limit_bytes: int | None = None
        #: No admission until a sequence leaves: a request did not fit (`waiting_room`),
        #: or a step ran out of memory and shed rows (`hold`: no prefill either).
        self.waiting_room = False
        self.hold = False
        #: Items per prefill after a prefill alone ran out of memory (0 = the token budget decides).
        self.prefill_cap = 0
        self.loras = Loras(self.spec.name, self.base, self.spec.profile.max_loras)
        self.rows: list[Sequence] = []
        self.pending: list[Sequence] = []
        self.cache = self.mask = self.pos = self.last = None
        self._warm_up()

    def _warm_up(self) -> None:
        """One short generation at load: pays kernel selection now, refuses models
        whose cache this batcher cannot pad and merge (sliding windows), and
        measures what one token takes in the cache."""
        self.admit(None, GenerateRequest(model=self.spec.name, prompt="hello", max_tokens=2, temperature=0.0))
        self.step()
        if self.cache is not None:  # the prefill's cache holds exactly the prompt's tokens
            held = sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))
            self.kv_token_bytes = held // self.mask.numel()
        while self.has_active():
            self.step()

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            eos = [int(e) for e in self.eos.tolist()]
            self.grammars = Grammars(self.tokenizer, self.vocab_size, eos)
        return self.grammars

    def _engine_token(self, text: str) -> int | None:
        """The id of `text` when it is one added token, which the grammar engine holds
        apart from text (a grammar names it as a token)."""
        tid = added_id(self.tokenizer, text)
        return tid if tid is not None and self._grammars().tokenizer.is_special_token(tid) else None

    def footprint_bytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in itertools.chain(self.base.parameters(), self.base.buffers()))
        return held + self.lora_bytes()

    def unload(self) -> None:
        if self.decider is not None:
            self.decider.unload()
            self.decider = None
        self.rows, self.pending, self.grammars = [], [], None
        self.cache = self.mask = self.pos = self.last = None
        self.base = self.loras = None

    # -- LoRA --------------------------------------------------------------------

    def attach_lora(self, spec: ModelSpec, keep: Collection[str] = ()) -> None:
        """Attach `spec`; the adapters of sequences in flight stay attached."""
        busy = {s.lora for s in itertools.chain(self.rows, self.pending)}
        keep = {*keep, *(n for n, a in self.loras.attached.items() if a.peft_name in busy)}
        super().attach_lora(spec, keep)

    # -- continuous batching -----------------------------------------------------

    def free_slots(self) -> int:
        if self.waiting_room or self.hold:
            return 0
        return max(0, self.spec.profile.max_batch_items - len(self.rows) - len(self.pending))

    def reserved_bytes(self) -> int:
        """The sequences' cache reserve, and the decision states' caches kept (`side_batch`)."""
        return self._kv_reserved() + self._decisions_held()

    def _kv_reserved(self) -> int:
        seqs = self.rows + self.pending
        return kv_reserve(self.kv_token_bytes, len(seqs), max((s.final_len for s in seqs), default=0))

    def _decisions_held(self) -> int:
        return self.decider.held_bytes() if self.decider is not None else 0

    # -- typed decisions from the same weights -----------------------------------

    def side_batch(self, requests: list[DecideRequest], ctx: BatchContext) -> Steps:
        """Decision requests of this lane as runtimes/adapters/decide.py answers them, read from
        this model (`SharedDecisions`: no second copy of the weights)."""
        if self.decider is None:
            from fleet.runtimes.adapters.decide_shared import SharedDecisions

            self.decider = SharedDecisions(self)
        self.decider.spec = self.spec  # as it is now: a reload replaces it (calibration, profile)
        return self.decider.batch(requests, ctx)

    def has_active(self) -> bool:
        return bool(self.rows or self.pending)

    def active_count(self) -> int:
        return len(self.rows) + len(self.pending)

    def in_flight(self) -> list[Any]:
        return [s.key for s in itertools.chain(self.rows, self.pending)]

    def round_tokens(self) -> tuple[int, int]:
        seqs = (*self.rows, *self.pending)
        return sum(len(s.prompt_ids) for s in seqs), sum(len(s.ids) for s in seqs)

    def cancel(self, keep) -> list[Any]:
        dropped = [s.key for s in itertools.chain(self.rows, self.pending) if not keep(s.key)]
        if dropped:
            self._room_freed()
            self.pending = [s for s in self.pending if keep(s.key)]
            kept = [i for i, s in enumerate(self.rows) if keep(s.key)]
            if len(kept) < len(self.rows):
                self._keep_rows(kept)
        return dropped

    def abort(self) -> list[Any]:
        keys = [s.key for s in itertools.chain(self.rows, self.pending)]
        self.rows, self.pending = [], []
        self.cache = self.mask = self.pos = self.last = None
        self._room_freed()
        return keys

    def admit(self, key: Any, request: GenerateRequest) -> WorkError | None:
        try:
            seq = self._sequence(key, request)
        except FleetError as exc:
            return WorkError(exc.code, exc.message)
        self.pending.append(seq)
        return None

    def _sequence(self, key: Any, req: GenerateRequest) -> Sequence:
        torch = self._torch
        lora = self.loras.peft_name(self.lora_of(req))  # marks it recently used
        caller = None
        if req.tools and req.tool_choice != "none":
            if req.messages is None:
                raise BadRequest("`tools` need chat `messages` (a prompt has no template to render them)",
                                 param="tools")
            caller = Caller(self.spec.name, self.tokenizer, req.tools, req.tool_choice, req.parallel_tool_calls,
                            self._engine_token)
        ids = self.prompt_ids(req, caller)
        if not ids:
            raise BadRequest("the prompt is empty")
        room = self.max_len - len(ids)
        if room < 1:
            raise InputTooLong(f"the prompt has {len(ids)} tokens; {self.spec.name} takes at most {self.max_len} "
                               "with room for one generated token")
        open_ended = req.max_tokens is None
        max_new = room if open_ended else req.max_tokens
        if not 1 <= max_new <= room:
            raise BadRequest(f"max_tokens must be between 1 and {room} for this prompt ({len(ids)} tokens; "
                             f"{self.spec.name} takes {self.max_len} in all), got {req.max_tokens}")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}")
        reserve = len(ids) + min(max_new, ANSWER_RESERVE_TOKENS)
        self._check_room(reserve)
        matcher = self._grammars().lark(caller.grammar(), "`tools`") if caller is not None else \
            self._grammars().matcher(req.format, req.regex) if req.format is not None or req.regex is not None \
            else None
        if req.logprobs:
            self._grammars()  # token bytes
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        generator = None
        if req.temperature > 0:
            generator = torch.Generator(device=self.device)
            if req.seed is not None:
                generator.manual_seed(req.seed)
            else:
                generator.seed()
        return Sequence(key, ids, max_new, req.temperature, req.top_p, generator, stop, req.stream,
                        lora, matcher,
                        req.top_logprobs if req.logprobs else -1, open_ended=open_ended, reserve=reserve,
                        caller=caller, admitted_ns=time.perf_counter_ns())

    def needs_room(self) -> bool:
        """Does the next step grow an open-ended row's reserve (`_grow_reserves`; the
        worker refreshes `kv_limit_bytes` before it)?"""
        return any(s.open_ended and s.held() > s.reserve for s in self.rows)

    def _grow_reserves(self) -> list:
        """Before a decode step: each open-ended row about to outgrow its reserve gets
        ANSWER_RESERVE_TOKENS more (never past its context), if the batch's reserve
        then stays within `kv_limit_bytes`; one that cannot grow ends here, its cache
        full to its reserve ("length", `length_limit` "memory"). Returns their results."""
        ended = []
        for s in self.rows:
            if not (s.open_ended and s.held() > s.reserve):
                continue
            before, s.reserve = s.reserve, min(len(s.prompt_ids) + s.max_new, s.reserve + ANSWER_RESERVE_TOKENS)
            if self._reserve_over():
                s.reserve, s.finish, s.length_limit = before, "length", "memory"
                ended.append(s)
        if not ended:
            return []
        texts = self._texts(ended)
        self._keep_rows([i for i, s in enumerate(self.rows) if not s.finish])
        return [(s.key, self._result(s, text)) for s, text in zip(ended, texts)]

    def _reserve_over(self) -> bool:
        """Is the batch's reserve past what its cache may hold (`kv_limit_bytes`)?"""
        return self.kv_limit_bytes is not None and self.reserved_bytes() > self.kv_limit_bytes

    def _check_room(self, final_len: int) -> None:
        """Does the batch's reserve, with a row of `final_len` tokens more, stay within
        `kv_limit_bytes`? Raises NotNow (wait for a sequence to leave) or, when not
        even this row alone fits, ModelTooLarge."""
        if self.kv_limit_bytes is None:
            return
        seqs = self.rows + self.pending
        need = kv_reserve(self.kv_token_bytes, len(seqs) + 1, max([final_len] + [s.final_len for s in seqs]))
        if need + self._decisions_held() <= self.kv_limit_bytes:
            return
        if self.decider is not None:  # the decision states kept are a cache: generation comes first
            self.decider.prefixes.clear()
        if need <= self.kv_limit_bytes:
            return
        alone = kv_reserve(self.kv_token_bytes, 1, final_len)
        if not seqs or alone > self.kv_limit_bytes:
            raise ModelTooLarge(
                f"the key/value cache of this request ({final_len} tokens: prompt + max_tokens) needs "
                f"{alone / (1 << 20):.1f} MiB; {max(0, self.kv_limit_bytes) / (1 << 20):.1f} MiB of the {self.device} "
                f"budget is left for {self.spec.name}'s cache", hint="send fewer max_tokens or a shorter prompt")
        self.waiting_room = True
        raise NotNow(f"{self.spec.name}: the cache reserve of {len(seqs)} sequences leaves no room for another")

    def prompt_ids(self, req: GenerateRequest, caller: Caller | None = None) -> list[int]:
        """Token ids of the prompt: the text as the tokenizer encodes it, or the chat
        rendered by the model's template (its special tokens written by the template),
        with the request's tools when `caller` holds them."""
        if req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest(f"{self.spec.name} has no chat template; send `prompt` instead of `messages`")
            if not req.messages:
                raise BadRequest("`messages` is empty: send at least one message")
            messages, kwargs = template_messages(req.messages), {}
            if caller is not None:
                messages, kwargs = caller.render(messages)
            elif isinstance(self.tokenizer.chat_template, str):
                messages = history_turns(self.tokenizer.chat_template, messages)
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          **kwargs)
            except Exception as exc:  # templates raise on what they refuse (roles, order)
                raise BadRequest(f"the chat template of {self.spec.name} refused these messages: {exc}") from exc
            self.check_prompt_chars(text)
            return self.encode(text, chat=True)
        self.check_prompt_chars(req.prompt or "")
        return self.encode(req.prompt or "", chat=False)

    def encode(self, text: str, *, chat: bool) -> list[int]:
        """Token ids of a prompt's text: a rendered chat holds its own special tokens (none
        added); a raw prompt gets what the tokenizer adds (BOS)."""
        return self.tokenizer(text, add_special_tokens=not chat)["input_ids"]

    def check_prompt_chars(self, text: str) -> None:
        """A prompt far longer than the context is refused before tokenizing it (a
        prompt is never cut; tokenizing 15 MB would hold the worker for seconds)."""
        bound = char_bound(self.max_len)
        if len(text) > bound:
            raise InputTooLong(f"the prompt has {len(text)} characters; {self.spec.name} reads at most "
                               f"{self.max_len} tokens (at most {bound} characters)")

    def run_batch(self, requests: list[GenerateRequest]) -> list[Any]:
        """All requests to the end, together (the non-continuous path, and tests)."""
        results: list[Any] = [None] * len(requests)
        for i, req in enumerate(requests):
            results[i] = self.admit(i, req)
        while self.has_active():
            for i, res in self.step()[1]:
                results[i] = res
        return results

    def step(self) -> tuple[list, list]:
        """0. Grow the reserves of open-ended rows (or end those that find no room);
        1. one decode step for the rows in the batch; 2. prefill the newly
        admitted ones (their first token) and merge them in; 3. finish rows that
        hit EOS, a stop string, the end of their grammar or max_tokens, and
        stream what is safe to send. A phase that runs out of memory is undone
        and sheds rows (module doc); other failures raise."""
        torch = self._torch
        failed: list = self._grow_reserves() if self.rows else []
        with torch.inference_mode():
            if self.rows:
                try:
                    self._decode()
                except Exception as exc:
                    if not is_out_of_memory(exc):
                        raise
                    return [], failed + self._shed_rows(exc)
            if self.pending and not self.hold:
                try:
                    self._prefill_and_merge()
                except Exception as exc:
                    if not is_out_of_memory(exc):
                        raise
                    failed = self._shed_prefill(exc)
        if not self.rows:
            return [], failed
        partials, finished = self._settle()
        return partials, finished + failed

    def _out_of_memory(self, s: Sequence, exc: BaseException) -> tuple[Any, WorkError]:
        log.warning("out of memory generating on %s with one sequence: %s", self.device, exc)
        return s.key, WorkError("overloaded", f"{self.spec.name}: out of memory on {self.device} for this sequence "
                                              "alone; retry shortly")

    def _shed_rows(self, exc: BaseException) -> list:
        """After a decode step ran out of memory (and was undone): the newest half of
        the rows go back to wait for a prefill, keeping what they generated; a lone
        row fails. Returns the failed rows' results."""
        n = len(self.rows)
        k = shed_count(n)
        if k == 0:
            lone = self.rows[0]
            self._keep_rows([])
            return [self._out_of_memory(lone, exc)]
        shed = self.rows[n - k:]
        self._keep_rows(list(range(n - k)))
        self.pending = shed + self.pending
        self.hold = True
        log.warning("out of memory decoding %d sequences of %s on %s; %d wait to be prefilled again",
                    n, self.spec.name, self.device, k)
        return []

    def _shed_prefill(self, exc: BaseException) -> list:
        """After a prefill ran out of memory (undone, its group back in `pending`):
        wait for a row to leave, or prefill fewer at once; a lone request with
        nothing else in flight fails. Returns the failed rows' results."""
        group = len(self.pending) if self.prefill_cap == 0 else min(self.prefill_cap, len(self.pending))
        if self.rows:
            self.hold = True
        elif group > 1:
            self.prefill_cap = group // 2
        else:
            return [self._out_of_memory(self.pending.pop(0), exc)]
        log.warning("out of memory prefilling %d sequences of %s on %s; they wait", group, self.spec.name, self.device)
        return []

    def _room_freed(self) -> None:
        """A sequence left: what waited for its room may be tried again."""
        self.waiting_room = self.hold = False
        self.prefill_cap = 0

    def _forward(self, input_ids, mask, pos, cache, loras: list[str]):
        self.loras.bank.select(loras, self.device)
        try:
            # The base module itself (peft's wrapper adds nothing once its LoRA
            # layers are off); logits_to_keep=1: the LM head runs on the last
            # position only (prefill included).
            out = self.base(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                            logits_to_keep=1, **{self._cache_kw: cache})
        finally:
            self.loras.bank.select(None, self.device)
        return out.logits[:, -1, :].float(), getattr(out, self._cache_kw)

    def _decode(self) -> None:
        """One token per row; all or nothing (a failure leaves the batch as it was)."""
        torch = self._torch
        n, width = self.mask.shape
        mask = torch.cat([self.mask, self.mask.new_ones((n, 1))], dim=1)
        try:
            logits, _ = self._forward(self.last[:, None], mask, self.pos[:, None], self.cache,
                                      [s.lora for s in self.rows])
            last = self._pick(logits, self.rows)
        except BaseException:
            self._truncate_cache(n, width)
            raise
        self.mask, self.pos, self.last = mask, self.pos + 1, last

    def _truncate_cache(self, rows: int, width: int) -> None:
        """Back to the first `rows` rows and last `width` columns: undoes a step that
        grew some layers before it failed (views, nothing is copied)."""
        for layer in self.cache.layers:
            if layer.keys.shape[0] != rows or layer.keys.shape[-2] != width:
                layer.keys = layer.keys[:rows, :, -width:]
                layer.values = layer.values[:rows, :, -width:]

    def _prefill_and_merge(self) -> None:
        new, self.pending = self._prefill_group(self.pending)
        try:
            self._prefill(new)
        except BaseException:
            self.pending = new + self.pending  # nothing of them was kept: they wait, in order
            raise

    def _prefill(self, new: list[Sequence]) -> None:
        """Prefill `new` and merge it into the batch; all or nothing."""
        torch = self._torch
        from transformers import DynamicCache

        contexts = [s.context() for s in new]
        lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long)
        width = int(lengths.max())
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, c in enumerate(contexts):  # left padding: each prompt ends in the last column
            ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
            mask[i, width - len(c):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        logits, cache = self._forward(ids, mask, pos, DynamicCache(), [s.lora for s in new])
        check_cache(cache)
        first = self._pick(logits, new)
        now = time.perf_counter_ns()
        for s in new:  # a row shed and prefilled again keeps its first
            s.first_ns = s.first_ns or now
        lengths = lengths.to(self.device)
        if not self.rows:
            self.cache, self.mask, self.pos, self.last, self.rows = cache, mask, lengths, first, new
            return
        # Merge: left-pad the narrower cache so both end at the same column.
        n, old_width = self.mask.shape
        total = max(old_width, width)
        pad_old, pad_new = total - old_width, total - width
        try:
            for old, add in zip(self.cache.layers, cache.layers):
                old.keys = torch.cat([pad_left(old.keys, pad_old), pad_left(add.keys, pad_new)], dim=0)
                old.values = torch.cat([pad_left(old.values, pad_old), pad_left(add.values, pad_new)], dim=0)
            merged = torch.cat([pad_left_2d(self.mask, pad_old), pad_left_2d(mask, pad_new)], dim=0)
        except BaseException:
            self._truncate_cache(n, old_width)
            raise
        self.mask = merged
        self.pos = torch.cat([self.pos, lengths])
        self.last = torch.cat([self.last, first])
        self.rows = self.rows + new

    def _prefill_group(self, pending: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(prefilled now, left for the next steps): the oldest admitted requests
        whose padded prefill (items x longest context, tokens) fits
        `max_batch_tokens`, and no more than `prefill_cap` after a prefill ran
        out of memory; always at least one, so every step makes progress."""
        budget, widest = self.spec.profile.max_batch_tokens, 0
        for n, s in enumerate(pending):
            widest = max(widest, len(s.prompt_ids) + len(s.ids))
            if n and ((n + 1) * widest > budget or n == self.prefill_cap):
                return pending[:n], pending[n:]
        return pending, []

    def _keep_rows(self, keep: list[int]) -> None:
        torch = self._torch
        if len(keep) < len(self.rows):
            self._room_freed()
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.pos = self.last = None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        used = self.mask.any(dim=0)
        lead = int(used.to(torch.int8).argmax())  # first column some row still uses
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, lead:]
            layer.values = layer.values[idx, :, lead:]
        self.mask = self.mask[:, lead:]
