"""Token classification / NER (task `extract`, runtime `transformers`).

Entity spans are aggregated the way transformers' token-classification
pipeline does with `aggregation_strategy="simple"`: every non-special token
takes its argmax label (softmax score); adjacent tokens with the same entity
type join one span unless a token starts a new one (`B-`); a span's score is
the mean of its tokens' scores, its type the first token's label without the
`B-`/`I-` prefix; spans of type `O` are dropped. Offsets come from the fast
tokenizer's offset mapping: characters into the text as sent (Python str
indices), so `text[start:end]` is the span.

LoRA adapters of the model (runtimes.lora) run in the same batches, each row
with its own; an adapter that trained its own head tags with its own labels
(its folder's `config.json` `id2label`, else the base's when the widths
agree, else `LABEL_<i>`). The label tables of every attached adapter are laid
end to end (`tag_tables` over all of them), so a token's label id is its
row's offset plus its argmax.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import nullcontext
from typing import Any

import numpy as np

from fleet.errors import ModelLoadFailed
from fleet.protocol import ExtractRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import flat_inputs, micro_batches, split_refused, too_long
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, choose_dtype, footprint_bytes, labels_agree, load_transformers, max_length, to_device,
)
from fleet.messages import EntitySpan, ExtractResult, WorkError
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.adapters import traced


def tag_tables(labels: list[str]) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Per label id: (group key id, starts a span?, entity name, is outside?).

    The group key is the label without `B-`/`I-` (a label without either
    continues like `I-`); the entity name strips everything up to the first
    `-`, as the pipeline names groups; `O` is the outside label.
    """
    keys: dict[str, int] = {}
    group = np.empty(len(labels), dtype=np.int64)
    begins = np.zeros(len(labels), dtype=bool)
    for i, label in enumerate(labels):
        if label.startswith(("B-", "I-")):
            begins[i] = label.startswith("B-")
            key = label[2:]
        else:
            key = label
        group[i] = keys.setdefault(key, len(keys))
    names = [label.split("-", 1)[-1] for label in labels]
    outside = np.array([name == "O" for name in names], dtype=bool)
    return group, begins, names, outside


def group_spans(rows: np.ndarray, label: np.ndarray, score: np.ndarray, group: np.ndarray,
                begins: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans over tokens flattened in row-major order (one row per text).

    Returns (first token, last token, mean score) per span, in token order. A
    span starts at a row's first token, where the group key changes, or at a
    `B-` token.
    """
    m = len(rows)
    if m == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, np.empty(0, dtype=np.float32)
    key = group[label]
    new = np.ones(m, dtype=bool)
    new[1:] = (rows[1:] != rows[:-1]) | (key[1:] != key[:-1]) | begins[label[1:]]
    first = np.flatnonzero(new)
    last = np.append(first[1:], m) - 1
    mean = np.add.reduceat(score, first) / (last - first + 1)
    return first, last, mean.astype(np.float32)


#: Features the tokenizer gives for spans, not the model's inputs.
SPAN_KEYS = ("offset_mapping", "special_tokens_mask")


class TokenClassifier(LoraHost, Adapter):
    request_type = ExtractRequest
    #: The model's forward as a traced graph on the CPU (runtimes/adapters/traced.py); None: eager.
    compiled: traced.TracedForward | None = None
    #: Why the CPU forward is traced or not (`fleetctl ps`; None: not tried).
    traced_why: str | None = None

    def load(self) -> None:
        import torch

        self._torch = torch
        model, self.tokenizer = load_transformers(self.spec, self.device, "AutoModelForTokenClassification")
        if not getattr(self.tokenizer, "is_fast", False):
            raise ModelLoadFailed(
                f"{self.spec.name!r} has no fast tokenizer (tokenizer.json): entity offsets need one"
            )
        config = model.config
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        self._set_tables([self.labels])
        self.max_seq_len = max_length(self.spec, self.tokenizer, config)
        self.model, self.dtype = choose_dtype(
            model, name=self.spec.name, wanted=self.spec.profile.dtype, device=self.device,
            run=self._check_probs, agree=labels_agree(max_prob_diff=0.02), kept_in=self.spec.path,
        )
        self.loras = Loras(self.spec.name, self.model, self.spec.profile.max_loras)
        if self.device == "cpu":
            self.compiled, self.traced_why = traced.trace_probed(
                torch, self.spec.name, [self.model], lambda held, f: held[0](**f).logits,
                lambda texts: model_inputs(self._features(texts)), list(CHECK_SET),
                traced.long_text(CHECK_SET, self.max_seq_len), self.max_seq_len, kept_in=self.spec.path,
                what="token-logits")
        run_through(self._extract(CHECK_SET, ctx=BatchContext()))  # warm-up: pay kernel selection at load

    def _set_tables(self, label_sets: list[list[str]]) -> None:
        """The tag tables of every bank slot's labels laid end to end; `offset[slot]`
        is where the slot's label ids start."""
        self.label_sets = label_sets
        self.offset = np.cumsum([0, *map(len, label_sets[:-1])]).astype(np.int64)
        self.group, self.begins, self.names, self.outside = tag_tables([lab for s in label_sets for lab in s])

    def loras_changed(self) -> None:
        for slot, adapter in enumerate(self.loras.by_slot):
            if adapter is not None and adapter.info is None:
                adapter.info = self._adapter_labels(slot)
        self._set_tables([self.labels, *(a.info for a in self.loras.by_slot[1:])])

    def _adapter_labels(self, slot: int) -> list[str]:
        """The labels of the rows of bank slot `slot`: a probe forward says how many
        outputs its head gives."""
        adapter = self.loras.adapter_at(slot)
        if adapter is None:
            return self.labels
        with self._torch.inference_mode():
            width = int(self._logits(self.model, self._features(CHECK_SET[:1]), np.array([slot])).shape[-1])
        own = adapter.config.get("id2label") or {}
        if len(own) == width:
            return [str(own.get(str(i), own.get(i))) for i in range(width)]
        return self.labels if width == len(self.labels) else [f"LABEL_{i}" for i in range(width)]

    def _check_probs(self, model: Any) -> np.ndarray:
        """Label probabilities (tokens, labels) of every real token of the check set."""
        torch = self._torch
        with torch.inference_mode():
            features = self._features(CHECK_SET)
            probs = torch.softmax(self._logits(model, features), dim=-1)
            real = features["attention_mask"].bool() & ~features["special_tokens_mask"].bool()
        return probs[real].cpu().numpy()

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model) + self.lora_bytes()

    def batch(self, requests: list[ExtractRequest], ctx: BatchContext) -> Steps:
        # 1. Requests this model cannot serve as asked fail alone.
        results, live = split_refused(requests, self._refusal)
        if not live:
            return results
        texts, counts = flat_inputs(requests, live, self.max_seq_len)
        # 2. All texts together in length-sorted micro-batches, each row with its LoRA
        #    adapter (bank slot); spans per text.
        spans, tokens = yield from self._extract(texts, self.row_slots(requests, live, counts), ctx=ctx)
        # 3. Split back per request.
        at = 0
        for i in live:
            n = len(requests[i].inputs)
            results[i] = ExtractResult(spans[at : at + n], int(tokens[at : at + n].sum()))
            at += n
        return results

    def _refusal(self, req: ExtractRequest) -> WorkError | None:
        if req.labels is not None:
            base = len(self.labels)  # the base's labels lead the tables
            kinds = ", ".join(sorted({n for n, o in zip(self.names[:base], self.outside[:base]) if not o}))
            return WorkError(
                "bad_request",
                f"{self.spec.name} is a token-classification model with fixed entity types ({kinds}); "
                "`labels` (entity types chosen per request) needs a zero-shot extraction model: omit it",
            )
        return None if req.truncate else too_long(self.spec.name, req.inputs, self.max_seq_len, self._lengths)

    def _lengths(self, inputs: list[str]) -> list[int]:
        """Tokens per input with the special tokens, not truncated."""
        return self.tokenizer(inputs, truncation=False, return_length=True)["length"]

    def _features(self, texts: list[str]) -> dict[str, Any]:
        features = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_seq_len, return_tensors="pt",
            return_offsets_mapping=True, return_special_tokens_mask=True,
        )
        return to_device(features, self.device)

    def _logits(self, model: Any, features: dict[str, Any], slots: np.ndarray | None = None) -> Any:
        """Label logits (rows, tokens, labels), each row with its LoRA slot (None: the
        base alone). Rows of the base alone replay the traced graph where it takes
        them (the adapters' hooks run only eagerly)."""
        inputs = model_inputs(features)
        base = slots is None or not slots.any()
        logits = self.compiled(inputs) if base and self.compiled is not None and model is self.model else None
        if logits is None:
            with nullcontext() if base else self.loras.rows(slots, self.device):
                logits = model(**inputs).logits
        return logits.float()

    def _extract(self, texts: list[str], slots: np.ndarray | None = None, *, ctx: BatchContext,
                 ) -> Generator[None, None, tuple[list[list[EntitySpan]], np.ndarray]]:
        """Entity spans per text and tokens per text, in input order (`slots`: the
        LoRA bank slot per text, None: all the base's). Texts run in length-sorted
        micro-batches, the generator yielding before each (the worker's step loop
        decides there whether the rest is wanted: `Adapter.batch`), outside
        inference mode (a thread-local switch another batch's steps may flip between)."""
        torch = self._torch
        n = len(texts)
        spans: list[list[EntitySpan]] = [[] for _ in range(n)]
        tokens = np.empty(n, dtype=np.int64)
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=n)
        for idx in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            with torch.inference_mode():
                features = self._features([texts[j] for j in idx])
                row_slots = None if slots is None else slots[idx]
                # Softmax over the row's own labels: a narrower head's -inf columns get 0.
                score, label = torch.softmax(self._logits(self.model, features, row_slots), dim=-1).max(dim=-1)
                mask = features["attention_mask"]
                real = mask.bool() & ~features["special_tokens_mask"].bool()
                tokens[idx] = mask.sum(dim=1).cpu().numpy()
                # Real tokens of the micro-batch, flattened row-major (nonzero's order).
                rows = real.nonzero(as_tuple=True)[0].cpu().numpy()
                label_np = label[real].cpu().numpy()
                if row_slots is not None:  # per-slot label ids -> ids into the tables laid end to end
                    label_np = label_np + self.offset[row_slots[rows]]
                score_np = score[real].cpu().numpy()
                char = features["offset_mapping"][real].cpu().numpy()
                first, last, mean = group_spans(rows, label_np, score_np, self.group, self.begins)
                kind = label_np[first]
                keep = ~self.outside[kind]
                for row, lab, a, b, s in zip(rows[first[keep]].tolist(), kind[keep].tolist(),
                                             char[first[keep], 0].tolist(), char[last[keep], 1].tolist(),
                                             mean[keep].tolist()):
                    spans[int(idx[row])].append(EntitySpan(self.names[lab], a, b, s))
        return spans, tokens

    def unload(self) -> None:
        self.model = self.compiled = None


def model_inputs(features: dict[str, Any]) -> dict[str, Any]:
    """The model's inputs of a micro-batch's features (the span keys left out)."""
    return {k: v for k, v in features.items() if k not in SPAN_KEYS}
