"""Generation on llama.cpp (runtime `llama.cpp`, the fleet-serve[llamacpp] extra): GGUF models
behind the same continuous-batching contract as the transformers generator.

`LlamaCppLM` is `runtimes.adapters.generate.CausalLM` with llama.cpp in place of the torch
forward and its padded cache. Everything about a request is CausalLM's and runs
unchanged: admission and its 400s, chat templates, stop strings, streaming, seeded
sampling (temperature, top-p), logprobs, JSON-schema and tool-call grammars
(llguidance masks the logits of constrained rows before their pick), open-ended
answers. What differs is how a step computes logits:

- One llama.cpp context holds every sequence: `n_seq_max` sequences in one KV
  cache of `kv_cells` cells shared by all of them (`kv_unified`), allocated when the
  model loads. Each admitted request gets a sequence id while it is in flight.
- A step is ONE `llama_decode` of one batch: the newest token of every decoding row
  and, beside them, up to `PREFILL_TOKENS` prompt tokens of the requests admitted
  since (a long prompt is fed over several steps, so it never stalls the others'
  tokens for more than one such chunk). Logits are asked for the decoding rows and
  for the last prompt token of each prompt that completes; they are read in place
  (a numpy view of llama.cpp's buffer, handed to the pick as a torch tensor).
- The batch arrays are numpy arrays the `llama_batch` points at: filling one is
  vectorised per sequence, not per token.
- Memory: weights (the GGUF's tensors) and the KV cache are allocated at load, so
  both are the footprint (`/v1/ps` bytes). Admission reserves cells: a request
  takes prompt + max_tokens cells (open-ended: its reserve, grown as it goes, as
  CausalLM does with bytes); one that does not fit waits in its lane (`NotNow`)
  until a sequence leaves, one larger than the whole cache is `model_too_large`.
- The tokenizer: prompts are tokenized by llama.cpp itself (the ids its own `Llama`
  feeds); the chat template, tool rendering, grammars and detokenizing use a
  transformers fast tokenizer built from the GGUF's vocabulary at load
  (`gguf_tokenizer`: fleet.gguf reads the arrays, transformers converts them).
- LoRA adapters are not served on this runtime (refused at attach).
- Device: a `cuda:K` worker puts every layer on its GPU, a CPU worker none, and a
  `cuda:K` worker whose llama.cpp was built without GPU support refuses the load
  (`llamacpp_offload`). On the GPU the footprint is what the load took from the device
  (weights, KV cache, llama.cpp's compute buffers), at least weights + KV cache.

Threads: the worker's, or one where one runs faster (`_choose_threads`, timed at load and
shown in `/v1/ps`); a model all on the GPU keeps the worker's (its host threads only feed
the GPU: nothing to time).

Deadlines and cancels are checked between steps by the worker, as for every
generator; a step is bounded by one chunk of prefill plus one token per row.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.errors import FleetError, ModelLoadFailed, ModelTooLarge
from fleet.gguf import FILE_TYPES, read_metadata
from fleet.protocol import GenerateRequest
from fleet.runtimes.base import ModelSpec
from fleet.runtimes.adapters.generate import CausalLM
from fleet.runtimes.adapters.generate_rows import Sequence
from fleet.runtimes.adapters.llamacpp_offload import device_free_bytes, llama_gpus, offload_params
from fleet.runtimes.lora import BASE_ROW
from fleet.runtimes.memory import NotNow

log = logging.getLogger("fleet.worker")

INSTALL = "pip install 'fleet-serve[llamacpp]'"
RUNTIME = "llama.cpp"
#: Prompt tokens one step feeds beside the decoding rows (llama.cpp's own server
#: feeds prompts in micro-batches of 512 as well).
PREFILL_TOKENS = 512
#: llama.cpp's bound on sequences in one context.
MAX_SEQUENCES = 256
#: Choosing the threads at load: rounds, and the probe's prompt tokens and decode steps.
THREAD_ROUNDS = 3
PROBE_TOKENS = 32
PROBE_STEPS = 4
#: The GGUF arrays the tokenizer is built from.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(folder: Path) -> Path:
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise ModelLoadFailed(f"a llama.cpp model folder holds one .gguf file; {folder.name} holds {len(found)}")
    return found[0]


def gguf_tokenizer(meta: dict[str, Any], name: str) -> Any:
    """A transformers fast tokenizer of the GGUF's vocabulary, as transformers builds it
    from a GGUF (its converters), from the arrays fleet.gguf reads (`meta`: 0.2-0.5 s;
    the library's own reader maps every field and takes 5-25 s on SmolLM2's file)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer,
    )

    groups = {group: {new: meta[f"tokenizer.{key}"] for key, new in renames.items() if f"tokenizer.{key}" in meta}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    vocab, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in vocab:
        raise ModelLoadFailed(f"{name}: its GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    if vocab.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                         ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        tid = meta.get(f"tokenizer.ggml.{key}")
        config[special] = vocab["tokens"][tid] if isinstance(tid, int) and 0 <= tid < len(vocab["tokens"]) else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], vocab)
    return PreTrainedTokenizerFast(tokenizer_object=files_tokens_only(backend, len(vocab["tokens"])), **config,
                                   **extra)


def files_tokens_only(backend: Any, n: int) -> Any:
    """`backend` (a `tokenizers.Tokenizer`) without the tokens past the file's `n`:
    transformers' GPT-2-style builder adds `<|endoftext|>` where the vocabulary lacks it
    (Llama 3's GGUFs, a generator fleet converted), so the tokenizer counted n + 1 tokens
    against the model's n logits and llguidance refused it: JSON, schemas, tools and
    logprobs failed with "vocab size too small". The model can never produce such a
    token; a prompt that spells it is read as the text it is."""
    from tokenizers import Tokenizer

    if max(backend.get_vocab(with_added_tokens=True).values(), default=-1) < n:
        return backend  # the common case: no JSON round trip of the whole tokenizer at load
    data = json.loads(backend.to_str())
    data["added_tokens"] = [t for t in data.get("added_tokens") or [] if t["id"] < n]
    if isinstance(data["model"].get("vocab"), dict):
        data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if v < n}
    return Tokenizer.from_str(json.dumps(data))


#: llama.cpp's log levels (ggml_log_level) at or above which its lines reach the worker's log.
WARN_LEVEL = 3
_log_callback: Any = None


def quiet_logs(L: Any) -> None:
    """llama.cpp writes every step of a load to stderr; only its warnings and errors
    reach the worker's log (the callback is kept alive here: C holds a pointer to it)."""
    global _log_callback
    if _log_callback is None:
        def forward(level: int, text: bytes, _: Any) -> None:
            if WARN_LEVEL <= level < 5 and text:
                log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _log_callback = L.llama_log_callback(forward)
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))


@dataclass(frozen=True)
class Engine:
    """What `/v1/ps` shows of the engine (runtimes.info.engine_info reads `info()`)."""

    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def candidate(self) -> Any:
        return self

    @property
    def engine(self) -> str:
        return RUNTIME

    def info(self) -> dict[str, Any]:
        return {"engine": RUNTIME, "by": "runtime", **self.facts}


class _Batch:
    """A `llama_batch` over numpy arrays of `n` tokens: filled with array writes."""

    def __init__(self, L: Any, n: int) -> None:
        import numpy as np

        self.token = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        # seq_id is a pointer per token to its list of sequence ids: one each, in `seq`.
        self.seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(n, dtype=np.uint64)).astype(np.uint64)
        self.c = L.llama_batch()
        self.c.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self.c.embd = None
        self.c.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self.c.n_seq_id = self.n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.c.seq_id = self.seq_ptrs.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
        self.c.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


class LlamaCppLM(CausalLM):
    """A GGUF generator on llama.cpp (module doc)."""

    engines = (RUNTIME,)

    # -- load ------------------------------------------------------------------

    def load(self) -> None:
        if not available():
            raise ModelLoadFailed(f"the llama.cpp runtime is not installed: {INSTALL}")
        # ggml's threads meet at a barrier after every operation; libgomp's default is to
        # spin there, which on a busy CPU (more runnable threads than cores) made 32 tokens
        # of SmolLM2 on 2 threads take 23-29 s instead of 0.85 s. Read when libgomp loads.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import numpy as np
        import torch
        import llama_cpp.llama_cpp as L

        self._torch, self._np, self.L = torch, np, L
        L.llama_backend_init()
        quiet_logs(L)
        # Before the file is read: a worker that cannot honour its device refuses at once.
        self.offload = offload_params(self.device, bool(L.llama_supports_gpu_offload()), llama_gpus())
        free_before = device_free_bytes(torch, self.device)
        path = gguf_file(self.spec.path)
        _, meta, _, _ = read_metadata(path, self.spec.name, TOKENIZER_ARRAYS)
        try:
            self.tokenizer = gguf_tokenizer(meta, self.spec.name)
        except FleetError:
            raise
        except Exception as exc:  # the converters raise many types for vocabularies they do not know
            raise ModelLoadFailed(f"cannot build {self.spec.name!r}'s tokenizer from its GGUF file: {exc}") from exc
        mparams = L.llama_model_default_params()
        self.offload.apply(mparams)
        self.model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ModelLoadFailed(f"llama.cpp cannot load {self.spec.name!r} from its GGUF file")
        self.vocab = L.llama_model_get_vocab(self.model)
        profile = self.spec.profile
        self.n_seq = max(1, min(profile.max_batch_items, MAX_SEQUENCES))
        train = L.llama_model_n_ctx_train(self.model)
        limits = [int(x) for x in (self.spec.max_seq_len, train) if x and x > 0]
        self.max_len = min(limits) if limits else 2048
        # The cache: max_batch_tokens cells shared by every sequence, at least one full context.
        self.kv_cells = max(self.max_len, profile.max_batch_tokens)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.kv_cells
        cparams.n_batch = cparams.n_ubatch = PREFILL_TOKENS + self.n_seq
        cparams.n_seq_max = self.n_seq
        cparams.kv_unified = True
        self.n_threads = cparams.n_threads = cparams.n_threads_batch = max(1, torch.get_num_threads())
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self._free()
            raise ModelLoadFailed(f"llama.cpp cannot make a context of {self.kv_cells} cells for {self.spec.name!r}")
        self.memory = L.llama_get_memory(self.ctx)
        self.vocab_size = L.llama_vocab_n_tokens(self.vocab)
        self.eos = torch.tensor([t for t in range(self.vocab_size) if L.llama_vocab_is_eog(self.vocab, t)],
                                dtype=torch.long)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.pad_id = 0
        self.weights_bytes = int(L.llama_model_size(self.model))
        self.kv_bytes = self._kv_bytes()
        ftype = meta.get("general.file_type")
        self.dtype = FILE_TYPES.get(ftype, "gguf") if isinstance(ftype, int) else "gguf"
        self.batch = _Batch(L, PREFILL_TOKENS + self.n_seq)
        self.grammars = None
        self.kv_token_bytes = 0  # the cache is allocated: admission counts cells, not bytes
        self.kv_limit_bytes = None
        self.waiting_room = self.hold = False
        self.prefill_cap = 0
        self.loras = _NoLoras()
        self.rows: list[Sequence] = []
        self.pending: list[Sequence] = []
        self.seq_ids: dict[int, int] = {}  # id(Sequence) -> llama.cpp sequence id, while in flight
        self.fed: dict[int, int] = {}  # id(Sequence) -> prompt tokens already in the cache
        self.free_ids = list(range(self.n_seq))
        self.cache = self.mask = self.pos = None
        self.last = None
        gpu = self.offload.gpu
        threads_ms = self._choose_threads() if gpu is None else {}
        self._warm_up()
        facts: dict[str, Any] = {"kv_cells": self.kv_cells, "sequences": self.n_seq, "threads": self.n_threads,
                                 "threads_ms": threads_ms, "weights_bytes": self.weights_bytes,
                                 "kv_bytes": self.kv_bytes}
        self.device_bytes = 0
        if gpu is not None:
            # What the load took from the GPU (the device's load lock keeps other loads out
            # meanwhile): llama.cpp's compute buffers beside weights and cache (and the token
            # embeddings stay in host memory), so neither count alone is the device's.
            self.device_bytes = max(0, (free_before or 0) - (device_free_bytes(torch, self.device) or 0))
            facts.update(threads_probe="skipped: every layer on the GPU", gpu=gpu,
                         gpu_layers=L.llama_model_n_layer(self.model) + 1, device_bytes=self.device_bytes)
        self.choice = Engine(facts)

    def _choose_threads(self) -> dict[str, float]:
        """The worker's threads or one, whichever runs a short prompt and a few decode
        steps faster here, timed in interleaved rounds (median): on a CPU other processes
        share, one thread can beat two (ggml waits for every thread after each operation).
        Returns each candidate's milliseconds."""
        full = self.n_threads
        if full <= 1:
            return {}
        times: dict[int, list[float]] = {1: [], full: []}
        for _ in range(THREAD_ROUNDS):
            for n in times:
                self.L.llama_set_n_threads(self.ctx, n, n)
                t0 = time.perf_counter()
                self._probe()
                times[n].append((time.perf_counter() - t0) * 1000)
        ms = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        self.n_threads = min(ms, key=ms.__getitem__)
        self.L.llama_set_n_threads(self.ctx, self.n_threads, self.n_threads)
        return {str(n): round(v, 1) for n, v in ms.items()}

    def _probe(self) -> None:
        """A 32-token prompt and 4 decode steps on sequence 0, then its cells cleared."""
        b, np = self.batch, self._np
        b.token[:PROBE_TOKENS] = np.arange(PROBE_TOKENS, dtype=np.int32) % self.vocab_size
        b.pos[:PROBE_TOKENS] = np.arange(PROBE_TOKENS, dtype=np.int32)
        b.seq[:PROBE_TOKENS] = 0
        b.logits[:PROBE_TOKENS] = 0
        b.logits[PROBE_TOKENS - 1] = 1
        b.c.n_tokens = PROBE_TOKENS
        for k in range(PROBE_STEPS + 1):
            if k:
                b.token[0], b.pos[0], b.logits[0] = k, PROBE_TOKENS + k - 1, 1
                b.c.n_tokens = 1
            if self.L.llama_decode(self.ctx, b.c) != 0:
                raise ModelLoadFailed(f"llama.cpp failed a {PROBE_TOKENS}-token probe of {self.spec.name!r}")
        self.L.llama_memory_seq_rm(self.memory, 0, -1, -1)

    def _kv_bytes(self) -> int:
        """Bytes of the KV cache llama.cpp allocated: cells x layers x (K + V) widths,
        f16 (its default cache type)."""
        L = self.L
        layers, heads, kv_heads = (L.llama_model_n_layer(self.model), L.llama_model_n_head(self.model),
                                   L.llama_model_n_head_kv(self.model))
        head_dim = L.llama_model_n_embd(self.model) // max(1, heads)
        return self.kv_cells * layers * 2 * kv_heads * head_dim * 2

    def _warm_up(self) -> None:
        self.admit(None, GenerateRequest(model=self.spec.name, prompt="hello", max_tokens=2, temperature=0.0))
        while self.has_active():
            self.step()

    def footprint_bytes(self) -> int:
        return max(self.weights_bytes + self.kv_bytes, self.device_bytes)

    def unload(self) -> None:
        self.rows, self.pending, self.grammars = [], [], None
        self._free()

    def _free(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
        self.ctx = self.model = None

    def attach_lora(self, spec: ModelSpec, keep: Collection[str] = ()) -> None:
        raise ModelLoadFailed(f"{self.spec.name} ({RUNTIME}) does not serve LoRA adapters")

    # -- tokens ----------------------------------------------------------------

    def encode(self, text: str, *, chat: bool) -> list[int]:
        """llama.cpp's own tokens for the prompt (those its `Llama` feeds): special tokens
        written in the text are read as such; BOS on a raw prompt where the vocabulary
        asks for it."""
        return self._tokenize(text, self.add_bos and not chat)

    def _tokenize(self, text: str, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        n = len(data) + 2
        buf = (self.L.llama_token * n)()
        got = self.L.llama_tokenize(self.vocab, data, len(data), buf, n, add_bos, True)
        if got < 0:  # cannot happen with a buffer of bytes + 2 tokens
            raise RuntimeError(f"llama_tokenize wanted {-got} tokens for {len(data)} bytes; this is a bug")
        return list(buf[:got])

    # -- admission -------------------------------------------------------------

    def free_slots(self) -> int:
        if self.waiting_room:
            return 0
        return max(0, min(self.n_seq, self.spec.profile.max_batch_items) - len(self.rows) - len(self.pending))

    def reserved_bytes(self) -> int:
        return 0  # the cache is allocated at load and counted in footprint_bytes

    def _cells(self) -> int:
        return sum(s.final_len for s in (*self.rows, *self.pending))

    def _check_room(self, final_len: int) -> None:
        """Cells, not bytes: the request's prompt + max_tokens must fit beside what the
        sequences in flight reserved."""
        if final_len > self.kv_cells:
            raise ModelTooLarge(f"this request needs {final_len} cache cells (prompt + max_tokens); "
                                f"{self.spec.name} has {self.kv_cells}",
                                hint="send fewer max_tokens or a shorter prompt")
        if self._cells() + final_len > self.kv_cells:
            self.waiting_room = True
            raise NotNow(f"{self.spec.name}: the cache cells of {self.active_count()} sequences leave no room")

    def needs_room(self) -> bool:
        return False

    def _reserve_over(self) -> bool:
        """Cells, not bytes: an open-ended row grows its reserve while the cache has the
        cells (`CausalLM._grow_reserves`)."""
        return self._cells() > self.kv_cells

    # -- steps -----------------------------------------------------------------

    def step(self) -> tuple[list, list]:
        """0. grow open-ended reserves; 1. one batch: each decoding row's newest token,
        then prompt chunks of the pending requests, oldest first, up to PREFILL_TOKENS;
        2. one llama_decode; 3. pick the next token of every row with logits (the
        decoding rows, and prompts that completed), the prompts' rows join the batch;
        4. CausalLM's settle: stops, grammars, streaming, finished rows leave."""
        torch, np = self._torch, self._np
        failed: list = self._grow_reserves() if self.rows else []
        b = self.batch
        n = len(self.rows)
        if n:
            b.token[:n] = [s.ids[-1] for s in self.rows]
            b.pos[:n] = [len(s.prompt_ids) + len(s.ids) - 1 for s in self.rows]
            b.seq[:n] = [self.seq_ids[id(s)] for s in self.rows]
            b.logits[:n] = 1
        joined: list[Sequence] = []
        budget = PREFILL_TOKENS
        for s in self.pending:
            if budget == 0:
                break
            if id(s) not in self.seq_ids:
                self.seq_ids[id(s)] = self.free_ids.pop()
                self.fed[id(s)] = 0
            context, done = s.context(), self.fed[id(s)]
            take = min(budget, len(context) - done)
            b.token[n:n + take] = context[done:done + take]
            b.pos[n:n + take] = np.arange(done, done + take, dtype=np.int32)
            b.seq[n:n + take] = self.seq_ids[id(s)]
            b.logits[n:n + take] = 0
            self.fed[id(s)] = done + take
            n += take
            budget -= take
            if done + take == len(context):
                b.logits[n - 1] = 1
                joined.append(s)
        b.c.n_tokens = n
        code = self.L.llama_decode(self.ctx, b.c)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for a batch of {n} tokens "
                               f"({len(self.rows)} rows); the cell reserve should have prevented it: this is a bug")
        outputs = len(self.rows) + len(joined)
        if outputs:
            ptr = self.L.llama_get_logits(self.ctx)
            logits = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(outputs, self.vocab_size)))
            rows = self.rows + joined
            picked = self._pick(logits, rows)
            now = time.perf_counter_ns()
            for s in joined:
                s.first_ns = s.first_ns or now
                del self.fed[id(s)]
            if joined:
                self.pending = [s for s in self.pending if id(s) in self.fed]
            self.rows, self.last = rows, picked
        if not self.rows:
            return [], failed
        partials, finished = self._settle()
        return partials, finished + failed

    def _keep_rows(self, keep: list[int]) -> None:
        """Rows not in `keep` leave: their cells are cleared and their sequence ids freed."""
        gone = set(range(len(self.rows))) - set(keep)
        if gone:
            self._room_freed()
        for i in gone:
            self._release(self.rows[i])
        self.rows = [self.rows[i] for i in keep]
        self.last = self.last[keep] if self.last is not None and keep else None

    def _release(self, s: Sequence) -> None:
        sid = self.seq_ids.pop(id(s), None)
        self.fed.pop(id(s), None)
        if sid is not None:
            self.L.llama_memory_seq_rm(self.memory, sid, -1, -1)
            self.free_ids.append(sid)

    def cancel(self, keep) -> list[Any]:
        dropped = [s for s in (*self.rows, *self.pending) if not keep(s.key)]
        if not dropped:
            return []
        self._room_freed()
        for s in self.pending:
            if not keep(s.key):
                self._release(s)
        self.pending = [s for s in self.pending if keep(s.key)]
        self._keep_rows([i for i, s in enumerate(self.rows) if keep(s.key)])
        return [s.key for s in dropped]

    def abort(self) -> list[Any]:
        keys = [s.key for s in (*self.rows, *self.pending)]
        self.rows, self.pending, self.last = [], [], None
        self.seq_ids.clear()
        self.fed.clear()
        self.free_ids = list(range(self.n_seq))
        self.L.llama_memory_clear(self.memory, True)
        self._room_freed()
        return keys


class _NoLoras:
    """This runtime serves the base model alone: every row is the base's."""

    def peft_name(self, name: str | None) -> str:
        if name is not None:
            raise RuntimeError(f"LoRA {name!r} reached a llama.cpp model; attach refuses them: this is a bug")
        return BASE_ROW

    def names(self) -> list[str]:
        return []

    def hosts(self, lora: str) -> bool:
        return False

    def extra_bytes(self) -> int:
        return 0
