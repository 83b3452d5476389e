"""Quotas per owner: how many models and adapters a team may store, and how many bytes
of them may be resident, on one box.

Owners are named in config.toml with the model names that are theirs (shell patterns):

    [owners.ml-team]
    models_match = ["tone-*", "support-*"]
    models = 5                  # stored models (LoRA adapters not counted), at most
    adapters = 20               # stored LoRA adapters, at most
    resident_bytes = 4294967296 # bytes of its models resident on this box's workers

A bound of 0 is no bound. A model belongs to the first owner (by name) one of whose
patterns matches its name; a model no owner claims is bounded by the box's own limits
only (`store_max_models`, memory). Past a bound the pull, copy or create (checked as the
store commits it, whatever path added it: fleet.store.Store.commit) or the load (checked
by the daemon before a request or an admin call loads the model: daemon.quotas) is
refused 507 `quota_exceeded`, naming the owner, the bound and its setting.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import msgspec

from fleet.errors import QuotaExceeded


class OwnerQuota(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: Model names (shell patterns) that are this owner's.
    models_match: list[str] = []
    models: int = 0
    adapters: int = 0
    resident_bytes: int = 0


def owner_of(owners: dict[str, OwnerQuota], name: str) -> str | None:
    """The owner whose patterns claim model `name` (the first by owner name), or None."""
    for owner in sorted(owners):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in owners[owner].models_match):
            return owner
    return None


def check_add(owners: dict[str, OwnerQuota], name: str, adapter: bool, stored: Iterable[Any]) -> None:
    """May `name` (a LoRA adapter when `adapter`) be stored? `stored`: the manifests in the
    store now (one of `name` itself is being replaced: it does not count)."""
    owner = owner_of(owners, name)
    if owner is None:
        return
    quota = owners[owner]
    kind, bound = ("adapters", quota.adapters) if adapter else ("models", quota.models)
    if not bound:
        return
    held = sorted(m.name for m in stored
                  if m.name != name and bool(m.base) == adapter and owner_of(owners, m.name) == owner)
    if len(held) >= bound:
        raise QuotaExceeded(
            f"{owner} stores {len(held)} {kind} ({', '.join(held)}), its quota (owners.{owner}.{kind} = {bound}): "
            f"{name!r} is not stored", hint=f"remove one of them first (fleetctl rm NAME), or raise owners.{owner}.{kind}")


def check_load(owners: dict[str, OwnerQuota], name: str, size_bytes: int, resident: dict[str, int]) -> None:
    """May `name` (`size_bytes` on disk, its size once loaded as near as the store knows)
    be loaded beside what is resident (`resident`: model -> bytes on this box's workers)?"""
    owner = owner_of(owners, name)
    if owner is None or name in resident:
        return
    bound = owners[owner].resident_bytes
    if not bound:
        return
    mine = {m: b for m, b in resident.items() if owner_of(owners, m) == owner}
    held = sum(mine.values())
    if held + size_bytes > bound:
        listed = ", ".join(f"{m} {b / (1 << 20):.1f} MiB" for m, b in sorted(mine.items())) or "none"
        raise QuotaExceeded(
            f"loading {name!r} ({size_bytes / (1 << 20):.1f} MiB) would take {owner}'s resident models to "
            f"{(held + size_bytes) / (1 << 20):.1f} MiB, past its quota (owners.{owner}.resident_bytes = {bound}); "
            f"resident now: {listed}", hint=f"unload one (fleetctl ps shows them), or raise owners.{owner}.resident_bytes")
