"""LLM rerankers (task `rerank`, runtime `llm-rerank`): a causal language model
asked, in its own prompt, whether a document answers a query; the answer is
read from two next-token logits at the last position.

    score     = logit[true token] - logit[false token]      (log-odds; `raw_scores`)
    relevance = sigmoid(score)                              (the default reply)

For Qwen3-Reranker the relevance is the README's `softmax([l_no, l_yes])[1]`
(P("yes") of the two), the same number. Two prompt formats, chosen by the
model's catalog entry (`prompt_format`, default `qwen3`):

- `qwen3`: QwenLM/Qwen3-Embedding README, "Reranker Model / Transformers
  Usage": prefix + "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}"
  + suffix; the body is cut at its end to fit (the document first, then the
  query), the prefix and suffix never; tokens "yes" / "no"; the instruction
  defaults to the README's.
- `mxbai-v2`: mixedbread-ai/mxbai-rerank, `mxbai_rerank_v2.py`: a system
  prefix, "instruction: ...\\n" (only when given) "query: {query}", "\\n",
  "document: {doc}" (the query cut to 3/4 of the budget, the document to the
  rest), "\\n" + the relevance task prompt + the assistant suffix; tokens "1"
  / "0". `raw_scores` is the library's score; the default is sigmoid(score),
  not the library's `normalize=True` (a sigmoid shifted by a per-model estimate).

The entry's `default_instruction` replaces the format's, `true_token` /
`false_token` its answer tokens (vocabulary entries); the worker finds them
in `ModelSpec.extra` (runtimes/resolve.py). A request's
`instruction` replaces the default for that request; requests with different
instructions share one batch (the instruction is part of each pair's text).

Pairs are left-padded (the last column is every row's last real token) and
run in length-sorted micro-batches with `logits_to_keep=1` and no cache, so a
forward holds one row of vocabulary logits per pair, not one per token.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Generator
from typing import Any, ClassVar

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import WorkError
from fleet.protocol import RerankRequest
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import (
    cut_to_bound, input_too_long, micro_batches, over_char_bound, rank_into, split_refused,
)
from fleet.runtimes.adapters.hf_common import CHECK_SET, footprint_bytes, to_device
from fleet.runtimes.adapters.tokenizing import bare_copies, direct_refusal, features_differ, tokenize_probes

log = logging.getLogger("fleet.worker")

#: Tokens per pair (prompt included for `qwen3`; query + document for
#: `mxbai-v2`) when the catalog says nothing: both references' default,
#: never past the model's positions.
DEFAULT_MAX_TOKENS = 8192


class PromptFormat(abc.ABC):
    """How one family turns (instruction, query, document) into token ids.

    `inputs` builds each pair's text (a string, or a (first, second) pair of
    strings); `own_ids` tokenizes them as the family's reference code does,
    unpadded; `template` says how a Rust tokenizer's post-processor and
    truncation reproduce that (`PromptTokenizer`); `overflow` names the first
    pair the reference would cut.
    """

    name: ClassVar[str]
    true_token: ClassVar[str]
    false_token: ClassVar[str]
    default_instruction: ClassVar[str | None]

    def __init__(self, tokenizer: Any, max_tokens: int, model_max: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.model_max = model_max

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @abc.abstractmethod
    def inputs(self, instruction: str | None, query: str, docs: list[str]) -> list[Any]:
        """Each pair's text, in the form `own_ids` and the template take."""

    @abc.abstractmethod
    def own_ids(self, inputs: list[Any]) -> list[list[int]]:
        """Token ids of each pair by the reference's steps (before padding)."""

    @abc.abstractmethod
    def template(self) -> tuple[str, list[tuple[str, list[int]]], int, str]:
        """(template of one input, its pieces (name, ids), truncation length, strategy)."""

    @abc.abstractmethod
    def overflow(self, inputs: list[Any], plain: Any) -> tuple[str, int, int] | None:
        """(what, tokens, limit) of the first pair the reference would cut, or None.
        `plain(texts)`: token counts of bare texts, untruncated (int64 array)."""

    def fast_applies(self, inputs: list[Any], plain: Any) -> bool:
        """Does the template reproduce `own_ids` for these inputs?"""
        return True


class Qwen3Format(PromptFormat):
    """Qwen3-Reranker (QwenLM/Qwen3-Embedding README, transformers usage)."""

    name = "qwen3"
    true_token = "yes"
    false_token = "no"
    default_instruction = "Given a web search query, retrieve relevant passages that answer the query"
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

    def __init__(self, tokenizer: Any, max_tokens: int, model_max: int) -> None:
        super().__init__(tokenizer, max_tokens, model_max)
        self.prefix_ids = self.ids(self.prefix)
        self.suffix_ids = self.ids(self.suffix)
        self.body_max = max_tokens - len(self.prefix_ids) - len(self.suffix_ids)
        if self.body_max < 1:
            raise ValueError(f"max_seq_len {max_tokens} leaves no room beside the prompt's "
                             f"{len(self.prefix_ids) + len(self.suffix_ids)} tokens")

    def inputs(self, instruction: str | None, query: str, docs: list[str]) -> list[str]:
        head = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: "
        return [head + d for d in docs]

    def own_ids(self, inputs: list[str]) -> list[list[int]]:
        # The README's process_inputs: the body alone is truncated, then framed.
        bodies = self.tokenizer(inputs, add_special_tokens=False, truncation=True,
                                max_length=self.body_max)["input_ids"]
        return [self.prefix_ids + b + self.suffix_ids for b in bodies]

    def template(self) -> tuple[str, list[tuple[str, list[int]]], int, str]:
        return ("[PREFIX] $A [SUFFIX]", [("[PREFIX]", self.prefix_ids), ("[SUFFIX]", self.suffix_ids)],
                self.max_tokens, "longest_first")

    def overflow(self, inputs: list[str], plain: Any) -> tuple[str, int, int] | None:
        lengths = plain(inputs) + len(self.prefix_ids) + len(self.suffix_ids)
        return first_over(lengths, self.max_tokens, "query + document {} (with the prompt)")


class MxbaiV2Format(PromptFormat):
    """mxbai-rerank-v2 (mixedbread-ai/mxbai-rerank, mxbai_rerank_v2.py, `MxbaiRerankV2.prepare_inputs`)."""

    name = "mxbai-v2"
    true_token = "1"
    false_token = "0"
    default_instruction = None
    sep = "\n"
    task = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
            "query-document pair, carefully analyze the semantic relationship between them, then provide your "
            "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
    prefix = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
              "<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n"

    def __init__(self, tokenizer: Any, max_tokens: int, model_max: int) -> None:
        super().__init__(tokenizer, max_tokens, model_max)
        self.prefix_ids = self.ids(self.prefix)
        self.sep_ids = self.ids(self.sep)
        self.tail_ids = self.sep_ids + self.ids(self.task) + self.ids(self.suffix)
        predefined = len(self.prefix_ids) + len(self.tail_ids)
        # The library's clamp: the prompt and the pair together fit the model's positions.
        if max_tokens + predefined > model_max:
            self.max_tokens = model_max - predefined
        self.query_max = self.max_tokens * 3 // 4
        if self.query_max < 1:
            raise ValueError(f"the model's {model_max} positions leave no room beside the prompt's "
                             f"{predefined} tokens")

    def inputs(self, instruction: str | None, query: str, docs: list[str]) -> list[tuple[str, str]]:
        first = f"instruction: {instruction}{self.sep}query: {query}" if instruction else f"query: {query}"
        return [(first, f"document: {d}") for d in docs]

    def own_ids(self, inputs: list[tuple[str, str]]) -> list[list[int]]:
        # The query part is cut to 3/4 of the budget, then "\n" + the document part to the rest.
        # (The library also caps the document at model_max - query - prompt, never
        # tighter than this after its clamp of max_tokens.)
        queries = self.tokenizer([q for q, _ in inputs], add_special_tokens=False, truncation=True,
                                 max_length=self.query_max)["input_ids"]
        docs = self.tokenizer([d for _, d in inputs], add_special_tokens=False, truncation=True,
                              max_length=self.max_tokens)["input_ids"]
        return [self.prefix_ids + q + (self.sep_ids + d)[: self.max_tokens - len(q)] + self.tail_ids
                for q, d in zip(queries, docs)]

    def template(self) -> tuple[str, list[tuple[str, list[int]]], int, str]:
        # "only_second" cuts the document part to max_tokens - query - sep, as the
        # library does, given a query within query_max (`fast_applies`).
        added = len(self.prefix_ids) + len(self.sep_ids) + len(self.tail_ids)
        return ("[PREFIX] $A [SEP] $B:1 [TAIL]",
                [("[PREFIX]", self.prefix_ids), ("[SEP]", self.sep_ids), ("[TAIL]", self.tail_ids)],
                self.max_tokens - len(self.sep_ids) + added, "only_second")

    def fast_applies(self, inputs: list[tuple[str, str]], plain: Any) -> bool:
        return bool((plain(list({q for q, _ in inputs})) <= self.query_max).all())

    def overflow(self, inputs: list[tuple[str, str]], plain: Any) -> tuple[str, int, int] | None:
        queries = plain([q for q, _ in inputs])
        if (over := first_over(queries, self.query_max, "query")) is not None:
            return over
        pairs = queries + len(self.sep_ids) + plain([d for _, d in inputs])
        return first_over(pairs, self.max_tokens, "query + document {}")


def first_over(lengths: np.ndarray, limit: int, what: str) -> tuple[str, int, int] | None:
    """(what, tokens, limit) of the first length over `limit` (`what` formatted with its index), or None."""
    over = np.flatnonzero(lengths > limit)
    if not len(over):
        return None
    i = int(over[0])
    return what.format(i), int(lengths[i]), limit


FORMATS: dict[str, type[PromptFormat]] = {f.name: f for f in (Qwen3Format, MxbaiV2Format)}


class PromptTokenizer:
    """A model's Rust tokenizer with the prompt format as its post-processor: one
    `encode_batch_fast` gives framed, truncated, left-padded ids, so no pair is
    assembled in Python. Private copies (transformers re-configures its own on
    every call), each configured once and never changed after. Built only
    through `prompt_tokenizer`, which checks it against the format's `own_ids`."""

    def __init__(self, tokenizer: Any, fmt: PromptFormat) -> None:
        from tokenizers import processors

        template, pieces, max_length, strategy = fmt.template()
        specials = [{"id": name, "ids": ids, "tokens": tokenizer.convert_ids_to_tokens(ids)} for name, ids in pieces]
        pair = "$B" in template
        self._framed, self._plain = bare_copies(tokenizer)
        for copy_ in (self._framed, self._plain):
            copy_.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
        self._framed.post_processor = processors.TemplateProcessing(
            single="$A" if pair else template, pair=template if pair else "$A $B:1", special_tokens=specials)
        self._framed.enable_truncation(max_length, strategy=strategy, direction=tokenizer.truncation_side)
        self._framed.enable_padding(direction="left", pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which nothing here reads.
        self._encode_framed = getattr(self._framed, "encode_batch_fast", self._framed.encode_batch)
        self._encode_plain = getattr(self._plain, "encode_batch_fast", self._plain.encode_batch)

    def __call__(self, inputs: list[Any]) -> dict[str, Any]:
        """int64 tensors (rows, tokens): framed, truncated, left-padded to the longest."""
        import torch

        encodings = self._encode_framed(inputs)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}

    def plain(self, texts: list[str]) -> np.ndarray:
        """Token counts of bare texts (no special tokens), untruncated (int64)."""
        return np.fromiter(map(len, self._encode_plain(texts)), dtype=np.int64, count=len(texts))


def prompt_tokenizer(tokenizer: Any, fmt: PromptFormat, own: Any, name: str) -> PromptTokenizer | None:
    """A PromptTokenizer that gives exactly what `own` (the format's own steps,
    left-padded) gives, or None (said once in the log). Checked on the tokenize
    probes paired with each other (the default, an empty and another
    instruction; the long probe as document and as query), each alone and all
    in one batch: the pairs the template applies to (`fast_applies`)."""
    why = direct_refusal(tokenizer)
    fast = None
    if why is None:
        probes = tokenize_probes(fmt.max_tokens)
        inputs = [*fmt.inputs(fmt.default_instruction, probes[1], probes), *fmt.inputs("", probes[-1], probes[:3])]
        inputs += [x for i, q in enumerate(probes) for x in fmt.inputs("Find the answer", q, [probes[i - 1]])]
        try:
            fast = PromptTokenizer(tokenizer, fmt)
            usable = [x for x in inputs if fmt.fast_applies([x], fast.plain)]
            why = next(filter(None, (features_differ(own(batch), fast(batch))
                                     for batch in [*([x] for x in usable), usable])), None)
        except Exception as exc:  # a tokenizer this copy cannot mirror
            why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        log.info("prompt tokenizer %s: off (%s); framing pairs in Python", name, why)
        return None
    log.info("prompt tokenizer %s: on (%d probe pairs agree)", name, len(usable))
    return fast


def left_padded(rows: list[list[int]], pad_id: int) -> dict[str, Any]:
    """int64 tensors (rows, longest) of id lists, padded on the left."""
    import torch

    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = row
            mask[i, width - len(row):] = 1
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


class LlmReranker(Adapter):
    request_type = RerankRequest

    #: The prompt format as a Rust post-processor (None: framed by `own_ids` in Python).
    fast: PromptTokenizer | None = None

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        extra = self.spec.extra
        fmt_name = extra.get("prompt_format") or Qwen3Format.name
        if fmt_name not in FORMATS:
            raise ModelLoadFailed(f"{self.spec.name!r}: unknown prompt_format {fmt_name!r} "
                                  f"(known: {', '.join(FORMATS)})")
        self.dtype = causal_lm_dtype(self)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(self.spec.path), local_files_only=True, trust_remote_code=self.spec.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                str(self.spec.path), local_files_only=True, trust_remote_code=self.spec.trust_remote_code,
                use_safetensors=True, dtype=getattr(torch, self.dtype))
        except FleetError:
            raise
        except Exception as exc:  # the library raises many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r} as a causal LM: {exc}") from exc
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # as the MTEB wrapper of Qwen3-Reranker does
        self.tokenizer = tokenizer
        self.model = model.to(self.device).eval()
        positions = int(getattr(model.config, "max_position_embeddings", 0) or DEFAULT_MAX_TOKENS)
        max_tokens = min(int(self.spec.max_seq_len or DEFAULT_MAX_TOKENS), positions)
        try:
            self.fmt = FORMATS[fmt_name](tokenizer, max_tokens, positions)
        except ValueError as exc:
            raise ModelLoadFailed(f"{self.spec.name!r}: {exc}") from exc
        self.max_seq_len = self.fmt.max_tokens
        own = extra.get("default_instruction")
        self.instruction = self.fmt.default_instruction if own is None else own
        self.answer_ids = [self._token_id(extra.get(key) or default) for key, default in
                           (("false_token", self.fmt.false_token), ("true_token", self.fmt.true_token))]
        self.fast = prompt_tokenizer(tokenizer, self.fmt, self._own_features, self.spec.name)
        # Warm-up at load, not in the first client's latency (kernel selection per shape).
        run_through(self._score(self.fmt.inputs(self.instruction, CHECK_SET[1], CHECK_SET), ctx=BatchContext()))

    def _token_id(self, token: str) -> int:
        """The vocabulary id of an answer token (as Qwen's README and sentence-transformers' LogitScore read it)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        unk = self.tokenizer.unk_token
        if tid is None or (tid == self.tokenizer.unk_token_id and token != unk):
            raise ModelLoadFailed(f"{self.spec.name!r}: the answer token {token!r} is not in its vocabulary "
                                  "(set true_token / false_token in its catalog entry)")
        return int(tid)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def refuse(self, req: RerankRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        if req.truncate:
            return None
        if over := (over_char_bound(self.spec.name, [req.query], self.max_seq_len, "query")
                    or over_char_bound(self.spec.name, req.docs, self.max_seq_len, "document")):
            return over
        inputs = self.fmt.inputs(self._instruction(req), req.query, req.docs)
        over = self.fmt.overflow(inputs, self._plain)
        return None if over is None else input_too_long(self.spec.name, *over)

    def _instruction(self, req: RerankRequest) -> str | None:
        return self.instruction if req.instruction is None else req.instruction

    def batch(self, requests: list[RerankRequest], ctx: BatchContext) -> Steps:
        # 1. Requests that refuse truncation and have a pair over the limit fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        # 2. Every pair of the batch in one list, each framed with its request's instruction.
        inputs: list[Any] = []
        for i in live:
            req = requests[i]
            (query,) = cut_to_bound([req.query], self.max_seq_len)
            inputs.extend(self.fmt.inputs(self._instruction(req), query, cut_to_bound(req.docs, self.max_seq_len)))
        counts = np.fromiter((len(requests[i].docs) for i in live), dtype=np.int64, count=len(live))
        # 3. Score them together, length-sorted into micro-batches.
        logits, tokens = yield from self._score(inputs, ctx=ctx)
        # 4. Per request: log-odds or their sigmoid, best first, cut to top_n.
        rank_into(results, requests, live, counts, logits, 1.0 / (1.0 + np.exp(-logits)), tokens)
        return results

    def _own_features(self, inputs: list[Any]) -> dict[str, Any]:
        return left_padded(self.fmt.own_ids(inputs), self.tokenizer.pad_token_id)

    def _plain(self, texts: list[str]) -> np.ndarray:
        """Token counts of bare texts, untruncated (int64)."""
        if self.fast is not None:
            return self.fast.plain(texts)
        # verbose=False: counting a text over the limit is the point here, not a reason to warn.
        lengths = self.tokenizer(texts, add_special_tokens=False, return_length=True, verbose=False)["length"]
        return np.asarray(lengths, dtype=np.int64)

    def _features(self, inputs: list[Any]) -> dict[str, Any]:
        if self.fast is not None and self.fmt.fast_applies(inputs, self.fast.plain):
            return self.fast(inputs)
        return self._own_features(inputs)

    def _score(self, inputs: list[Any], *, ctx: BatchContext) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """(log-odds float32, tokens read int64) per pair, in input order. Pairs run
        in length-sorted micro-batches, the generator yielding before each (the
        worker's step loop decides there whether the rest is wanted: `Adapter.batch`),
        outside inference mode (a thread-local switch another batch's steps may flip
        between)."""
        torch = self._torch
        n = len(inputs)
        logits = np.empty(n, dtype=np.float32)
        tokens = np.empty(n, dtype=np.int64)
        lengths = np.fromiter((len(x) if x.__class__ is str else len(x[0]) + len(x[1]) for x in inputs),
                              dtype=np.int64, count=n)
        for idx in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            with torch.inference_mode():
                features = self._features([inputs[j] for j in idx])
                tokens[idx] = features["attention_mask"].sum(dim=1).numpy()
                features = to_device(features, self.device)
                # Left padding: column -1 is every row's last real token. Upcast before
                # the difference (MTEB's wrapper does: bf16 logits tie).
                last = self.model(**features, use_cache=False, logits_to_keep=1).logits[:, -1, self.answer_ids]
                last = last.float()
                logits[idx] = (last[:, 1] - last[:, 0]).cpu().numpy()
        return logits, tokens

    def unload(self) -> None:
        self.fast = None
        self.model = None
