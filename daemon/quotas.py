"""Owners' resident-bytes quotas (fleet.quotas) where the daemon makes a worker load: a
request for a model that is not resident, an admin load or pin.

The check reads what is resident from the workers' info blobs at most every REFRESH_S
(a request for a resident model costs a dict look-up), and sizes the model to load by
its files in the store (the weights it will hold; the worker measures its real
footprint once loaded, and the next check counts that). Two loads of one owner
admitted within one refresh can together pass the bound by one model: the bound is
the operator's guard against a team's models crowding the box, not a byte-exact cap.
"""

from __future__ import annotations

import time
from typing import Any

from fleet.quotas import check_load, owner_of

#: Seconds a read of the resident models stays fresh for the check.
REFRESH_S = 0.5


class ResidentBytes:
    """model -> bytes resident on this box's workers (a model on two workers counts twice)."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.read_at = float("-inf")
        self.resident: dict[str, int] = {}

    async def current(self) -> dict[str, int]:
        if time.monotonic() - self.read_at > REFRESH_S:
            resident: dict[str, int] = {}
            for w in await self.daemon.workers():
                if w["up"]:
                    for name, m in w["models"].items():
                        resident[name] = resident.get(name, 0) + int(m.get("bytes", 0))
            self.resident, self.read_at = resident, time.monotonic()
        return self.resident


async def check_owner_load(daemon: Any, model: str) -> None:
    """QuotaExceeded when loading `model` (a stored one, this box's) would take its owner
    past `resident_bytes`; nothing to do for a model no owner claims, or one resident."""
    owners = daemon.settings.owners
    if not owners or owner_of(owners, model) is None:
        return
    view = getattr(daemon, "resident_bytes", None)
    if view is None:
        view = daemon.resident_bytes = ResidentBytes(daemon)
    resident = await view.current()
    if model not in resident:
        check_load(owners, model, daemon.store.get(model).size_bytes, resident)
