"""Typed decisions from a causal LM (task `decide`, runtime `transformers`): the
answer is read from the model's next-token distribution, nothing is generated.

Every request's state is a shared prefix: it is run once (once per batch for
requests that share it, and kept for later batches: `PrefixCache`), and its
questions continue from its key/value cache, packed end to end into one sequence
(`PackBuilder`): each question's head (its text) once, then its rows, each row
seeing the state, its head and itself only (an attention mask; positions count on
from the head as if the row were alone). A question never sees another, so adding,
removing or reordering the other questions of a request leaves its answer as it was
(to float rounding of the batch's shapes, under 1e-5).

    prefix = template head + INTRO (what to answer) + state
    head   = "Question: ..."
    row    = options listed "A. ...", "B. ..." + template tail + "Answer:"

The state is read once and a question's text once, whatever the number of questions
and rows; what eight questions cost against one is measured in bench/README ("Typed
decisions").

- Up to `len(labels)` options (the letters that are one token each after the cue,
  at most 26): two rows, the options listed in request order and in reverse; each
  row's next-token logits at the label tokens, divided by the question's temperature,
  give a distribution over the options it listed; the answer is the mean of the
  two (the position bias of one order cancels against the other's).
- More options (up to 255): the head holds the question, the template's tail and
  the cue; one row per option holds its name, whose summed log-likelihood, over the
  temperature, is the option's logit, and a softmax over the options gives the answer.

LoRA adapters (peft, pulled with the decision model as their base) answer in the same
batches as the base (runtimes/lora.py: per batch row, its request's adapter); a state
read by an adapter is its own state (cached apart), so its answers are those of the
adapter's merged weights.

The template is the model's chat template rendered around the user's turn, with
thinking off (`enable_thinking=False`, which templates that know no thinking
ignore); a model without one reads the plain text. Temperatures are per question
kind and option-count bucket (`fleet.decisions.temperature_key`), 1 unless the
model's catalog entry has a calibration (`fleetctl calibrate`, fleet.calibration),
read at each batch so a new one applies at once (runtimes.commands.reprofile).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.decisions import DecideRequest, DecideResult, decide_temperatures, temperature_key
from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import WorkError
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.adapters.decide_cache import PrefixCache, gathered, plain_layers
from fleet.runtimes.adapters.hf_common import footprint_bytes
from fleet.runtimes.adapters.batching import char_bound
from fleet.runtimes.lora import Loras, LoraHost

log = logging.getLogger("fleet.worker")

#: Positions a decision model reads when neither the store nor its config says.
DEFAULT_MAX_TOKENS = 8192
#: Read once per state: everything a row would repeat for every question is said here.
INTRO = ("Read the following, then answer the question after it: the letter of the best option when the options "
         "are lettered, else the option itself.\n\n")
CUE = "Answer:"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: Device bytes of gathered key/value rows one micro-batch may hold (each pack holds its
#: own copy of its state's cache while the forward runs): packs are cut to fit.
ROW_CACHE_BYTES = 256 << 20
#: Tokens of one state's rows packed into one sequence (its attention mask is square in them).
PACK_TOKENS = 1024
#: Bytes of vocabulary logits one micro-batch may hold (the likelihood rows keep one
#: row of logits per option token).
LOGIT_BYTES = 128 << 20
#: Device bytes of state caches kept between batches (`PrefixCache`), at most the
#: weights' own bytes; counted in the footprint.
PREFIX_CACHE_BYTES = 64 << 20
_SENTINEL = "\x00FLEET-DECIDE-CONTENT\x00"


@dataclass(frozen=True)
class Frame:
    """The text around a request: `head` before the state, `tail` after a question
    (the end of the user's turn, the assistant's start), `cue` before the answer."""

    head: str
    tail: str
    cue: str
    templated: bool


def chat_frame(tokenizer: Any) -> Frame:
    """The model's chat template split around one user message (thinking off), or plain text."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
        except Exception as exc:  # a template that needs a system turn, tools, ...
            log.info("decide: chat template not used (%s: %s); plain text", type(exc).__name__, exc)
        else:
            if text.count(_SENTINEL) == 1:
                head, tail = text.split(_SENTINEL)
                return Frame(head, tail, ("" if not tail or tail[-1].isspace() else " ") + CUE, True)
    return Frame("", "\n", CUE, False)


def single_token_labels(tokenizer: Any, frame: Frame) -> tuple[list[str], list[int], str]:
    """(labels, their token ids, the cue they follow): the letters A, B, ... that the
    tokenizer reads as one token after the cue, as " A" (else "A" after the cue and a
    space), in order up to the first that is not; fewer than two: none (every question
    is then scored by likelihood)."""
    probe = "Question: x\n" + frame.tail
    for space in (" ", ""):
        cue = frame.cue + ("" if space else " ")
        base = tokenizer(probe + cue, add_special_tokens=False)["input_ids"]
        ids = []
        for letter in LETTERS:
            full = tokenizer(probe + cue + space + letter, add_special_tokens=False)["input_ids"]
            if len(full) != len(base) + 1 or full[: len(base)] != base:
                break
            ids.append(int(full[-1]))
        if len(ids) >= 2 and len(set(ids)) == len(ids):
            return [space + c for c in LETTERS[: len(ids)]], ids, cue
    return [], [], frame.cue


@dataclass
class Plan:
    """A batch's questions (request order) and their rows. A question's head (its
    text; with the cue too when its rows are options' likelihoods) is read once; each
    row is a branch after it (the options listed, the template's tail and the cue; or
    one option's tokens)."""

    heads: list[list[int]]
    questions: list[tuple[str, int, int, bool]]  # (kind, first row, options, read from labels)
    owner: np.ndarray  # per question: the request (index into the live requests) it belongs to
    ids: list[list[int]]  # per row: its tokens after its question's head
    question_of: np.ndarray  # per row: its question
    keep: np.ndarray  # per row: a likelihood row's option tokens (its whole branch); 0: a label row
    per_request: list[int]  # questions of each live request


class PackBuilder:
    """One sequence after a state's cache: questions' heads, each followed by branches
    that see the state, their head and themselves only (the rest is masked)."""

    def __init__(self, state: int) -> None:
        self.state = state
        self.ids: list[int] = []
        self.seg: list[int] = []  # per token: where its own segment starts
        self.head_lo: list[int] = []  # per token: its question's head in the pack ([lo, hi); empty for heads)
        self.head_hi: list[int] = []
        self.offset: list[int] = []  # per token: its position after the state's
        self.head: tuple[int, int, int] = (-1, 0, 0)  # (question, start, end) of the last head added
        self.label_rows: list[int] = []
        self.label_at: list[int] = []
        self.option_rows: list[int] = []
        self.option_at: list[int] = []
        self.option_tokens: list[int] = []
        self.option_first: list[int] = []

    def add_head(self, question: int, tokens: list[int]) -> None:
        start = len(self.ids)
        self._add(tokens, start, 0, 0, 0)
        self.head = (question, start, len(self.ids))

    def add_row(self, row: int, tokens: list[int], keep: int) -> None:
        _, lo, hi = self.head
        start = len(self.ids)
        self._add(tokens, start, lo, hi, hi - lo)
        if keep:  # each option token is read at the position before it: the head's last, then its own
            self.option_rows.append(row)
            self.option_first.append(len(self.option_at))
            self.option_at.extend([hi - 1, *range(start, start + keep - 1)])
            self.option_tokens.extend(tokens)
        else:
            self.label_rows.append(row)
            self.label_at.append(len(self.ids) - 1)

    def _add(self, tokens: list[int], start: int, lo: int, hi: int, base: int) -> None:
        n = len(tokens)
        self.ids.extend(tokens)
        self.seg.extend([start] * n)
        self.head_lo.extend([lo] * n)
        self.head_hi.extend([hi] * n)
        self.offset.extend(range(base, base + n))

    @property
    def rows(self) -> int:
        return len(self.label_rows) + len(self.option_rows)

    def reads(self) -> np.ndarray:
        return np.unique(np.asarray(self.label_at + self.option_at, dtype=np.int64))


class DecisionLM(LoraHost, Adapter):
    """LoRA adapters of the model (peft, `runtimes.lora`) answer in the same batches:
    a request's state and rows run with its adapter's weights (per batch row), and its
    state's cache is kept under its adapter (a state read by two adapters is two states)."""

    request_type = DecideRequest

    def load(self) -> None:
        import torch
        from transformers import AutoTokenizer

        self._torch = torch
        self.dtype = causal_lm_dtype(self)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(self.spec.path), local_files_only=True, trust_remote_code=self.spec.trust_remote_code)
            model = load_causal_lm(self.spec, getattr(torch, self.dtype))
        except FleetError:
            raise
        except Exception as exc:  # the library raises many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r} as a causal LM: {exc}") from exc
        self.loras = Loras(self.spec.name, model, self.spec.profile.max_loras)
        self.read_with(tokenizer, model.to(self.device).eval(), min(PREFIX_CACHE_BYTES, footprint_bytes(model)))

    def read_with(self, tokenizer: Any, model: Any, cache_bytes: int) -> None:
        """Read decisions with `model` and `tokenizer` (loaded here, or a generator's:
        runtimes/adapters/decide_shared.py), keeping up to `cache_bytes` of states' caches;
        the warm-up decision runs on them."""
        self.tokenizer = tokenizer
        self.model = model
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else
                          tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
        positions = int(getattr(model.config, "max_position_embeddings", 0) or DEFAULT_MAX_TOKENS)
        self.max_len = min(int(self.spec.max_seq_len or positions), positions)
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # SDPA takes the packs' mask as booleans (True: attend); the eager attention adds it.
        self.bool_mask = getattr(model.config, "_attn_implementation", "") == "sdpa"
        self.frame = chat_frame(tokenizer)
        self.labels, self.label_ids, self.label_cue = single_token_labels(tokenizer, self.frame)
        self.prefixes = PrefixCache(cache_bytes)
        #: Bytes one token of one row holds in the key/value cache, measured at warm-up.
        self.kv_token_bytes = 0
        log.info("decide %s: %d single-token labels, %s", self.spec.name, len(self.labels),
                 "chat template" if self.frame.templated else "plain text")
        self._warm_up()

    def _warm_up(self) -> None:
        """One decision at load: kernel selection now, not in the first client's
        latency; refuses caches this adapter cannot gather; measures a token's cache bytes."""
        probe_decision(self)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model) + self.prefixes.limit + self.lora_bytes()

    def unload(self) -> None:
        self.prefixes.clear()
        self.model = self.loras = None

    # -- one batch ----------------------------------------------------------------

    def refuse(self, req: DecideRequest) -> WorkError | None:
        if len(req.state) > char_bound(self.max_len):
            return too_long(self.spec.name, "state", len(req.state), char_bound(self.max_len), "characters")
        return None

    def batch(self, requests: list[DecideRequest], ctx: BatchContext) -> Steps:
        results: list[Any] = [self.refuse(r) for r in requests]
        live = [i for i, r in enumerate(results) if r is None]
        # 1. Token ids: each state framed as a prefix, each question as its head and rows.
        prefix_ids = self._prefix_ids([requests[i].state for i in live])
        plan = self._plan([requests[i] for i in live])
        head_len = np.fromiter(map(len, plan.heads), dtype=np.int64, count=len(plan.heads))
        row_len = np.fromiter(map(len, plan.ids), dtype=np.int64, count=len(plan.ids))
        # 2. A request whose state, a question's head and its longest row do not fit the
        #    model's positions fails alone.
        prefix_len = np.fromiter(map(len, prefix_ids), dtype=np.int64, count=len(prefix_ids))
        question_len = head_len.copy()
        np.maximum.at(question_len, plan.question_of, row_len + head_len[plan.question_of])
        longest = np.zeros(len(live), dtype=np.int64)
        np.maximum.at(longest, plan.owner, question_len)
        ok = prefix_len + longest <= self.max_len
        for k in np.flatnonzero(~ok):
            results[live[k]] = too_long(self.spec.name, "state and question", int(prefix_len[k] + longest[k]),
                                        self.max_len, "tokens")
        # 3. Each distinct state once, per LoRA adapter (its weights read it): from the cache
        #    of earlier batches, else one forward. Kept under the attachment's peft name,
        #    which no later attachment reuses: a detached adapter's states are never read again.
        adapters = [self.loras.peft_name(self.lora_of(requests[i])) for i in live]
        keys = [a.encode() + b"\0" + np.asarray(p, dtype=np.int64).tobytes() for a, p in zip(adapters, prefix_ids)]
        distinct: dict[bytes, int] = {}
        state_of = np.array([distinct.setdefault(key, len(distinct)) for key in keys], dtype=np.int64)
        first_of = {s: k for k, s in reversed(list(enumerate(state_of.tolist())))}
        slot_of = np.array([self.loras.bank.slot[adapters[first_of[s]]] for s in range(len(distinct))],
                           dtype=np.int64)
        caches: list[Any] = [self.prefixes.get(key) for key in distinct]
        todo = [s for s in range(len(caches)) if caches[s] is None and ok[first_of[s]]]
        if todo:
            yield from self._run_prefixes([prefix_ids[first_of[s]] for s in todo], todo, caches, slot_of[todo], ctx)
            for s in todo:
                self.prefixes.put(keys[first_of[s]], caches[s])
        # 4. The questions of the requests that fit, packed by state, in micro-batches.
        scores = np.zeros(len(plan.ids), dtype=np.float64)
        label_logits = np.zeros((len(plan.ids), max(1, len(self.label_ids))), dtype=np.float64)
        which = np.flatnonzero(ok[plan.owner]) if len(plan.owner) else plan.owner
        yield from self._run_rows(plan, state_of[plan.owner], which, caches, slot_of, scores, label_logits, ctx)
        # 5. Probabilities per question, then per request (at its temperatures: its LoRA
        #    adapter's own calibration, else the model's); tokens read: the state once, each
        #    head, each row.
        tables = [self.temperatures_for(requests[i]) for i in live]
        probs = self._combine(plan, scores, label_logits, [requests[i].raw for i in live], [t for t, _ in tables])
        used = prefix_len.copy()
        np.add.at(used, plan.owner, head_len)
        np.add.at(used, plan.owner[plan.question_of], row_len)
        for k, i in enumerate(live):
            if ok[k]:
                results[i] = DecideResult(probs[k].astype("<f8").tobytes(), int(used[k]), tables[k][1])
        return results

    def temperatures_for(self, req: DecideRequest) -> tuple[dict[str, float], str]:
        """(the temperatures `req` is answered at, the model they are the calibration of):
        its LoRA adapter's own when it has one, else this model's; ({}, ""): none, 1.0."""
        lora = self.lora_of(req)
        if lora is not None and (own := self.loras.attached[lora].extra.get("decide_temperatures")):
            return own, lora
        table = decide_temperatures(self.spec)
        return table, self.spec.name if table else ""

    def _prefix_ids(self, states: list[str]) -> list[list[int]]:
        texts = [self.frame.head + INTRO + s + "\n\n" for s in states]
        return self.tokenizer(texts, add_special_tokens=not self.frame.templated)["input_ids"] if texts else []

    def _plan(self, requests: list[DecideRequest]) -> Plan:
        """Every question's head and rows as token ids. A question of up to
        `len(labels)` options has two label rows (its options listed in order, then
        reversed); one of more has a likelihood row per option (after a head that ends
        with the cue); one with a single option has none (its answer is certain)."""
        heads: list[str] = []
        texts: list[str] = []
        owner: list[int] = []
        question_of: list[int] = []
        options: list[int] = []
        questions: list[tuple[str, int, int, bool]] = []
        n_labels = len(self.labels)
        tail = self.frame.tail
        for k, req in enumerate(requests):
            for q in req.questions:
                n = len(q.options)
                labelled = n <= n_labels or n <= 1
                qi = len(questions)
                questions.append((q.kind, len(texts), n, labelled))
                owner.append(k)
                if n <= 1:
                    heads.append("")
                elif labelled:
                    heads.append(f"Question: {q.text}\n")
                    for order in (q.options, q.options[::-1]):
                        listed = "".join(f"{c.strip()}. {o}\n" for c, o in zip(self.labels, order))
                        texts.append(f"{listed}{tail}{self.label_cue}")
                        question_of.append(qi)
                else:
                    heads.append(f"Question: {q.text}\n{tail}{self.frame.cue}")
                    for name in q.names:
                        options.append(len(texts))
                        texts.append(" " + name)
                        question_of.append(qi)
        tokenize = self.tokenizer
        head_ids = tokenize(heads, add_special_tokens=False)["input_ids"] if heads else []
        ids = tokenize(texts, add_special_tokens=False)["input_ids"] if texts else []
        keep = np.zeros(len(texts), dtype=np.int64)
        keep[options] = [len(ids[j]) for j in options]
        return Plan(head_ids, questions, np.asarray(owner, dtype=np.int64), ids,
                    np.asarray(question_of, dtype=np.int64), keep, [len(r.questions) for r in requests])

    def _run_prefixes(self, prefixes: list[list[int]], slots: list[int], caches: list[Any], loras: np.ndarray,
                      ctx: BatchContext):
        """Forward the states (right-padded, so every row's first column is real and no
        query attends to nothing), each with its LoRA bank slot (`loras`), in
        micro-batches; each state's cache is a copy of its row's keys and values cut to
        its length."""
        torch = self._torch
        lengths = np.fromiter(map(len, prefixes), dtype=np.int64, count=len(prefixes))
        step = max(1, min(self.micro_items(ctx), ROW_CACHE_BYTES // max(1, int(lengths.max()) * self._kv_bytes())))
        for idx in micro_batches_by_count(lengths, step):
            yield
            width = int(lengths[idx].max())
            ids = np.full((len(idx), width), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for r, j in enumerate(idx):
                ids[r, : lengths[j]] = prefixes[j]
                mask[r, : lengths[j]] = 1
            with torch.inference_mode(), self.loras.rows(loras[idx], self.device):
                out = self.model(input_ids=torch.from_numpy(ids).to(self.device),
                                 attention_mask=torch.from_numpy(mask).to(self.device), use_cache=True,
                                 logits_to_keep=1)
                layers = plain_layers(getattr(out, self.cache_kw))
                if not self.kv_token_bytes:
                    self.kv_token_bytes = sum(k.element_size() * k.shape[1] * k.shape[3] * 2 for k, _ in layers)
                for r, j in enumerate(idx):
                    n = int(lengths[j])
                    # Copies: a view would hold the whole micro-batch's cache while the state is kept.
                    caches[slots[j]] = [(k[r : r + 1, :, :n].clone(), v[r : r + 1, :, :n].clone()) for k, v in layers]

    def _kv_bytes(self) -> int:
        return self.kv_token_bytes or 1

    def _run_rows(self, plan: Plan, state: np.ndarray, which: np.ndarray, caches: list[Any], loras: np.ndarray,
                  scores: np.ndarray, label_logits: np.ndarray, ctx: BatchContext):
        """Forward the questions `which` on their states' caches (`state`: per question;
        `loras`: per state, its LoRA bank slot).
        A state's questions are packed end to end into one sequence (`PackBuilder`):
        the state's keys are held once per sequence, not once per row, and a question's
        head once for all its rows. Label rows give the label logits at their last
        token, likelihood rows the summed log-probability of their option's tokens."""
        torch = self._torch
        if not len(which):
            return
        prefix_len = np.array([c[0][0].shape[2] if c is not None else 0 for c in caches], dtype=np.int64)
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        label_ids = torch.tensor(self.label_ids or [0], dtype=torch.long, device=self.device)
        for batch in self._packs(plan, state, which, prefix_len, vocab, ctx):
            yield
            # 1. Inputs: each pack's state right-padded to the widest, then the pack.
            used, local = np.unique([pk.state for pk in batch], return_inverse=True)
            p_width = int(prefix_len[used].max())
            q_width = max(len(pk.ids) for pk in batch)
            ids = np.full((len(batch), q_width), self.pad_id, dtype=np.int64)
            positions = np.zeros((len(batch), q_width), dtype=np.int64)
            allowed = np.zeros((len(batch), q_width, p_width + q_width), dtype=bool)
            q = np.arange(q_width)
            for b, pk in enumerate(batch):
                n = len(pk.ids)
                ids[b, :n] = pk.ids
                # A token sees the state, its question's head and its own segment up to
                # itself; padding sees the state and itself.
                seg = np.concatenate([pk.seg, q[n:]])
                lo = np.concatenate([pk.head_lo, np.zeros(q_width - n, dtype=np.int64)])
                hi = np.concatenate([pk.head_hi, np.zeros(q_width - n, dtype=np.int64)])
                allowed[b, :, : prefix_len[pk.state]] = True
                allowed[b, :, p_width:] = (((q[None, :] >= seg[:, None]) & (q[None, :] <= q[:, None]))
                                           | ((q[None, :] >= lo[:, None]) & (q[None, :] < hi[:, None])))
                positions[b] = prefix_len[pk.state] + np.concatenate([pk.offset, np.zeros(q_width - n, np.int64)])
            # 2. The positions whose next-token logits are read, shared by the batch's packs.
            keep = np.unique(np.concatenate([pk.reads() for pk in batch]))
            slots = loras[[pk.state for pk in batch]]
            with torch.inference_mode(), self.loras.rows(slots, self.device):
                if self.bool_mask:
                    mask = torch.from_numpy(allowed)
                else:
                    mask = torch.zeros(allowed.shape, dtype=self.model.dtype)
                    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(self.model.dtype).min)
                cache = gathered([caches[s] for s in used], p_width, torch.from_numpy(local).to(self.device))
                out = self.model(input_ids=torch.from_numpy(ids).to(self.device),
                                 attention_mask=mask[:, None].to(self.device),
                                 position_ids=torch.from_numpy(positions).to(self.device), use_cache=True,
                                 logits_to_keep=torch.from_numpy(keep).to(self.device), **{self.cache_kw: cache})
                logits = out.logits.float()
                for b, pk in enumerate(batch):
                    if pk.label_rows:
                        at = torch.from_numpy(np.searchsorted(keep, pk.label_at)).to(self.device)
                        label_logits[pk.label_rows] = logits[b, at][:, label_ids].double().cpu().numpy()
                    if pk.option_rows:
                        at = torch.from_numpy(np.searchsorted(keep, pk.option_at)).to(self.device)
                        token = torch.tensor(pk.option_tokens, device=self.device)
                        picked = torch.log_softmax(logits[b, at], dim=-1).gather(-1, token[:, None])[:, 0]
                        scores[pk.option_rows] = np.add.reduceat(picked.double().cpu().numpy(), pk.option_first)

    def _packs(self, plan: Plan, state: np.ndarray, which: np.ndarray, prefix_len: np.ndarray, vocab: int,
               ctx: BatchContext):
        """The questions `which` as packs (a state's questions end to end, at most
        PACK_TOKENS tokens and `micro_items` rows; a question too long for one pack
        repeats its head in the next), in micro-batches of at most `micro_items` rows
        whose gathered caches and kept logits fit ROW_CACHE_BYTES and LOGIT_BYTES."""
        step = self.micro_items(ctx)
        rows_of = np.split(np.argsort(plan.question_of, kind="stable"),
                           np.cumsum(np.bincount(plan.question_of, minlength=len(plan.heads)))[:-1])
        # A state's questions in packs of about equal length (no pack padded far past its own).
        tokens = np.fromiter(map(len, plan.heads), dtype=np.int64, count=len(plan.heads))
        np.add.at(tokens, plan.question_of, np.fromiter(map(len, plan.ids), dtype=np.int64, count=len(plan.ids)))
        per_state = np.bincount(state[which], weights=tokens[which], minlength=int(state.max(initial=0)) + 1)
        limit = np.ceil(per_state / np.maximum(1, np.ceil(per_state / PACK_TOKENS))).astype(np.int64)
        packs: list[PackBuilder] = []
        pack: PackBuilder | None = None
        for qi in which[np.argsort(state[which], kind="stable")]:
            head = plan.heads[qi]
            for r in rows_of[qi]:
                row = plan.ids[r]
                if pack is None or pack.state != state[qi] or pack.rows >= step or (
                        len(pack.ids) + len(row) + (len(head) if pack.head[0] != qi else 0) > limit[state[qi]]):
                    pack = PackBuilder(int(state[qi]))
                    packs.append(pack)
                if pack.head[0] != qi:
                    pack.add_head(int(qi), head)
                pack.add_row(int(r), row, int(plan.keep[r]))
        batch: list[PackBuilder] = []
        for pk in packs:
            grown = [*batch, pk]
            width = int(prefix_len[[x.state for x in grown]].max()) + max(len(x.ids) for x in grown)
            reads = len(np.unique(np.concatenate([x.reads() for x in grown])))
            if batch and (sum(x.rows for x in grown) > step or len(grown) * width * self._kv_bytes() > ROW_CACHE_BYTES
                          or len(grown) * reads * vocab * 8 > LOGIT_BYTES):
                yield batch
                grown = [pk]
            batch = grown
        if batch:
            yield batch

    def _combine(self, plan: Plan, scores: np.ndarray, label_logits: np.ndarray, raw: list[bool],
                 tables: list[dict[str, float]]) -> list[np.ndarray]:
        """Per live request, its questions' probabilities laid end to end, at its
        temperatures (`tables`); for a `raw` request their scores before any temperature
        (fleet.decisions.DecideRequest)."""
        flat: list[np.ndarray] = []
        raw_of = np.repeat(np.asarray(raw, dtype=bool), plan.per_request)
        for (kind, first, n, labelled), as_raw, owner in zip(plan.questions, raw_of.tolist(), plan.owner.tolist()):
            temperatures = tables[owner]
            if as_raw:
                if labelled:
                    flat.append(np.concatenate([label_logits[first, :n], label_logits[first + 1, :n][::-1]]))
                else:
                    flat.append(np.tile(scores[first : first + n], 2))
                continue
            if n <= 1:
                flat.append(np.ones(n))
                continue
            t = float(temperatures.get(temperature_key(kind, n), 1.0))
            if labelled:
                forward = softmax(label_logits[first, :n] / t)
                backward = softmax(label_logits[first + 1, :n] / t)[::-1]
                flat.append((forward + backward) / 2)
            else:
                flat.append(softmax(scores[first : first + n] / t))
        ends = np.cumsum(plan.per_request)
        return [np.concatenate(flat[e - c : e]) if c else np.zeros(0) for c, e in zip(plan.per_request, ends)]


def probe_decision(adapter: Any) -> None:
    """One decision at load (kernels chosen now, not in the first client's latency); a
    model that cannot answer it is refused."""
    from fleet.decisions import DecideQuestion

    probe = DecideRequest(adapter.spec.name, "hello", [
        DecideQuestion("noul", "Is this a greeting?", ["Yes", "No"], ["Yes", "No"]),
        DecideQuestion("choice", "It is about", ["red", "green", "blue"], ["red", "green", "blue"])])
    res = run_through(adapter.batch([probe], BatchContext()))[0]
    if isinstance(res, WorkError):
        raise ModelLoadFailed(f"{adapter.spec.name!r}: a probe decision failed: {res.message}")


def load_causal_lm(spec: Any, dtype: Any) -> Any:
    """The model with SDPA attention (the packs' mask as booleans), else as its config
    says (a model without SDPA: eager, with an additive mask)."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(local_files_only=True, trust_remote_code=spec.trust_remote_code, use_safetensors=True, dtype=dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(str(spec.path), attn_implementation="sdpa", **kwargs)
    except ValueError:  # "does not support an attention implementation through torch.nn.functional.sdpa"
        return AutoModelForCausalLM.from_pretrained(str(spec.path), **kwargs)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def too_long(model: str, what: str, size: int, limit: int, unit: str) -> WorkError:
    return WorkError("input_too_long", f"the {what} come to {size} {unit}; {model} reads at most {limit} {unit} "
                                       "per question: send a shorter state")


def micro_batches_by_count(lengths: np.ndarray, step: int):
    order = np.argsort(lengths, kind="stable")
    for a in range(0, len(order), step):
        yield order[a : a + step]
