"""`fleetctl ps`: what the daemon runs now (workers, models, devices, lanes).

Readable in an 80-column terminal: one titled table per kind, model names whole on
one line (they are what people copy into the next command; fleetctl.tables),
numbers never split over lines, sizes in MiB only, LoRA adapters under their base
model, and the worker ids of `ps --json` and `fleetctl pin`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.console import Console, Group

from fleetctl.commands.alias import aliases_table
from fleetctl.commands.batch import batches_table, running_batches
from fleetctl.residency import device_rows
from fleetctl.tables import NAMES, TEXT, FitTable, WhereLine


def register(app: typer.Typer) -> None:
    @app.command()
    def ps(as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
           cluster: bool = typer.Option(False, "--cluster", help="Every box in the NATS cluster, its models and load.")
           ) -> None:
        """Show workers, resident models and queue lanes of the running daemon (the first
        line names its URL, where that came from, and the FLEET_HOME it serves)."""
        from fleet.config import client_url_source
        from fleetctl.client import Client

        url, source = client_url_source()
        if cluster:
            from fleetctl.cluster_view import print_cluster

            with Client(url) as client:
                print_cluster(client.get("/v1/cluster"), as_json=as_json)
            return
        with Client(url) as client:
            state = client.ps()
            state["batches"] = running_batches(client)
        state["url"], state["url_from"] = url, source
        if as_json:
            print(json.dumps(state, indent=2))
            return
        Console(highlight=False).print(render(state))


def mib(n: int | float) -> str:
    return f"{n / (1 << 20):,.1f}"


def table(title: str, *columns: str) -> FitTable:
    """A titled table whose first columns are names and numbers, each whole on one line."""
    t = FitTable(title)
    for name in columns:
        t.add_column(name)
    return t


def render(state: dict[str, Any], now: float | None = None) -> Group:
    now = time.time() if now is None else now
    q = state["queue"]
    head = (f"[bold]{state['box']}[/] · {state['status']} · {q['depth']} waiting, {q['in_flight']} in flight"
            f" · up {state['uptime_s']:.0f} s")
    parts: list[Any] = [head, *where(state), workers_table(state), devices_table(state), models_table(state, now)]
    profiles = profiles_table(state)
    if profiles.row_count:
        parts.append(profiles)
    if state.get("aliases"):
        parts.append(aliases_table(state["aliases"]))
    if state["lanes"]:
        parts.append(lanes_table(state))
    if state.get("batches"):
        parts.append(batches_table(state["batches"], "Batches running"))
    return Group(*parts)


#: How `client_url_source` found the URL, as the header line says it.
URL_FROM = {"env": "FLEET_URL", "config": "config.toml", "lock file": "this FLEET_HOME's daemon", "default": "default"}


def where(state: dict[str, Any]) -> list[WhereLine]:
    """The daemon this view shows: its URL (and where the URL came from) and the
    FLEET_HOME it serves, which it tells its operator only (`home` needs the admin key).
    One line at 80 columns: a long home is cut in the middle, the URL never (WhereLine)."""
    if "url" not in state:
        return []
    lead = f"{state['url']} ({URL_FROM.get(state.get('url_from', ''), state.get('url_from', ''))})"
    if state.get("home"):
        return [WhereLine(lead, "FLEET_HOME", state["home"])]
    return [WhereLine(lead, "FLEET_HOME", "not shown (the daemon tells its operator: admin key)", cut=False)]


def workers_table(state: dict[str, Any]) -> FitTable:
    t = table("Workers", "worker", "pid", "device", "state")
    t.add_column("restarts", drop=1, justify="right")
    t.add_column("claimed", drop=2, justify="right")
    t.add_column("last batch", NAMES, drop=3)
    for w in state["workers"]:
        t.add_row(str(w["worker"]), str(w["pid"]), w["device"], "up" if w["up"] else "down",
                  str(w.get("restarts", 0)), str(w["claimed"]), last_batch(w.get("last_batch") or {}))
    for slot in state.get("slots", []):
        if slot["pid"] is None:
            t.add_row("-", "-", slot["device"], "restarting", str(slot["restarts"]), "",
                      f"next start in {slot['restart_in_s']:.1f} s")
    return t


def devices_table(state: dict[str, Any]) -> FitTable:
    """Budget and use per device (a device's use is the sum over its workers)."""
    t = table("Devices", "device")
    for name in ("budget MiB", "used MiB", "free MiB", "models"):
        t.add_column(name, justify="right")
    t.add_column("loading", NAMES)
    for d in device_rows(state):
        loading = ", ".join(m["name"] for m in d["models"] if m.get("loading"))
        resident = sum(1 for m in d["models"] if not m.get("loading"))
        t.add_row(d["device"], mib(d["budget_bytes"]), mib(d["used_bytes"]),
                  mib(max(0, d["budget_bytes"] - d["used_bytes"])), str(resident), loading or "-")
    return t


def models_table(state: dict[str, Any], now: float) -> FitTable:
    """Resident models per worker, LoRA adapters under their base."""
    t = table("Models", "worker", "model")
    t.add_column("dtype", drop=3)
    t.add_column("pinned", drop=2)
    t.add_column("MiB", drop=5, justify="right")
    t.add_column("served", drop=4, justify="right")
    t.add_column("idle s", drop=1, justify="right")
    for w in state["workers"]:
        for name, m in sorted(w["models"].items()):
            if not m:  # the worker's record was too small for details
                t.add_row(str(w["worker"]), name, "", "", "", "", "")
                continue
            dtype = m["dtype"] if (m.get("engine") or {}).get("engine", "torch") == "torch" else \
                f"{m['dtype']} {m['engine']['engine']}"
            t.add_row(str(w["worker"]), name, dtype, "yes" if m.get("pinned") else "no",
                      mib(m["bytes"]), str(m["served"]), f"{now - m['last_used']:.0f}")
            for lora in m.get("loras") or []:  # LoRA adapters attached to this base
                t.add_row("", f"└ {lora}", "LoRA", "", "", "", "")
    return t


def engine(m: dict[str, Any]) -> str:
    """What runs the forward and why (runtimes/adapters/engines.py: measured at load, a kept
    verdict, the profile's), its measured speed, whether it replays a traced graph and
    how much faster that was measured (runtimes/adapters/traced.py), the one-thread size (runtimes/adapters/threads.py)
    and a forward's fixed cost in tokens, where micro-batches cut (runtimes/base.py)."""
    e = m.get("engine") or {}
    text = e.get("engine", "torch")
    if e.get("by"):
        text += f" ({e['by']}"
        text += f", {e['tokens_per_s']:,} tok/s)" if e.get("tokens_per_s") else ")"
    if (m.get("forward") or {}).get("traced"):
        text += f"; traced {m['forward']['speedup']}x"
    small = (m.get("threads") or {}).get("one_thread_up_to_tokens")
    if small:
        text += f"; 1 thread <= {small} tok"
    if m.get("fixed_tokens"):
        text += f"; cut at {m['fixed_tokens']} tok"
    return text


def profiles_table(state: dict[str, Any]) -> FitTable:
    """Which serving profile each model runs with, its settings in force and where each
    came from, its batch cost as fitted from its batches, and its engine: one line each
    beside the model's name, so the name stays whole at 80 columns."""
    t = table("Profiles", "model")
    t.add_column("serving", TEXT)
    seen = set()
    for w in state["workers"]:
        for name, m in sorted(w["models"].items()):
            if m and (name, m.get("profile")) not in seen:
                seen.add((name, m.get("profile")))
                lines = [f"profile {m.get('profile', 'default')}", f"settings (from) {settings(m)}",
                         f"batch cost (fitted) {cost(m.get('cost') or {})}", f"engine (chosen by) {engine(m)}"]
                if "decide_temperatures" in m:
                    lines.append(f"temperatures (from) {temperatures(m)}")
                t.add_row(name, "\n".join(lines))
    return t


def temperatures(m: dict) -> str:
    """"choice:3-5 0.41, noul:1-2 0.62 (fleetctl calibrate 2026-12-07, ECE 0.210 -> 0.031)": a
    decision model's live temperatures and where they came from (fleet.calibration)."""
    temps, cal = m.get("decide_temperatures") or {}, m.get("calibration")
    values = ", ".join(f"{k} {v:g}" for k, v in temps.items()) or "1.0 everywhere"
    if not cal:
        return f"{values} (default: never calibrated)"
    when = (cal.get("calibrated_at") or "")[:10]
    ece = (f", ECE {cal['ece_before']:.3f} -> {cal['ece_after']:.3f}"
           if cal.get("ece_before") is not None and cal.get("ece_after") is not None else "")
    return f"{values} ({cal.get('source', 'models.toml')}{' ' + when if when else ''}{ece})"


#: Profile settings as `ps` names them, in this order.
SETTING_NAMES = {"max_batch_items": "items", "max_batch_tokens": "tokens", "linger_ms": "linger ms", "dtype": "dtype"}


def settings(m: dict) -> str:
    """"items 64 (shipped), tokens 16384 (tuned), ...": the live profile's batch settings."""
    values, sources = m.get("settings") or {}, m.get("profile_from") or {}
    return ", ".join(f"{label} {values[key]} ({sources.get(key, 'default')})"
                     for key, label in SETTING_NAMES.items() if key in values) or "-"


def lanes_table(state: dict[str, Any]) -> FitTable:
    t = table("Lanes", "lane")
    t.add_column("waiting", justify="right")
    t.add_column("est. tokens", drop=2, justify="right")  # not tokenized yet: the daemon's estimate
    t.add_column("claimed", drop=1, justify="right")
    t.add_column("oldest ms", drop=3, justify="right")
    for lane in state["lanes"]:
        t.add_row(lane["model"], str(lane["depth"]), str(lane["estimated_tokens"]), str(lane["claimed"]),
                  f"{lane['oldest_wait_ms']:.0f}")
    return t


def last_batch(b: dict) -> str:
    if not b.get("model"):
        return "-"
    if "generated_tokens" in b:  # a generation step: its sequences' prompt and generated tokens
        text = (f"{b['model']}: {b['items']} seqs, {b['prompt_tokens']} prompt + {b['generated_tokens']} generated tok,"
                f" {b['ms']:.1f} ms")
    else:
        # Inputs and the tokenizer's tokens (`padded`, the daemon's estimate, is in --json).
        text = f"{b['model']}: {b['items']} inputs, {b['tokens']} tok, {b['ms']:.1f} ms"
    if b.get("returned"):
        text += f", {b['returned']} returned"
    if b.get("loras"):
        text += f", LoRA {', '.join(b['loras'])}"
    return text


def cost(c: dict) -> str:
    if not c.get("samples"):
        return "-"
    return f"{c['a_ms']:.2f} ms + {c['b_ms_per_1k_tokens']:.2f} ms/1k tok ({c['samples']} batches)"
