"""`fleetctl ps --cluster`: every box in the NATS cluster, its models and its load.

Read from the daemon's `GET /v1/cluster` (itself read from the `fleet_boxes`
heartbeat bucket in JetStream), so the CLI needs no NATS credentials of its own.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_cluster(view: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(view, indent=2))
        return
    out = Console()
    state = "joined" if view["joined"] else "joining"
    out.print(f"[bold]{escape(view['box'])}[/] · cluster {escape(view['nats'])} ({state}) · {len(view['boxes'])} box(es)")
    table = Table("box", "url", "workers", "held / capacity", "local queue", "waiting", "served", "models (loaded*)",
                  "heartbeat", box=None)
    for b in view["boxes"]:
        loaded = set(b["loaded"])
        models = ", ".join(f"{m}*" if m in loaded else m for m in sorted(b["models"])) or "-"
        table.add_row(escape(b["box"]), escape(b["url"]), str(b["workers"]), f"{b['held']} / {b['capacity']}",
                      str(b["local_depth"]), str(b["waiting"]), str(b["served"]), escape(models),
                      f"{b['age_s']:.1f}s ago")
    out.print(table)
