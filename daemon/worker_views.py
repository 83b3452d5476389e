"""The workers as the daemon sees them, from the shared queue's worker table and their
info blobs: the views `/v1/ps`, the admin routes and the serving profiles read, and the
gauges and counters `/metrics` and `GET /v1/top` get from the workers' cumulative
counters.

Apart from daemon/core.py because it is reading, not running: plain functions over one
read of the queue, and one bookkeeper (`WorkerGauges`) that remembers what it read last
so no load, eviction or batch between two reads is missed or counted twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleet.control import is_control_lane
from fleet.local_queue import LaneStats, LocalQueue, WorkerInfo
from fleet.protocol import ProfileView

from fleet.daemon.metrics import Metrics
from fleet.daemon.top import Recent

log = logging.getLogger("fleet.daemon")

_info_decoder = msgspec.msgpack.Decoder()

#: A worker that has not heartbeaten for this long is not counted as up.
HEARTBEAT_STALE_S = 30.0


def worker_views(infos: list[WorkerInfo], now_ns: int) -> list[dict[str, Any]]:
    """The workers as `/v1/ps` and the admin routes see them, from one read of the queue."""
    out = []
    for w in infos:
        info = _info_decoder.decode(w.info) if w.info else {}
        out.append({
            "worker": w.wid,
            "pid": w.pid,
            "device": w.device,
            "up": (now_ns - w.last_heartbeat_ns) / 1e9 < HEARTBEAT_STALE_S,
            "claimed": w.claimed,
            "models": info.get("models", {}),
            "last_batch": info.get("last_batch", {}),
            # Device memory as the worker sees it (runtimes.device_memory): its device's budget, its own use.
            "budget_bytes": info.get("budget_bytes", 0),
            "used_bytes": info.get("used_bytes", 0),
            "loading": info.get("loading", ""),
            # Pins it was to keep and cannot (runtimes.residency.Residency.restore): name -> why.
            "unservable": info.get("unservable", {}),
        })
    return out


def live_profiles(workers: list[dict[str, Any]], name: str) -> list[ProfileView]:
    """The serving profile `name` runs with on each live worker holding it (their info
    blobs, as `worker_views` reads them): the settings in force and where each came from."""
    return [ProfileView(w["worker"], w["device"], m.get("profile", "default"), m.get("settings", {}),
                        m.get("profile_from", {}),
                        **{k: m[k] for k in ("decide_temperatures", "calibration") if k in m})
            for w in workers if w["up"] and (m := w["models"].get(name))]


def lane_views(stats: list[LaneStats], now_ns: int) -> list[dict[str, Any]]:
    """The lanes with work, from one read of the queue; control lanes (admin commands
    to one worker) are plumbing, not demand, and left out."""
    return [
        {
            "model": s.model,
            "depth": s.depth,
            # Its items' sizes in the daemon's estimate (no tokenizer has run on them yet).
            "estimated_tokens": s.tokens,
            "claimed": s.claimed,
            "oldest_wait_ms": round((now_ns - s.oldest_enqueue_ns) / 1e6, 1) if s.depth else 0.0,
        }
        for s in stats if not is_control_lane(s.model)
    ]


@dataclass
class WorkerSeen:
    """What `WorkerGauges.refresh` last read from one worker's info blob: its cumulative
    counters (diffed into the Prometheus counters) and its resident models."""

    pid: int
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, dict[str, int]] = field(default_factory=dict)
    batch_seq: int = 0
    models: tuple[str, ...] = ()
    #: Each resident model's cumulative `tokens` (reset when it is loaded again).
    tokens: dict[str, int] = field(default_factory=dict)


class WorkerGauges:
    """The workers' cumulative counters (loads, evictions, batches, tokens), diffed into
    the Prometheus series and the recent-activity view, per worker as last read."""

    def __init__(self, metrics: Metrics, recent: Recent) -> None:
        self.metrics = metrics
        self.recent = recent
        self._seen: dict[int, WorkerSeen] = {}

    def refresh(self, queue: LocalQueue) -> int:
        """Bring the worker-side series up to date; the number of workers up. Lanes and
        device memory as they are now;
        loads, evictions and batches from the workers' cumulative counters, diffed
        against the last read so no event between two reads is missed. A worker
        whose pid changed or that left the queue lost its models (`worker_exit`).
        Event loop only (no lock needed for `_seen`)."""
        now = time.monotonic_ns()
        for lane in lane_views(queue.lane_stats(), now):
            self.metrics.set_lane(lane["model"], lane["depth"], lane["oldest_wait_ms"] / 1000.0)
        memory: dict[str, tuple[int, int]] = {}
        current: set[int] = set()
        infos = queue.workers()
        workers_up = sum((now - w.last_heartbeat_ns) / 1e9 < HEARTBEAT_STALE_S for w in infos)
        for w in infos:
            info = _info_decoder.decode(w.info) if w.info else {}
            current.add(w.wid)
            seen = self._seen.get(w.wid)
            if seen is None or seen.pid != w.pid:
                if seen is not None:
                    self._worker_exited(seen)
                seen = self._seen[w.wid] = WorkerSeen(w.pid)
            self._count_worker(seen, info)
            used, budget = memory.get(w.device, (0, 0))
            # Workers of one device share its budget; each reports its own use.
            memory[w.device] = (used + info.get("used_bytes", 0), max(budget, info.get("budget_bytes", 0)))
        for wid in [wid for wid in self._seen if wid not in current]:
            self._worker_exited(self._seen.pop(wid))
        for device, (used, budget) in memory.items():
            self.metrics.set_device_memory(device, used, budget)
        return workers_up

    def _count_worker(self, seen: WorkerSeen, info: dict[str, Any]) -> None:
        for name, n in info.get("loads", {}).items():
            for _ in range(n - seen.loads.get(name, 0)):
                self.metrics.model_loaded(name)
                self.recent.event(name, "load")
        seen.loads = dict(info.get("loads", {}))
        for name, by_reason in info.get("evictions", {}).items():
            before = seen.evictions.get(name, {})
            for reason, n in by_reason.items():
                for _ in range(n - before.get(reason, 0)):
                    self.metrics.model_evicted(name, reason)
                    self.recent.event(name, reason)
        seen.evictions = {name: dict(r) for name, r in info.get("evictions", {}).items()}
        batches = info.get("batches")
        if batches:
            seq, names, ring = batches["seq"], batches["models"], batches["ring"]
            new = seq - seen.batch_seq
            kept = len(ring) // 3
            if new > kept:
                log.warning("worker pid %d ran %d batches since the last read; batch metrics have the last %d",
                            seen.pid, new, kept)
            for i in range(max(0, kept - new), kept):
                model, items, tokens = ring[3 * i: 3 * i + 3]
                self.metrics.observe_batch(names[model], items, tokens)
                self.recent.batch(names[model], items, tokens)
            seen.batch_seq = seq
        seen.models = tuple(info.get("models", {}))
        tokens = {name: m.get("tokens", 0) for name, m in info.get("models", {}).items() if m}
        for name, n in tokens.items():
            before = seen.tokens.get(name, 0)
            self.recent.served_tokens(name, n - before if n >= before else n)
        seen.tokens = tokens

    def _worker_exited(self, seen: WorkerSeen) -> None:
        for name in seen.models:
            self.metrics.model_evicted(name, "worker_exit")
            self.recent.event(name, "worker_exit")
