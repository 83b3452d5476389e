"""`fleetctl ps --cluster`: every box in the NATS cluster, its models and its load.

Read from the daemon's `GET /v1/cluster` (itself read from the `fleet_boxes`
heartbeat bucket in JetStream), so the CLI needs no NATS credentials of its own.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from fleetctl.tables import NAMES, FitTable


def print_cluster(view: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(view, indent=2))
        return
    out = Console()
    state = "joined" if view["joined"] else "joining"
    out.print(f"[bold]{escape(view['box'])}[/] · cluster {escape(view['nats'])} ({state}) · {len(view['boxes'])} box(es)")
    out.print(cluster_table(view))


def cluster_table(view: dict[str, Any]) -> FitTable:
    """One row per box; its name and its models' names whole at any width."""
    table = FitTable()
    table.add_column("box")
    table.add_column("url", drop=4)
    table.add_column("workers", drop=6, justify="right")
    table.add_column("held / capacity", drop=5, justify="right")
    table.add_column("local queue", drop=3, justify="right")
    table.add_column("waiting", drop=7, justify="right")
    table.add_column("served", drop=2, justify="right")
    table.add_column("models (loaded*)", NAMES)
    table.add_column("heartbeat", drop=1, justify="right")
    for b in view["boxes"]:
        loaded = set(b["loaded"])
        models = ", ".join(f"{m}*" if m in loaded else m for m in sorted(b["models"])) or "-"
        table.add_row(b["box"], b["url"], str(b["workers"]), f"{b['held']} / {b['capacity']}", str(b["local_depth"]),
                      str(b["waiting"]), str(b["served"]), models, f"{b['age_s']:.1f}s ago")
    return table
