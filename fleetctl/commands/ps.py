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
    def ps(as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
           cluster: bool = typer.Option(False, "--cluster", help="Every box in the NATS cluster, its models and load.")
           ) -> None:
        """Show workers, resident models and queue lanes of the running daemon."""
        from fleetctl.client import Client

        if cluster:
            from fleetctl.cluster_view import print_cluster

            with Client() as client:
                print_cluster(client.get("/v1/cluster"), as_json=as_json)
            return
        with Client() as client:
            state = client.ps()
        if as_json:
            print(json.dumps(state, indent=2))
            return
        out = Console()
        out.print(f"[bold]{state['box']}[/] · {state['status']} · queue depth {state['queue']['depth']}"
                  f" · in flight {state['queue']['in_flight']} · up {state['uptime_s']:.0f}s")
        # 1. Workers: where each runs, what it claims now, its last batch.
        workers = Table("worker", "pid", "device", "up", "restarts", "claimed", "last batch", box=None)
        for w in state["workers"]:
            workers.add_row(str(w.get("index", w["worker"])), str(w["pid"]), w["device"], "yes" if w["up"] else "no",
                            str(w.get("restarts", 0)), str(w["claimed"]), _last_batch(w.get("last_batch") or {}))
        for slot in state.get("slots", []):
            if slot["pid"] is None:
                workers.add_row(str(slot["index"]), "-", slot["device"], "restarting", str(slot["restarts"]),
                                "", f"next start in {slot['restart_in_s']:.1f}s")
        out.print(workers)
        # 2. Models resident per worker, with the cost model fitted from its batches.
        models = Table("worker", "model", "dtype", "profile", "size", "served", "last used", "cost (a + b/1k tok)", box=None)
        for w in state["workers"]:
            for name, m in sorted(w["models"].items()):
                if not m:  # the worker's record was too small for details
                    models.add_row(str(w.get("index", w["worker"])), name, "", "", "", "", "", "")
                    continue
                ago = time.time() - m["last_used"]
                models.add_row(str(w.get("index", w["worker"])), name, m["dtype"], m.get("profile", "default"),
                               _size(m["bytes"]),
                               str(m["served"]), f"{ago:.0f}s ago", _cost(m.get("cost") or {}))
        out.print(models)
        # Device memory: budget, used and resident models per device (fleetctl.residency).
        from fleetctl.residency import devices_table

        out.print(devices_table(state))
        # 3. Lanes: what waits, and for how long.
        if state["lanes"]:
            lanes = Table("lane", "depth", "tokens", "claimed", "oldest wait", box=None)
            for lane in state["lanes"]:
                lanes.add_row(lane["model"], str(lane["depth"]), str(lane["tokens"]), str(lane["claimed"]),
                              f"{lane['oldest_wait_ms']:.0f} ms")
            out.print(lanes)


def _last_batch(b: dict) -> str:
    if not b.get("model"):
        return "-"
    text = f"{b['model']}: {b['items']} items, {b['tokens']} tok ({b.get('padded', b['tokens'])} padded), {b['ms']:.1f} ms"
    if b.get("returned"):
        text += f", {b['returned']} returned"
    return text


def _cost(c: dict) -> str:
    if not c.get("samples"):
        return "-"
    return f"{c['a_ms']:.2f} + {c['b_ms_per_1k_tokens']:.2f} ms ({c['samples']} batches)"
