"""What the GPU acceptance run's checks share (`python -m fleet.bench gpu-check`): the
`Check` record each prints as a line, the run's sizes, and HTTP to its daemons.

A module of its own so the checks can live by concern (bench.gpu_parity: answers
against a CPU daemon; bench.gpu_capacity: what the device holds and how fast) while
bench.gpu_check keeps the run that orders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleet.bench.daemon import LocalDaemon

#: Texts per request at the knee (closed loop).
BATCH = 32
TIMEOUT_MS = 120_000
#: Inputs every daemon of the run is asked about: short, long, entities, one letter.
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "Invoices must be paid within thirty days of receipt unless agreed otherwise in writing.",
         "Angela Merkel met Emmanuel Macron in Berlin on Tuesday to discuss Airbus and Siemens.",
         "GPU memory is managed per device: pinned models stay resident, others are evicted LRU.", "a"]


@dataclass(frozen=True)
class Sizes:
    """Model and load sizes: the GPU run's, or small ones for `--device cpu`."""

    base: dict  # BertConfig of the 110M-class embedder
    budget_hidden: int  # the vram-budget models: sized so 2.5 of them dominate a CUDA context
    budget_layers: int
    clients: tuple[int, ...]  # closed-loop steps
    step_s: float
    generators: int  # load generator processes
    two_worker_requests: int
    host_clients: int  # the host-path check (bench.host_path): clients, measured and timeline seconds
    host_s: float
    host_timeline_s: float


GPU = Sizes(base=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
            budget_hidden=1536, budget_layers=24, clients=(4, 8, 16, 32, 64, 128, 256), step_s=4.0,
            generators=4, two_worker_requests=96, host_clients=16, host_s=6.0, host_timeline_s=2.0)
CPU = Sizes(base=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
            budget_hidden=64, budget_layers=2, clients=(1,), step_s=2.0, generators=1, two_worker_requests=8,
            host_clients=4, host_s=1.5, host_timeline_s=0.5)


@dataclass
class Check:
    """One check's verdict: its line on stdout and its entry in the run's JSON."""

    name: str
    ok: bool | None  # None: not applicable here (the line says why)
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{'SKIP' if self.ok is None else 'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def serve(home: Path, device: str, workers: int, env: dict[str, str] | None = None, wait: bool = True) -> LocalDaemon:
    """A daemon of the run on `home`: nothing preloaded (a check loads what it asks for),
    the caller's FLEET_* settings left out."""
    return LocalDaemon(home, env={"FLEET_PRELOAD": ",", "FLEET_DEVICE": device, "FLEET_WORKERS": str(workers),
                                  **(env or {})}, wait=wait, inherit_fleet=False)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={**body, "timeout_ms": TIMEOUT_MS}, timeout=TIMEOUT_MS / 1000 + 30)


def answer(url: str, path: str, body: dict) -> dict:
    resp = post(url, path, body)
    if resp.status_code != 200:
        raise RuntimeError(f"{path} {body.get('model')}: HTTP {resp.status_code} {resp.text[:300]}")
    return resp.json()


def ps(url: str) -> dict:
    return httpx.get(url + "/v1/ps", timeout=30).json()


def resident(url: str) -> dict[str, dict]:
    return {name: m for w in ps(url)["workers"] for name, m in w["models"].items()}
