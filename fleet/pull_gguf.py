"""Pulling a GGUF model: `path:FILE.gguf`, a folder holding one GGUF file and no
Hugging Face model files, or `pkg:PACKAGE/FILE.gguf` (fleet.pull hands these here).

A GGUF file is the whole model (weights, tokenizer, chat template), served by the
`llama.cpp` runtime (the fleet-serve[llamacpp] extra) for the task `generate`. Its header
is read before a byte is copied (`fleet.gguf.read_facts`: a file fleet cannot read is
refused at once, not after copying gigabytes); the file is then copied into the store
and hashed on the way like every store file, and the manifest keeps the header's facts
(`Manifest.gguf`). The transformers weight check of a pull has nothing to check here:
no config.json, no class to build; llama.cpp refuses a file whose tensors do not fit
its architecture when it loads it.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import msgspec

from fleet.catalog import CatalogEntry, Profile
from fleet.errors import BadRequest, SourceUnreachable
from fleet.gguf import SUFFIX, is_gguf, read_facts
from fleet.gguf_convert import convert
from fleet.pull_files import intact
from fleet.store import NO_PROGRESS, Manifest, Progress, Store, hash_file, utc_now

TASK = "generate"
RUNTIME = "llama.cpp"
#: `name-00001-of-00003.gguf`: one part of a split model.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def gguf_file(path: Path, origin: str, *, has_model_files: bool) -> Path | None:
    """The GGUF file a source names: `path` itself, or the one GGUF file at the top of
    a folder that holds no other model files (`has_model_files`: what fleet.pull's scan
    found); None for a model folder. Several GGUF files in one folder (quantisations of
    one model, as people keep them) are refused naming them: the source says which."""
    if path.is_file():
        if not is_gguf(path.name):
            raise SourceUnreachable(f"cannot pull {origin}: {path} is neither a folder nor a GGUF file")
        found = [path]
    elif has_model_files or not path.is_dir():
        return None
    else:
        found = sorted(p for p in path.iterdir() if is_gguf(p.name) and p.is_file())
        if not found:
            return None
        if len(found) > 1:
            shown = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
            raise BadRequest(f"{origin} holds {len(found)} GGUF files ({shown}); pull one of them",
                             hint=f"fleetctl pull path:{path / found[0].name}")
    if _SPLIT.search(found[0].name):
        raise BadRequest(f"{origin}: {found[0].name} is one part of a split GGUF model; fleet serves a model "
                         "of one file: merge the parts into one first")
    return found[0]


def model_name(ref: str) -> str:
    """What a GGUF source's name derives from: its file name without `.gguf`."""
    return ref[: -len(SUFFIX)] if is_gguf(ref) else ref


def pull_gguf(*, store: Store, name: str, file: Path, source_text: str, revision: str | None,
              entry: CatalogEntry | None, previous: Manifest | None, existing: Manifest | None,
              task: str | None, runtime: str | None, progress: Progress = NO_PROGRESS,
              converted_from: str = "") -> tuple[str, Manifest]:
    """(status, manifest) of pulling the GGUF `file` as `name`; the caller holds the
    store's lock for `name`. Status as fleet.pull's: pulled, up_to_date, updated.
    `converted_from`: `file` was made from the source at pull (fleet.gguf_convert)."""
    task = task or (entry.task if entry else None) or (previous.task if previous else None) or TASK
    runtime = runtime or (entry.runtime if entry else None) or (previous.runtime if previous else None) or RUNTIME
    if task != TASK or runtime != RUNTIME:
        raise BadRequest(f"{source_text} is a GGUF model: fleet serves it for task {TASK!r} on runtime "
                         f"{RUNTIME!r}, not {task}/{runtime}", hint="leave out --task and --runtime")
    facts = read_facts(file, file.name, source_text)
    if converted_from:
        facts = msgspec.structs.replace(facts, converted_from=converted_from)
    kept = entry or previous
    max_seq_len = kept.max_seq_len if kept is not None else None
    profile = kept.profile if kept is not None else Profile()
    size = file.stat().st_size
    if existing is not None and [(f.path, f.size) for f in existing.files] == [(file.name, size)] \
            and hash_file(file)[1] == existing.files[0].sha256 and intact(store, existing):
        fresh = msgspec.structs.replace(existing, source=source_text, revision=revision, task=task, runtime=runtime,
                                        base=None, max_seq_len=max_seq_len, profile=profile, gguf=facts)
        if fresh == existing:
            return "up_to_date", existing
        store.rewrite_manifest(fresh)
        return "updated", fresh
    with store.staging(name) as staging:
        progress.start(f"copying {name}", size)
        staging.copy_in(file, file.name, progress)
        progress.finish()
        manifest = Manifest(name=name, source=source_text, revision=revision, task=task, runtime=runtime,
                            files=list(staging.files), created_at=utc_now(), max_seq_len=max_seq_len,
                            profile=profile, gguf=facts)
        store.commit(staging, manifest)
    return "pulled", manifest


def pull_converted(*, store: Store, name: str, folder: Path, source_text: str, revision: str | None,
                   entry: CatalogEntry | None, previous: Manifest | None, existing: Manifest | None,
                   quantize: str, progress: Progress = NO_PROGRESS) -> tuple[str, Manifest]:
    """(status, manifest) of `--quantize`: the safetensors generator in `folder` converted
    to one GGUF file (fleet.gguf_convert) in a temporary folder beside the store, then
    stored as any GGUF pull is, the manifest saying what it was made from."""
    if not folder.is_dir():
        raise BadRequest(f"--quantize converts a model folder; {source_text} is not one")
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=store.root.parent) as tmp:
        progress.start(f"converting {name} to {quantize}", 1)
        file = convert(folder, Path(tmp), quantize, origin=source_text)
        progress.advance(1)
        progress.finish()
        how = "safetensors, converted to F16 by fleet" + (f", quantized to {quantize} by llama.cpp"
                                                          if quantize != "f16" else "")
        return pull_gguf(store=store, name=name, file=file, source_text=source_text, revision=revision, entry=entry,
                         previous=previous, existing=existing, task=None, runtime=None, progress=progress,
                         converted_from=how)
