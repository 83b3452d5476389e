"""Runtime name -> adapter class, per task. A plain dict; models.toml names the runtime.

Values are "module:Class" strings so that importing the registry imports no
model library; the worker imports the one it needs when it loads a model.
"""

from __future__ import annotations

import importlib

from fleet.errors import ModelLoadFailed
from fleet.runtimes.base import Adapter

ADAPTERS: dict[tuple[str, str], str] = {
    ("embed", "sentence-transformers"): "fleet.runtimes.adapters.sentence_transformer:SentenceTransformerEmbedder",
    ("embed", "splade"): "fleet.runtimes.adapters.splade:SpladeEmbedder",
    ("embed", "clip"): "fleet.runtimes.adapters.clip:ClipEmbedder",
    ("embed", "bge-m3"): "fleet.runtimes.adapters.bge_m3:BgeM3Embedder",
    ("rerank", "sentence-transformers"): "fleet.runtimes.adapters.rerank:SentenceTransformersReranker",
    ("rerank", "transformers"): "fleet.runtimes.adapters.rerank:TransformersReranker",
    ("rerank", "llm-rerank"): "fleet.runtimes.adapters.llm_rerank:LlmReranker",
    ("classify", "transformers"): "fleet.runtimes.adapters.classify:SequenceClassifier",
    ("extract", "transformers"): "fleet.runtimes.adapters.extract:TokenClassifier",
    ("extract", "gliner"): "fleet.runtimes.adapters.gliner:GlinerExtractor",
    # LoRA adapters (runtime "peft") are no entry: they attach to their base's
    # adapter (Adapter.attach_lora) and their requests run in the base's batches.
    ("generate", "transformers"): "fleet.runtimes.adapters.generate:CausalLM",
    # GGUF generators (fleet.pull_gguf), the fleet-serve[llamacpp] extra.
    ("generate", "llama.cpp"): "fleet.runtimes.adapters.llamacpp:LlamaCppLM",
    ("decide", "transformers"): "fleet.runtimes.adapters.decide:DecisionLM",
    ("decide", "nli"): "fleet.runtimes.adapters.decide_nli:NliDecider",
    # Decision checkpoints with their own heads, recognised at pull by their files.
    ("decide", "laya"): "fleet.runtimes.adapters.decide_laya:LayaDecider",
    ("decide", "bev"): "fleet.runtimes.adapters.decide_bev:BevDecider",
}


def adapter_class(task: str, runtime: str) -> type[Adapter]:
    try:
        target = ADAPTERS[(task, runtime)]
    except KeyError:
        known = ", ".join(f"{t}/{r}" for t, r in sorted(ADAPTERS))
        raise ModelLoadFailed(f"no runtime adapter for task {task!r} with runtime {runtime!r} (known: {known})") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
