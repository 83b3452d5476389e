"""Cross-encoder rerankers (task `rerank`): one relevance score per (query, document).

Two runtimes, one batch path:
- `transformers`: a sequence-classification model with one output
  (`num_labels == 1`), tokenised as a text pair.
- `sentence-transformers`: a `CrossEncoder` folder, run through its own
  modules (so its saved max length, activation and prompt handling apply).

Scores are what `CrossEncoder.predict` returns by default: the model's
activation applied to its logit, which is the sigmoid for a one-label model
unless the folder names another (`activation_fn` as sentence-transformers saves
it; torch activations only). `raw_scores: true` returns the logit itself.

LoRA adapters of the model (runtimes.lora) run in the same batches, each
(query, document) pair with its request's adapter; an adapter's own head must
give one output, as the base's does.
"""

from __future__ import annotations

import abc
import importlib
import logging
from collections.abc import Generator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.protocol import RerankRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import cut_to_bound, over_char_bound, rank_into, sorted_cuts, split_refused, too_long
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, footprint_bytes, load_transformers, max_length, scores_agree, to_device,
)
from fleet.runtimes.adapters.tokenizing import DirectTokenizer, direct_tokenizer
from fleet.messages import WorkError
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.adapters import engines, openvino, traced

log = logging.getLogger("fleet.worker")

#: (query, document) pairs for the dtype check and warm-up: each check text
#: against itself and three others, so related and unrelated pairs both occur.
CHECK_PAIRS = [(CHECK_SET[i], CHECK_SET[(i + k) % len(CHECK_SET)]) for k in (0, 1, 3, 7) for i in range(len(CHECK_SET))]


class CrossEncoderAdapter(LoraHost, Adapter):
    request_type = RerankRequest
    engines = ("torch", "openvino")
    #: The torch model in fp32, kept while OpenVINO serves (tokenizing config, and
    #: what LoRA adapters attach to: `lora_bank`); None while torch serves.
    torch_model: Any = None
    #: The torch forward as a traced graph on the CPU (runtimes/adapters/traced.py); None: eager.
    compiled: traced.TracedForward | None = None
    #: Why the CPU forward is traced or not (`fleetctl ps`; None: not tried).
    traced_why: str | None = None

    #: Set by `load`: tokens per pair the model takes, the tokenizer, the model,
    #: and the activation applied to logits (a tensor -> tensor callable, or None).
    max_seq_len: int
    tokenizer: Any
    model: Any
    activation: Any
    #: The tokenizer's Rust tokenizer called directly, checked at load to give
    #: what the model's own tokenization gives (None: the model's own).
    direct: DirectTokenizer | None = None

    @abc.abstractmethod
    def _forward(self, model: Any, features: dict[str, Any], base: bool = False) -> tuple[Any, Any]:
        """(logits as a float32 tensor (b,), tokens per pair (b,)) for one micro-batch's
        token tensors on the device (`base`: every pair is the base model's, no LoRA
        row: the traced forward may run)."""

    @abc.abstractmethod
    def _own_features(self, model: Any, queries: list[str], docs: list[str]) -> Any:
        """Token tensors of (query, document) pairs by the model's own code."""

    @abc.abstractmethod
    def _logits_of(self, model: Any, features: dict[str, Any]) -> Any:
        """The model's (pairs, outputs) logits of token tensors (torch or OpenVINO's stand-in)."""

    @abc.abstractmethod
    def _stand_in(self, forward: Any, model: Any) -> Any:
        """OpenVINO's compiled graph called as `_logits_of` calls the torch model."""

    @abc.abstractmethod
    def _transformers_model(self) -> Any:
        """The transformers module of the served model (LoRA adapters attach to it), or None."""

    def _model_logits(self, model: Any, features: dict[str, Any], base: bool) -> Any:
        """`_logits_of` the serving model, by its traced graph where that takes the
        features (`base`: no LoRA row; the adapters' hooks run only eagerly)."""
        out = self.compiled(features) if base and self.compiled is not None and model is self.model else None
        return self._logits_of(model, features) if out is None else out

    def _features(self, model: Any, queries: list[str], docs: list[str]) -> Any:
        """Token tensors of one micro-batch of pairs, padded to its longest pair."""
        if self.direct is not None:
            return self.direct(list(zip(queries, docs)))
        return self._own_features(model, queries, docs)

    def _finish_load(self, model: Any) -> None:
        import torch

        self._torch = torch
        self.model = self._serve(model)
        if self.engine == "openvino":
            self.torch_model = model
        self.direct = direct_tokenizer(
            self.tokenizer, self.max_seq_len, lambda pairs: self._own_features(self.model, *unzipped(pairs)),
            self.spec.name, lengths=lambda pairs: self._own_lengths(*unzipped(pairs)), pairs=True,
        )
        # LoRA adapters patch torch's modules: none while OpenVINO serves (`lora_bank`).
        target = None if self.engine == "openvino" else self._transformers_model()
        self.loras = None if target is None else Loras(self.spec.name, target, self.spec.profile.max_loras)
        if self.device == "cpu" and self.engine == "torch":
            self.compiled, self.traced_why = self._trace()
        # Warm-up at load, not in the first client's latency (kernel selection per shape).
        run_through(self._score([q for q, _ in CHECK_PAIRS], [d for _, d in CHECK_PAIRS], ctx=BatchContext()))

    def _serve(self, model: Any) -> Any:
        """What serves: torch in fp32 or a fast dtype, or OpenVINO f32 / bf16, the
        fastest whose activated scores agree with torch fp32's on the check pairs,
        timed on one short pair and one full micro-batch (runtimes/adapters/engines.py)."""
        torch = self._torch
        qs, ds = [q for q, _ in CHECK_PAIRS], [d for _, d in CHECK_PAIRS]
        n = self.spec.profile.micro_batch_items
        short = dict(self._own_features(model, qs[1:2], ds[1:2]))
        full = dict(self._own_features(model, engines.repeated(qs, n), engines.repeated(ds, n)))

        def run(serving: Any, features: dict[str, Any]) -> Any:
            with torch.inference_mode():
                return self._logits_of(serving, dict(features))

        return engines.serve(
            self, model, what="cross-encoder-logits", forward=lambda f: self._logits_of(model, f),
            example=dict(self._own_features(model, qs[:2], ds[:2])),
            stand_in=lambda forward: self._stand_in(forward, model), outputs=self._check_scores,
            agree=scores_agree(), workloads=engines.short_and_full(run, short, full, "pairs"))

    def _trace(self) -> tuple[traced.TracedForward | None, str]:
        """The torch model's logits traced on the CPU (runtimes/adapters/traced.py), probed on
        (query, document) pairs as the embedder's forward is on texts."""
        longest = traced.long_text(CHECK_SET, self.max_seq_len)
        return traced.trace_probed(
            self._torch, self.spec.name, [self.model], lambda held, f: self._logits_of(held[0], f),
            lambda pairs: dict(to_device(self._features(self.model, *unzipped(pairs)), self.device)), CHECK_PAIRS,
            (longest, longest), self.max_seq_len, kept_in=self.spec.path, what="cross-encoder-logits")

    def lora_bank(self) -> Loras | None:
        """OpenVINO chosen by measurement goes back to torch fp32 for a LoRA adapter
        (its base rows replay a traced forward, as a model torch served from the start)."""
        if not engines.back_to_torch(self):
            return None
        self.model, self.torch_model = self.torch_model, None
        if self.device == "cpu":
            self.compiled, self.traced_why = self._trace()
        target = self._transformers_model()
        return None if target is None else Loras(self.spec.name, target, self.spec.profile.max_loras)

    def _check_scores(self, model: Any) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            features = to_device(self._features(model, [q for q, _ in CHECK_PAIRS], [d for _, d in CHECK_PAIRS]),
                                 self.device)
            logits, _ = self._forward(model, features)
            scores = self.activation(logits) if self.activation is not None else logits
        return scores.cpu().numpy().copy()  # a copy: OpenVINO's output views its request's buffer

    def footprint_bytes(self) -> int:
        torch_part = footprint_bytes(self.model if self.torch_model is None else self.torch_model)
        return torch_part + openvino.weight_bytes(self.model) + self.lora_bytes()

    def loras_changed(self) -> None:
        """A new adapter must score with one output, as the base does (`_forward` checks)."""
        for slot, adapter in enumerate(self.loras.by_slot):
            if adapter is not None and adapter.info is None:
                run_through(self._score(*map(list, zip(*CHECK_PAIRS[:1])), np.array([slot]), ctx=BatchContext()))
                adapter.info = True

    def refuse(self, req: RerankRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        if req.instruction is not None:
            return WorkError("bad_request", f"{self.spec.name} is a cross-encoder: it takes no `instruction` "
                                            "(LLM rerankers, runtime llm-rerank, do)")
        if req.truncate:
            return None
        return (over_char_bound(self.spec.name, [req.query], self.max_seq_len, "query")
                or too_long(self.spec.name, req.docs, self.max_seq_len, lambda docs: self._lengths(req.query, docs),
                            "document", "query + document"))

    def batch(self, requests: list[RerankRequest], ctx: BatchContext) -> Steps:
        # 1. Requests that refuse truncation and have a pair over the limit fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        # 2. Every pair of the batch in one list: the query repeated per document.
        queries: list[str] = []
        docs: list[str] = []
        for i in live:
            req_docs = cut_to_bound(requests[i].docs, self.max_seq_len)
            queries.extend(cut_to_bound([requests[i].query], self.max_seq_len) * len(req_docs))
            docs.extend(req_docs)
        counts = np.fromiter((len(requests[i].docs) for i in live), dtype=np.int64, count=len(live))
        # 3. Score them together, length-sorted into micro-batches, each pair with its
        #    request's LoRA adapter (bank slot).
        logits, activated, tokens = yield from self._score(queries, docs, self.row_slots(requests, live, counts),
                                                           ctx=ctx)
        # 4. Per request: its scores (raw or activated), best first, cut to top_n.
        rank_into(results, requests, live, counts, logits, activated, tokens)
        return results

    def _lengths(self, query: str, docs: list[str]) -> Sequence[int]:
        """Tokens of `query` with each of `docs` as a pair, special tokens in, not truncated."""
        if self.direct is not None:
            return self.direct.lengths([(query, d) for d in docs])
        return self._own_lengths([query] * len(docs), docs)

    def _own_lengths(self, queries: list[str], docs: list[str]) -> list[int]:
        # verbose=False: counting a pair over the limit is the point here, not a reason to warn.
        return self.tokenizer(queries, docs, truncation=False, return_length=True, verbose=False)["length"]

    def _score(self, queries: list[str], docs: list[str], slots: np.ndarray | None = None, *, ctx: BatchContext,
               ) -> Generator[None, None, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(logits, activated scores, tokens) per pair, float32 / float32 / int64, in
        input order (`slots`: the LoRA bank slot per pair; None: all the base's).
        Pairs run in length-sorted micro-batches, the generator yielding before
        each (the worker's step loop decides there whether the rest is wanted:
        `Adapter.batch`), outside inference mode (a thread-local switch another
        batch's steps may flip between)."""
        torch = self._torch
        n = len(docs)
        logits = np.empty(n, dtype=np.float32)
        activated = np.empty(n, dtype=np.float32)
        tokens = np.empty(n, dtype=np.int64)
        cuts, tokenize = sorted_cuts(list(zip(queries, docs)), self.micro_items(ctx), self.fixed_tokens, self.direct,
                                     self.direct or (lambda pairs: self._own_features(self.model, *unzipped(pairs))),
                                     self.row_multiple)
        for idx in cuts:
            yield
            with torch.inference_mode():
                rows = None if slots is None else slots[idx]
                rows = rows if rows is not None and rows.any() else None
                features = to_device(tokenize(idx), self.device)
                with self.loras.rows(rows, self.device) if rows is not None else nullcontext():
                    raw, used = self._forward(self.model, features, base=rows is None)
                logits[idx] = raw.cpu().numpy()
                activated[idx] = (self.activation(raw) if self.activation is not None else raw).cpu().numpy()
                tokens[idx] = used.cpu().numpy()
        return logits, activated, tokens

    def unload(self) -> None:
        self.direct = self.compiled = None
        self.model = self.torch_model = None


class TransformersReranker(CrossEncoderAdapter):
    """A transformers `*ForSequenceClassification` with one output, fed (query, document) pairs."""

    def load(self) -> None:
        model, tokenizer = load_transformers(self.spec, self.device, "AutoModelForSequenceClassification")
        if model.config.num_labels != 1:
            raise ModelLoadFailed(
                f"{self.spec.name!r} has {model.config.num_labels} labels; a reranker has one relevance output "
                "(pull it with --task classify to serve its labels)"
            )
        self.tokenizer = tokenizer
        self.max_seq_len = max_length(self.spec, tokenizer, model.config)
        self.activation = config_activation(model.config, self.spec.path, self.spec.name)
        self._finish_load(model)

    def _own_features(self, model: Any, queries: list[str], docs: list[str]) -> Any:
        return self.tokenizer(queries, docs, padding=True, truncation="longest_first", max_length=self.max_seq_len,
                              return_tensors="pt")

    def _transformers_model(self) -> Any:
        return self.model

    def _logits_of(self, model: Any, features: dict[str, Any]) -> Any:
        return model(**features).logits

    def _stand_in(self, forward: Any, model: Any) -> Any:
        return openvino.LogitsModel(forward)

    def _forward(self, model: Any, features: dict[str, Any], base: bool = False) -> tuple[Any, Any]:
        # Upcast before the activation (as CrossEncoder does): reduced-precision ties break in fp32.
        logits = self._model_logits(model, features, base).float()
        return one_score(logits, self.spec.name), features["attention_mask"].sum(dim=1)


class SentenceTransformersReranker(CrossEncoderAdapter):
    """A sentence-transformers `CrossEncoder`, run through its own modules."""

    def load(self) -> None:
        from sentence_transformers import CrossEncoder

        try:
            model = CrossEncoder(
                str(self.spec.path), device=self.device, trust_remote_code=self.spec.trust_remote_code,
                local_files_only=True, max_length=self.spec.max_seq_len,
            )
        except FleetError:
            raise
        except Exception as exc:  # the library raises many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r} as a CrossEncoder: {exc}") from exc
        if model.num_labels != 1:
            raise ModelLoadFailed(
                f"{self.spec.name!r} has {model.num_labels} labels; a reranker has one relevance output"
            )
        model.eval()
        self.tokenizer = model.tokenizer
        self.max_seq_len = int(model.max_length)
        self.activation = model.activation_fn
        self._finish_load(model)

    def _own_features(self, model: Any, queries: list[str], docs: list[str]) -> Any:
        return model.preprocess(list(zip(queries, docs)))

    def _transformers_model(self) -> Any:
        return getattr(self.model[0], "auto_model", None)

    def _logits_of(self, model: Any, features: dict[str, Any]) -> Any:
        return model(features)["scores"]

    def _stand_in(self, forward: Any, model: Any) -> Any:
        return openvino.ScoresModel(forward, model)

    def _forward(self, model: Any, features: dict[str, Any], base: bool = False) -> tuple[Any, Any]:
        mask = features["attention_mask"]
        scores = self._model_logits(model, features, base).float()
        return one_score(scores.reshape(mask.shape[0], -1), self.spec.name), mask.sum(dim=1)


def one_score(logits: Any, name: str) -> Any:
    """The (pairs,) relevance logits of a (pairs, outputs) tensor with one output
    (a LoRA adapter's own head must keep to one, as the base's)."""
    if logits.shape[1] != 1:
        raise ModelLoadFailed(f"{name}: a LoRA adapter's head gives {logits.shape[1]} outputs; a reranker gives one")
    return logits[:, 0]


def unzipped(pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(queries, documents) of (query, document) pairs."""
    return [q for q, _ in pairs], [d for _, d in pairs]


def config_activation(config: Any, folder: Path, name: str) -> Any:
    """The activation a CrossEncoder would apply to this model's logit.

    A folder saved by sentence-transformers may name one, as a dotted path in
    `config_sentence_transformers.json` (v5+) or in config.json's
    `sentence_transformers` table (v4). Only torch's own classes are imported
    (no model code runs). Otherwise the sigmoid, CrossEncoder's default for
    one-label models.
    """
    import torch

    path = None
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        try:
            path = msgspec.json.decode(st_config.read_bytes()).get("activation_fn")
        except (msgspec.DecodeError, AttributeError) as exc:
            raise ModelLoadFailed(f"{name!r}: unreadable {st_config.name}: {exc}") from exc
    if path is None:
        saved = getattr(config, "sentence_transformers", None)
        path = saved.get("activation_fn") if isinstance(saved, dict) else None
    if path:
        module, _, cls = str(path).rpartition(".")
        if module == "torch" or module.startswith("torch."):
            return getattr(importlib.import_module(module), cls)()
        log.warning("%s: ignoring activation %r (not a torch class); using the sigmoid", name, path)
    return torch.sigmoid

