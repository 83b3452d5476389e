"""`fleetctl top`: the box live (per model rates, latencies, queues and batches;
workers, devices, batch jobs, loads and evictions), from `GET /v1/top`.

Readable in an 80-column terminal: short column names, numbers never split, model
names and job ids whole on one line (fleetctl.tables); narrower, the right-hand
columns give way and the table says which. `--once` prints one view and exits; `--json` prints the
daemon's snapshot for scripts. Rates and percentiles are the daemon's, over its
window (daemon/top.py); CPU % is measured between two reads, so `--once` reads twice.
"""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.console import Console, Group

from fleetctl.commands.ps import mib, table, where
from fleetctl.tables import NAMES, FitTable


def register(app: typer.Typer) -> None:
    @app.command()
    def top(interval: float = typer.Option(2.0, "--interval", "-n", min=0.2, help="Seconds between refreshes."),
            once: bool = typer.Option(False, "--once", help="Print one view and exit."),
            as_json: bool = typer.Option(False, "--json", help="Print one snapshot as JSON for scripts and exit."),
            ) -> None:
        """Watch the running daemon: per-model load and latency, queues, batches, workers, devices."""
        from fleet.config import client_url_source
        from fleetctl.client import Client

        url, source = client_url_source()
        with Client(url) as client:
            def snapshot() -> dict[str, Any]:
                return {**client.top(), "url": url, "url_from": source}

            if once or as_json:
                client.get("/v1/top")  # CPU % is measured between two reads
                time.sleep(min(interval, 1.0))
                state = snapshot()
                if as_json:
                    print(json.dumps(state, indent=2))
                else:
                    Console(highlight=False).print(render(state))
                return
            from rich.live import Live

            with Live(render(snapshot()), refresh_per_second=4, screen=False) as live:
                try:
                    while True:
                        time.sleep(interval)
                        live.update(render(snapshot()))
                except KeyboardInterrupt:
                    return


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def short(n: float | None) -> str:
    """16384 -> 16k: budgets stay narrow."""
    if n is None:
        return "-"
    return f"{n / 1000:.0f}k" if n >= 10_000 else f"{n:.0f}"


def render(state: dict[str, Any]) -> Group:
    q = state["queue"]
    head = (f"[bold]{state['box']}[/] · up {state['uptime_s']:.0f} s · {q['depth']} waiting, {q['in_flight']} in flight"
            f" · CPU {state.get('cpu_percent', 0):.0f}% · last {state['window_s']:.0f} s")
    parts: list[Any] = [head, *where(state), models_table(state), workers_table(state), devices_table(state)]
    if state.get("batches"):
        parts.append(batches_table(state["batches"]))
    if state.get("upstreams"):
        parts.insert(1, upstreams_line(state["upstreams"]))
    if state.get("events"):
        parts.append(events_table(state["events"]))
    return Group(*parts)


def upstreams_line(upstreams: list[dict[str, Any]]) -> str:
    """One line: each upstream, up or down, and what it answered or failed since the start."""
    parts = []
    for u in upstreams:
        state = "up" if u["up"] else f"[red]down {u['down_s']:.0f} s[/]" if u["down_s"] else "[red]retrying[/]"
        parts.append(f"{u['name']} ({u['kind']}) {state}, {u['spilled']} spilled, {u['errors']} errors")
    return "upstreams: " + " · ".join(parts)


def models_table(state: dict[str, Any]) -> FitTable:
    """Per model: requests/s, tokens/s, p50/p95 ms, queue depth and oldest wait, its
    batches (mean inputs and tokenizer tokens), a generator's time to first token and
    generated tokens/s, and what is wrong with it. The profile's budgets are not set
    beside the batch means: they count other units (`max_batch_items` queue items,
    `max_batch_tokens` the daemon's estimate before tokenizing; both in `--json`).
    The name stays whole; narrower, the columns on the right give way."""
    t = table("Models", "model", "req/s")
    for name, drop in (("tok/s", 3), ("p50", 6), ("p95", 4), ("queue", 5), ("wait ms", 2), ("batch items · tok", 1)):
        t.add_column(name, drop=drop, justify="right")
    t.add_column("notes", NAMES, drop=7)
    for m in state["models"]:
        batch = "-"
        if m["batches"]:
            batch = f"{m['batch_items']:.0f} · {short(m['batch_tokens'])}"
        flags = []
        if m.get("ttft_p50_ms") is not None:  # a generator: time to first token, generated tokens/s
            flags.append(f"ttft {ms(m['ttft_p50_ms'])} ms · {short(m['generated_tokens_per_s'])} gen tok/s")
        if m["errors_per_s"]:
            flags.append(f"{m['errors_per_s']:.1f} err/s")
        if m["evictions"]:
            flags.append(f"{m['evictions']} evicted")
        if not m["workers"]:
            flags.append("not loaded")
        if m.get("aliases"):
            flags.append("as " + ", ".join(m["aliases"]))
        t.add_row(m["model"], f"{m['requests_per_s']:.1f}", short(m["tokens_per_s"]), ms(m["p50_ms"]),
                  ms(m["p95_ms"]), str(m["depth"]), ms(m["oldest_wait_ms"]) if m["depth"] else "-", batch,
                  ", ".join(flags))
    return t


def workers_table(state: dict[str, Any]) -> FitTable:
    t = table("Workers", "worker")
    t.add_column("pid", drop=3)
    t.add_column("device")
    t.add_column("CPU %", drop=2, justify="right")
    t.add_column("MiB", drop=1, justify="right")
    t.add_column("state")
    t.add_column("models", NAMES)
    for w in state["workers"]:
        cpu = "-" if w.get("cpu_percent") is None else f"{w['cpu_percent']:.0f}"
        rss = "-" if w.get("rss_bytes") is None else f"{w['rss_bytes'] / (1 << 20):,.0f}"
        models = ", ".join(w["models"]) + (f"{', ' if w['models'] else ''}loading {w['loading']}" if w.get("loading")
                                           else "")
        t.add_row(str(w["worker"]), str(w["pid"]), w["device"], cpu, rss, "up" if w["up"] else "down", models or "-")
    for slot in state.get("slots", []):
        if slot["pid"] is None:
            t.add_row("-", "-", slot["device"], "-", "-", f"restarting ({slot['restarts']})", "-")
    return t


def devices_table(state: dict[str, Any]) -> FitTable:
    """fleet's budget and use per device; for GPUs, NVML's utilisation and memory."""
    t = table("Devices", "device", "used MiB", "budget MiB", "GPU %", "GPU mem MiB")
    for d in state["devices"]:
        gpu = "-" if "util_percent" not in d else f"{d['util_percent']:.0f}"
        mem = "-" if "memory_total_bytes" not in d else \
            f"{mib(d['memory_used_bytes'])}/{mib(d['memory_total_bytes'])}"
        t.add_row(d["device"], mib(d["used_bytes"]), mib(d["budget_bytes"]), gpu, mem)
    return t


def batches_table(jobs: list[dict[str, Any]]) -> FitTable:
    t = table("Batch jobs", "job")
    t.add_column("model", drop=4)
    t.add_column("status", drop=3)
    t.add_column("done", drop=2, justify="right")
    t.add_column("failed", drop=1, justify="right")
    t.add_column("total", drop=2, justify="right")
    for j in jobs:
        c = j.get("request_counts") or {}
        t.add_row(j["id"], j.get("model") or "-", j["status"], str(c.get("completed", 0)), str(c.get("failed", 0)),
                  str(c.get("total", 0)))
    return t


def events_table(events: list[dict[str, Any]]) -> FitTable:
    """Loads and evictions of the last minute, newest first (an eviction thrash shows here)."""
    t = table("Loads and evictions", "s ago", "what", "model")
    for e in events[:8]:
        t.add_row(f"{e['ago_s']:.0f}", "loaded" if e["what"] == "load" else f"evicted ({e['what']})", e["model"])
    return t
