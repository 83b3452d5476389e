"""BGE-M3 (task `embed`, runtime `bge-m3`): dense, sparse and multi-vector
embeddings of one XLM-RoBERTa forward, as FlagEmbedding's M3 model computes them
(FlagOpen/FlagEmbedding, `finetune/embedder/encoder_only/m3/modeling.py` and
`inference/embedder/encoder_only/m3.py`). With H the last hidden states:

- `dense`:  H[:, 0] (the CLS position); `normalize` makes it unit length;
  `dimensions` and `output_dtype` as for every dense embedder (runtimes.adapters.dense).
- `sparse`: relu(sparse_linear(H)), one weight per token; per input, each
  vocabulary id's largest weight over its positions, without the CLS, EOS,
  padding and unknown tokens and without zero weights (FlagEmbedding's
  `lexical_weights`, keyed by id); ids ascending, or the `top_k` largest.
- `tokens`: colbert_linear(H[:, 1:]), one vector per token after CLS (EOS
  kept, padding cut off); `normalize` makes each unit length (ColBERT scoring).

A prompt (`prompt`, or `prompt_name` from the folder's sentence-transformers
config or the catalog; bge-m3 ships none) goes before each text and is
embedded with it, for every output (as FlagEmbedding's query instruction is).

The two heads ship as `sparse_linear.pt` and `colbert_linear.pt`: torch
pickles of a Linear's state dict. They are read with `torch.load(...,
weights_only=True)` only, torch's restricted unpickler that builds tensors and
plain containers and refuses any other global (no code runs), then checked to
be exactly a weight and a bias of the expected shapes. They are not converted
at pull: pulls run in the API process, which never imports torch.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fleet.errors import ModelLoadFailed
from fleet.messages import SparseEmbedResult, SparseVec, TokenEmbedResult, WorkError
from fleet.prompts import folder_prompts, prompt_table
from fleet.protocol import EmbedRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import (
    flat_inputs, offsets, prompt_of, sorted_cuts, split_refused,
)
from fleet.runtimes.adapters.dense import dense_refusal, finish_dense
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, Agreement, choose_dtype, footprint_bytes, load_transformers, max_length, to_device,
)
from fleet.runtimes.adapters.tokenizing import DirectTokenizer, direct_tokenizer

#: The head files of a bge-m3 folder, next to config.json (fleet.pull keeps them).
SPARSE_HEAD = "sparse_linear.pt"
COLBERT_HEAD = "colbert_linear.pt"
#: A reduced dtype is kept when every check row (dense vector, token vector,
#: token weights) keeps this cosine to fp32.
MIN_COSINE = 0.9999
#: Per text: which output its request asked for.
DENSE, SPARSE, TOKENS = 0, 1, 2
OUTPUTS = {"dense": DENSE, "sparse": SPARSE, "tokens": TOKENS}


def load_head(folder: Path, file: str, hidden: int, name: str, *, rows: int | None = None) -> Any:
    """A torch Linear from a head file, read with the weights-only unpickler.

    The file must hold exactly {"weight": (out, hidden), "bias": (out,)}
    (`rows`: the out size it must have)."""
    import torch

    path = folder / file
    if not path.is_file():
        raise ModelLoadFailed(f"{name!r} has no {file}: a bge-m3 model ships {SPARSE_HEAD} and {COLBERT_HEAD}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights-only refusal, truncated or foreign file: all are "not a head"
        raise ModelLoadFailed(f"{name!r}: {file} is not a weights-only tensor file ({type(exc).__name__})") from exc
    weight = state.get("weight") if isinstance(state, dict) else None
    bias = state.get("bias") if isinstance(state, dict) else None
    if (set(state) if isinstance(state, dict) else None) != {"weight", "bias"} \
            or not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor) \
            or weight.dim() != 2 or weight.shape[1] != hidden or tuple(bias.shape) != (weight.shape[0],) \
            or (rows is not None and weight.shape[0] != rows):
        want = f"({rows if rows is not None else 'n'}, {hidden})"
        raise ModelLoadFailed(f"{name!r}: {file} is not a linear head over the model's {hidden} hidden units "
                              f"(a weight {want} and its bias)")
    linear = torch.nn.Linear(hidden, int(weight.shape[0]))
    linear.load_state_dict({"weight": weight, "bias": bias})
    return linear


def rows_agree(min_cos: float) -> Agreement:
    """Check rows (any scale, zero-padded) keep their direction: cosine >= `min_cos`
    for every row; a row that is zero in fp32 must be zero in the candidate."""

    def agree(ref: np.ndarray, got: np.ndarray) -> tuple[bool, str]:
        rn = np.linalg.norm(ref, axis=1)
        gn = np.linalg.norm(got, axis=1)
        live = rn > 0
        if (gn[~live] > 0).any():
            return False, "a zero row became non-zero"
        cos = np.sum(ref[live] * got[live], axis=1) / np.maximum(rn[live] * gn[live], 1e-30)
        cosine = float(cos.min()) if len(cos) else 1.0
        return cosine >= min_cos, f"min cosine {cosine:.6f} (need {min_cos})"

    return agree


class BgeM3Embedder(Adapter):
    request_type = EmbedRequest
    #: The tokenizer's Rust tokenizer called directly, checked at load to give
    #: what the tokenizer gives (None: the tokenizer's own call).
    direct: DirectTokenizer | None = None
    #: Prompt name -> text (fleet.prompts.prompt_table) and the default name.
    prompts: dict[str, str] = {}
    default_prompt: str | None = None

    def load(self) -> None:
        import torch

        self._torch = torch
        backbone, self.tokenizer = load_transformers(self.spec, self.device, "AutoModel")
        hidden = int(backbone.config.hidden_size)
        self.max_seq_len = max_length(self.spec, self.tokenizer, backbone.config)
        self.vocab = int(backbone.config.vocab_size)
        sparse = load_head(self.spec.path, SPARSE_HEAD, hidden, self.spec.name, rows=1)
        colbert = load_head(self.spec.path, COLBERT_HEAD, hidden, self.spec.name)
        self.dim = hidden
        self.token_dim = int(colbert.out_features)
        # FlagEmbedding's unused_tokens: never a term of a sparse vector.
        tok = self.tokenizer
        self.unused = np.array(sorted({t for t in (tok.cls_token_id, tok.eos_token_id, tok.pad_token_id,
                                                   tok.unk_token_id) if t is not None}), dtype=np.int64)
        self.direct = direct_tokenizer(tok, self.max_seq_len, self._own_features, self.spec.name,
                                       lengths=self._own_lengths)
        # Prompts as pulled (the manifest's), else as the folder says.
        prompts, default = self.spec.extra.get("prompts"), self.spec.extra.get("default_prompt_name")
        if prompts is None:
            prompts, default = folder_prompts(self.spec.path)
        self.prompts = prompt_table(self.spec.runtime, prompts)
        self.default_prompt = default
        model = torch.nn.ModuleDict({"backbone": backbone, "sparse": sparse, "colbert": colbert}).to(self.device)
        self.model, self.dtype = choose_dtype(
            model.eval(), name=self.spec.name, wanted=self.spec.profile.dtype, device=self.device,
            run=self._check_rows, agree=rows_agree(MIN_COSINE), kept_in=self.spec.path,
        )
        # Warm-up: the first forward of each shape pays kernel selection; pay it at load.
        run_through(self._embed(CHECK_SET, np.arange(len(CHECK_SET)) % 3, np.zeros(len(CHECK_SET), dtype=np.int64),
                                ctx=BatchContext()))

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def prompt_of(self, req: EmbedRequest) -> str | WorkError:
        """The text `req` puts before each input ('' = none), or why it cannot."""
        return prompt_of(self.spec.name, self.prompts, self.default_prompt, req)

    def refuse(self, req: EmbedRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        return dense_refusal(self.spec.name, req, self.prompt_of, self.dim, self.max_seq_len, self._lengths)

    def batch(self, requests: list[EmbedRequest], ctx: BatchContext) -> Steps:
        # 1. Requests this model cannot answer fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        texts, counts = flat_inputs(requests, live, self.max_seq_len, [self.prompt_of(requests[i]) for i in live])
        # 2. One forward per micro-batch; each text gets the output its request asked for.
        wants = np.repeat(np.fromiter((OUTPUTS[requests[i].output] for i in live), dtype=np.int64,
                                      count=len(live)), counts)
        top_k = np.repeat(np.fromiter((requests[i].top_k or 0 for i in live), dtype=np.int64, count=len(live)),
                          counts)
        dense, per_token, sparse, tokens = yield from self._embed(texts, wants, top_k, ctx=ctx)
        # 3. One result per request: dense vectors cut, normalised and converted as
        #    each asks (runtimes.adapters.dense), token vectors normalised as each asks.
        if dense_live := [i for i in live if requests[i].output == "dense"]:
            rows = wants == DENSE
            finish_dense(dense[rows], tokens[rows], requests, dense_live, results)
        starts, ends = offsets(counts)
        for k, i in enumerate(live):
            req = requests[i]
            a, b = int(starts[k]), int(ends[k])
            used = int(tokens[a:b].sum())
            if req.output == "tokens":
                blocks = [per_token[j] for j in range(a, b)]
                if req.normalize:
                    blocks = [m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12) for m in blocks]
                results[i] = TokenEmbedResult([m.astype("<f4", copy=False).tobytes() for m in blocks],
                                              [m.shape for m in blocks], used)
            elif req.output == "sparse":
                results[i] = SparseEmbedResult(sparse[a:b], self.vocab, used)
        return results

    def _own_features(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_len, return_tensors="pt")

    def _lengths(self, texts: list[str]) -> Sequence[int]:
        """Tokens per text with the special tokens, not truncated."""
        return self.direct.lengths(texts) if self.direct is not None else self._own_lengths(texts)

    def _own_lengths(self, texts: list[str]) -> list[int]:
        # verbose=False: counting a text over the limit is the point here, not a reason to warn.
        return self.tokenizer(texts, truncation=False, return_length=True, verbose=False)["length"]

    def _forward(self, model: Any, features: dict[str, Any]) -> Any:
        return model["backbone"](**to_device(features, self.device)).last_hidden_state

    def _embed(self, texts: list[str], wants: np.ndarray, top_k: np.ndarray, *, ctx: BatchContext,
               ) -> Generator[None, None, tuple[np.ndarray, dict[int, np.ndarray], list[Any], np.ndarray]]:
        """Per text, in input order: its dense vector (rows of `dense` for texts
        that want it), token vectors (t_i - 1, d'), sparse vector (SparseVec),
        tokens read. Only the heads some text of a micro-batch wants run on it.
        Texts run in length-sorted micro-batches, the generator yielding before
        each (the worker's step loop decides there whether the rest is wanted:
        `Adapter.batch`), outside inference mode (a thread-local switch another
        batch's steps may flip between)."""
        torch = self._torch
        n = len(texts)
        dense = np.empty((n, self.dim), dtype=np.float32)
        per_token: dict[int, np.ndarray] = {}
        sparse: list[Any] = [None] * n
        tokens = np.empty(n, dtype=np.int64)
        cuts, tokenize = sorted_cuts(texts, self.micro_items(ctx), self.fixed_tokens, self.direct,
                                     self.direct or self._own_features)
        for idx in cuts:
            yield
            with torch.inference_mode():
                features = tokenize(idx)
                mask = features["attention_mask"]
                used = mask.sum(dim=1).numpy()
                tokens[idx] = used
                hidden = self._forward(self.model, features)
                want = wants[idx]
                if (want == DENSE).any():
                    dense[idx] = hidden[:, 0].float().cpu().numpy()
                if (rows := np.flatnonzero(want == TOKENS)).size:
                    sel = torch.from_numpy(rows).to(hidden.device)
                    vecs = self.model["colbert"](hidden[sel, 1:]).float().cpu().numpy()
                    for r, block in zip(rows, vecs):
                        per_token[int(idx[r])] = block[: int(used[r]) - 1]
                if (rows := np.flatnonzero(want == SPARSE)).size:
                    sel = torch.from_numpy(rows).to(hidden.device)
                    weights = torch.relu(self.model["sparse"](hidden[sel])).squeeze(-1).float().cpu().numpy()
                    ids = features["input_ids"].numpy()[rows]
                    keep = mask.numpy()[rows].astype(bool) & ~np.isin(ids, self.unused)
                    for r, vec in zip(rows, lexical_weights(ids, weights, keep, top_k[idx[rows]], self.vocab)):
                        sparse[int(idx[r])] = vec
        return dense, per_token, sparse, tokens

    def _check_rows(self, model: Any) -> np.ndarray:
        """What the dtype check compares, per check text: its dense vector, each
        token vector and its token weights, as rows zero-padded to one width."""
        torch = self._torch
        with torch.inference_mode():
            features = self._own_features(CHECK_SET)
            hidden = self._forward(model, features)
            mask = features["attention_mask"].to(hidden.device)
            dense = hidden[:, 0].float()
            colbert = (model["colbert"](hidden[:, 1:]).float() * mask[:, 1:, None])
            colbert = colbert[mask[:, 1:].bool()]
            weights = torch.relu(model["sparse"](hidden)).squeeze(-1).float() * mask
        parts = [p.cpu().numpy() for p in (dense, colbert, weights)]
        width = max(p.shape[1] for p in parts)
        return np.concatenate([np.pad(p, ((0, 0), (0, width - p.shape[1]))) for p in parts])

    def unload(self) -> None:
        self.direct = None
        self.model = None


def lexical_weights(ids: np.ndarray, weights: np.ndarray, keep: np.ndarray, top_k: np.ndarray,
                    vocab: int) -> list[SparseVec]:
    """Per row of (rows, tokens) ids and weights: each kept id's largest positive
    weight, ids ascending (or the `top_k` largest, 0 = all), in one sort of the
    (row, id) keys (no per-token Python loop)."""
    r, c = np.nonzero(keep & (weights > 0))
    key = r.astype(np.int64) * vocab + ids[r, c]
    order = np.argsort(key, kind="stable")
    key, values = key[order], weights[r, c][order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, dtype=np.int64)
    best = np.maximum.reduceat(values, first) if len(key) else values
    row, term = np.divmod(key[first], vocab)
    bounds = np.searchsorted(row, np.arange(len(ids) + 1))
    out = []
    for j in range(len(ids)):
        t, v = term[bounds[j] : bounds[j + 1]], best[bounds[j] : bounds[j + 1]]
        if top_k[j] and len(v) > top_k[j]:
            kept = np.sort(np.argsort(-v, kind="stable")[: top_k[j]])
            t, v = t[kept], v[kept]
        out.append(SparseVec(t.astype("<i4").tobytes(), v.astype("<f4").tobytes()))
    return out
