"""A daemon whose embedder's forward is a stand-in for an accelerator (bench.host_path).

On a CPU the model's forward runs on the very cores the host path needs, so a
CPU run cannot tell the host's cost per token from the device's. Here the
forward is replaced by a wait that releases the GIL and burns no CPU, as a GPU
kernel does for the host thread that launched it: `fixed_us` per forward plus
`per_token_us` per padded token (FLEET_BENCH_FORWARD="fixed_us,per_token_us").
Everything else is the product: `fleetctl serve`, the API process, the queue,
a spawned worker process running `runtimes.process.run`, the sentence-transformers
adapter with its tokenizer threads, pooling-free vectors of the model's width.

`python -m fleet.bench.stand_in serve`: what `fleetctl serve` runs (settings from the
FLEET_* environment), its supervisor spawning `stand_in_worker` (the tests start marker workers the same
way, tests/test_worker_core.py). The worker registers `StandInEmbedder` for the
sentence-transformers runtime (bench/stand_in_forward.py, imported in the
worker only: the API process never loads torch) before it resolves any model,
then runs the product's worker entry. Bench only: nothing in the product reads the variable.
"""

from __future__ import annotations

import os
import sys
ENV = "FLEET_BENCH_FORWARD"


def forward_costs() -> tuple[float, float]:
    """(fixed us per forward, us per padded token) from FLEET_BENCH_FORWARD."""
    fixed, _, per_token = os.environ.get(ENV, "0,0").partition(",")
    return float(fixed), float(per_token or 0)


def stand_in_worker(queue_name: str, index: int, device: str, settings_blob: bytes) -> None:
    """Supervisor target: the product's worker entry with `StandInEmbedder` registered."""
    from fleet.runtimes import registry
    from fleet.runtimes.process import run

    registry.ADAPTERS[("embed", "sentence-transformers")] = "fleet.bench.stand_in_forward:StandInEmbedder"
    run(queue_name, index, device, settings_blob)


def main() -> None:
    """`serve`, as `fleetctl serve` with no options runs it (the bench configures the
    daemon through its FLEET_* environment)."""
    from fleet.daemon import core
    from fleet.daemon.logs import setup_logging
    from fleet.daemon.server import serve
    from fleet.config import load_settings

    if sys.argv[1:] != ["serve"]:
        sys.exit("usage: python -m fleet.bench.stand_in serve (settings from the FLEET_* environment)")

    class StandInSupervisor(core.Supervisor):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, target=f"{__name__}:stand_in_worker", **kw)

    # The name daemon.core builds its supervisor by: the one place the worker entry is chosen.
    core.Supervisor = StandInSupervisor
    settings = load_settings()
    setup_logging(settings.log_level, home=settings.home_path)
    serve(settings)


if __name__ == "__main__":
    main()
