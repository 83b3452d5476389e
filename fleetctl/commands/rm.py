"""`fleetctl rm NAME`: delete a model from the store.

With a daemon running, through it (`DELETE /v1/models/NAME`): every loaded copy is
unloaded, the operator's pin released, then the files go (daemon.owner). With none,
from FLEET_HOME's store directly, saying so (fleetctl.owner).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    @app.command("rm")
    def rm(
        name: Annotated[str, typer.Argument(help="The stored model's name (see `fleetctl list`).")],
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    ) -> None:
        """Remove a model: the running daemon unloads it and deletes it from its store
        (with no daemon running: from FLEET_HOME/models)."""
        from fleetctl.owner import as_operator, store_daemon

        err = Console(stderr=True, highlight=False, soft_wrap=True)
        client = store_daemon()
        if client is None:
            remove_here(name, yes, err)
            return
        with as_operator(client):
            size = None if yes else daemon_size(client, name)
            if size is not None:
                confirm(name, size, err)
            done = client.request("DELETE", f"/v1/models/{name}")
        import msgspec

        answer = msgspec.msgpack.decode(done)
        from fleetctl.commands.pull import human_size

        shown = human_size(answer["size_bytes"]) if answer.get("size_bytes") is not None else "damaged"
        line = f"removed {name} ({shown})"
        if answer.get("unloaded"):
            line += "; unloaded from worker " + ", ".join(str(w) for w in answer["unloaded"])
        if answer.get("was_pinned"):
            line += "; its pin is released"
        print(line)


def daemon_size(client, name: str) -> str | None:
    """The size the confirmation names, from the daemon's store; None when it holds no
    such model (the delete then answers why, with the closest name)."""
    from fleetctl.commands.pull import human_size

    listing = client.get("/v1/store")
    for m in listing["models"]:
        if m["name"] == name:
            return human_size(m["size_bytes"])
    return "damaged" if any(d["name"] == name for d in listing["damaged"]) else None


def confirm(name: str, size: str, err: Console) -> None:
    from fleet.errors import BadRequest

    if not sys.stdin.isatty():
        raise BadRequest(f"not removing {name!r} without confirmation", hint=f"`fleetctl rm {name} --yes`")
    if not typer.confirm(f"remove {name} ({size})?", err=True):
        err.print("nothing removed")
        raise typer.Exit(1)


def remove_here(name: str, yes: bool, err: Console) -> None:
    """No daemon runs: remove it from FLEET_HOME's store directly, and say so."""
    from fleetctl.commands.pull import human_size
    from fleetctl.owner import without_daemon
    from fleet import blobs
    from fleet.config import load_settings
    from fleet.errors import BadRequest, IntegrityError, ModelNotFound
    from fleet.store import Store

    without_daemon("removing from")
    settings = load_settings()
    store = Store(settings.store_path)
    try:
        size = human_size(store.get(name).size_bytes)
    except (IntegrityError, ModelNotFound):
        if not store.path(name).is_dir():
            raise
        size = "damaged"  # missing or unreadable manifest: still removable
    dependents = store.dependents(name)
    if dependents:
        raise BadRequest(
            f"{name!r} is the base model of {', '.join(dependents)}",
            hint=f"remove those first: `fleetctl rm {dependents[0]}`",
        )
    if not yes:
        confirm(name, size, err)
    # The uploaded blobs only this model held (`ollama create`) go with it (fleet.blobs).
    blobs.release(settings.home_path, store, store.remove(name))
    print(f"removed {name} ({size})")
