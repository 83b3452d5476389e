"""sentence-transformers embedding adapter (task `embed`).

LoRA adapters of the model (runtimes.lora) attach to its transformers module
(the first module's `auto_model`) and run in the same batches, each text with
its request's adapter; a micro-batch with adapter rows runs eagerly (the CUDA
graphs hold the base's forward).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, nullcontext
from typing import Any

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.protocol import EmbedRequest
from runtimes.base import Adapter
from runtimes.hf_common import (
    CHECK_SET, DirectTokenizer, GraphedForward, choose_dtype, cut_to_bound, direct_tokenizer, first_too_long,
    footprint_bytes, input_too_long, micro_batches, min_cosine, offsets, over_char_bound, pinned, prefetched,
    split_refused, to_device,
)
from fleet.messages import EmbedResult, TokenEmbedResult, WorkError
from runtimes.lora import Loras, LoraHost

log = logging.getLogger("fleet.worker")

#: A dtype is kept only if every check-set row stays this close to fp32 (cosine).
MIN_COSINE = 0.9999


class SentenceTransformerEmbedder(LoraHost, Adapter):
    request_type = EmbedRequest

    #: The thread that tokenizes the next micro-batch while the current one runs
    #: (None: tokenize in turn, e.g. to compare).
    tokenize_ahead: ThreadPoolExecutor | None = None
    #: CUDA graphs of the small micro-batch shapes (CUDA only; None elsewhere or when the check failed).
    graphs: GraphedForward | None = None
    #: The model's Rust tokenizer called directly, checked at load to give what
    #: `model.preprocess` gives (None: preprocess, e.g. a module that works in Python).
    direct: DirectTokenizer | None = None

    def load(self) -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Transformer

        try:
            model = SentenceTransformer(
                str(self.spec.path),
                device=self.device,
                trust_remote_code=self.spec.trust_remote_code,
                local_files_only=True,
            )
        except FleetError:
            raise
        except Exception as exc:  # the library raises many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r}: {exc}") from exc
        model.eval()
        if self.spec.max_seq_len:
            model.max_seq_length = self.spec.max_seq_len
        self.max_seq_len = int(model.max_seq_length)
        self.tokenizer = model.tokenizer
        self._torch = torch
        self.model, self.dtype = choose_dtype(
            model, name=self.spec.name, wanted=self.spec.profile.dtype, device=self.device,
            run=lambda m: self._encode_with(m, CHECK_SET), agree=min_cosine(MIN_COSINE),
        )
        # A trailing Normalize module is applied by us, per request (normalize=false
        # returns the pooled vector); everything before it runs as the model says.
        modules = list(self.model)
        if modules and isinstance(modules[-1], Normalize):
            modules = modules[:-1]
        self._modules = modules
        if modules and isinstance(modules[0], Transformer):
            self.direct = direct_tokenizer(self.model.tokenizer, self.max_seq_len, self.model.preprocess,
                                           self.spec.name, lengths=self._own_lengths)
        else:
            log.info("direct tokenizer %s: off (the first module is %s); tokenizing through the model's own code",
                     self.spec.name, type(modules[0]).__name__ if modules else "none")
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.tokenize_ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{self.spec.name}")
        if self.device.startswith("cuda"):
            with torch.inference_mode():
                graphs = GraphedForward(self._pooled, self.model.preprocess(CHECK_SET), self.device,
                                        self.max_seq_len, min_cosine(MIN_COSINE), self.spec.name)
            self.graphs = graphs if graphs.graphs else None
        target = getattr(modules[0], "auto_model", None) if modules else None
        self.loras = None if target is None else Loras(self.spec.name, target, self.spec.profile.max_loras)
        # Warm-up: the first forward of each shape pays kernel selection (oneDNN,
        # cuBLAS); pay it at load, not in the first client's latency.
        self._embed(CHECK_SET)

    def _encode_with(self, model: Any, texts: list[str]) -> np.ndarray:
        """Unit vectors from a full forward (the check compares directions)."""
        torch = self._torch
        with torch.inference_mode():
            features = model.preprocess(texts)
            features = to_device(features, self.device)
            emb = model.forward(features)["sentence_embedding"].float()
            emb = torch.nn.functional.normalize(emb, dim=1)
        return emb.cpu().numpy()

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model) + self.lora_bytes()

    def refuse(self, req: EmbedRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        if req.output == "sparse":
            return WorkError("bad_request", f"{self.spec.name} gives dense or per-token vectors; output 'sparse' "
                                            "needs a SPLADE model (runtime splade)")
        if any(x.__class__ is not str for x in req.inputs):
            return WorkError("bad_request", f"{self.spec.name} embeds text only; images need an image model "
                                            "(runtime clip)")
        if not req.truncate and (over := over_char_bound(self.spec.name, req.inputs, self.max_seq_len)):
            return over
        too_long = None if req.truncate else self._first_too_long(req.inputs)
        if too_long is not None:
            return input_too_long(self.spec.name, f"input {too_long[0]}", too_long[1], self.max_seq_len)
        return None

    def run_batch(self, requests: list[EmbedRequest]) -> list[Any]:
        # 1. Requests this model cannot answer (images, sparse, too long with
        #    truncate=false) fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        texts = cut_to_bound([t for i in live for t in requests[i].inputs], self.max_seq_len)
        counts = np.fromiter((len(requests[i].inputs) for i in live), dtype=np.int64, count=len(live))
        # Per-token output is rare: the common batch builds no mask for it (each numpy
        # call costs tens of us on a cold CPU, the case of a lone client's request).
        wants = [requests[i].output == "tokens" for i in live]
        want_tokens = np.repeat(np.array(wants), counts) if any(wants) else None
        # 2. Embed all texts of the batch together, length-sorted into micro-batches,
        #    each text with its request's LoRA adapter (bank slot).
        vectors, tokens, per_token = self._embed(texts, want_tokens, self.row_slots(requests, live, counts))
        # 3. Normalise (per request) and split back, one result per request.
        starts, ends = offsets(counts)
        if per_token:
            self._split_tokens(requests, live, starts, ends, per_token, tokens, results)
            live = [i for i in live if requests[i].output != "tokens"]
            if not live:
                return results
            keep = ~want_tokens
            vectors, tokens = vectors[keep], tokens[keep]
            counts = np.fromiter((len(requests[i].inputs) for i in live), dtype=np.int64, count=len(live))
            starts, ends = offsets(counts)
        want_norm = np.repeat(np.fromiter((requests[i].normalize for i in live), dtype=bool), counts)
        if want_norm.any():
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            np.maximum(norms, 1e-12, out=norms)
            vectors = np.where(want_norm[:, None], vectors / norms, vectors)
        token_sums = np.add.reduceat(tokens, starts) if len(texts) else tokens
        for k, i in enumerate(live):
            a, b = int(starts[k]), int(ends[k])
            results[i] = EmbedResult(vectors[a:b].tobytes(), (b - a, self.dim), int(token_sums[k]))
        return results

    def _first_too_long(self, inputs: list[str]) -> tuple[int, int] | None:
        lengths = self.direct.lengths(inputs) if self.direct is not None else self._own_lengths(inputs)
        return first_too_long(lengths, self.max_seq_len)

    def _own_lengths(self, inputs: list[str]) -> list[int]:
        """Tokens per input with the special tokens, not truncated, by the model's tokenizer."""
        # verbose=False: counting a text over the limit is the point here, not a reason to warn.
        return self.tokenizer(inputs, add_special_tokens=True, truncation=False, return_length=True,
                              verbose=False)["length"]

    def _split_tokens(self, requests: list[EmbedRequest], live: list[int], starts: np.ndarray, ends: np.ndarray,
                      per_token: dict[int, np.ndarray], tokens: np.ndarray, results: list[Any]) -> None:
        """One TokenEmbedResult per `output: "tokens"` request: each input's
        (t_i, d) block, cut to unit rows when the request normalises."""
        for k, i in enumerate(live):
            req = requests[i]
            if req.output != "tokens":
                continue
            a, b = int(starts[k]), int(ends[k])
            blocks = [per_token[j] for j in range(a, b)]
            if req.normalize:
                blocks = [m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12) for m in blocks]
            results[i] = TokenEmbedResult([m.astype("<f4", copy=False).tobytes() for m in blocks],
                                          [m.shape for m in blocks], int(tokens[a:b].sum()))

    def _pooled(self, features: dict[str, Any]) -> Any:
        """The pooled (rows, d) vectors of token tensors already on the device."""
        for module in self._modules:
            features = module(features)
        return features["sentence_embedding"]

    def _tokenized(self, texts: list[str]) -> dict[str, Any]:
        """Host token tensors of one micro-batch, padded to its longest text (pinned on CUDA)."""
        return pinned((self.direct or self.model.preprocess)(texts), self.device)

    def _embed(self, texts: list[str], want_tokens: np.ndarray | None = None, slots: np.ndarray | None = None,
               ) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """float32 vectors (n, d) in input order, tokens used per text, and for
        the inputs flagged in `want_tokens` their token vectors (t_i, d) without
        padding (right-padded rows: the first `mask.sum()` positions are real).

        1. Length-sorted micro-batches (`micro_batches`): each is padded only to
           its own longest text.
        2. The `tokenize_ahead` thread tokenizes micro-batch k+1 while k runs.
        3. Each micro-batch runs by CUDA-graph replay when a captured shape holds
           it, else eagerly; on CUDA its vectors come back by an async copy and
           the batch synchronises once at the end, not once per micro-batch.
        """
        torch = self._torch
        n = len(texts)
        tokens = np.empty(n, dtype=np.int64)
        per_token: dict[int, np.ndarray] = {}
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=n)
        batches = list(micro_batches(lengths, self.spec.profile.micro_batch_items))
        out = np.empty((n, self.dim), dtype=np.float32)
        cuda = self.device.startswith("cuda")
        # CUDA: vectors land in pinned host memory in sorted order by async copies,
        # synchronised once at the end; CPU: scattered straight into `out`.
        landing = torch.empty((n, self.dim), dtype=torch.float32, pin_memory=True) if cuda else None
        lo = 0
        with torch.inference_mode(), closing(prefetched(
                batches, lambda idx: self._tokenized([texts[j] for j in idx]), self.tokenize_ahead)) as ready:
            for idx, host in ready:
                tokenized = time.monotonic_ns()
                used = host["attention_mask"].sum(dim=1).numpy()
                tokens[idx] = used
                wants = want_tokens is not None and bool(want_tokens[idx].any())
                lora_rows = slots[idx] if slots is not None and slots[idx].any() else None
                emb = None if wants or lora_rows is not None or self.graphs is None else self.graphs(host)
                if emb is None:
                    features = to_device(host, self.device)
                    with self.loras.rows(lora_rows, self.device) if lora_rows is not None else nullcontext():
                        for module in self._modules:
                            features = module(features)
                    emb = features["sentence_embedding"]
                forward = time.monotonic_ns()
                if landing is not None:
                    landing[lo : lo + len(idx)].copy_(emb.float(), non_blocking=True)
                    lo += len(idx)
                else:
                    out[idx] = emb.float().numpy()
                self.marks = (tokenized, forward, time.monotonic_ns())
                if wants:
                    rows = np.flatnonzero(want_tokens[idx])
                    block = features["token_embeddings"][torch.from_numpy(rows).to(self.device)].float().cpu().numpy()
                    for r, m in zip(rows, block):
                        per_token[int(idx[r])] = m[: int(used[r])]
        if landing is not None and n:
            torch.cuda.current_stream(self.device).synchronize()
            out[np.concatenate(batches)] = landing.numpy()
        return out, tokens, per_token

    def unload(self) -> None:
        if self.tokenize_ahead is not None:
            self.tokenize_ahead.shutdown(wait=True)
        self.tokenize_ahead = None
        self.graphs = None
        self.direct = None
        self.model = None
        self._modules = []
