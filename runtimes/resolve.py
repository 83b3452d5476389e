"""Model name -> ModelSpec, from the store (files, checked) and the catalog (profile)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from fleet.calibration import calibration_extra
from fleet.catalog import Profile as CatalogProfile
from fleet.catalog import load_catalog, profile_sources, select_profile
from fleet.config import Settings
from fleet.errors import BadRequest
from fleet.store import Store
from fleet.runtimes.base import ModelSpec, Profile

log = logging.getLogger("fleet.worker")


#: Every setting's source when a model has no catalog entry (fleet.catalog.profile_sources).
MANIFEST_SOURCES = dict.fromkeys(CatalogProfile.__struct_fields__, "manifest")


def store_resolver(settings: Settings, device: str = "cpu", *, verify: bool = True) -> Callable[[str], ModelSpec]:
    """Resolver for a worker on `device`: the catalog profile tuned for its device
    class (`runtimes.device.device_class`) when the entry has one, else the
    entry's default profile, else the manifest's. `spec.extra["profile"]` says
    which ("<device class>" or "default"; the worker's info blob shows it).
    `verify`: re-hash every file first (every load does; a decision that may not
    load sizes the model without, runtimes.residency `peek`)."""
    from fleet.runtimes.device import device_class

    store = Store(settings.store_path)
    klass = device_class(device)

    def resolve(name: str) -> ModelSpec:
        # Every load re-hashes the files: a changed file is reported, never served.
        manifest, path = store.open(name, verify=verify)
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
        sources = profile_sources(settings.home, name, klass) if entry is not None else MANIFEST_SOURCES
        return ModelSpec(
            name=name,
            path=path,
            task=manifest.task,
            runtime=manifest.runtime,
            profile=Profile.from_mapping(msgspec.structs.asdict(profile)),
            trust_remote_code=manifest.trust_remote_code,
            max_seq_len=manifest.max_seq_len,
            extra={"base": manifest.base, "profile": which, "profile_from": sources,
                   "threshold": entry.threshold if entry is not None else None,
                   **calibration_extra(entry.calibration if entry is not None else None),
                   # Prompts as pulled (None: a manifest from before fleet recorded them;
                   # the adapter reads the folder then); the source names INSTRUCTOR hub ids.
                   "source": manifest.source, "prompts": manifest.prompts,
                   "default_prompt_name": manifest.default_prompt_name,
                   # LLM rerankers' prompt settings (runtimes/adapters/llm_rerank.py); None: the format's.
                   **{k: getattr(entry, k, None) for k in ("prompt_format", "default_instruction", "true_token",
                                                          "false_token")}},
        )

    return resolve


ProfileNow = tuple[Profile, str, dict[str, str], dict[str, Any]]


def store_profiles(settings: Settings, device: str = "cpu") -> Callable[[str], ProfileNow]:
    """What a model's profile is now for a worker on `device` (`store_resolver`'s choice,
    read again from the catalog and the manifest, files not re-hashed): (profile, its
    name, each setting's source, its calibration as `calibration_extra`). A SIGHUP, or
    a calibration written through the daemon, applies it to resident models
    (runtimes.commands)."""
    from fleet.runtimes.device import device_class

    store = Store(settings.store_path)
    klass = device_class(device)

    def profile_of(name: str) -> ProfileNow:
        manifest = store.get(name)
        entry = load_catalog(settings.home).find(name)  # a broken models.toml raises: nothing is changed
        if entry is None:
            return (Profile.from_mapping(msgspec.structs.asdict(manifest.profile)), "default", MANIFEST_SOURCES,
                    calibration_extra(None))
        profile, which = select_profile(entry, klass)
        return (Profile.from_mapping(msgspec.structs.asdict(profile)), which,
                profile_sources(settings.home, name, klass), calibration_extra(entry.calibration))

    return profile_of
