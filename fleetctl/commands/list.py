"""`fleetctl list`: the models in the store (or, with --catalog, the ones fleet knows)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from fleetctl.tables import CUT, FitTable


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_models(
        catalog: Annotated[bool, typer.Option("--catalog", help="List the catalog (models.toml) instead of the store.")] = False,
        json: Annotated[bool, typer.Option("--json", help="Print a JSON array on stdout.")] = False,
    ) -> None:
        """List pulled models (the running daemon's store; with no daemon, FLEET_HOME's): name, task, runtime, size, source, revision, pulled at (with --catalog:
        name, task, runtime, license, parameters, size, pulled, source)."""
        import msgspec

        from fleet.catalog import load_catalog
        from fleet.config import load_settings
        from fleet.store import Manifest, Store, damage_fix
        from fleetctl.owner import as_operator, store_daemon, without_daemon

        settings = load_settings()
        store = Store(settings.store_path)
        # Piped output is for other programs: never fold a row (a terminal folds the source).
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 4096)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        if catalog:
            entries = load_catalog(settings.home).all()
            pulled = catalog_pulled(store, err)
            sizes = {e.name: known_size(e, store, pulled) for e in entries}
            if json:
                # size_bytes: measured here when this box holds the files (size_from "store",
                # "package", "folder"), else the catalog's figure ("catalog"), else null.
                rows = [{**msgspec.to_builtins(e), "pulled": e.name in pulled, "size_bytes": sizes[e.name][0],
                         "size_from": sizes[e.name][1]} for e in entries]
                sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
                return
            out.print(catalog_table(entries, pulled, sizes))
            return

        client = store_daemon()
        if client is not None:  # the daemon's store, as it reads it (daemon/controllers/store.py)
            with as_operator(client):
                listing = client.get("/v1/store")
            rows, damaged = listing["models"], [(d["name"], d["why"], d["path"]) for d in listing["damaged"]]
        else:
            without_daemon("listing")
            rows = [{**msgspec.to_builtins(m), "size_bytes": m.size_bytes, "path": str(store.path(m.name))}
                    for m in store.list()]
            damaged = [(name, why, str(store.root / name)) for name, why in store.damage()]
        for name, why, path in damaged:
            err.print(f"[yellow]damaged[/]: {escape(why)} ({escape(path)}); it is neither listed "
                      f"nor served. fix: {escape(damage_fix(name))}")
        if json:
            sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
            return
        manifests = [msgspec.convert(row, Manifest) for row in rows]
        if not manifests:
            err.print("no models pulled yet; try `fleetctl pull all-minilm-l6-v2` (see `fleetctl list --catalog`)")
            return
        out.print(store_table(manifests))


def catalog_pulled(store, err: Console) -> set[str]:
    """The names the `pulled` column marks: what the daemon serves when one answers (open to
    every user: /v1/models), else what this box's store holds.

    The catalog itself is a file in the package and needs no daemon, so an unreachable
    FLEET_URL (an error for the verbs that act on a store) only costs this column: it is
    taken from FLEET_HOME's store, and one line on stderr says so.
    """
    from fleet.errors import Unavailable
    from fleetctl.owner import store_daemon

    try:
        client = store_daemon()
        if client is not None:
            with client:
                return {m.id for m in client.models().data}
    except Unavailable as exc:
        err.print(f"{escape(exc.message)}; the catalog needs none: 'pulled' shows the store in "
                  f"{escape(str(store.root))}")
    return set(store.names())


def catalog_table(entries, pulled: set[str], sizes: dict) -> FitTable:
    """`list --catalog`: names whole; at 80 columns source, runtime and license give way."""
    from fleetctl.catalog_table import UNKNOWN, format_count, format_size

    table = FitTable()
    table.add_column("name")
    table.add_column("task", drop=6)
    table.add_column("runtime", drop=2)
    table.add_column("license", drop=3)
    table.add_column("params", drop=4, justify="right")
    table.add_column("size", drop=5, justify="right")
    table.add_column("pulled", drop=7)
    table.add_column("source", CUT, drop=1)
    for e in entries:
        size, size_from = sizes[e.name]
        # "~": the catalog's figure, not measured on this box.
        shown = format_size(size) if size_from != "catalog" else "~" + format_size(size)
        table.add_row(e.name, e.task, e.runtime, e.license or UNKNOWN, format_count(e.params), shown,
                      "yes" if e.name in pulled else "no", e.source)
    return table


def store_table(manifests) -> FitTable:
    """`list`: names whole; at 80 columns revision, runtime and the pull time give way
    and the source is cut."""
    from fleetctl.commands.pull import human_size

    table = FitTable()
    table.add_column("name")
    table.add_column("task", drop=5)
    table.add_column("runtime", drop=2)
    table.add_column("size", drop=4, justify="right")
    table.add_column("source", CUT, drop=6)
    table.add_column("revision", drop=1)
    table.add_column("pulled at", drop=3)
    for m in manifests:
        revision = m.revision or ""
        table.add_row(m.name, m.task, m.runtime, human_size(m.size_bytes), m.source,
                      revision[:12] if len(revision) == 40 else revision,
                      m.created_at.replace("T", " ").removesuffix("Z")[:16])
    return table


def known_size(entry, store, pulled: set[str]) -> tuple[int | None, str | None]:
    """(bytes, where from) of a catalog model: measured where this box can tell without
    a network (the stored copy, else the folder a `pkg:`/`path:` source points at), else
    the catalog's `size_bytes`; (None, None) when nobody knows."""
    from fleet.catalog import parse_source
    from fleet.errors import FleetError
    from fleet.pull_files import package_folder

    if entry.name in pulled:
        try:
            return store.get(entry.name).size_bytes, "store"
        except FleetError:  # a damaged manifest (`fleetctl list` reports it): measured as if not pulled
            pass
    source = parse_source(entry.source)
    folder = None
    try:
        if source.kind == "pkg":
            folder = package_folder(source.ref)[0]
        elif source.kind == "path":
            folder = Path(source.ref).expanduser()
    except FleetError:  # the package is not installed: not measurable here
        folder = None
    if folder is not None and folder.is_dir():
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()), \
            "package" if source.kind == "pkg" else "folder"
    return (entry.size_bytes, "catalog") if entry.size_bytes is not None else (None, None)
