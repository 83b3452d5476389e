"""`fleetctl rm NAME`: delete a model from the store."""

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
        """Remove a model from the store (a running daemon keeps what it has loaded)."""
        from fleetctl.commands.pull import human_size
        from fleet import blobs
        from fleet.config import load_settings
        from fleet.errors import BadRequest, IntegrityError, ModelNotFound
        from fleet.store import Store

        settings = load_settings()
        store = Store(settings.store_path)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
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
            if not sys.stdin.isatty():
                raise BadRequest(f"not removing {name!r} without confirmation", hint=f"`fleetctl rm {name} --yes`")
            if not typer.confirm(f"remove {name} ({size})?", err=True):
                err.print("nothing removed")
                raise typer.Exit(1)
        # The uploaded blobs only this model held (`ollama create`) go with it (fleet.blobs).
        blobs.release(settings.home_path, store, store.remove(name))
        print(f"removed {name} ({size})")
