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

Per-row extras: a grammar matcher (structured output, runtimes.grammar) masks
the row's logits before its pick, and EOS ends the row only where the matcher
accepts; a matcher that fails (an engine limit hit mid-generation) fails its
own row (`Sequence.error`), which leaves the batch while the others go on.
`logprobs` records the chosen token's log-probability and the top ones, from
the distribution the pick used (after the grammar mask, before temperature and
top-p). A request with tools holds a `Caller` (runtimes.tools): the tools go
into its prompt, its calls' grammar is its matcher, a stream holds back what may
be a call, and the finished text is split into text and calls.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from fleet.decisions import DecideRequest
from fleet.errors import BadRequest, FleetError, InputTooLong, ModelLoadFailed, ModelTooLarge
from fleet.messages import GenerateChunk, GenerateResult, TokenLogprob, WorkError
from fleet.protocol import ANSWER_RESERVE_TOKENS, GenerateRequest
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.base import Adapter, BatchContext, ModelSpec, Steps
from fleet.runtimes.grammar import Grammars
from fleet.runtimes.hf_common import char_bound
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.memory import NotNow, is_out_of_memory
from fleet.runtimes.tools import Caller, added_id, history_turns, template_messages

log = logging.getLogger("fleet.worker")

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
#: Most likely tokens returned per step with `logprobs` (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
NEG_INF = float("-inf")


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


class CausalLM(LoraHost, Adapter):
    request_type = GenerateRequest
    continuous = True
    #: Typed decisions queued in this model's lane, answered in batches beside the
    #: rounds from the same weights (runtimes/decide_shared.py; `side_batch`).
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
        """Decision requests of this lane as runtimes/decide.py answers them, read from
        this model (`SharedDecisions`: no second copy of the weights)."""
        if self.decider is None:
            from fleet.runtimes.decide_shared import SharedDecisions

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
            if self.kv_limit_bytes is not None and self.reserved_bytes() > self.kv_limit_bytes:
                s.reserve, s.finish, s.length_limit = before, "length", "memory"
                ended.append(s)
        if not ended:
            return []
        texts = self._texts(ended)
        self._keep_rows([i for i, s in enumerate(self.rows) if not s.finish])
        return [(s.key, self._result(s, text)) for s, text in zip(ended, texts)]

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
        whose call markers are special tokens (runtimes.tools strips the others)."""
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

