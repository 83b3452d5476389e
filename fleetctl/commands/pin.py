"""`fleetctl pin MODEL [--device D]` and `fleetctl unpin MODEL`.

A pinned model is loaded now and never evicted; pins are kept by the daemon
under FLEET_HOME and survive its restart. Talks to the running daemon
(`POST|DELETE /v1/models/{name}/pin`).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def register(app: typer.Typer) -> None:
    @app.command("pin")
    def pin(
        model: Annotated[str, typer.Argument(help="A stored model's name (see `fleetctl list`).")],
        device: Annotated[
            str | None, typer.Option("--device", help="cpu or cuda:K (default: the device with most room)."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's answer as JSON.")] = False,
    ) -> None:
        """Load MODEL now and keep it resident (never evicted), also after a restart."""
        from fleetctl.client import Client

        with Client() as client:
            answer = client.post(f"/v1/models/{model}/pin", {"device": device} if device else {})
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        for r in answer["results"]:
            how = "already resident" if r.get("already") else f"loaded in {r.get('load_ms', 0):.0f} ms"
            line = f"pinned {model} on {r['device']} (worker {r['worker']}, {_size(r.get('bytes', 0))}, {how})"
            if r.get("evicted"):
                line += "; evicted " + ", ".join(r["evicted"])
            print(line)

    @app.command("unpin")
    def unpin(
        model: Annotated[str, typer.Argument(help="A pinned model's name.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's answer as JSON.")] = False,
    ) -> None:
        """Let MODEL be evicted again when room is needed (it stays loaded until then)."""
        import msgspec

        from fleetctl.client import Client

        with Client() as client:
            answer = msgspec.msgpack.decode(client.request("DELETE", f"/v1/models/{model}/pin"))
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        if not answer["was_pinned"] and not any(not r.get("already") for r in answer["results"]):
            print(f"{model} was not pinned")
            return
        where = ", ".join(r["device"] for r in answer["results"]) or "no worker (not loaded)"
        print(f"unpinned {model} ({where})")
