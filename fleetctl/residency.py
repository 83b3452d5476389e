"""Per-device memory view of `/v1/ps` (what `fleetctl ps` prints under "Devices").

Each worker reports its device's budget and its own use (runtimes.device_memory);
a device's `used` is the sum over its workers. Pure functions over the JSON.
"""

from __future__ import annotations

from typing import Any



def device_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per device: budget, used, and its resident models (pinned or not,
    bytes, last used, served), most recently used first."""
    devices: dict[str, dict[str, Any]] = {}
    for w in state.get("workers", []):
        if not w.get("up", True):
            continue
        d = devices.setdefault(w["device"], {"device": w["device"], "budget_bytes": 0, "used_bytes": 0, "models": []})
        d["budget_bytes"] = max(d["budget_bytes"], w.get("budget_bytes", 0))
        d["used_bytes"] += w.get("used_bytes", 0)
        for name, m in w.get("models", {}).items():
            d["models"].append({"name": name, "worker": w["worker"], "pinned": bool(m.get("pinned")),
                                "bytes": m.get("bytes", 0), "last_used": m.get("last_used", 0.0),
                                "served": m.get("served", 0)})
        if w.get("loading"):
            d["models"].append({"name": w["loading"], "worker": w["worker"], "loading": True})
    for d in devices.values():
        d["models"].sort(key=lambda m: -m.get("last_used", float("inf")))
    return sorted(devices.values(), key=lambda d: d["device"])
