"""What `fleetctl top` shows (`GET /v1/top`): the box over the last WINDOW_S seconds.

Built from what the daemon keeps anyway, never by asking the workers: each answered
request's latency (`Daemon.submit` calls `Recent.request`), and the workers'
cumulative counters as `Daemon.refresh_gauges` reads them every METRICS_REFRESH_S
(batches from the batch ring, tokens per resident model, loads and evictions),
diffed and stamped with the read's time. The queue's tables are read through
`Broker.call` (`Daemon.workers`, `Daemon.lanes`), so the route never waits for the
queue lock on the event loop. Process CPU and memory come from psutil, GPU
utilisation and memory from NVML (nvidia-ml-py) when a GPU and its driver are there.

Everything here runs on the event loop: no lock.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from fleet.nvml import handle, nvml, nvml_index  # noqa: F401 (nvml_index: where top's readers find it)

#: The span rates and percentiles are taken over, seconds.
WINDOW_S = 10.0
#: Latencies kept per model (a bound on memory at high request rates; the percentiles
#: of a busier model cover the last LATENCIES_KEPT requests of the window).
LATENCIES_KEPT = 4096
#: Events (batches, loads, evictions) kept per kind.
EVENTS_KEPT = 4096


#: A model's window when nothing happened to it.
QUIET: dict[str, Any] = {"requests_per_s": 0.0, "errors_per_s": 0.0, "p50_ms": None, "p95_ms": None,
                         "tokens_per_s": 0.0, "batches": 0, "batch_items": 0.0, "batch_tokens": 0.0, "loads": 0,
                         "evictions": 0, "ttft_p50_ms": None, "generated_tokens_per_s": 0.0}


class Recent:
    """Requests, batches, token counts, loads and evictions of the last WINDOW_S seconds.
    Times are `clock()` seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: model -> (at, seconds, ok) per answered request.
        self.requests: dict[str, deque] = defaultdict(lambda: deque(maxlen=LATENCIES_KEPT))
        #: (at, model, items, tokens) per batch a worker ran.
        self.batches: deque = deque(maxlen=EVENTS_KEPT)
        #: (at, model, tokens) per counter read that saw tokens served.
        self.tokens: deque = deque(maxlen=EVENTS_KEPT)
        #: (at, model, what): "load" or the eviction's reason.
        self.events: deque = deque(maxlen=EVENTS_KEPT)
        #: (at, model, time to first token in seconds, tokens generated) per answered generation.
        self.generations: deque = deque(maxlen=EVENTS_KEPT)

    def request(self, model: str, seconds: float, ok: bool) -> None:
        self.requests[model].append((self.clock(), seconds, ok))

    def batch(self, model: str, items: int, tokens: int) -> None:
        self.batches.append((self.clock(), model, items, tokens))

    def served_tokens(self, model: str, tokens: int) -> None:
        if tokens > 0:
            self.tokens.append((self.clock(), model, tokens))

    def event(self, model: str, what: str) -> None:
        self.events.append((self.clock(), model, what))

    def generation(self, model: str, ttft_s: float, tokens: int) -> None:
        self.generations.append((self.clock(), model, ttft_s, tokens))

    def models(self, window_s: float = WINDOW_S) -> dict[str, dict[str, Any]]:
        """Per model: requests/s, errors/s, p50/p95 ms of the answered ones, tokens/s,
        batches (count, mean items, mean tokens), loads and evictions, and for a generator
        its median time to first token and generated tokens/s, over the window."""
        since = self.clock() - window_s
        out: dict[str, dict[str, Any]] = defaultdict(lambda: dict(QUIET))
        for model, kept in self.requests.items():
            recent = [(s, ok) for at, s, ok in kept if at >= since]
            if not recent:
                continue
            m = out[model]
            m["requests_per_s"] = round(len(recent) / window_s, 2)
            m["errors_per_s"] = round(sum(1 for _, ok in recent if not ok) / window_s, 2)
            ms = np.array([s for s, ok in recent if ok]) * 1e3
            if ms.size:
                m["p50_ms"], m["p95_ms"] = (round(float(v), 2) for v in np.percentile(ms, [50, 95]))
        per_model: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for at, model, items, tokens in self.batches:
            if at >= since:
                per_model[model].append((items, tokens))
        for model, runs in per_model.items():
            m = out[model]
            m["batches"] = len(runs)
            m["batch_items"] = round(sum(i for i, _ in runs) / len(runs), 1)
            m["batch_tokens"] = round(sum(t for _, t in runs) / len(runs), 1)
        for at, model, tokens in self.tokens:
            if at >= since:
                out[model]["tokens_per_s"] += tokens / window_s
        for at, model, what in self.events:
            if at >= since:
                out[model]["loads" if what == "load" else "evictions"] += 1
        ttfts: dict[str, list[float]] = defaultdict(list)
        for at, model, ttft_s, tokens in self.generations:
            if at >= since:
                ttfts[model].append(ttft_s)
                out[model]["generated_tokens_per_s"] += tokens / window_s
        for model, kept in ttfts.items():
            out[model]["ttft_p50_ms"] = round(float(np.median(kept)) * 1e3, 2)
            out[model]["generated_tokens_per_s"] = round(out[model]["generated_tokens_per_s"], 1)
        for m in out.values():
            m["tokens_per_s"] = round(m["tokens_per_s"], 1)
        return dict(out)

    def recent_events(self, window_s: float = WINDOW_S * 6) -> list[dict[str, Any]]:
        """Loads and evictions of the last minute, newest first: (seconds ago, model, what)."""
        now = self.clock()
        return [{"ago_s": round(now - at, 1), "model": model, "what": what}
                for at, model, what in reversed(self.events) if now - at <= window_s]


class ProcessStats:
    """CPU % (since the previous read) and resident memory of processes by pid (psutil)."""

    def __init__(self) -> None:
        self._procs: dict[int, Any] = {}

    def read(self, pids: list[int]) -> dict[int, dict[str, float]]:
        import psutil

        out = {}
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                with proc.oneshot():
                    out[pid] = {"cpu_percent": proc.cpu_percent(None), "rss_bytes": proc.memory_info().rss}
            except psutil.Error:
                self._procs.pop(pid, None)
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        return out


def gpu_stats(devices: list[str], opener: Callable[[], Any] = nvml) -> dict[str, dict[str, float]]:
    """Utilisation (%) and memory (bytes used, total) of each `cuda:K` device, from NVML;
    {} without pynvml, a driver or a GPU. `opener` gives the initialised pynvml module
    (fleet.nvml's, opened once per process: this runs on the API's event loop at every
    /v1/top; a fake in tests)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return {}
    try:
        lib = opener()
    except Exception:  # ImportError, NVMLError: no library, driver or GPU
        return {}
    out = {}
    for device in cuda:
        try:
            h = handle(lib, device)
            util = lib.nvmlDeviceGetUtilizationRates(h)
            mem = lib.nvmlDeviceGetMemoryInfo(h)
        except Exception:
            continue
        out[device] = {"util_percent": float(util.gpu), "memory_used_bytes": int(mem.used),
                       "memory_total_bytes": int(mem.total)}
    return out


def model_rows(recent: dict[str, dict[str, Any]], workers: list[dict[str, Any]],
               lanes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model that is resident, waiting or was served in the window: the
    window's rates and latencies, its lane, its batches against its live profile's budget,
    and the workers holding it."""
    rows: dict[str, dict[str, Any]] = {}

    def row(name: str) -> dict[str, Any]:
        if name not in rows:
            rows[name] = {"model": name, **QUIET, "depth": 0, "oldest_wait_ms": 0.0, "max_batch_items": None,
                          "max_batch_tokens": None, "workers": []}
        return rows[name]

    for name, m in recent.items():
        row(name).update(m)
    for lane in lanes:
        r = row(lane["model"])
        r["depth"], r["oldest_wait_ms"] = lane["depth"], lane["oldest_wait_ms"]
    for w in workers:
        if not w["up"]:
            continue
        for name, m in w["models"].items():
            r = row(name)
            r["workers"].append(w["worker"])
            settings = m.get("settings") or {}
            r["max_batch_items"] = settings.get("max_batch_items", r["max_batch_items"])
            r["max_batch_tokens"] = settings.get("max_batch_tokens", r["max_batch_tokens"])
    return sorted(rows.values(), key=lambda r: (-r["requests_per_s"], r["model"]))
