"""sentence-transformers embedding adapter (task `embed`)."""

from __future__ import annotations

import copy
import logging
from itertools import chain
from typing import Any

import numpy as np

from fleetctl.errors import FleetError, ModelLoadFailed
from fleetctl.protocol import EmbedRequest
from runtimes.base import Adapter
from runtimes.device import fast_dtypes
from runtimes.messages import EmbedResult, WorkError

log = logging.getLogger("fleet.worker")

#: Texts used at load to check that a reduced-precision dtype keeps the answers:
#: varied lengths and topics, so a dtype that only works on short inputs fails.
CHECK_SET = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Invoices must be paid within thirty days of receipt unless agreed otherwise in writing.",
    "GPU memory is managed per device: pinned models stay resident, others are evicted LRU.",
    "¿Dónde está la biblioteca? Está al lado del museo de historia natural.",
    "def add(a, b):\n    return a + b",
    "Patient presented with mild fever, cough and fatigue for three days; no travel history.",
    "The central bank raised interest rates by 25 basis points to curb persistent inflation, "
    "citing strong labour markets and rising services prices across the euro area.",
    "a",
    "Tokyo, Paris, Nairobi, Lima and Sydney are capitals or major cities on five continents.",
    "Reranking improves retrieval quality by scoring each query-document pair jointly.",
    "Error 0x80070005: access is denied when writing to the configuration directory.",
]

#: A dtype is kept only if every check-set row stays this close to fp32 (cosine).
MIN_COSINE = 0.9999


class SentenceTransformerEmbedder(Adapter):
    request_type = EmbedRequest

    def load(self) -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize

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
        self.model = self._choose_dtype(model)
        # A trailing Normalize module is applied by us, per request (normalize=false
        # returns the pooled vector); everything before it runs as the model says.
        modules = list(self.model)
        if modules and isinstance(modules[-1], Normalize):
            modules = modules[:-1]
        self._modules = modules
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        # Warm-up: the first forward of each shape pays kernel selection (oneDNN,
        # cuBLAS); pay it at load, not in the first client's latency.
        self._embed(CHECK_SET)

    def _choose_dtype(self, model: Any) -> Any:
        torch = self._torch
        wanted = self.spec.profile.dtype
        if wanted not in ("auto", "float32"):
            self.dtype = wanted
            return model.to(getattr(torch, wanted))
        if wanted == "float32":
            return model
        reference = self._encode_with(model, CHECK_SET)
        for name in fast_dtypes(self.device):
            candidate = copy.deepcopy(model).to(getattr(torch, name))
            got = self._encode_with(candidate, CHECK_SET)
            cosine = float(np.min(np.sum(got * reference, axis=1)))
            log.info("dtype check %s %s: min cosine %.6f", self.spec.name, name, cosine)
            if cosine >= MIN_COSINE:
                self.dtype = name
                return candidate
        return model

    def _encode_with(self, model: Any, texts: list[str]) -> np.ndarray:
        """Unit vectors from a full forward (the check compares directions)."""
        torch = self._torch
        with torch.inference_mode():
            features = model.preprocess(texts)
            features = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in features.items()}
            emb = model.forward(features)["sentence_embedding"].float()
            emb = torch.nn.functional.normalize(emb, dim=1)
        return emb.cpu().numpy()

    def footprint_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in chain(self.model.parameters(), self.model.buffers()))

    def estimate_tokens(self, request: EmbedRequest) -> int:
        return sum(len(t) for t in request.inputs) // 4 + 2 * len(request.inputs)

    def run_batch(self, requests: list[EmbedRequest]) -> list[Any]:
        # 1. Requests that refuse truncation and have an input over the limit fail alone.
        results: list[Any] = [None] * len(requests)
        live = []
        for i, req in enumerate(requests):
            too_long = None if req.truncate else self._first_too_long(req.inputs)
            if too_long is not None:
                results[i] = WorkError(
                    "input_too_long",
                    f"input {too_long[0]} has {too_long[1]} tokens; {self.spec.name} takes at most "
                    f"{self.max_seq_len} (send truncate=true to cut it)",
                )
            else:
                live.append(i)
        if not live:
            return results
        texts = list(chain.from_iterable(requests[i].inputs for i in live))
        counts = np.fromiter((len(requests[i].inputs) for i in live), dtype=np.int64, count=len(live))
        # 2. Embed all texts of the batch together, length-sorted into micro-batches.
        vectors, tokens = self._embed(texts)
        # 3. Normalise (per request) and split back, one result per request.
        ends = np.cumsum(counts)
        starts = ends - counts
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
        lengths = self.tokenizer(inputs, add_special_tokens=True, truncation=False, return_length=True)["length"]
        for index, n in enumerate(lengths):
            if n > self.max_seq_len:
                return index, int(n)
        return None

    def _embed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """float32 vectors (n, d) in input order, and tokens used per text."""
        torch = self._torch
        n = len(texts)
        order = np.argsort(np.fromiter((len(t) for t in texts), dtype=np.int64, count=n), kind="stable")
        out = np.empty((n, self.dim), dtype=np.float32)
        tokens = np.empty(n, dtype=np.int64)
        step = max(1, self.spec.profile.micro_batch_items)
        with torch.inference_mode():
            for lo in range(0, n, step):
                idx = order[lo : lo + step]
                features = self.model.preprocess([texts[j] for j in idx])
                features = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in features.items()}
                for module in self._modules:
                    features = module(features)
                out[idx] = features["sentence_embedding"].float().cpu().numpy()
                tokens[idx] = features["attention_mask"].sum(dim=1).cpu().numpy()
        return out, tokens

    def unload(self) -> None:
        self.model = None
        self._modules = []
