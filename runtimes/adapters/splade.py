"""SPLADE sparse embeddings (task `embed`, runtime `splade`): a masked-LM head's
logits turned into one weight per vocabulary term.

    w[v] = max over real tokens t of log(1 + relu(logits[t, v]))

(SPLADE v2 / SPLADE++ "max" pooling; padding positions are masked out). The
reply lists the non-zero terms per input (`{indices, values}`), or the `top_k`
largest when the request asks. log1p and relu are monotonic, so the max is
taken over the masked logits first and log1p(relu(.)) applied to (n, V) once,
not to (n, t, V).

Any `AutoModelForMaskedLM` folder (BERT, DistilBERT, ...) loads; nothing in the
folder says "SPLADE", so `fleetctl pull` never guesses it: pull with
`--runtime splade` (and `--task embed`) or name it in the catalog.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from fleet.protocol import EmbedRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps
from fleet.runtimes.adapters.batching import (
    flat_inputs, no_prompts, offsets, sorted_cuts, split_refused, text_only, too_long,
)
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, choose_dtype, footprint_bytes, load_transformers, max_length, min_cosine, to_device,
)
from fleet.runtimes.adapters.tokenizing import DirectTokenizer, direct_tokenizer
from fleet.messages import SparseEmbedResult, SparseVec, WorkError

#: A reduced dtype is kept when every check text's (unit-scaled) term vector
#: keeps this cosine to fp32: the ranking a sparse index computes is a dot product.
MIN_COSINE = 0.999
#: Logit elements (rows x tokens x vocabulary) one forward pass may produce:
#: 64M float32 = 256 MiB. The (n, t, V) logits dwarf the encoder's activations,
#: so micro-batches are cut to this, not only to `micro_batch_items`.
MAX_LOGIT_ELEMENTS = 64 << 20


class SpladeEmbedder(Adapter):
    request_type = EmbedRequest
    #: The tokenizer's Rust tokenizer called directly, checked at load to give
    #: what the tokenizer gives (None: the tokenizer's own call).
    direct: DirectTokenizer | None = None

    def load(self) -> None:
        import torch

        self._torch = torch
        model, self.tokenizer = load_transformers(self.spec, self.device, "AutoModelForMaskedLM")
        self.max_seq_len = max_length(self.spec, self.tokenizer, model.config)
        self.direct = direct_tokenizer(self.tokenizer, self.max_seq_len, self._own_features, self.spec.name,
                                       lengths=self._own_lengths)
        self.vocab = int(model.config.vocab_size)
        self.model, self.dtype = choose_dtype(
            model, name=self.spec.name, wanted=self.spec.profile.dtype, device=self.device,
            run=lambda m: unit_rows(self._weights_with(m, CHECK_SET)), agree=min_cosine(MIN_COSINE),
            kept_in=self.spec.path,
        )
        self._weights_with(self.model, CHECK_SET)  # warm-up: first-shape kernel choice paid at load

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def refuse(self, req: EmbedRequest) -> WorkError | None:
        if req.output != "sparse":
            return WorkError("bad_request", f"{self.spec.name} is a SPLADE model: it gives sparse vectors only "
                                            "(send output 'sparse')")
        if refused := text_only(self.spec.name, req.inputs) or no_prompts(self.spec.name, self.spec.runtime, req):
            return refused
        return None if req.truncate else too_long(self.spec.name, req.inputs, self.max_seq_len, self._lengths)

    def batch(self, requests: list[EmbedRequest], ctx: BatchContext) -> Steps:
        # 1. Requests this model cannot answer fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        texts, counts = flat_inputs(requests, live, self.max_seq_len)
        # 2. Term weights of every text, micro-batched by length, with each
        #    request's top_k applied per row.
        top_k = np.repeat(np.fromiter((requests[i].top_k or 0 for i in live), dtype=np.int64, count=len(live)),
                          counts)
        vectors, tokens = yield from self._sparse(texts, top_k, ctx=ctx)
        # 3. One result per request.
        starts, ends = offsets(counts)
        for k, i in enumerate(live):
            a, b = int(starts[k]), int(ends[k])
            results[i] = SparseEmbedResult(vectors[a:b], self.vocab, int(tokens[a:b].sum()))
        return results

    def _lengths(self, inputs: list[str]) -> Sequence[int]:
        """Tokens per input with the special tokens, not truncated."""
        return self.direct.lengths(inputs) if self.direct is not None else self._own_lengths(inputs)

    def _own_lengths(self, inputs: list[str]) -> list[int]:
        # verbose=False: counting a text over the limit is the point here, not a reason to warn.
        return self.tokenizer(inputs, truncation=False, return_length=True, verbose=False)["length"]

    def _own_features(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_len, return_tensors="pt")

    def _weights_with(self, model: Any, texts: list[str]) -> np.ndarray:
        """Dense (n, V) float32 term weights (the dtype check compares these)."""
        out = np.empty((len(texts), self.vocab), dtype=np.float32)
        with self._torch.inference_mode():
            groups, tokenize = self._groups(texts, BatchContext())
            for group in groups:
                for idx, weights, _ in self._passes(model, tokenize(group), group):
                    out[idx] = weights.float().cpu().numpy()
        return out

    def _groups(self, texts: list[str], ctx: BatchContext,
                ) -> tuple[list[np.ndarray], Callable[[np.ndarray], dict[str, Any]]]:
        """Input indices per micro-batch of the batch of `ctx`, shortest texts first,
        and what tokenizes one (`batching.sorted_cuts`: by tokens on a CPU with the
        direct tokenizer)."""
        return sorted_cuts(texts, self.micro_items(ctx), self.fixed_tokens, self.direct,
                           self.direct or self._own_features)

    def _passes(self, model: Any, enc: dict[str, Any], group: np.ndarray,
                ) -> Iterator[tuple[np.ndarray, Any, np.ndarray]]:
        """(input indices, (b, V) weights on the device, tokens per input) per forward
        pass of micro-batch `group` (input indices; `enc`: its host token tensors): as
        many rows a pass as keep its logits within MAX_LOGIT_ELEMENTS."""
        torch = self._torch
        rows = max(1, MAX_LOGIT_ELEMENTS // (enc["input_ids"].shape[1] * self.vocab))
        for lo in range(0, len(group), rows):
            part = {k: v[lo : lo + rows] for k, v in enc.items()}
            mask = part["attention_mask"]
            width = int(mask.sum(dim=1).max())  # drop padding columns no row of this slice needs
            part = to_device({k: v[:, :width] for k, v in part.items()}, self.device)
            logits = model(**part).logits
            logits = logits.masked_fill(~part["attention_mask"].bool().unsqueeze(-1), float("-inf"))
            weights = torch.log1p(torch.relu(logits.amax(dim=1)))
            yield group[lo : lo + rows], weights, mask.sum(dim=1).numpy()

    def _sparse(self, texts: list[str], top_k: np.ndarray, *, ctx: BatchContext,
                ) -> Generator[None, None, tuple[list[SparseVec], np.ndarray]]:
        """Per text its non-zero terms (ascending ids) cut to its top_k (0 = all), and
        tokens used. Texts run in length-sorted micro-batches, the generator yielding
        before each (the worker's step loop decides there whether the rest is wanted:
        `Adapter.batch`), outside inference mode (a thread-local switch another
        batch's steps may flip between)."""
        torch = self._torch
        vectors: list[Any] = [None] * len(texts)
        tokens = np.empty(len(texts), dtype=np.int64)
        groups, tokenize = self._groups(texts, ctx)
        for group in groups:
            yield
            with torch.inference_mode():
                for idx, weights, used in self._passes(self.model, tokenize(group), group):
                    tokens[idx] = used
                    weights = weights.float()
                    ks = top_k[idx]
                    for k in np.unique(ks[ks > 0]):
                        # Rows with the same k: keep their k largest in one topk call.
                        rows = torch.from_numpy(np.flatnonzero(ks == k)).to(weights.device)
                        sub = weights[rows]
                        kept = torch.zeros_like(sub).scatter_(1, sub.topk(min(int(k), self.vocab), dim=1).indices, 1.0)
                        weights[rows] = sub * kept
                    w = weights.cpu().numpy()
                    # Row-major nonzero: ids come out ascending within each row.
                    r, c = np.nonzero(w)
                    bounds = np.searchsorted(r, np.arange(len(idx) + 1))
                    values = w[r, c]
                    ids = c.astype("<i4")
                    for j, target in enumerate(idx):
                        lo, hi = bounds[j], bounds[j + 1]
                        vectors[int(target)] = SparseVec(ids[lo:hi].tobytes(), values[lo:hi].astype("<f4").tobytes())
        return vectors, tokens

    def unload(self) -> None:
        self.direct = None
        self.model = None


def unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
