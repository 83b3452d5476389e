"""`GET /v1/top`: the box live, for `fleetctl top` (daemon.top says what each figure is).

Reply: `{box, uptime_s, window_s, queue: {depth, in_flight}, cpu_percent, models: [...],
workers: [...], devices: [...], events: [...]}`. The queue's tables are read through
`Broker.call` (never waiting for its lock on the loop); the rates come from the
window the daemon keeps (`Daemon.recent`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from litestar import Controller, Request, Response, get

from fleet.daemon.controllers.models import workers_view
from fleet.daemon.core import Daemon
from fleet.daemon.http import reply
from fleet.daemon.operator import is_operator
from fleet.daemon.top import WINDOW_S, ProcessStats, gpu_stats, model_rows

#: CPU % of each process is measured between two reads of the route; one reader
#: (fleetctl top) polling every second or two gets per-interval figures.
_procs = ProcessStats()


def device_rows(workers: list[dict[str, Any]], gpus: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per device: fleet's budget and use (the workers' info blobs) and, for GPUs, NVML's view."""
    devices: dict[str, dict[str, Any]] = {}
    for w in workers:
        d = devices.setdefault(w["device"], {"device": w["device"], "budget_bytes": 0, "used_bytes": 0, "workers": []})
        d["budget_bytes"] = max(d["budget_bytes"], w.get("budget_bytes", 0))
        d["used_bytes"] += w.get("used_bytes", 0)
        d["workers"].append(w["worker"])
    for name, g in gpus.items():
        devices.setdefault(name, {"device": name, "budget_bytes": 0, "used_bytes": 0, "workers": []}).update(g)
    return sorted(devices.values(), key=lambda d: d["device"])


class TopController(Controller):
    @get("/v1/top")
    async def top(self, request: Request, daemon: Daemon) -> Response:
        import psutil

        workers = await workers_view(daemon)
        lanes = await daemon.lanes()
        stats = _procs.read([os.getpid(), *(w["pid"] for w in workers)])
        rows = []
        for w in workers:
            proc = stats.get(w["pid"], {})
            rows.append({"worker": w["worker"], "index": w["index"], "pid": w["pid"], "device": w["device"],
                         "up": w["up"], "restarts": w["restarts"], "claimed": w["claimed"],
                         "cpu_percent": proc.get("cpu_percent"), "rss_bytes": proc.get("rss_bytes"),
                         "loading": w.get("loading", ""), "models": sorted(w["models"]),
                         "last_batch": w.get("last_batch", {})})
        api = stats.get(os.getpid(), {})
        return reply(request, {
            "box": daemon.box,
            # Which store this daemon serves, for its operator (`fleetctl top` names it).
            **({"home": daemon.settings.home} if is_operator(request) else {}),
            "uptime_s": round(time.time() - daemon.started_at, 1),
            "window_s": WINDOW_S,
            "queue": {"depth": sum(lane["depth"] for lane in lanes),
                      "in_flight": daemon.broker.in_flight if daemon.broker else 0},
            "cpu_percent": psutil.cpu_percent(None),
            "api": {"pid": os.getpid(), **api},
            # Each model row names the aliases it serves (as their version or their canary).
            "models": [{**m, "aliases": daemon.aliases.aliases_of(m["model"])}
                       for m in model_rows(daemon.recent.models(), workers, lanes)],
            "workers": rows,
            "slots": daemon.supervisor.view() if daemon.supervisor else [],
            "devices": device_rows(workers, gpu_stats(sorted({w["device"] for w in workers}))),
            "events": daemon.recent.recent_events(),
            # Upstreams (daemon.upstreams): each one's state, and the requests it answered for this box.
            "upstreams": daemon.upstreams.view() if daemon.upstreams is not None else [],
        })
