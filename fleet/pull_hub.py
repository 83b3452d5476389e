"""Pulling from the Hugging Face hub (`hf:ORG/NAME[@REV]`).

Its own concern apart from the pull's steps (fleet.pull): the hub's API and its
errors, mapped to fleet's (`_hub_error`), its progress bars forwarded to the pull's
`Progress`, and the download checked against the hub's record (sizes, sha256 of LFS
files). A pinned commit already stored needs no network. `huggingface_hub` is
imported only here, only when a hub source is pulled.
"""

from __future__ import annotations

import re
import shutil
from typing import Any

from fleet.catalog import Catalog, CatalogEntry, Source
from fleet.errors import BadRequest, FleetError, IntegrityError, ModelNotFound, SourceUnreachable
from fleet.pull_files import add_backbone, intact, select_files
from fleet.pull_meta import (
    check_mismatched_weights, checked_adapter, model_metadata, new_manifest, refreshed, remote_code,
)
from fleet.store import Manifest, Progress, Store, safe_relpath

#: A full commit id: a stored model pinned to one needs no network to be up to date.
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


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


def pull_hub(
    *, store: Store, name: str, source: Source, entry: CatalogEntry | None, previous: Manifest | None,
    existing: Manifest | None, task: str | None, runtime: str | None, base: str | None,
    catalog: Catalog, progress: Progress, weights_check: bool,
) -> tuple[str, Manifest, list[str]]:
    """(status, manifest, skipped files) of a pull from the hub, under the store's lock for
    `name`. Status as fleet.pull's: pulled, up_to_date, updated."""
    revision = source.revision or "main"
    source_text = f"hf:{source.ref}@{revision}"
    allow_pickle = entry.allow_pickle if entry else (previous.allow_pickle if previous else False)

    def up_to_date(commit: str, skipped: list[str]) -> tuple[str, Manifest, list[str]] | None:
        if existing is None or existing.revision != commit or not intact(store, existing):
            return None
        meta = model_metadata(entry=entry, previous=previous, folder=store.path(name), task=task,
                              runtime=runtime, base=base, catalog=catalog, origin=source_text)
        meta = checked_adapter(store, meta, store.path(name), task=task or (entry.task if entry else None),
                               origin=source_text)
        fresh = refreshed(existing, meta, source_text, commit)
        status = "up_to_date"
        if fresh != existing:
            store.rewrite_manifest(fresh)
            status = "updated"
        return status, fresh, skipped

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
        meta = model_metadata(entry=entry, previous=previous, folder=staging.path, task=task,
                              runtime=runtime, base=base, catalog=catalog, origin=source_text)
        meta = checked_adapter(store, meta, staging.path, task=task or (entry.task if entry else None),
                               origin=source_text)
        if weights_check:
            check_mismatched_weights(staging.path, name, meta)
        manifest = new_manifest(name, meta, source=source_text, revision=commit, files=list(staging.files))
        store.commit(staging, manifest)
    return "pulled", manifest, skipped
