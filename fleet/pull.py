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

The steps' parts live beside it: which files a pull takes (fleet.pull_files),
what the model is and the checks it passes (fleet.pull_meta), the hub
(fleet.pull_hub: `huggingface_hub` is imported only for `hf:` sources) and GGUF
files (fleet.pull_gguf).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Literal

import msgspec

from fleet.catalog import (
    RUNTIME_RE, TASKS, Catalog, CatalogEntry, Source, derive_name, load_catalog, parse_source, validate_name,
)
from fleet.errors import BadRequest, FleetError, IntegrityError, ModelNotFound, SourceUnreachable
from fleet.gguf_convert import check_quant_type
from fleet.pull_files import PICKLE_SUFFIXES, add_backbone, intact, package_folder, same_files, scan_folder
from fleet.pull_gguf import gguf_file, model_name, pull_converted, pull_gguf
from fleet.pull_hub import pull_hub
from fleet.pull_meta import (
    check_mismatched_weights, checked_adapter, model_metadata, new_manifest, refreshed, remote_code,
)
from fleet.store import NO_PROGRESS, Manifest, Progress, Store


class PullResult(msgspec.Struct, kw_only=True):
    #: pulled: files written; up_to_date: nothing changed; updated: manifest metadata refreshed.
    status: Literal["pulled", "up_to_date", "updated"]
    manifest: Manifest
    path: str
    #: Source files left out (pickle weights next to safetensors, foreign formats, ...).
    skipped: list[str] = msgspec.field(default_factory=list)


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
                status, manifest, skipped = pull_hub(**args)
                return PullResult(status=status, manifest=manifest, path=str(store.path(name)), skipped=skipped)
            return _pull_local(**args)
        except OSError as exc:
            # Reading the source or writing the store failed (permissions, disk
            # full): the staging dir is gone already, the stored copy untouched.
            where = f" ({exc.filename})" if exc.filename else ""
            raise FleetError(f"cannot pull {source} into {store.root}: {exc.strerror or exc}{where}") from exc


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
    meta = model_metadata(entry=entry, previous=previous, folder=folder, task=task, runtime=runtime,
                          base=base, catalog=catalog, origin=source_text)
    meta = checked_adapter(store, meta, folder, task=task or (entry.task if entry else None), origin=source_text)

    if existing is not None and same_files(existing, files) and intact(store, existing):
        fresh = refreshed(existing, meta, source_text, revision)
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
        manifest = new_manifest(name, meta, source=source_text, revision=revision, files=list(staging.files))
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
