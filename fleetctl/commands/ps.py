"""`fleetctl ps`: what the daemon runs now (workers, models, lanes)."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.table import Table


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def register(app: typer.Typer) -> None:
    @app.command()
    def ps(as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
        """Show workers, resident models and queue lanes of the running daemon."""
        from fleetctl.client import Client

        with Client() as client:
            state = client.ps()
        if as_json:
            print(json.dumps(state, indent=2))
            return
        out = Console()
        out.print(f"[bold]{state['box']}[/] · {state['status']} · queue depth {state['queue']['depth']}"
                  f" · in flight {state['queue']['in_flight']} · up {state['uptime_s']:.0f}s")
        models = Table("worker", "device", "model", "dtype", "size", "served", "last used", box=None)
        for w in state["workers"]:
            for name, m in sorted(w["models"].items()):
                ago = time.time() - m["last_used"]
                models.add_row(str(w["worker"]), w["device"], name, m["dtype"], _size(m["bytes"]),
                               str(m["served"]), f"{ago:.0f}s ago")
            if not w["models"]:
                models.add_row(str(w["worker"]), w["device"], "-", "", "", "", "")
        out.print(models)
        if state["lanes"]:
            lanes = Table("lane", "depth", "tokens", "claimed", "oldest wait", box=None)
            for lane in state["lanes"]:
                lanes.add_row(lane["model"], str(lane["depth"]), str(lane["tokens"]), str(lane["claimed"]),
                              f"{lane['oldest_wait_ms']:.0f} ms")
            out.print(lanes)
