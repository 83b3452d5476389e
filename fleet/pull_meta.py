"""What a pulled model is: its task, runtime, base and the rest of its manifest metadata.

Its own concern apart from the pull's steps (fleet.pull): flags win, then the
catalog entry, then the stored manifest, then what the folder's config files say
(`detect_kind`); an embedder's prompts are merged with its folder's; and the checks
a folder passes before it is stored: a LoRA adapter against its stored base
(`checked_adapter`), the weights against the architecture the runtime builds
(`check_mismatched_weights`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from fleet.catalog import Catalog, CatalogEntry, Profile, Source, derive_name, validate_name
from fleet.errors import BadRequest
from fleet.lora import check_adapter
from fleet.prompts import check_default, merged_prompts, prompt_table
from fleet.pull_files import WEIGHTS_ONLY_HEADS
from fleet.store import FileEntry, Manifest, Store, utc_now
from fleet.weights import check_weights, refusal

#: The runtime a task uses when only the task is known.
DEFAULT_RUNTIME = {
    "embed": "sentence-transformers",
    "rerank": "transformers",
    "classify": "transformers",
    "extract": "transformers",
    "generate": "transformers",
    # Typed decisions (runtimes/adapters/decide.py): a causal LM read by scoring.
    "decide": "transformers",
}
#: (task the folder looks like, task it is pulled as) -> runtime: a causal LM
#: pulled with --task rerank is an LLM reranker (its prompt asks for a yes/no token).
OTHER_TASK_RUNTIME = {("generate", "rerank"): "llm-rerank",
                      # A sequence classifier pulled --task decide: an NLI cross-encoder (runtimes/adapters/decide_nli.py).
                      ("classify", "decide"): "nli"}
#: peft's `task_type` -> fleet task.
PEFT_TASKS = {
    "FEATURE_EXTRACTION": "embed",
    "SEQ_CLS": "classify",
    "TOKEN_CLS": "extract",
    "CAUSAL_LM": "generate",
}


class Kind(NamedTuple):
    task: str
    runtime: str
    #: LoRA adapters: the base model as the adapter names it (hub id or path).
    base_ref: str | None = None


class Meta(NamedTuple):
    """The manifest metadata a pull writes, once resolved (`model_metadata`)."""

    task: str
    runtime: str
    base: str | None
    trust_remote_code: bool
    allow_pickle: bool
    max_seq_len: int | None
    profile: Profile
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    matryoshka_dims: list[int] | None = None



def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    return data if isinstance(data, dict) else None


def detect_kind(folder: Path) -> Kind | None:
    """Task and runtime of a Hugging Face-format folder from its config files, or None."""
    adapter = _read_json(folder / "adapter_config.json")
    if adapter is not None:
        task = PEFT_TASKS.get(str(adapter.get("task_type", "")).upper(), "generate")
        return Kind(task, "peft", adapter.get("base_model_name_or_path") or None)
    if all((folder / head).is_file() for head in WEIGHTS_ONLY_HEADS):
        # bge-m3 (FlagEmbedding's M3): its dense/sparse/ColBERT heads beside the
        # encoder; its sentence-transformers files would say dense only.
        return Kind("embed", "bge-m3")
    # sentence-transformers writes its model type here; a CrossEncoder folder also
    # has modules.json, so the type is read before modules.json decides "embed".
    st = _read_json(folder / "config_sentence_transformers.json")
    if st is not None and st.get("model_type") == "CrossEncoder":
        return Kind("rerank", "sentence-transformers")
    if (folder / "modules.json").is_file():
        return Kind("embed", "sentence-transformers")
    if st is not None and st.get("model_type", "SentenceTransformer") == "SentenceTransformer":
        return Kind("embed", "sentence-transformers")
    if (folder / "gliner_config.json").is_file():
        # GLiNER's own layout (GLiNER.save_pretrained): no transformers config.json.
        return Kind("extract", "gliner")
    if (folder / "rl_agent_config.json").is_file():
        # A Laya decision checkpoint (runtimes/adapters/decide_laya.py): its config beside encoder/ and tokenizer/.
        return Kind("decide", "laya")
    config = _read_json(folder / "config.json")
    if config is None:
        return None
    if "backbone_config" in config and "head" in config:
        # A bev-decider checkpoint (runtimes/adapters/decide_bev.py): its head's sizes and the backbone's config file.
        return Kind("decide", "bev")
    for arch in config.get("architectures") or []:
        arch = str(arch)
        if arch.endswith("ForSequenceClassification"):
            labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
            return Kind("rerank" if labels == 1 else "classify", "transformers")
        if arch.endswith("ForTokenClassification"):
            return Kind("extract", "transformers")
        if arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
            return Kind("generate", "transformers")
        if arch in ("CLIPModel", "SiglipModel", "Siglip2Model"):
            # Text and image towers into one space: the image-capable embedder.
            return Kind("embed", "clip")
        if arch.endswith("Model"):
            # A bare encoder (BertModel, ...): embeddings by mean pooling.
            return Kind("embed", "sentence-transformers")
    return None


def _base_name(ref: str, catalog: Catalog) -> str:
    """The fleet name of an adapter's base model (hub id or path as the adapter wrote it)."""
    if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", ref):
        entry = catalog.find_by_source(Source("hf", ref))
        if entry is not None:
            return entry.name
    return derive_name(ref)


def model_metadata(
    *, entry: CatalogEntry | None, previous: Manifest | None, folder: Path | None,
    task: str | None, runtime: str | None, base: str | None, catalog: Catalog, origin: str,
) -> Meta:
    """Flags win, then the catalog entry, then the stored manifest, then detection."""
    known_task = task or (entry.task if entry else None) or (previous.task if previous else None)
    known_runtime = runtime or (entry.runtime if entry else None) or (previous.runtime if previous else None)
    known_base = base or (entry.base if entry else None) or (previous.base if previous else None)
    kind = detect_kind(folder) if folder is not None and not (known_task and known_runtime) else None
    if known_task is None:
        if kind is None:
            raise BadRequest(
                f"cannot tell what kind of model {origin} is (no modules.json, adapter_config.json "
                "or known architecture in config.json)",
                hint="pass --task embed|rerank|classify|extract|generate|decide (and --runtime)",
            )
        known_task = kind.task
    if known_runtime is None:
        # A folder with adapter_config.json is a LoRA adapter whatever task is asked of it.
        if kind is not None and (kind.task == known_task or kind.runtime == "peft"):
            known_runtime = kind.runtime
        else:
            known_runtime = OTHER_TASK_RUNTIME.get((kind.task if kind else None, known_task),
                                                   DEFAULT_RUNTIME[known_task])
    if known_base is None and kind is not None and kind.base_ref:
        known_base = _base_name(kind.base_ref, catalog)
    if known_runtime == "peft" and known_base is None:
        raise BadRequest(f"{origin} is a LoRA adapter without a base model", hint="pass --base NAME")
    if known_base is not None:
        validate_name(known_base)
    if entry is not None:
        meta = Meta(known_task, known_runtime, known_base, entry.trust_remote_code,
                     entry.allow_pickle, entry.max_seq_len, entry.profile, entry.prompts, entry.default_prompt_name,
                     entry.matryoshka_dims)
    elif previous is not None:
        meta = Meta(known_task, known_runtime, known_base, previous.trust_remote_code,
                     previous.allow_pickle, previous.max_seq_len, previous.profile, previous.prompts,
                     previous.default_prompt_name, previous.matryoshka_dims)
    else:
        meta = Meta(known_task, known_runtime, known_base, False, False, None, Profile())
    return _with_prompts(meta, folder, origin) if known_task == "embed" else meta


def _with_prompts(meta: Meta, folder: Path | None, origin: str) -> Meta:
    """An embedder's prompts as the manifest keeps them: the folder's own with the
    entry's (or the earlier manifest's) over them; a default that names none is refused."""
    prompts, default = merged_prompts(folder, meta.prompts, meta.default_prompt_name)
    check_default(origin, prompt_table(meta.runtime, prompts), default)
    return meta._replace(prompts=prompts, default_prompt_name=default)


def checked_adapter(store: Store, meta: Meta, folder: Path, *, task: str | None, origin: str) -> Meta:
    """`meta` once a LoRA adapter in `folder` is checked against its stored base
    (`fleet.lora.check_adapter`): its task is its base's. Other models pass as they are."""
    if meta.runtime != "peft":
        return meta
    if meta.base is None or not store.exists(meta.base):
        raise BadRequest(f"{origin} is a LoRA adapter of {meta.base!r}, which is not stored",
                         hint=f"pull the base first (fleetctl pull {meta.base}), or name a stored one with --base")
    base = store.get(meta.base)
    return meta._replace(task=check_adapter(folder, base=base, base_folder=store.path(base.name), task=task,
                                            origin=origin))


def refreshed(manifest: Manifest, meta: Meta, source: str, revision: str | None) -> Manifest:
    """The stored manifest with this pull's metadata: an up-to-date pull rewrites it where they differ.
    Every `Meta` field is the `Manifest` field of the same name."""
    return msgspec.structs.replace(manifest, source=source, revision=revision, **meta._asdict())


def new_manifest(name: str, meta: Meta, *, source: str, revision: str | None, files: list[FileEntry]) -> Manifest:
    """The manifest a fresh pull commits with its staged `files`: one place for a folder's and a hub's pull."""
    return Manifest(name=name, source=source, revision=revision, files=files, created_at=utc_now(), **meta._asdict())


def remote_code(entry: CatalogEntry | None, previous: Manifest | None) -> bool:
    """Does the model's entry (or its stored manifest) trust its own Python code?"""
    return entry.trust_remote_code if entry else (previous.trust_remote_code if previous else False)


def check_mismatched_weights(folder: Path, name: str, meta: Meta) -> None:
    """BadRequest when the weights in `folder` do not fit the architecture the
    model's runtime builds from its config.json (fleet.weights): transformers would
    load it with random parameters, and fleet would serve noise."""
    report = check_weights(folder, meta.task, meta.runtime, trust_remote_code=meta.trust_remote_code)
    if (why := refusal(report, meta.task, meta.runtime)) is not None:
        raise BadRequest(f"cannot pull {name}: {why}",
                         hint="pull the folder a model was saved to whole (config.json with its own weights)")
