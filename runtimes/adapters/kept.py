"""What a load measured about a model, kept beside it so a reload does not measure again.

A load probes: whether a reduced-precision dtype keeps the answers
(`hf_common.choose_dtype`), whether a traced forward agrees and is faster
(`traced.trace_probed`, which keeps its graph too), up to what size one thread
beats the worker's (`threads.measure`). The verdicts depend only on the model's
files, the device class, the thread count and the libraries' versions, so each
is kept as a note in the model's store folder (`fleet.derived.read_note` /
`write_note`) under a key of exactly those, and a reload with the same key
serves the kept verdict. A model outside a store (no manifest) keeps nothing.

Keeping never fails a load: a note that cannot be written is logged, and the
next load measures again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fleet.derived import model_sources, read_note, sources_digest, write_note
from fleet.runtimes.device import device_class

log = logging.getLogger("fleet.worker")


def versions(torch: Any) -> dict[str, str]:
    """The libraries whose change may change a verdict."""
    import transformers

    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def key(model_dir: Path | None, device: str, torch: Any, **parts: object) -> dict[str, str] | None:
    """What a verdict on the model in `model_dir` depends on: its files, the device
    class, the libraries and `parts` (None outside a store: nothing is kept)."""
    sources = model_sources(model_dir) if model_dir is not None else None
    if sources is None:
        return None
    return {"model": sources_digest(sources), "device_class": device_class(device), **versions(torch),
            **{k: str(v) for k, v in parts.items()}}


def recall(model_dir: Path, note: str, under: dict[str, str] | None) -> dict | None:
    """The verdict kept as `note` under this key, else None."""
    return read_note(model_dir, note, under) if under is not None else None


def keep(model_dir: Path, note: str, under: dict[str, str] | None, value: dict) -> None:
    """Keep a verdict (replacing any); a failure to write is logged, never raised."""
    if under is None:
        return
    try:
        write_note(model_dir, note, under, value)
    except OSError as exc:
        log.warning("cannot keep the %s verdict of %s: %s", note, model_dir.name, exc)
