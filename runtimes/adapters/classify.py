"""Sequence classification (task `classify`, runtime `transformers`).

Labels are the model's own (`config.id2label`). Scores are the softmax over
labels, or a sigmoid per label for multi-label models (`config.problem_type ==
"multi_label_classification"`, or `multi_label: true` in the request);
`raw_scores: true` returns the logits. Each input's labels come back best first,
cut to `top_k`.

LoRA adapters of the model (runtimes.lora) run in the same batches, each row
with its own: an adapter that trained its own head answers with its own labels
(its folder's `config.json` `id2label` and `problem_type`, else the base's
when the widths agree, else `LABEL_<i>`); one of another width than the base
gives its rows -inf past their own width, which no row's answer includes.

Zero-shot (`candidate_labels`, on an NLI model: one whose labels include
entailment and contradiction) is transformers' zero-shot classification
pipeline: each (input, `hypothesis_template` with a label) pair runs through
the model, the premise truncated where `truncate` allows; the labels' scores are
the softmax of their entailment logits over the labels, or with `multi_label`
(or one label) softmax([contradiction, entailment]) per label; `raw_scores`
returns the entailment logits. It runs eagerly on the torch model, its pairs in
length-sorted micro-batches.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from fleet.nli import DEFAULT_HYPOTHESIS, hypotheses, nli_ids
from fleet.protocol import ClassifyRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import (
    cut_to_bound, flat_inputs, input_too_long, micro_batches, offsets, sorted_cuts, split_refused, too_long,
)
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, footprint_bytes, labels_agree, load_transformers, max_length, to_device,
)
from fleet.runtimes.adapters.tokenizing import DirectTokenizer, direct_tokenizer
from fleet.messages import ClassifyResult, WorkError
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.adapters import engines, openvino, traced


class SequenceClassifier(LoraHost, Adapter):
    request_type = ClassifyRequest
    engines = ("torch", "openvino")
    #: The torch model in fp32, kept while OpenVINO serves (what LoRA adapters
    #: attach to: `lora_bank`); None while torch serves.
    torch_model: Any = None
    #: The tokenizer's Rust tokenizer called directly, checked at load to give
    #: what the tokenizer gives (None: the tokenizer's own call).
    direct: DirectTokenizer | None = None
    #: The torch forward as a traced graph on the CPU (runtimes/adapters/traced.py); None: eager.
    compiled: traced.TracedForward | None = None
    #: Why the CPU forward is traced or not (`fleetctl ps`; None: not tried).
    traced_why: str | None = None

    def load(self) -> None:
        import torch

        self._torch = torch
        model, self.tokenizer = load_transformers(self.spec, self.device, "AutoModelForSequenceClassification")
        config = model.config
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        self.multi_label = config.problem_type == "multi_label_classification"
        #: (entailment, contradiction) label ids of an NLI model (zero-shot); None for any other.
        self.nli = nli_ids(self.labels)
        self.max_seq_len = max_length(self.spec, self.tokenizer, config)
        self.direct = direct_tokenizer(self.tokenizer, self.max_seq_len, self._own_features, self.spec.name,
                                       lengths=self._own_lengths)
        self.model = self._serve(model)
        # LoRA adapters patch torch's modules: none while OpenVINO serves (`lora_bank`).
        if self.engine == "openvino":
            self.torch_model = model
        else:
            self.loras = Loras(self.spec.name, self.model, self.spec.profile.max_loras)
        if self.device == "cpu" and self.engine == "torch":
            self.compiled, self.traced_why = self._trace()
        #: Per bank slot: (labels, multi-label?) of the rows of that adapter (slot 0: the base's).
        self.label_sets: list[tuple[list[str], bool]] = [(self.labels, self.multi_label)]
        run_through(self._logits(CHECK_SET, ctx=BatchContext()))  # warm-up: pay kernel selection at load

    def _serve(self, model: Any) -> Any:
        """What serves: torch in fp32 or a fast dtype, or OpenVINO f32 / bf16, the
        fastest whose probabilities agree with torch fp32's on the check set, timed
        on one short text and one full micro-batch (runtimes/adapters/engines.py)."""
        torch = self._torch
        n = self.spec.profile.micro_batch_items
        short = dict(self._own_features(CHECK_SET[1:2]))
        full = dict(self._own_features(engines.repeated(CHECK_SET, n)))

        def run(serving: Any, features: dict[str, Any]) -> Any:
            with torch.inference_mode():
                return serving(**features).logits

        return engines.serve(
            self, model, what="sequence-classification-logits", forward=lambda f: model(**f).logits,
            example=dict(self._own_features(CHECK_SET[:2])), stand_in=openvino.LogitsModel,
            outputs=self._check_probs, agree=labels_agree(),
            workloads=engines.short_and_full(run, short, full, "texts"))

    def _trace(self) -> tuple[traced.TracedForward | None, str]:
        """The torch model's logits traced on the CPU (runtimes/adapters/traced.py), probed as
        the embedder's forward is."""
        return traced.trace_probed(
            self._torch, self.spec.name, [self.model], lambda held, f: held[0](**f).logits,
            lambda texts: dict(self._features(texts)), list(CHECK_SET),
            traced.long_text(CHECK_SET, self.max_seq_len), self.max_seq_len, kept_in=self.spec.path,
            what="sequence-logits")

    def lora_bank(self) -> Loras | None:
        """OpenVINO chosen by measurement goes back to torch fp32 for a LoRA adapter
        (its base rows replay a traced forward, as a model torch served from the start)."""
        if not engines.back_to_torch(self):
            return None
        self.model, self.torch_model = self.torch_model, None
        if self.device == "cpu":
            self.compiled, self.traced_why = self._trace()
        return Loras(self.spec.name, self.model, self.spec.profile.max_loras)

    def _check_probs(self, model: Any) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            logits = self._forward(model, self._features(CHECK_SET))[0]
            probs = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
        return probs.cpu().numpy()

    def footprint_bytes(self) -> int:
        torch_part = footprint_bytes(self.model if self.torch_model is None else self.torch_model)
        return torch_part + openvino.weight_bytes(self.model) + self.lora_bytes()

    def loras_changed(self) -> None:
        for slot, adapter in enumerate(self.loras.by_slot):
            if adapter is not None and adapter.info is None:
                adapter.info = self._adapter_labels(slot)
        self.label_sets = [(self.labels, self.multi_label), *(a.info for a in self.loras.by_slot[1:])]

    def _adapter_labels(self, slot: int) -> tuple[list[str], bool]:
        """(labels, multi-label?) of the rows of bank slot `slot`: a probe forward
        says how many outputs its head gives."""
        adapter = self.loras.adapter_at(slot)
        if adapter is None:
            return self.labels, self.multi_label
        with self._torch.inference_mode():
            width = int(self._forward(self.model, self._features(CHECK_SET[:1]), np.array([slot]))[0].shape[1])
        own = adapter.config.get("id2label") or {}
        if len(own) == width:
            labels = [str(own.get(str(i), own.get(i))) for i in range(width)]
        elif width == len(self.labels):
            labels = self.labels
        else:
            labels = [f"LABEL_{i}" for i in range(width)]
        problem = adapter.config.get("problem_type")
        return labels, self.multi_label if problem is None else problem == "multi_label_classification"

    def refuse(self, req: ClassifyRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        return None if req.truncate else too_long(self.spec.name, req.inputs, self.max_seq_len, self._lengths)

    def batch(self, requests: list[ClassifyRequest], ctx: BatchContext) -> Steps:
        # 1. Requests that refuse truncation and have an input over the limit fail alone;
        #    zero-shot requests run their (input, hypothesis) pairs first.
        results, live = split_refused(requests, self.refuse)
        zero_shot = [i for i in live if requests[i].candidate_labels]
        if zero_shot:
            yield from self._zero_shot(requests, zero_shot, results, ctx)
            live = [i for i in live if not requests[i].candidate_labels]
        if not live:
            return results
        texts, counts = flat_inputs(requests, live, self.max_seq_len)
        # 2. All texts of the batch in length-sorted micro-batches, each row with its
        #    LoRA adapter (bank slot): logits (n, widest label set of the batch).
        slots = self.row_slots(requests, live, counts)
        request_slots = np.zeros(len(live), dtype=np.int64) if slots is None else slots[offsets(counts)[0]]
        sets = [self.label_sets[k] for k in request_slots.tolist()]
        width = max(len(labels) for labels, _ in sets)
        logits, tokens = yield from self._logits(texts, slots, width, ctx=ctx)
        # 3. Every row's scores in each form, then each row takes the one its request asked for.
        mode = np.repeat(np.fromiter((self._mode(requests[i], multi) for i, (_, multi) in zip(live, sets)),
                                     dtype=np.int8, count=len(live)), counts)
        scores = np.where((mode == 0)[:, None], logits, 0.0).astype(np.float32)
        if (mode == 1).any():
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            scores = np.where((mode == 1)[:, None], shifted / shifted.sum(axis=1, keepdims=True), scores)
        if (mode == 2).any():
            with np.errstate(over="ignore"):  # exp(-x) overflows for x < -88: the sigmoid is then 0, as it should be
                scores = np.where((mode == 2)[:, None], 1.0 / (1.0 + np.exp(-logits)), scores)
        scores = scores.astype(np.float32, copy=False)
        # 4. Labels best first (stable: equal scores keep label order, and the -inf
        #    columns past a row's own labels come last), cut per request.
        order = np.argsort(-scores, axis=1, kind="stable").astype("<i4")
        ranked = np.take_along_axis(scores, order, axis=1)
        starts, ends = offsets(counts)
        token_sums = np.add.reduceat(tokens, starts)
        for k, i in enumerate(live):
            labels = sets[k][0]
            top_k = requests[i].top_k
            keep = len(labels) if top_k is None else min(top_k, len(labels))
            a, b = int(starts[k]), int(ends[k])
            top = np.ascontiguousarray(order[a:b, :keep])
            results[i] = ClassifyResult(
                labels, top.tobytes(), np.ascontiguousarray(ranked[a:b, :keep]).tobytes(), (b - a, keep),
                int(token_sums[k]),
            )
        return results

    def _zero_shot(self, requests: list[ClassifyRequest], which: list[int], results: list[Any],
                   ctx: BatchContext) -> Generator[None, None, None]:
        """Answer the zero-shot requests `which` into `results`, as transformers'
        zero-shot classification pipeline scores them.

        1. Each request's pairs: every input with every label's hypothesis; a request
           on a model that is no NLI model, or with a pair over the model's positions
           where it refuses truncation, fails alone.
        2. All pairs in length-sorted micro-batches: their entailment and
           contradiction logits, and tokens per pair.
        3. Per request: its labels' scores per input, best first, cut to `top_k`."""
        torch = self._torch
        premises: list[str] = []
        claims: list[str] = []
        owned: list[tuple[int, int, int]] = []  # (request, first pair, inputs) per request that runs
        hyp_tokens: list[np.ndarray] = []  # per request that runs: its hypotheses' tokens, per pair
        # A hypothesis that leaves no room for the input: nothing to cut, the pair cannot run.
        room = self.max_seq_len - self.tokenizer.num_special_tokens_to_add(pair=True)
        for i in which:
            req = requests[i]
            if self.nli is None:
                results[i] = WorkError("bad_request", f"zero-shot classification needs an NLI model (labels with "
                                                      f"entailment and contradiction); {self.spec.name!r} has "
                                                      f"{', '.join(self.labels)}")
                continue
            if req.adapter:
                results[i] = WorkError("bad_request", "zero-shot classification runs on the NLI model itself: send "
                                                      "it without `adapter`")
                continue
            try:
                said = hypotheses(req.hypothesis_template or DEFAULT_HYPOTHESIS, req.candidate_labels)
            except ValueError as exc:
                results[i] = WorkError("bad_request", str(exc))
                continue
            owned.append((i, len(premises), len(req.inputs)))
            hyp_tokens.append(np.tile(self.tokenizer(said, add_special_tokens=False, return_length=True,
                                                     verbose=False)["length"], len(req.inputs)))
            # A text to be cut anyway is cut to the characters the model can read first (batching.cut_to_bound).
            premises.extend(t for t in (cut_to_bound(req.inputs, self.max_seq_len) if req.truncate else req.inputs)
                            for _ in said)
            claims.extend(said * len(req.inputs))
        if not owned:
            return
        n = len(premises)
        logits = np.zeros((n, 2), dtype=np.float64)  # (entailment, contradiction)
        tokens = np.zeros(n, dtype=np.int64)
        too_long = np.zeros(n, dtype=bool)
        hyp = np.concatenate(hyp_tokens)
        no_room = hyp >= room
        truncate = np.zeros(n, dtype=bool)
        for i, first, count in owned:
            truncate[first:first + count * len(requests[i].candidate_labels)] = requests[i].truncate
        lengths = np.fromiter((len(p) + len(c) for p, c in zip(premises, claims)), dtype=np.int64, count=n)
        model = self.torch_model if self.torch_model is not None else self.model
        entail, contradict = self.nli
        for idx in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            too_long[idx] = no_room[idx]
            keep = idx[~truncate[idx] & ~no_room[idx]]
            if keep.size:  # pairs that may not be cut: their whole length, refused past the model's positions
                whole = self.tokenizer([premises[j] for j in keep], [claims[j] for j in keep], truncation=False,
                                       return_length=True, verbose=False)["length"]
                tokens[keep] = whole
                too_long[keep] = np.asarray(whole) > self.max_seq_len
            run = idx[~too_long[idx]]
            if not run.size:
                continue
            # As the pipeline: only the premise is cut, to the model's positions.
            features = self.tokenizer([premises[j] for j in run], [claims[j] for j in run], padding=True,
                                      truncation="only_first", max_length=self.max_seq_len, return_tensors="pt")
            with torch.inference_mode():
                out = model(**to_device(features, self.device)).logits.double()
            logits[run] = out[:, [entail, contradict]].cpu().numpy()
            tokens[run] = features["attention_mask"].sum(dim=1).numpy()
        for i, first, count in owned:
            req = requests[i]
            k = len(req.candidate_labels)
            span = slice(first, first + count * k)
            if no_room[span].any():
                at = int(np.argmax(no_room[span])) + first
                results[i] = WorkError("input_too_long", f"the hypothesis {claims[at][:80]!r} has {hyp[at]} "
                                                         f"tokens: with an input it cannot fit {self.spec.name}'s "
                                                         f"{self.max_seq_len} (a shorter label or hypothesis_template)")
                continue
            if too_long[span].any():
                results[i] = input_too_long(self.spec.name, "an input with its hypothesis", int(tokens[span].max()),
                                            self.max_seq_len)
                continue
            pair = logits[span].reshape(count, k, 2)
            if req.raw_scores:
                scores = pair[:, :, 0]
            elif req.multi_label or k == 1:  # each label alone: entailment against contradiction
                with np.errstate(over="ignore"):  # exp past 88 is inf: the score is then 0, as it should be
                    scores = 1.0 / (1.0 + np.exp(pair[:, :, 1] - pair[:, :, 0]))
            else:  # the labels against each other: a softmax of their entailment logits
                shifted = np.exp(pair[:, :, 0] - pair[:, :, 0].max(axis=1, keepdims=True))
                scores = shifted / shifted.sum(axis=1, keepdims=True)
            scores = scores.astype(np.float32)
            keep = k if req.top_k is None else min(req.top_k, k)
            order = np.argsort(-scores, axis=1, kind="stable")[:, :keep].astype("<i4")
            ranked = np.take_along_axis(scores, order, axis=1)
            results[i] = ClassifyResult(list(req.candidate_labels), np.ascontiguousarray(order).tobytes(),
                                        np.ascontiguousarray(ranked).tobytes(), (count, keep), int(tokens[span].sum()))

    def _mode(self, req: ClassifyRequest, multi_label: bool) -> int:
        """0 = logits, 1 = softmax, 2 = sigmoid (`multi_label`: the model's, or its adapter's, default)."""
        if req.raw_scores:
            return 0
        multi = multi_label if req.multi_label is None else req.multi_label
        return 2 if multi else 1

    def _lengths(self, inputs: list[str]) -> Sequence[int]:
        """Tokens per input with the special tokens, not truncated."""
        return self.direct.lengths(inputs) if self.direct is not None else self._own_lengths(inputs)

    def _own_lengths(self, inputs: list[str]) -> list[int]:
        # verbose=False: counting a text over the limit is the point here, not a reason to warn.
        return self.tokenizer(inputs, truncation=False, return_length=True, verbose=False)["length"]

    def _features(self, texts: list[str]) -> Any:
        """Token tensors of one micro-batch on the device, as the model is fed them."""
        return to_device((self.direct or self._own_features)(texts), self.device)

    def _own_features(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_len, return_tensors="pt")

    def _forward(self, model: Any, features: dict[str, Any], slots: np.ndarray | None = None) -> tuple[Any, Any]:
        """(logits, tokens per text) of one micro-batch's token tensors on the device,
        each row with its LoRA slot (None: the base alone)."""
        base = slots is None or not slots.any()
        # Rows of the base alone replay the traced graph where it takes them (the adapters' hooks run only eagerly).
        logits = self.compiled(features) if base and self.compiled is not None and model is self.model else None
        if logits is None:
            with nullcontext() if base else self.loras.rows(slots, self.device):
                logits = model(**features).logits
        logits = logits.float()
        return logits, features["attention_mask"].sum(dim=1)

    def _logits(self, texts: list[str], slots: np.ndarray | None = None, width: int | None = None, *,
                ctx: BatchContext) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """float32 logits (n, width) and tokens per text, in input order; a row's
        columns past its own head's width are -inf. Texts run in length-sorted
        micro-batches, the generator yielding before each (the worker's step loop
        decides there whether the rest is wanted: `Adapter.batch`), outside
        inference mode (a thread-local switch another batch's steps may flip between)."""
        torch = self._torch
        n = len(texts)
        logits = np.full((n, width or len(self.labels)), -np.inf, dtype=np.float32)
        tokens = np.empty(n, dtype=np.int64)
        cuts, tokenize = sorted_cuts(texts, self.micro_items(ctx), self.fixed_tokens, self.direct,
                                     self.direct or self._own_features, self.row_multiple)
        for idx in cuts:
            yield
            with torch.inference_mode():
                raw, used = self._forward(self.model, to_device(tokenize(idx), self.device),
                                          None if slots is None else slots[idx])
                logits[idx, : raw.shape[1]] = raw.cpu().numpy()
                tokens[idx] = used.cpu().numpy()
        return logits, tokens

    def unload(self) -> None:
        self.direct = self.compiled = None
        self.model = self.torch_model = None
