"""`fleetctl list`: the models in the store (or, with --catalog, the ones fleet knows)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_models(
        catalog: Annotated[bool, typer.Option("--catalog", help="List the catalog (models.toml) instead of the store.")] = False,
        json: Annotated[bool, typer.Option("--json", help="Print a JSON array on stdout.")] = False,
    ) -> None:
        """List pulled models: name, task, runtime, size, source, revision, pulled at."""
        import msgspec
        from rich.table import Table

        from fleet.catalog import load_catalog
        from fleetctl.commands.pull import human_size
        from fleet.config import load_settings
        from fleet.store import Store

        settings = load_settings()
        store = Store(settings.store_path)
        # Piped output is for other programs: never fold a row (a terminal folds the source).
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 4096)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        if catalog:
            entries = load_catalog(settings.home).all()
            pulled = set(store.names())
            if json:
                rows = [{**msgspec.to_builtins(e), "pulled": e.name in pulled} for e in entries]
                sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
                return
            table = Table(box=None)
            table.add_column("name", no_wrap=True, min_width=max((len(e.name) for e in entries), default=4))
            for column in ("task", "runtime", "source", "pulled"):
                table.add_column(column, overflow="fold")
            for e in entries:
                cells = (e.name, e.task, e.runtime, e.source, "yes" if e.name in pulled else "")
                table.add_row(*map(escape, cells))
            out.print(table)
            return

        manifests = store.list()
        for name in store.damaged():
            err.print(f"[yellow]warning[/]: {escape(str(store.root / name))} has no readable manifest; "
                      f"re-pull it (`fleetctl pull {name} --force`) or remove it (`fleetctl rm {name}`)")
        if json:
            rows = [{**msgspec.to_builtins(m), "size_bytes": m.size_bytes, "path": str(store.path(m.name))}
                    for m in manifests]
            sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
            return
        if not manifests:
            err.print("no models pulled yet; try `fleetctl pull all-minilm-l6-v2` (see `fleetctl list --catalog`)")
            return
        table = Table(box=None)
        # Names are what people copy into the next command: never cut them.
        table.add_column("name", no_wrap=True, min_width=max(len(m.name) for m in manifests))
        for column in ("task", "runtime", "size", "source", "revision", "pulled at"):
            table.add_column(column, overflow="fold")
        for m in manifests:
            revision = m.revision or ""
            # Cells are plain text (a folder may be named `[x]`), never markup.
            cells = (m.name, m.task, m.runtime, human_size(m.size_bytes), m.source,
                     revision[:12] if len(revision) == 40 else revision,
                     m.created_at.replace("T", " ").removesuffix("Z")[:16])
            table.add_row(*map(escape, cells))
        out.print(table)
