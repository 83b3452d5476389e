"""sentence-transformers embedding adapter (task `embed`).

LoRA adapters of the model (runtimes.lora) attach to its transformers module
(the first module's `auto_model`) and run in the same batches, each text with
its request's adapter; a micro-batch with adapter rows runs eagerly (the
recorded forward, CUDA graphs or a CPU trace, holds the base's).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, nullcontext
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.prompts import folder_prompts, prompt_table
from fleet.protocol import EmbedRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import (
    flat_inputs, offsets, prompt_of, sorted_cuts, split_refused,
)
from fleet.runtimes.adapters.dense import dense_refusal, finish_dense
from fleet.runtimes.adapters.hf_common import CHECK_SET, choose_dtype, footprint_bytes, min_cosine, pinned, to_device
from fleet.runtimes.adapters.cuda_graphs import GRAPH_ROWS, GraphedForward
from fleet.runtimes.adapters.tokenizing import DirectTokenizer, direct_tokenizer, prefetched, tokenize_threads
from fleet.messages import TokenEmbedResult, WorkError
from fleet.runtimes.lora import Loras, LoraHost
from fleet.runtimes.adapters import engines, openvino, traced
from fleet.runtimes.adapters.threads import Threads, measure as measure_threads

log = logging.getLogger("fleet.worker")

#: A dtype is kept only if every check-set row stays this close to fp32 (cosine).
MIN_COSINE = 0.9999
#: Hub ids sentence-transformers loads with `include_prompt=False` pooling whatever
#: their folder says (`SentenceTransformer.__init__`); fleet loads from a folder, so
#: it reads the id from the model's source.
INSTRUCTOR_SOURCES = tuple(f"hf:hkunlp/instructor-{size}" for size in ("base", "large", "xl"))
#: Prompt texts whose token length is kept (models that pool without the prompt).
PROMPT_LENGTHS_KEPT = 256
#: The share of a CPU forward's tokens that sorting a batch by tokens saves over sorting
#: it by characters: 8 merged 32-text requests of the bench corpus padded 15.1 % sorted by
#: characters, 7.2 % by tokens. Sorting by tokens pays where this share of the forward
#: outweighs tokenizing the batch on the batch thread (`SentenceTransformerEmbedder.sort_pays`).
TOKEN_SORT_SAVES = 0.08


class SentenceTransformerEmbedder(LoraHost, Adapter):
    request_type = EmbedRequest
    engines = ("torch", "openvino")

    #: The threads that tokenize the next micro-batches while the current one runs
    #: (`tokenizing.tokenize_threads`; None: tokenize in turn, e.g. to compare), and
    #: how many micro-batches they tokenize ahead (one each).
    tokenize_ahead: ThreadPoolExecutor | None = None
    tokenize_depth: int = 1
    #: The base's forward recorded at load: CUDA graphs of the small micro-batch shapes on
    #: CUDA, a traced graph on the CPU (runtimes/adapters/traced.py); None when its check or measurement failed.
    compiled: GraphedForward | traced.TracedForward | None = None
    #: Why the CPU forward is traced or not (`fleetctl ps`; None: not tried).
    traced_why: str | None = None
    #: The model's Rust tokenizer called directly, checked at load to give what
    #: `model.preprocess` gives (None: preprocess, e.g. a module that works in Python).
    direct: DirectTokenizer | None = None
    #: Prompt name -> text (fleet.prompts.prompt_table) and the default name.
    prompts: dict[str, str] = {}
    default_prompt: str | None = None
    #: The pooling leaves prompt tokens out (`include_prompt: false`): each row's prompt length is needed.
    exclude_prompt: bool = False
    #: The input module reads chat messages (a prompt would be a system message there): prompts are refused.
    chat_inputs: bool = False
    #: CPU: micro-batches up to a measured size run on one thread (runtimes/adapters/threads.py; None: off the CPU).
    threads: Threads | None = None
    #: A CPU batch is sorted by its tokens, not characters (`sort_pays`, measured at load).
    sort_by_tokens: bool = False

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
        if str(self.spec.extra.get("source", "")).lower().startswith(INSTRUCTOR_SOURCES):
            model.set_pooling_include_prompt(False)
        if self.spec.max_seq_len:
            model.max_seq_length = self.spec.max_seq_len
        self.max_seq_len = int(model.max_seq_length)
        self.tokenizer = model.tokenizer
        self._torch = torch
        profile = self.spec.profile
        # A trailing Normalize module is applied by us (on the device after the
        # forward, or in runtimes.adapters.dense.finish_dense: model_unit): every vector of
        # such a model is unit length before `dimensions` cuts it, `normalize: false`
        # included, as sentence-transformers' encode gives it.
        trailing = self._trailing = bool(list(model)) and isinstance(list(model)[-1], Normalize)
        if self.device == "cpu" and isinstance(list(model)[0], Transformer) and (
                profile.engine != "auto" or openvino.available()):
            # More than one engine to choose among: by measurement (runtimes/adapters/engines.py).
            self.model, modules = self._choose_engine(model, trailing)
        else:
            if profile.engine not in ("auto", "torch"):
                raise ModelLoadFailed(f"{self.spec.name}: engine {profile.engine!r} serves dense embedders "
                                      f"on the CPU only (this one runs on {self.device})")
            self.model, self.dtype = choose_dtype(
                model, name=self.spec.name, wanted=profile.dtype, device=self.device,
                run=lambda m: self._encode_with(m, CHECK_SET), agree=min_cosine(MIN_COSINE), kept_in=self.spec.path,
            )
            modules = list(self.model)[:-1] if trailing else list(self.model)
        self._modules = modules
        self._load_prompts(modules)
        if modules and isinstance(list(self.model)[0], Transformer):  # OpenVINO's stand-in takes the same features
            self.direct = direct_tokenizer(self.model.tokenizer, self.max_seq_len, self.model.preprocess,
                                           self.spec.name, lengths=self._own_lengths)
        else:
            log.info("direct tokenizer %s: off (the first module is %s); tokenizing through the model's own code",
                     self.spec.name, type(modules[0]).__name__ if modules else "none")
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.tokenize_depth = tokenize_threads(torch, self.direct, self.device)
        self.tokenize_ahead = ThreadPoolExecutor(max_workers=self.tokenize_depth,
                                                 thread_name_prefix=f"tokenize-{self.spec.name}")
        if self.device.startswith("cuda"):
            with torch.inference_mode():
                example = self.model.preprocess(engines.repeated(CHECK_SET, max(GRAPH_ROWS)))
                graphs = GraphedForward(self._pooled, example, self.device,
                                        self.max_seq_len, min_cosine(MIN_COSINE), self.spec.name)
            self.compiled = graphs if graphs.graphs else None
        elif self.device == "cpu" and self.engine == "torch" and modules and isinstance(modules[0], Transformer):
            self.compiled, self.traced_why = self._trace()
        # LoRA adapters attach to torch's module: not when OpenVINO runs the forward.
        target = getattr(modules[0], "auto_model", None) if modules else None
        self.loras = None if target is None else Loras(self.spec.name, target, self.spec.profile.max_loras)
        # Warm-up: the first forward of each shape pays kernel selection (oneDNN,
        # cuBLAS); pay it at load, not in the first client's latency.
        run_through(self._embed(CHECK_SET, ctx=BatchContext()))
        if self.device == "cpu" and self.engine == "torch":
            self.threads = self._measure_threads()
        self.sort_by_tokens = self.sort_pays()

    def lora_bank(self) -> Loras | None:
        """OpenVINO chosen by measurement goes back to torch fp32 (the model kept
        for tokenizing) for a LoRA adapter: its modules serve again, traced on the CPU
        as a model torch served from the start."""
        from sentence_transformers.models import Transformer

        if not engines.back_to_torch(self):
            return None
        self._modules = list(self.model)[:-1] if self._trailing else list(self.model)
        if self.device == "cpu" and isinstance(self._modules[0], Transformer):
            self.compiled, self.traced_why = self._trace()
        self.threads = self._measure_threads()
        self.sort_by_tokens = self.sort_pays()
        target = getattr(self._modules[0], "auto_model", None)
        return None if target is None else Loras(self.spec.name, target, self.spec.profile.max_loras)

    def _choose_engine(self, model: Any, trailing: bool) -> tuple[Any, list[Any]]:
        """(the torch model kept for tokenizing and its modules' config, the modules
        that run): torch fp32 / bf16 or OpenVINO f32 / bf16, the fastest that agrees
        with torch fp32 on the check set, timed on one short text and one full
        micro-batch (runtimes/adapters/engines.py). Sets `dtype` and `choice`."""
        import copy

        torch = self._torch
        profile = self.spec.profile
        cands = engines.candidates(self.device, profile.engine, profile.dtype)
        threads = torch.get_num_threads()
        first = model[0]
        example = dict(model.preprocess(CHECK_SET[:2]))
        graph = openvino.Graph(self.spec.path, self.spec.name, "st-token-embeddings",
                               lambda f: first(f)["token_embeddings"], example, first)

        def modules_of(m: Any) -> list[Any]:
            return list(m)[:-1] if trailing else list(m)

        def build(c: engines.Candidate) -> tuple[Any, list[Any]]:
            if c.engine == "openvino":
                return model, [openvino.TokenModule(graph.compiled(c.dtype, threads)), *modules_of(model)[1:]]
            m = model if c.dtype == "float32" else copy.deepcopy(model).to(getattr(torch, c.dtype))
            return m, modules_of(m)

        check = dict(model.preprocess(CHECK_SET))
        short = dict(model.preprocess(CHECK_SET[1:2]))
        full = dict(model.preprocess(engines.repeated(CHECK_SET, profile.micro_batch_items)))

        def run(built: tuple[Any, list[Any]], features: dict[str, Any]) -> np.ndarray:
            with torch.inference_mode():
                f = dict(features)
                for module in built[1]:
                    f = module(f)
                return f["sentence_embedding"].float().numpy()

        def outputs(built: tuple[Any, list[Any]]) -> np.ndarray:
            emb = run(built, check)
            return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)

        (kept, modules), self.choice = engines.choose(
            self.spec.name, self.spec.path, self.device, cands, build=build, outputs=outputs,
            agree=min_cosine(MIN_COSINE), workloads=engines.short_and_full(run, short, full, "texts"),
            threads=threads, forced=profile.engine != "auto" and profile.dtype != "auto")
        self.dtype = self.choice.candidate.dtype
        return kept, modules

    def _measure_threads(self) -> Threads:
        """One thread against the worker's on this model's small shapes (one short
        text, then 4 and 16 texts of the check set), timed through `_embed`'s own path."""
        shapes = []
        for texts in (CHECK_SET[1:2], CHECK_SET[:4], (CHECK_SET * 2)[:16]):
            host = self._tokenized(list(texts))
            shapes.append((int(host["input_ids"].numel()), lambda host=host: self._forward_host(host)))
        threads = measure_threads(self._torch, self.spec.name, shapes, kept_in=self.spec.path)
        # The same timings say what a forward costs before its tokens: where micro-batches cut.
        self.fixed_tokens = threads.fixed_tokens() or self.fixed_tokens
        return threads

    def sort_pays(self, clock: Callable[[], float] = time.perf_counter) -> bool:
        """Whether a CPU batch is sorted by tokens (`batching.sorted_cuts`): tokenizing the
        whole batch in one call on the batch thread before its first forward (the
        tokenize-ahead threads then only pad) costs less than TOKEN_SORT_SAVES of the
        forward. Timed at load on 16 texts of the check set, medians of 3. MiniLM on 2
        CPU cores: the forward 50-100x the tokenizing. A nearly free forward (the host-path
        bench's 1-layer, width-32 BERT) would leave the batch thread tokenizing alone at
        4.4 CPU-us a token: it keeps the character order and the tokenize-ahead threads."""
        if self.device != "cpu" or self.direct is None or self.fixed_tokens is None:
            return False
        texts = (CHECK_SET * 2)[:16]
        host = self._tokenized(texts)

        def median_s(run: Callable[[], Any]) -> float:
            times = []
            for _ in range(3):
                t0 = clock()
                run()
                times.append(clock() - t0)
            return sorted(times)[1]

        forward = median_s(lambda: self._forward_host(host))
        tokenize = median_s(lambda: self.direct.encode(texts))
        pays = TOKEN_SORT_SAVES * forward > tokenize
        log.info("batch order %s: by %s (forward %.2f ms, tokenizing %.2f ms, 16 texts)", self.spec.name,
                 "tokens" if pays else "characters", forward * 1e3, tokenize * 1e3)
        return pays

    def _forward_host(self, host: dict[str, Any]) -> Any:
        with self._torch.inference_mode():
            emb = None if self.compiled is None else self.compiled(host)
            if emb is None:
                emb = self._pooled(dict(host))
            return emb.float().numpy()

    def _trace(self) -> tuple[traced.TracedForward | None, str]:
        """The base's forward traced on the CPU (runtimes/adapters/traced.py), checked on one
        short text, a padded batch and the longest input probed beside a short one,
        timed on one short text and four."""
        return traced.trace_probed(self._torch, self.spec.name, self._modules, pooled,
                                   lambda texts: self._tokenized(list(texts)), list(CHECK_SET),
                                   traced.long_text(CHECK_SET, self.max_seq_len), self.max_seq_len,
                                   kept_in=self.spec.path, what="st-pooled")

    def _encode_with(self, model: Any, texts: list[str]) -> np.ndarray:
        """Unit vectors from a full forward (the check compares directions)."""
        torch = self._torch
        with torch.inference_mode():
            features = model.preprocess(texts)
            features = to_device(features, self.device)
            emb = model.forward(features)["sentence_embedding"].float()
            emb = torch.nn.functional.normalize(emb, dim=1)
        return emb.cpu().numpy()

    def _load_prompts(self, modules: list[Any]) -> None:
        """The model's prompts (recorded at pull; read from its folder when the
        manifest predates that) and how its pooling treats them."""
        from sentence_transformers.sentence_transformer.modules import Pooling

        prompts, default = self.spec.extra.get("prompts"), self.spec.extra.get("default_prompt_name")
        if prompts is None:
            prompts, default = folder_prompts(self.spec.path)
        self.prompts = prompt_table(self.spec.runtime, prompts)
        self.default_prompt = default
        self.exclude_prompt = any(isinstance(m, Pooling) and not m.include_prompt for m in modules)
        self.chat_inputs = bool(modules) and "message" in (getattr(modules[0], "modality_config", None) or {})
        self._prompt_lengths: dict[str, int] = {}

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model) + openvino.weight_bytes(self._modules) + self.lora_bytes()

    def prompt_of(self, req: EmbedRequest) -> str | WorkError:
        """The text `req` puts before each input ('' = none), or why it cannot."""
        prompt = prompt_of(self.spec.name, self.prompts, self.default_prompt, req)
        if prompt.__class__ is str and prompt and self.chat_inputs:
            return WorkError("bad_request", f"{self.spec.name} reads its inputs as chat messages; fleet applies "
                                            "no prompts to it")
        return prompt

    def refuse(self, req: EmbedRequest) -> WorkError | None:
        """Why this model cannot answer `req` (it fails alone), or None."""
        if req.output == "sparse":
            return WorkError("bad_request", f"{self.spec.name} gives dense or per-token vectors; output 'sparse' "
                                            "needs a SPLADE model (runtime splade)")
        return dense_refusal(self.spec.name, req, self.prompt_of, self.dim, self.max_seq_len, self._lengths)

    def batch(self, requests: list[EmbedRequest], ctx: BatchContext) -> Steps:
        # 1. Requests this model cannot answer (images, sparse, too long with
        #    truncate=false) fail alone.
        results, live = split_refused(requests, self.refuse)
        if not live:
            return results
        # Each text with its request's prompt in front, tokenized together (as sentence-transformers does).
        prompts = [self.prompt_of(requests[i]) for i in live]
        texts, counts = flat_inputs(requests, live, self.max_seq_len, prompts)
        prompt_tokens = None
        if self.exclude_prompt and any(prompts):
            prompt_tokens = np.repeat(np.fromiter(map(self._prompt_length, prompts), dtype=np.int64,
                                                  count=len(live)), counts)
        # Per-token output is rare: the common batch builds no mask for it (each numpy
        # call costs tens of us on a cold CPU, the case of a lone client's request).
        wants = [requests[i].output == "tokens" for i in live]
        want_tokens = np.repeat(np.array(wants), counts) if any(wants) else None
        # Every request normalises (the default), or the model's own Normalize module
        # does: the rows are made unit length by torch right after the forward, while
        # its kernels are warm.
        unit = want_tokens is None and (self._trailing or all(requests[i].normalize for i in live))
        # 2. Embed all texts of the batch together, length-sorted into micro-batches,
        #    each text with its request's LoRA adapter (bank slot).
        vectors, tokens, per_token = yield from self._embed(texts, want_tokens, prompt_tokens,
                                                            self.row_slots(requests, live, counts), unit=unit, ctx=ctx)
        # 3. Split back, one result per request: per-token blocks, then dense vectors
        #    (cut, normalised and converted per request: runtimes.adapters.dense).
        if per_token:
            starts, ends = offsets(counts)
            self._split_tokens(requests, live, starts, ends, per_token, tokens, results)
            live = [i for i in live if requests[i].output != "tokens"]
            if not live:
                return results
            keep = ~want_tokens
            vectors, tokens = vectors[keep], tokens[keep]
        finish_dense(vectors, tokens, requests, live, results, unit=unit, model_unit=self._trailing)
        return results

    def _prompt_length(self, prompt: str) -> int:
        """Tokens of `prompt` alone without a trailing special token (sentence-transformers'
        `Transformer._get_prompt_length`): the positions pooling leaves out."""
        if not prompt:
            return 0
        length = self._prompt_lengths.get(prompt)
        if length is None:
            ids = self.model.preprocess([prompt])["input_ids"][0]
            length = len(ids) - (1 if int(ids[-1]) in self.tokenizer.all_special_ids else 0)
            if len(self._prompt_lengths) >= PROMPT_LENGTHS_KEPT:
                self._prompt_lengths.clear()  # raw prompts come from clients: keep the memo bounded
            self._prompt_lengths[prompt] = length
        return length

    def _lengths(self, inputs: list[str]) -> Sequence[int]:
        """Tokens per input with the special tokens, not truncated."""
        return self.direct.lengths(inputs) if self.direct is not None else self._own_lengths(inputs)

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
        return pooled(self._modules, features)

    def _tokenized(self, texts: list[str]) -> dict[str, Any]:
        """Host token tensors of one micro-batch, padded to its longest text (pinned on CUDA)."""
        return pinned((self.direct or self.model.preprocess)(texts), self.device)

    def _cut(self, texts: list[str], ctx: BatchContext,
             ) -> tuple[list[np.ndarray], Callable[[np.ndarray], dict[str, Any]]]:
        """The batch's length-sorted micro-batches (input indices) and what tokenizes
        one of them (on the `tokenize_ahead` threads): `batching.sorted_cuts`, by
        the tokens the forward reads on a CPU with the direct tokenizer where that
        pays (`sort_by_tokens`). On a GPU (cut by count, tokenized on a pool so that
        no host thread is serial per batch), through a model's own tokenizer and
        before a nearly free forward, characters order them."""
        cuts, tokenize = sorted_cuts(texts, self.micro_items(ctx), self.fixed_tokens,
                                     self.direct if self.sort_by_tokens else None, self.direct or self.model.preprocess,
                                     self.row_multiple)
        return cuts, lambda idx: pinned(tokenize(idx), self.device)

    def _embed(self, texts: list[str], want_tokens: np.ndarray | None = None, prompt_tokens: np.ndarray | None = None,
               slots: np.ndarray | None = None, *, unit: bool = False, ctx: BatchContext,
               ) -> Generator[None, None, tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]]:
        """float32 vectors (n, d) in input order, tokens used per text, and for
        the inputs flagged in `want_tokens` their token vectors (t_i, d) without
        padding (right-padded rows: the first `mask.sum()` positions are real).
        `prompt_tokens`: per text, the prompt tokens its pooling leaves out (models
        with `include_prompt: false`; None = none). `slots`: per text, its LoRA
        bank slot (runtimes.lora; None = all the base's). `unit`: the vectors
        come back unit length (normalised in float32 on the device).

        1. Length-sorted micro-batches (`micro_batches`): each is padded only to
           its own longest text.
        2. The `tokenize_ahead` threads tokenize micro-batches k+1.. while k runs;
           before each, the generator yields: the worker's step loop decides
           there whether the rest is wanted and what runs first (`Adapter.batch`).
        3. Each micro-batch runs by CUDA-graph replay when a captured shape holds
           it, else eagerly; on CUDA its vectors come back by an async copy and
           the batch synchronises once at the end, not once per micro-batch.
        """
        torch = self._torch
        n = len(texts)
        tokens = np.empty(n, dtype=np.int64)
        per_token: dict[int, np.ndarray] = {}
        batches, tokenize = self._cut(texts, ctx)
        out = np.empty((n, self.dim), dtype=np.float32)
        cuda = self.device.startswith("cuda")
        # CUDA: vectors land in pinned host memory in sorted order by async copies,
        # synchronised once at the end; CPU: scattered straight into `out`.
        landing = torch.empty((n, self.dim), dtype=torch.float32, pin_memory=True) if cuda else None
        lo = 0
        with torch.inference_mode(), closing(prefetched(
                batches, tokenize, self.tokenize_ahead, self.tokenize_depth)) as ready:
            for idx, host in ready:
                yield
                tokenized = time.monotonic_ns()
                used = host["attention_mask"].sum(dim=1).numpy()
                tokens[idx] = used
                wants = want_tokens is not None and bool(want_tokens[idx].any())
                exclude = prompt_tokens is not None and bool(prompt_tokens[idx].any())
                lora_rows = slots[idx] if slots is not None and slots[idx].any() else None
                eager = wants or exclude or lora_rows is not None
                emb = None if eager or self.compiled is None else self.compiled(host)
                one = self.threads is not None and self.threads.enter(host["input_ids"].numel())
                try:
                    if emb is None:
                        features = to_device(host, self.device)
                        with self.loras.rows(lora_rows, self.device) if lora_rows is not None else nullcontext():
                            if exclude:
                                emb, features = self._pooled_without_prompts(features, prompt_tokens[idx])
                            else:
                                for module in self._modules:
                                    features = module(features)
                                emb = features["sentence_embedding"]
                    forward = time.monotonic_ns()
                    emb = emb.float()
                    if unit:
                        emb = emb / (emb * emb).sum(dim=1, keepdim=True).sqrt_().clamp_min_(1e-12)
                    if landing is not None:
                        landing[lo : lo + len(idx)].copy_(emb, non_blocking=True)
                        lo += len(idx)
                    else:
                        out[idx] = emb.numpy()
                finally:
                    if one:
                        self.threads.leave()
                ctx.marks = (tokenized, forward, time.monotonic_ns())
                if wants:
                    rows = np.flatnonzero(want_tokens[idx])
                    block = features["token_embeddings"][torch.from_numpy(rows).to(self.device)].float().cpu().numpy()
                    for r, m in zip(rows, block):
                        per_token[int(idx[r])] = m[: int(used[r])]
        if landing is not None and n:
            torch.cuda.current_stream(self.device).synchronize()
            out[np.concatenate(batches)] = landing.numpy()
        return out, tokens, per_token

    def _pooled_without_prompts(self, features: dict[str, Any], lengths: np.ndarray) -> tuple[Any, dict[str, Any]]:
        """(pooled vectors, the encoder's features) of a micro-batch whose rows carry
        prompts its pooling leaves out: the encoder runs once; the modules after it
        run once per prompt length on those rows, with `prompt_length` set as
        sentence-transformers sets it for a batch of one prompt."""
        torch = self._torch
        features = self._modules[0](features)
        rows = features["attention_mask"].shape[0]
        out = None
        for length in np.unique(lengths):
            at = torch.from_numpy(np.flatnonzero(lengths == length)).to(self.device)
            part = {k: (v[at] if hasattr(v, "shape") and v.ndim and v.shape[0] == rows else v)
                    for k, v in features.items()}
            if length:
                part["prompt_length"] = int(length)
            for module in self._modules[1:]:
                part = module(part)
            emb = part["sentence_embedding"]
            if out is None:
                out = emb.new_empty((rows, *emb.shape[1:]))
            out[at] = emb
        return out, features

    def unload(self) -> None:
        if self.tokenize_ahead is not None:
            self.tokenize_ahead.shutdown(wait=True)
        self.tokenize_ahead = None
        self.compiled = None
        self.direct = None
        self.model = None
        self._modules = []


def pooled(modules: list[Any], features: dict[str, Any]) -> Any:
    """The pooled (rows, d) vectors of token tensors through `modules`."""
    for module in modules:
        features = module(features)
    return features["sentence_embedding"]

