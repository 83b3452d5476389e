"""`fleetctl alias set | ls | rm`, `fleetctl rollback ALIAS`, `fleetctl history ALIAS`.

An alias is a stable name clients use (`support-tone`, `support-tone@prod`, or a name
they hard-code such as `text-embedding-3-small`) that points at one stored model or
adapter version; the daemon resolves it once per request and names the version that
answered in `X-Fleet-Model-Version`. These verbs talk to the running daemon
(`/v1/aliases`, daemon/controllers/aliases.py); changes are the operator's (the admin
key `fleetctl` sends on its own). `fleetctl promote` (fleetctl/commands/promote.py)
switches an alias only once an evaluation says the candidate is no worse.
"""

from __future__ import annotations

import getpass
import json
from typing import Annotated, Any

import typer
from rich.console import Console

from fleetctl.tables import NAMES, TEXT, FitTable

alias_app = typer.Typer(help="Stable names for model versions: set, list, remove.", no_args_is_help=True,
                        add_completion=False, rich_markup_mode=None)

JsonOption = Annotated[bool, typer.Option("--json", help="Print the daemon's answer as JSON.")]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why: kept in the alias's history.")]


def owner() -> str:
    """Who makes a change, as the history records it: FLEET_OWNER, else this user's name."""
    import os

    try:
        return os.environ.get("FLEET_OWNER") or getpass.getuser()
    except (KeyError, OSError):
        return "operator"


def call(client: Any, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The daemon's decoded answer to `method path` with `body` (fleetctl.client.Client)."""
    import msgspec

    return msgspec.msgpack.decode(client.request(method, path, body))


def metrics_line(candidate: dict[str, float], current: dict[str, float] | None) -> str:
    """A promotion's numbers: each metric of the candidate, with the replaced version's beside it."""
    if current is None:
        return ", ".join(f"{k} {v:.4f}" for k, v in candidate.items())
    return ", ".join(f"{k} {v:.4f} (was {current[k]:.4f})" if k in current else f"{k} {v:.4f}"
                     for k, v in candidate.items())


def share(percent: float | None) -> str:
    return f"{percent:g}%" if percent else ""


def aliases_table(aliases: list[dict[str, Any]]) -> FitTable:
    """Aliases as `ps` and `alias ls` show them: each version with its recent error rate and p95."""
    t = FitTable("Aliases")
    t.add_column("alias")
    t.add_column("version")
    t.add_column("canary")
    t.add_column("share", justify="right")
    t.add_column("errors", NAMES, drop=2)
    t.add_column("p95 ms", NAMES, drop=1)
    t.add_column("rollback to", drop=3)
    for a in aliases:
        versions = [v for v in (a["version"], a.get("canary")) if v]
        stats = a.get("versions", {})
        errors = " / ".join(f"{100 * stats.get(v, {}).get('error_rate', 0.0):.1f}%" for v in versions)
        p95 = " / ".join("-" if stats.get(v, {}).get("p95_ms") is None else f"{stats[v]['p95_ms']:.0f}"
                         for v in versions)
        t.add_row(a["name"], a["version"], a.get("canary") or "", share(a.get("canary_percent")), errors, p95,
                  a.get("previous") or "")
    return t


def print_change(answer: dict[str, Any], verb: str) -> None:
    after = answer.get("alias")
    took = f"{answer['seconds'] * 1000:.1f} ms"
    if after is None:
        print(f"{verb}: the alias pointed at {answer['before']} ({took})")
        return
    canary = f", canary {after['canary']} for {share(after['canary_percent'])} of clients" if after.get("canary") else ""
    before = f" (was {answer['before']})" if answer.get("before") and answer["before"] != after["version"] else ""
    print(f"{verb}: {after['name']} -> {after['version']}{before}{canary} ({took})")


def register(app: typer.Typer) -> None:
    app.add_typer(alias_app, name="alias")

    @alias_app.command("set")
    def set_alias(
        alias: Annotated[str, typer.Argument(help="The alias (name or name@tag).")],
        version: Annotated[str, typer.Argument(help="A stored model or adapter (see `fleetctl list`).")],
        reason: ReasonOption = "",
        warm: Annotated[bool, typer.Option("--warm/--no-warm", help="Load VERSION before switching.")] = True,
        as_json: JsonOption = False,
    ) -> None:
        """Point ALIAS at VERSION; requests already admitted finish on the version they started on."""
        from fleetctl.client import Client

        with Client() as client:
            answer = call(client, "PUT", f"/v1/aliases/{alias}", {"version": version, "owner": owner(),
                                                                 "reason": reason, "warm": warm})
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        print_change(answer, "set")

    @alias_app.command("ls")
    def list_aliases(as_json: JsonOption = False) -> None:
        """List the aliases, their versions and canaries, with recent error rates and latencies."""
        from fleetctl.client import Client

        with Client() as client:
            answer = client.get("/v1/aliases")
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        if not answer["aliases"]:
            print("no aliases; fleetctl alias set ALIAS VERSION makes one")
            return
        Console(highlight=False).print(aliases_table(answer["aliases"]))

    @alias_app.command("rm")
    def remove_alias(
        alias: Annotated[str, typer.Argument(help="The alias to remove.")],
        reason: ReasonOption = "",
        as_json: JsonOption = False,
    ) -> None:
        """Remove ALIAS (its history stays)."""
        from fleetctl.client import Client

        with Client() as client:
            answer = call(client, "DELETE", f"/v1/aliases/{alias}", {"owner": owner(), "reason": reason})
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        print_change(answer, f"removed {alias}")

    @app.command("rollback")
    def rollback(
        alias: Annotated[str, typer.Argument(help="The alias to take back to its previous version.")],
        reason: ReasonOption = "",
        warm: Annotated[bool, typer.Option("--warm/--no-warm", help="Load the previous version first when the "
                                                                    "current one is loaded.")] = True,
        as_json: JsonOption = False,
    ) -> None:
        """Take ALIAS back to its previous version (or end its canary), recorded in its history."""
        from fleetctl.client import Client

        with Client() as client:
            answer = call(client, "POST", f"/v1/aliases/{alias}/rollback",
                          {"owner": owner(), "reason": reason, "warm": warm})
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        print_change(answer, "rolled back")

    @app.command("history")
    def history(
        alias: Annotated[str, typer.Argument(help="The alias whose changes to show.")],
        as_json: JsonOption = False,
    ) -> None:
        """Every change of ALIAS, oldest first: promotions with their evaluation, rollbacks, canaries."""
        from fleetctl.client import Client

        with Client() as client:
            answer = client.get(f"/v1/aliases/{alias}/history")
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        t = FitTable(f"History of {alias}")
        t.add_column("at")
        t.add_column("change")
        t.add_column("version")
        t.add_column("from")
        t.add_column("by", drop=2)
        t.add_column("package", drop=3)
        t.add_column("reason", TEXT, drop=1)
        for e in answer["events"]:
            kind = e["kind"] + (f" {share(e.get('canary_percent'))} {e['canary']}" if e.get("canary") else "")
            t.add_row(e["at"], kind, e.get("version") or "", e.get("previous") or "", e.get("by", ""),
                      e.get("package") or "", e.get("reason", ""))
        Console(highlight=False).print(t)
        for pid, p in answer.get("packages", {}).items():
            print(f"{pid} ({p['kind']}{', forced' if p['forced'] else ''}): {p['candidate']} from {p['source']}, "
                  f"licence {p['licence']}; eval sha256 {p['eval_sha256'][:16]} ({p['lines']} lines): "
                  f"{metrics_line(p['candidate_metrics'], p['current_metrics'])}")
