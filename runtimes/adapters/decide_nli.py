"""Typed decisions from an NLI cross-encoder (task `decide`, runtime `nli`): a
sequence classifier whose labels include entailment and contradiction reads each
option as a hypothesis about the state, as transformers' zero-shot
classification pipeline does (its hypothesis template "{instructions} {}").

- `choice` and `score`: premise = the state, hypothesis = "<instructions> <option>"
  per option; the options' probabilities are the softmax of their entailment
  logits (the pipeline's `multi_label=False`), over the question's temperature.
- `noul`: one hypothesis, "<instructions> <yes line>" (the yes line is "Yes", or
  "Yes: <what counts as yes>"); P(yes) is softmax([contradiction, entailment])
  (the pipeline's `multi_label=True`), over the temperature.

Every (state, hypothesis) pair of the batch's requests runs in length-sorted
micro-batches; a question's pairs never see another question's, so its answer
does not depend on the others. A pair over the model's positions fails its
request (`input_too_long`): a state cut to fit would be another state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fleet.decisions import DecideRequest, DecideResult, decide_temperatures, temperature_key
from fleet.errors import ModelLoadFailed
from fleet.runtimes.base import Adapter, BatchContext, Steps
from fleet.runtimes.adapters.decide import probe_decision, softmax, too_long
from fleet.runtimes.adapters.hf_common import footprint_bytes, load_transformers, max_length, to_device
from fleet.runtimes.adapters.batching import char_bound, micro_batches


def nli_labels(id2label: dict[Any, str], name: str) -> tuple[int, int]:
    """(entailment, contradiction) label ids of a classifier's `id2label`, by name."""
    found: dict[str, int] = {}
    for i, label in (id2label or {}).items():
        low = str(label).lower()
        for key in ("entail", "contradict"):
            if low.startswith(key):
                found.setdefault(key, int(i))
    if len(found) != 2:
        raise ModelLoadFailed(f"{name!r} is no NLI model: its labels ({', '.join(map(str, (id2label or {}).values()))}) "
                              "name no entailment and contradiction")
    return found["entail"], found["contradict"]


class NliDecider(Adapter):
    request_type = DecideRequest

    def load(self) -> None:
        import torch

        self._torch = torch
        self.model, self.tokenizer = load_transformers(self.spec, self.device, "AutoModelForSequenceClassification")
        self.entail, self.contradict = nli_labels(self.model.config.id2label, self.spec.name)
        self.max_len = max_length(self.spec, self.tokenizer, self.model.config)
        probe_decision(self)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def unload(self) -> None:
        self.model = None

    def batch(self, requests: list[DecideRequest], ctx: BatchContext) -> Steps:
        torch = self._torch
        bound = char_bound(self.max_len)
        results: list[Any] = [too_long(self.spec.name, "state", len(r.state), bound, "characters")
                              if len(r.state) > bound else None for r in requests]
        live = [i for i, r in enumerate(results) if r is None]
        # 1. The pairs: (state, hypothesis) per option (one per noul), request by request.
        premises: list[str] = []
        hypotheses: list[str] = []
        owner: list[int] = []
        for k, i in enumerate(live):
            req = requests[i]
            for q in req.questions:
                lines = q.options[:1] if q.kind == "noul" else q.options
                premises.extend([req.state] * len(lines))
                hypotheses.extend(f"{q.text} {line}" for line in lines)
                owner.extend([k] * len(lines))
        logits = np.zeros((len(premises), 2), dtype=np.float64)  # (entailment, contradiction)
        tokens = np.zeros(len(premises), dtype=np.int64)
        lengths = np.fromiter((len(p) + len(h) for p, h in zip(premises, hypotheses)), dtype=np.int64,
                              count=len(premises))
        # 2. Length-sorted micro-batches, one forward each; a pair too long marks its request.
        owners = np.asarray(owner, dtype=np.int64)
        refused = np.zeros(len(live), dtype=bool)
        for idx in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            features = self.tokenizer([premises[j] for j in idx], [hypotheses[j] for j in idx], padding=True,
                                      truncation=False, return_tensors="pt", verbose=False)
            counts = features["attention_mask"].sum(dim=1).numpy()
            tokens[idx] = counts
            over = counts > self.max_len
            refused[owners[idx[over]]] = True
            keep = ~over
            if not keep.any():
                continue
            features = {k: v[torch.from_numpy(keep)] for k, v in features.items()}
            # Padded to the longest row kept: a refused row's length is past the model's positions.
            width = int(features["attention_mask"].sum(dim=1).max())
            cut = slice(-width, None) if self.tokenizer.padding_side == "left" else slice(None, width)
            features = {k: v[:, cut] for k, v in features.items()}
            with torch.inference_mode():
                out = self.model(**to_device(features, self.device)).logits.double()
            logits[idx[keep]] = out[:, [self.entail, self.contradict]].cpu().numpy()
        # 3. Per question: a softmax over its options' entailment, or entailment against contradiction.
        start = 0
        temperatures = decide_temperatures(self.spec)
        for k, i in enumerate(live):
            req = requests[i]
            if refused[k]:
                pairs = int((owners == k).sum())
                results[i] = too_long(self.spec.name, "state and hypothesis", int(tokens[owners == k].max()),
                                      self.max_len, "tokens")
                start += pairs
                continue
            probs = []
            for q in req.questions:
                n = len(q.options)
                t = float(temperatures.get(temperature_key(q.kind, n), 1.0))
                if q.kind == "noul":
                    entail, contradict = logits[start]
                    if req.raw:  # yes: entailment against contradiction, in either order alike
                        probs.append(np.tile(logits[start], 2))
                    else:
                        yes = softmax(np.array([entail, contradict]) / t)[0]
                        probs.append(np.array([yes, 1 - yes]))
                    start += 1
                else:
                    entail = logits[start : start + n, 0]
                    probs.append(np.tile(entail, 2) if req.raw else softmax(entail / t) if n > 1 else np.ones(n))
                    start += n
            results[i] = DecideResult(np.concatenate(probs).astype("<f8").tobytes(),
                                      int(tokens[owners == k].sum()))
        return results
