"""Pull a model into the store: from a catalog name, `pkg:`, `path:` or `hf:`.

One entry point, `pull_model`. Steps, for every source kind:

1. Resolve the target to (name, source, catalog entry or the stored manifest).
2. Under the store's lock for that name: list the source's files and filter them
   (`select_files`: no hidden files, no weights for other frameworks, pickle only
   when allowed and only when no safetensors exist).
3. If the stored model came from the same source and its files match (pkg/path:
   sizes + sha256 of the source files; hf: the same commit) and still verify,
   it is up to date: at most its manifest metadata is refreshed.
4. Otherwise copy (hashing as it goes) or download into a staging directory,
   detect task/runtime where nobody said them, check the weights against the
   architecture the runtime builds (`fleet.weights`: a folder whose weights do
   not fit its config.json is refused, not served as random weights), write the
   manifest, rename into place.

`huggingface_hub` is imported only for `hf:` sources.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from fleet.catalog import (
    RUNTIME_RE, TASKS, Catalog, CatalogEntry, Profile, Source, derive_name, load_catalog,
    parse_source, validate_name,
)
from fleet.errors import (
    BadRequest, FleetError, IntegrityError, ModelNotFound, SourceUnreachable,
)
from fleet.gliner_backbone import BACKBONE_DIR, fetch_backbone, needed_backbone
from fleet.gguf import is_gguf
from fleet.gguf_convert import check_quant_type
from fleet.lora import check_adapter
from fleet.prompts import check_default, merged_prompts, prompt_table
from fleet.pull_gguf import gguf_file, model_name, pull_converted, pull_gguf
from fleet.store import (
    NO_PROGRESS, Manifest, Progress, Store, hash_file, needed_by_runtime, safe_relpath, utc_now,
)
from fleet.weights import check_weights, refusal

#: Weight files that unpickle on load (arbitrary code): refused unless allowed.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
#: Head files at a folder's root that are torch pickles but are only ever read with
#: torch's weights-only unpickler (tensors and plain containers; any other global is
#: refused, no code runs): bge-m3's sparse and ColBERT heads (runtimes/bge_m3.py).
#: Taken whatever `allow_pickle` says and beside safetensors; every other pickle
#: follows the rule above.
WEIGHTS_ONLY_HEADS = ("sparse_linear.pt", "colbert_linear.pt")
#: Formats no fleet runtime loads; skipped so a hub pull does not fetch, e.g.,
#: an ONNX export that doubles its size.
FOREIGN_SUFFIXES = (".onnx", ".onnx_data", ".h5", ".msgpack", ".ot", ".tflite", ".gguf", ".mlmodel")
FOREIGN_DIRS = ("onnx", "openvino", "coreml", "tflite")
#: The runtime a task uses when only the task is known.
DEFAULT_RUNTIME = {
    "embed": "sentence-transformers",
    "rerank": "transformers",
    "classify": "transformers",
    "extract": "transformers",
    "generate": "transformers",
    # Typed decisions (runtimes/decide.py): a causal LM read by scoring.
    "decide": "transformers",
}
#: (task the folder looks like, task it is pulled as) -> runtime: a causal LM
#: pulled with --task rerank is an LLM reranker (its prompt asks for a yes/no token).
OTHER_TASK_RUNTIME = {("generate", "rerank"): "llm-rerank",
                      # A sequence classifier pulled --task decide: an NLI cross-encoder (runtimes/decide_nli.py).
                      ("classify", "decide"): "nli"}
#: peft's `task_type` -> fleet task.
PEFT_TASKS = {
    "FEATURE_EXTRACTION": "embed",
    "SEQ_CLS": "classify",
    "TOKEN_CLS": "extract",
    "CAUSAL_LM": "generate",
}
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class PullResult(msgspec.Struct, kw_only=True):
    #: pulled: files written; up_to_date: nothing changed; updated: manifest metadata refreshed.
    status: Literal["pulled", "up_to_date", "updated"]
    manifest: Manifest
    path: str
    #: Source files left out (pickle weights next to safetensors, foreign formats, ...).
    skipped: list[str] = msgspec.field(default_factory=list)


class Kind(NamedTuple):
    task: str
    runtime: str
    #: LoRA adapters: the base model as the adapter names it (hub id or path).
    base_ref: str | None = None


class _Meta(NamedTuple):
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


# ---- choosing files --------------------------------------------------------------

def select_files(paths: list[str], *, allow_pickle: bool, origin: str,
                 remote_code: bool = False, allow_empty: bool = False) -> tuple[list[str], list[str]]:
    """(files to take, files skipped) from relative POSIX paths of a model folder or repo
    (none: `BadRequest`, unless `allow_empty`: a folder that may hold a GGUF file instead)."""
    keep: list[str] = []
    skipped: list[str] = []
    for rel in sorted(paths):
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts):
            continue  # .git, .cache, .gitattributes: never model files
        if parts[0] in FOREIGN_DIRS or rel.endswith(FOREIGN_SUFFIXES) or not (
                needed_by_runtime(rel, remote_code=remote_code) or rel.endswith(PICKLE_SUFFIXES)):
            skipped.append(rel)
            continue
        keep.append(rel)
    pickles = [p for p in keep if p.endswith(PICKLE_SUFFIXES) and p not in WEIGHTS_ONLY_HEADS]
    if pickles:
        if any(p.endswith(".safetensors") for p in keep):
            keep = [p for p in keep if p not in pickles]
            skipped.extend(pickles)
        elif not allow_pickle:
            shown = ", ".join(pickles[:3]) + (" ..." if len(pickles) > 3 else "")
            raise BadRequest(
                f"{origin} has pickle weight files ({shown}) and no safetensors; "
                "pickle files can run code when loaded, so they are refused",
                hint="convert the weights to safetensors, or, if you trust the source, add "
                "`allow_pickle = true` to its entry in FLEET_HOME/models.toml and pull it by name",
            )
    if not keep and not allow_empty:
        raise BadRequest(f"{origin} has no model files to pull")
    return sorted(keep), sorted(skipped)


def scan_folder(folder: Path, *, allow_pickle: bool, origin: str, remote_code: bool = False,
                allow_empty: bool = False) -> tuple[list[tuple[str, Path]], list[str]]:
    """[(relative path, file to read)] of a local model folder, filtered; plus skipped paths.

    A symlink is followed only if it resolves inside `folder`.
    """
    root = folder.resolve()
    found: dict[str, Path] = {}
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for d in list(dirnames):
            full = here / d
            if d.startswith("."):
                dirnames.remove(d)
            elif full.is_symlink():
                target = full.resolve()
                if not target.is_relative_to(root):
                    raise BadRequest(
                        f"{origin}: {full.relative_to(root)} is a symlink to {target}, outside the folder; refusing it"
                    )
                # Inside the folder: its files are walked under their real path.
                skipped.append(full.relative_to(root).as_posix())
        for fn in filenames:
            full = here / fn
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                target = full.resolve()
                if not target.is_relative_to(root):
                    raise BadRequest(f"{origin}: {rel} is a symlink to {target}, outside the folder; refusing it")
                if not target.is_file():
                    raise BadRequest(f"{origin}: {rel} is a broken symlink")
                full = target
            elif not full.is_file():
                continue  # sockets, fifos: not model files
            found[rel] = full
    keep, skipped_sel = select_files(list(found), allow_pickle=allow_pickle, origin=origin, remote_code=remote_code,
                                     allow_empty=allow_empty)
    return [(rel, found[rel]) for rel in keep], sorted(skipped + skipped_sel)


def package_folder(ref: str) -> tuple[Path, str | None]:
    """(model folder, package version) of `pkg:PACKAGE[/SUBDIR]`, without importing the package."""
    package, _, sub = ref.partition("/")
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SourceUnreachable(
            f"cannot pull pkg:{ref}: the Python package {package!r} is not installed",
            hint=f"pip install {package}",
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / (sub or "model")
    if not (folder.is_dir() or (is_gguf(folder.name) and folder.is_file())):
        raise SourceUnreachable(f"cannot pull pkg:{ref}: package {package!r} has no folder {folder}")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return folder, version


# ---- what kind of model ------------------------------------------------------------

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
        # A Laya decision checkpoint (runtimes/decide_laya.py): its config beside encoder/ and tokenizer/.
        return Kind("decide", "laya")
    config = _read_json(folder / "config.json")
    if config is None:
        return None
    if "backbone_config" in config and "head" in config:
        # A bev-decider checkpoint (runtimes/decide_bev.py): its head's sizes and the backbone's config file.
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


def _metadata(
    *, entry: CatalogEntry | None, previous: Manifest | None, folder: Path | None,
    task: str | None, runtime: str | None, base: str | None, catalog: Catalog, origin: str,
) -> _Meta:
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
        meta = _Meta(known_task, known_runtime, known_base, entry.trust_remote_code,
                     entry.allow_pickle, entry.max_seq_len, entry.profile, entry.prompts, entry.default_prompt_name,
                     entry.matryoshka_dims)
    elif previous is not None:
        meta = _Meta(known_task, known_runtime, known_base, previous.trust_remote_code,
                     previous.allow_pickle, previous.max_seq_len, previous.profile, previous.prompts,
                     previous.default_prompt_name, previous.matryoshka_dims)
    else:
        meta = _Meta(known_task, known_runtime, known_base, False, False, None, Profile())
    return _with_prompts(meta, folder, origin) if known_task == "embed" else meta


def _with_prompts(meta: _Meta, folder: Path | None, origin: str) -> _Meta:
    """An embedder's prompts as the manifest keeps them: the folder's own with the
    entry's (or the earlier manifest's) over them; a default that names none is refused."""
    prompts, default = merged_prompts(folder, meta.prompts, meta.default_prompt_name)
    check_default(origin, prompt_table(meta.runtime, prompts), default)
    return meta._replace(prompts=prompts, default_prompt_name=default)


def _checked_adapter(store: Store, meta: _Meta, folder: Path, *, task: str | None, origin: str) -> _Meta:
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


def _refresh(manifest: Manifest, meta: _Meta, source: str, revision: str | None) -> Manifest:
    return msgspec.structs.replace(
        manifest, source=source, revision=revision, task=meta.task, runtime=meta.runtime,
        base=meta.base, trust_remote_code=meta.trust_remote_code, allow_pickle=meta.allow_pickle,
        max_seq_len=meta.max_seq_len, profile=meta.profile, prompts=meta.prompts,
        default_prompt_name=meta.default_prompt_name, matryoshka_dims=meta.matryoshka_dims,
    )


# ---- resolving the target ------------------------------------------------------------

def _resolve(
    store: Store, catalog: Catalog, target: str, name: str | None,
) -> tuple[str, Source, CatalogEntry | None, Manifest | None]:
    kind, sep, _ = target.partition(":")
    if sep and kind in ("hf", "path", "pkg"):
        source = parse_source(target)
        if source.kind == "path":
            # Stored and compared as an absolute path: `path:./x` from anywhere is one source.
            source = Source("path", str(Path(os.path.expanduser(source.ref)).resolve()))
        entry = catalog.find_by_source(source)
        if name is None:
            name = entry.name if entry is not None else derive_name(model_name(source.ref))
        validate_name(name)
        named = catalog.find(name)
        if named is not None and named is not entry:
            raise BadRequest(
                f"{name!r} is a catalog model with source {named.source}, not {target}",
                hint="pick another --name",
            )
        return name, source, entry, None
    if name is not None:
        raise BadRequest("--name is for hf:, path: and pkg: sources", hint=f"`fleetctl pull {target}`")
    try:
        validate_name(target)
    except BadRequest:
        raise BadRequest(
            f"{target!r} is neither a model name nor a source",
            hint="use a catalog name (`fleetctl list --catalog`), hf:ORG/NAME[@REV], path:DIR or pkg:PACKAGE",
        ) from None
    entry = catalog.find(target)
    if entry is not None:
        return target, entry.parsed_source, entry, None
    if store.exists(target):
        previous = store.get(target)
        return target, parse_source(previous.source), None, previous
    close = difflib.get_close_matches(target, [e.name for e in catalog.all()] + store.names(), n=1, cutoff=0.6)
    if close:
        raise ModelNotFound(f"unknown model {target!r}: not in the catalog and not in the store; did you mean "
                            f"{close[0]!r}?", hint=f"fleetctl pull {close[0]}")
    raise ModelNotFound(
        f"unknown model {target!r}: not in the catalog and not in the store",
        hint="see `fleetctl list --catalog` or models.toml; for a folder: `fleetctl pull path:DIR --name NAME`",
    )


def resolve_name(store: Store, target: str, *, name: str | None = None, catalog: Catalog | None = None) -> str:
    """The store name a pull of `target` writes (what `pull_model` resolves first): the
    daemon checks it (`store_max_models`, a bad name, an unknown one: 4xx) before it
    starts streaming a pull's progress."""
    return _resolve(store, catalog or load_catalog(store.root.parent), target, name)[0]


def _same_origin(stored: str, source: Source) -> bool:
    try:
        was = parse_source(stored)
    except BadRequest:
        return False
    if was.kind != source.kind:
        return False
    return was.ref.lower() == source.ref.lower() if was.kind == "hf" else was.ref == source.ref


def _intact(store: Store, manifest: Manifest) -> bool:
    try:
        store.verify(manifest.name, manifest)
    except IntegrityError:
        return False
    return True


# ---- the entry point -------------------------------------------------------------------

def pull_model(
    store: Store,
    target: str,
    *,
    name: str | None = None,
    task: str | None = None,
    runtime: str | None = None,
    base: str | None = None,
    force: bool = False,
    catalog: Catalog | None = None,
    progress: Progress = NO_PROGRESS,
    weights_check: bool = True,
    quantize: str | None = None,
) -> PullResult:
    """Pull `target` (catalog name, stored name, `hf:`/`path:`/`pkg:` source) into `store`.

    `weights_check`: refuse weights that do not fit the architecture now
    (`check_mismatched_weights`); a worker checks again before every load anyway.
    `quantize` (f16 | q8_0 | q4_k_m): a local safetensors generator is stored as one GGUF
    file of that type instead (fleet.gguf_convert), served by the llama.cpp runtime."""
    if quantize is not None:
        check_quant_type(quantize)
    if task is not None and task not in TASKS:
        raise BadRequest(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    if runtime is not None and not RUNTIME_RE.match(runtime):
        raise BadRequest(f"invalid runtime {runtime!r}")
    if base is not None:
        validate_name(base)
    catalog = catalog or load_catalog(store.root.parent)
    name, source, entry, previous = _resolve(store, catalog, target, name)
    with store.lock(name):
        existing: Manifest | None = None
        if store.exists(name):
            try:
                existing = store.get(name)
            except IntegrityError:
                existing = None  # unreadable manifest: pull over it
        if existing is not None and not force and not _same_origin(existing.source, source):
            raise BadRequest(
                f"{name!r} is already stored from {existing.source}, not {source}",
                hint="replace it with --force, or pick another --name",
            )
        if force:
            existing = None
        args = dict(store=store, name=name, source=source, entry=entry, previous=previous,
                    existing=existing, task=task, runtime=runtime, base=base, catalog=catalog,
                    progress=progress, weights_check=weights_check)
        try:
            if quantize is not None:
                return _pull_converted(**args, quantize=quantize)
            if source.kind == "hf":
                return _pull_hub(**args)
            return _pull_local(**args)
        except OSError as exc:
            # Reading the source or writing the store failed (permissions, disk
            # full): the staging dir is gone already, the stored copy untouched.
            where = f" ({exc.filename})" if exc.filename else ""
            raise FleetError(f"cannot pull {source} into {store.root}: {exc.strerror or exc}{where}") from exc


def remote_code(entry: CatalogEntry | None, previous: Manifest | None) -> bool:
    """Does the model's entry (or its stored manifest) trust its own Python code?"""
    return entry.trust_remote_code if entry else (previous.trust_remote_code if previous else False)


def _pull_local(
    *, store: Store, name: str, source: Source, entry: CatalogEntry | None, previous: Manifest | None,
    existing: Manifest | None, task: str | None, runtime: str | None, base: str | None,
    catalog: Catalog, progress: Progress, weights_check: bool,
) -> PullResult:
    if source.kind == "pkg":
        folder, revision = package_folder(source.ref)
        source_text = str(source)
    else:
        folder = Path(os.path.expanduser(source.ref)).resolve()
        source = Source("path", str(folder))
        if not (folder.is_dir() or folder.is_file()):
            raise SourceUnreachable(f"cannot pull {source}: {folder} is not a folder")
        revision = None
        source_text = f"path:{folder}"
    allow_pickle = entry.allow_pickle if entry else (previous.allow_pickle if previous else False)
    files, skipped = scan_folder(folder, allow_pickle=allow_pickle, origin=source_text,
                                 remote_code=remote_code(entry, previous), allow_empty=True) \
        if folder.is_dir() else ([], [])
    # A GGUF file, or a folder with one and no other weights (fleet.pull_gguf).
    weights = any(rel.endswith((".safetensors", *PICKLE_SUFFIXES)) for rel, _ in files)
    if (gguf := gguf_file(folder, source_text, has_model_files=weights)) is not None:
        status, manifest = pull_gguf(store=store, name=name, file=gguf, source_text=source_text, revision=revision,
                                     entry=entry, previous=previous, existing=existing, task=task, runtime=runtime,
                                     progress=progress)
        return PullResult(status=status, manifest=manifest, path=str(store.path(name)),
                          skipped=[rel for rel in skipped if rel != gguf.name])
    if not files:
        raise BadRequest(f"{source_text} has no model files to pull")
    meta = _metadata(entry=entry, previous=previous, folder=folder, task=task, runtime=runtime,
                     base=base, catalog=catalog, origin=source_text)
    meta = _checked_adapter(store, meta, folder, task=task or (entry.task if entry else None), origin=source_text)

    if existing is not None and _same_files(existing, files) and _intact(store, existing):
        fresh = _refresh(existing, meta, source_text, revision)
        if fresh == existing:
            return PullResult(status="up_to_date", manifest=existing, path=str(store.path(name)), skipped=skipped)
        store.rewrite_manifest(fresh)
        return PullResult(status="updated", manifest=fresh, path=str(store.path(name)), skipped=skipped)

    with store.staging(name) as staging:
        progress.start(f"copying {name}", sum(src.stat().st_size for _, src in files))
        for rel, src in files:
            staging.copy_in(src, rel, progress)
        progress.finish()
        add_backbone(staging, source_text)
        if weights_check:
            check_mismatched_weights(staging.path, name, meta)
        manifest = Manifest(
            name=name, source=source_text, revision=revision, task=meta.task, runtime=meta.runtime,
            base=meta.base, files=list(staging.files), created_at=utc_now(),
            trust_remote_code=meta.trust_remote_code, allow_pickle=meta.allow_pickle,
            max_seq_len=meta.max_seq_len, profile=meta.profile, prompts=meta.prompts,
            default_prompt_name=meta.default_prompt_name, matryoshka_dims=meta.matryoshka_dims,
        )
        path = store.commit(staging, manifest)
    return PullResult(status="pulled", manifest=manifest, path=str(path), skipped=skipped)


def _pull_converted(
    *, store: Store, name: str, source: Source, entry: CatalogEntry | None, previous: Manifest | None,
    existing: Manifest | None, task: str | None, runtime: str | None, base: str | None,
    catalog: Catalog, progress: Progress, weights_check: bool, quantize: str,
) -> PullResult:
    """`--quantize`: a local safetensors generator stored as one GGUF file (fleet.pull_gguf)."""
    if source.kind == "hf":
        raise BadRequest(f"--quantize converts a local folder, not {source}",
                         hint=f"fleetctl pull {source} --name NAME, then fleetctl pull path:<its folder> --quantize "
                              f"{quantize} --name NAME-{quantize}")
    if base is not None or task not in (None, "generate") or runtime not in (None, "llama.cpp"):
        raise BadRequest("--quantize makes a llama.cpp generator: leave out --task, --runtime and --base")
    if source.kind == "pkg":
        folder, revision = package_folder(source.ref)
        source_text = str(source)
    else:
        folder = Path(os.path.expanduser(source.ref)).resolve()
        source_text, revision = f"path:{folder}", None
    status, manifest = pull_converted(store=store, name=name, folder=folder, source_text=source_text,
                                      revision=revision, entry=entry, previous=previous, existing=existing,
                                      quantize=quantize, progress=progress)
    return PullResult(status=status, manifest=manifest, path=str(store.path(name)), skipped=[])


def check_mismatched_weights(folder: Path, name: str, meta: _Meta) -> None:
    """BadRequest when the weights in `folder` do not fit the architecture the
    model's runtime builds from its config.json (fleet.weights): transformers would
    load it with random parameters, and fleet would serve noise."""
    report = check_weights(folder, meta.task, meta.runtime, trust_remote_code=meta.trust_remote_code)
    if (why := refusal(report, meta.task, meta.runtime)) is not None:
        raise BadRequest(f"cannot pull {name}: {why}",
                         hint="pull the folder a model was saved to whole (config.json with its own weights)")


def add_backbone(staging: Any, origin: str) -> None:
    """A GLiNER folder without its backbone's config or tokenizer gets them in `backbone/`
    (fleet.gliner_backbone), so it loads offline."""
    if (backbone := needed_backbone(staging.path)) is not None:
        for rel in fetch_backbone(backbone, staging.path / BACKBONE_DIR, origin):
            staging.adopt(f"{BACKBONE_DIR}/{rel}")


def _same_files(manifest: Manifest, files: list[tuple[str, Path]]) -> bool:
    """Do the source files equal the stored ones (names, sizes, then sha256)? A GLiNER
    backbone fetched at pull (`backbone/`, not in the source) is not compared."""
    fetched = not any(rel.startswith(f"{BACKBONE_DIR}/") for rel, _ in files)
    stored = {f.path: f for f in manifest.files if not (fetched and f.path.startswith(f"{BACKBONE_DIR}/"))}
    if set(stored) != {rel for rel, _ in files}:
        return False
    if any(src.stat().st_size != stored[rel].size for rel, src in files):
        return False
    return all(hash_file(src)[1] == stored[rel].sha256 for rel, src in files)


# ---- hf: ---------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _hub_error(exc: Exception, source: Source) -> FleetError:
    from huggingface_hub import errors as hub_errors

    local = "or pull a local folder: `fleetctl pull path:DIR --name NAME`"
    if isinstance(exc, hub_errors.OfflineModeIsEnabled):
        return SourceUnreachable(
            f"cannot pull {source}: the hub is unreachable (HF_HUB_OFFLINE is set)",
            hint=f"unset HF_HUB_OFFLINE, {local}",
        )
    if isinstance(exc, hub_errors.GatedRepoError):
        return SourceUnreachable(
            f"cannot pull {source}: the repo is gated", hint="accept its terms on the hub and set HF_TOKEN",
        )
    if isinstance(exc, hub_errors.RepositoryNotFoundError):
        return ModelNotFound(
            f"cannot pull {source}: no such model on the hub (or it is private)",
            hint="check the id; private repos need HF_TOKEN",
        )
    if isinstance(exc, hub_errors.RevisionNotFoundError):
        return ModelNotFound(f"cannot pull {source}: the hub has no revision {source.revision or 'main'!r}")
    if isinstance(exc, hub_errors.HFValidationError):
        return BadRequest(f"cannot pull {source}: {_first_line(exc)}")
    if isinstance(exc, hub_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return SourceUnreachable(f"cannot pull {source}: the hub answered {status}: {_first_line(exc)}")
    return SourceUnreachable(
        f"cannot pull {source}: the hub is unreachable ({_first_line(exc)})",
        hint=f"check the network (and HF_ENDPOINT), {local}",
    )


def _progress_bar_class(progress: Progress) -> type:
    """A tqdm class huggingface_hub can drive that forwards bytes to `progress`.

    Make one class per file: `forwarded` counts the bytes all its bars reported.
    """
    from tqdm import tqdm

    class _Forward(tqdm):
        forwarded = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if n:
                _Forward.forwarded += int(n)
                progress.advance(int(n))
            return super().update(n)

    return _Forward


def _pull_hub(
    *, store: Store, name: str, source: Source, entry: CatalogEntry | None, previous: Manifest | None,
    existing: Manifest | None, task: str | None, runtime: str | None, base: str | None,
    catalog: Catalog, progress: Progress, weights_check: bool,
) -> PullResult:
    revision = source.revision or "main"
    source_text = f"hf:{source.ref}@{revision}"
    allow_pickle = entry.allow_pickle if entry else (previous.allow_pickle if previous else False)

    def up_to_date(commit: str, skipped: list[str]) -> PullResult | None:
        if existing is None or existing.revision != commit or not _intact(store, existing):
            return None
        meta = _metadata(entry=entry, previous=previous, folder=store.path(name), task=task,
                         runtime=runtime, base=base, catalog=catalog, origin=source_text)
        meta = _checked_adapter(store, meta, store.path(name), task=task or (entry.task if entry else None),
                                origin=source_text)
        fresh = _refresh(existing, meta, source_text, commit)
        status = "up_to_date"
        if fresh != existing:
            store.rewrite_manifest(fresh)
            status = "updated"
        return PullResult(status=status, manifest=fresh, path=str(store.path(name)), skipped=skipped)

    # A pinned commit already stored needs no network at all.
    if _COMMIT_RE.match(revision) and (done := up_to_date(revision, [])) is not None:
        return done

    try:
        from huggingface_hub import HfApi, constants, hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ModuleNotFoundError:
        raise SourceUnreachable(
            f"cannot pull {source}: huggingface_hub is not installed", hint="pip install huggingface_hub",
        ) from None

    caught = (hub_errors.HTTPError, OSError, ValueError)
    try:
        info = HfApi().model_info(
            source.ref, revision=revision, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT,
        )
    except caught as exc:
        raise _hub_error(exc, source) from None
    commit = info.sha
    if not commit:
        raise SourceUnreachable(f"cannot pull {source}: the hub did not say which commit {revision!r} is")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    keep, skipped = select_files(list(siblings), allow_pickle=allow_pickle, origin=source_text,
                                 remote_code=remote_code(entry, previous))
    for rel in keep:
        safe_relpath(rel)
    if (done := up_to_date(commit, skipped)) is not None:
        return done

    with store.staging(name) as staging:
        progress.start(f"downloading {name}", sum(siblings[rel].size or 0 for rel in keep))
        for rel in keep:
            bar = _progress_bar_class(progress)
            try:
                hf_hub_download(
                    source.ref, rel, revision=commit, local_dir=staging.path, tqdm_class=bar,
                    etag_timeout=constants.HF_HUB_ETAG_TIMEOUT,
                )
            except caught as exc:
                raise _hub_error(exc, source) from None
            # Bytes the bar did not see (a resumed or non-HTTP transfer) count once the file is there.
            expected = siblings[rel].size or 0
            done_bytes = (staging.path / rel).stat().st_size
            progress.advance(max(0, min(expected, done_bytes) - bar.forwarded))
        progress.finish()
        # huggingface_hub keeps its own bookkeeping in <local_dir>/.cache: not a model file.
        shutil.rmtree(staging.path / ".cache", ignore_errors=True)
        for rel in keep:
            got = staging.adopt(rel)
            sib = siblings[rel]
            want = sib.lfs.sha256 if sib.lfs is not None else None
            if (want and got.sha256 != want) or (sib.size is not None and got.size != sib.size):
                raise IntegrityError(
                    f"cannot pull {source}: downloaded {rel!r} does not match the hub's record "
                    f"(sha256 {got.sha256}, {got.size} bytes)",
                    hint=f"try again: `fleetctl pull {name} --force`",
                )
        add_backbone(staging, source_text)
        meta = _metadata(entry=entry, previous=previous, folder=staging.path, task=task,
                         runtime=runtime, base=base, catalog=catalog, origin=source_text)
        meta = _checked_adapter(store, meta, staging.path, task=task or (entry.task if entry else None),
                                origin=source_text)
        if weights_check:
            check_mismatched_weights(staging.path, name, meta)
        manifest = Manifest(
            name=name, source=source_text, revision=commit, task=meta.task, runtime=meta.runtime,
            base=meta.base, files=list(staging.files), created_at=utc_now(),
            trust_remote_code=meta.trust_remote_code, allow_pickle=meta.allow_pickle,
            max_seq_len=meta.max_seq_len, profile=meta.profile, prompts=meta.prompts,
            default_prompt_name=meta.default_prompt_name, matryoshka_dims=meta.matryoshka_dims,
        )
        path = store.commit(staging, manifest)
    return PullResult(status="pulled", manifest=manifest, path=str(path), skipped=skipped)


def ensure_model(store: Store, name: str, *, catalog: Catalog | None = None,
                 progress: Progress = NO_PROGRESS) -> Manifest:
    """The manifest of `name`, pulling it from the catalog first if it is not stored.

    The daemon calls this at start-up for its preloaded models: with a `pkg:`
    source it works offline on a fresh machine. Files are not re-hashed here
    (`Store.open` does that on load), nor are the weights checked against their
    architecture (that needs torch, which the daemon's process never imports; the
    worker checks before it loads, and a preload that fails is named unservable).
    """
    if store.exists(name):
        return store.get(name)
    return pull_model(store, name, catalog=catalog, progress=progress, weights_check=False).manifest
