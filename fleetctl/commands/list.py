"""`fleetctl list`: the models in the store (or, with --catalog, the ones fleet knows)."""

from __future__ import annotations

import sys
from pathlib import Path
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
            sizes = {e.name: known_size(e, store, pulled) for e in entries}
            if json:
                rows = [{**msgspec.to_builtins(e), "pulled": e.name in pulled, "size_bytes": sizes[e.name]}
                        for e in entries]
                sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
                return
            table = Table(box=None)
            table.add_column("name", no_wrap=True, min_width=max((len(e.name) for e in entries), default=4))
            for column in ("task", "runtime", "size", "source", "pulled"):
                table.add_column(column, overflow="fold")
            for e in entries:
                size = sizes[e.name]
                cells = (e.name, e.task, e.runtime, "-" if size is None else human_size(size), e.source,
                         "yes" if e.name in pulled else "")
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


def known_size(entry, store, pulled: set[str]) -> int | None:
    """Bytes of a catalog model where this box can tell without a network: the stored
    copy's, else the folder a `pkg:`/`path:` source points at; None for the hub."""
    from fleet.catalog import parse_source
    from fleet.errors import FleetError
    from fleet.pull import package_folder

    if entry.name in pulled:
        return store.get(entry.name).size_bytes
    source = parse_source(entry.source)
    try:
        if source.kind == "pkg":
            folder = package_folder(source.ref)[0]
        elif source.kind == "path":
            folder = Path(source.ref).expanduser()
        else:
            return None
    except FleetError:  # the package is not installed: unknown here
        return None
    if not folder.is_dir():
        return None
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
