"""Samples the box while a bench runs: CPU and RSS per process group, GPU via NVML.

A *group* is a label and root PIDs ("server", "generator", ...); each sample
covers the roots and all their descendants at that moment (a daemon's worker
processes, spawned later, are picked up). CPU is percent of one core, summed
over the group (200 % = two cores busy). GPU utilisation and memory come from
NVML (`pynvml`, package nvidia-ml-py); without a driver or a GPU the sampler
records none and says why, once. Sampling runs in a thread of the bench's
parent process; `window(t0, t1)` aggregates what fell inside one step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class Sample:
    t: float
    cpu_pct: dict[str, float]
    rss_bytes: dict[str, int]
    gpu_util_pct: list[float] = field(default_factory=list)
    gpu_mem_bytes: list[int] = field(default_factory=list)


class _Gpus:
    def __init__(self) -> None:
        self.handles: list = []
        self.names: list[str] = []
        self.total_mem: list[int] = []
        self.why_none = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self.handles.append(h)
                name = pynvml.nvmlDeviceGetName(h)
                self.names.append(name.decode() if isinstance(name, bytes) else name)
                self.total_mem.append(int(pynvml.nvmlDeviceGetMemoryInfo(h).total))
            self._nvml = pynvml
            if not self.handles:
                self.why_none = "NVML reports no GPU"
        except ImportError:
            self.why_none = "pynvml is not installed (pip install nvidia-ml-py)"
        except Exception as exc:  # pynvml.NVMLError and friends: no driver, no device
            self.why_none = f"no NVIDIA GPU ({type(exc).__name__}: {exc})"

    def read(self) -> tuple[list[float], list[int]]:
        util, mem = [], []
        for h in self.handles:
            util.append(float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu))
            mem.append(int(self._nvml.nvmlDeviceGetMemoryInfo(h).used))
        return util, mem


def describe_gpus() -> dict:
    g = _Gpus()
    return {"gpus": [{"name": n, "memory_bytes": m} for n, m in zip(g.names, g.total_mem)], "why_none": g.why_none}


class Sampler:
    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.groups: dict[str, list[int]] = {}
        self.samples: list[Sample] = []
        self.gpus = _Gpus()
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def track(self, label: str, pids: list[int]) -> None:
        with self._lock:
            self.groups[label] = [p for p in pids if p]

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _members(self, roots: list[int]) -> list[psutil.Process]:
        out = []
        for pid in roots:
            try:
                root = self._proc(pid)
                out.append(root)
                out.extend(self._proc(c.pid) for c in root.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return out

    def _proc(self, pid: int) -> psutil.Process:
        proc = self._procs.get(pid)
        if proc is None:
            proc = psutil.Process(pid)
            # The first cpu_percent() call primes the counter and returns 0.
            proc.cpu_percent(None)
            self._procs[pid] = proc
        return proc

    def sample_once(self) -> Sample:
        with self._lock:
            groups = dict(self.groups)
        cpu: dict[str, float] = {}
        rss: dict[str, int] = {}
        for label, roots in groups.items():
            c, r = 0.0, 0
            for proc in self._members(roots):
                try:
                    with proc.oneshot():
                        c += proc.cpu_percent(None)
                        r += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
            cpu[label], rss[label] = c, r
        util, mem = self.gpus.read() if self.gpus.handles else ([], [])
        s = Sample(time.time(), cpu, rss, util, mem)
        with self._lock:
            self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def window(self, t0: float, t1: float) -> dict:
        """Mean CPU %, peak RSS per group and mean GPU util / peak GPU memory over [t0, t1] (unix s)."""
        with self._lock:
            inside = [s for s in self.samples if t0 <= s.t <= t1]
        if not inside:
            return {}
        labels = sorted({k for s in inside for k in s.cpu_pct})
        out: dict = {
            "samples": len(inside),
            "cpu_pct": {k: round(sum(s.cpu_pct.get(k, 0.0) for s in inside) / len(inside), 1) for k in labels},
            "rss_bytes": {k: max(s.rss_bytes.get(k, 0) for s in inside) for k in labels},
        }
        if self.gpus.handles:
            n = len(self.gpus.handles)
            out["gpu_util_pct"] = [round(sum(s.gpu_util_pct[i] for s in inside) / len(inside), 1) for i in range(n)]
            out["gpu_mem_bytes"] = [max(s.gpu_mem_bytes[i] for s in inside) for i in range(n)]
        return out

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def listening_pids(port: int) -> list[int]:
    """PIDs with a TCP socket listening on `port` (the server to sample); empty if none is visible."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return []
    return sorted({c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})
