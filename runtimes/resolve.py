"""Model name -> ModelSpec, from the store (files, checked) and the catalog (profile)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from fleet.catalog import load_catalog, select_profile
from fleet.config import Settings
from fleet.errors import BadRequest
from fleet.store import Store
from runtimes.base import ModelSpec, Profile

log = logging.getLogger("fleet.worker")


def store_resolver(settings: Settings, device: str = "cpu") -> Callable[[str], ModelSpec]:
    """Resolver for a worker on `device`: the catalog profile tuned for its device
    class (`runtimes.device.device_class`) when the entry has one, else the
    entry's default profile, else the manifest's. `spec.extra["profile"]` says
    which ("<device class>" or "default"; the worker's info blob shows it)."""
    from runtimes.device import device_class

    store = Store(settings.store_path)
    klass = device_class(device)

    def resolve(name: str) -> ModelSpec:
        # Every load re-hashes the files: a changed file is reported, never served.
        manifest, path = store.open(name, verify=True)
        # The catalog (shipped file overlaid by FLEET_HOME/models.toml) is read at
        # each load, so a profile tuned while the daemon runs applies on next load.
        try:
            entry = load_catalog(settings.home).find(name)
        except BadRequest as exc:
            # models.toml broken while serving is the operator's to fix, not the
            # client's (never a 400 for a pin or a request): load with the profile
            # recorded at pull time, and say so.
            log.error("cannot read the model catalog (%s); loading %s with its manifest's profile", exc.message, name)
            entry = None
        profile, which = select_profile(entry, klass) if entry is not None else (manifest.profile, "default")
        return ModelSpec(
            name=name,
            path=path,
            task=manifest.task,
            runtime=manifest.runtime,
            profile=Profile.from_mapping(msgspec.structs.asdict(profile)),
            trust_remote_code=manifest.trust_remote_code,
            max_seq_len=manifest.max_seq_len,
            extra={"base": manifest.base, "profile": which,
                   "threshold": entry.threshold if entry is not None else None,
                   # Prompts as pulled (None: a manifest from before fleet recorded them;
                   # the adapter reads the folder then); the source names INSTRUCTOR hub ids.
                   "source": manifest.source, "prompts": manifest.prompts,
                   "default_prompt_name": manifest.default_prompt_name,
                   # LLM rerankers' prompt settings (runtimes/llm_rerank.py); None: the format's.
                   **{k: getattr(entry, k, None) for k in ("prompt_format", "default_instruction", "true_token",
                                                          "false_token")}},
        )

    return resolve
