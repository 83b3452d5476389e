"""`fleetctl pull SOURCE_OR_NAME`: copy or download a model into the store."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fleet.store import Progress


class RichProgress(Progress):
    """A rich byte bar on stderr, one per pull phase (copy / download)."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (
            BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Bar(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=console,
        )
        self._task: int | None = None

    def start(self, description: str, total_bytes: int) -> None:
        self.finish()
        self._bar.start()
        self._task = self._bar.add_task(description, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bar.update(self._task, advance=nbytes)

    def finish(self) -> None:
        if self._task is not None:  # stopping a bar that never started prints a stray newline
            self._bar.stop()
            self._bar.remove_task(self._task)
            self._task = None


def human_size(nbytes: int) -> str:
    from rich.filesize import decimal

    return decimal(nbytes)


def register(app: typer.Typer) -> None:
    @app.command("pull")
    def pull(
        target: Annotated[str, typer.Argument(
            metavar="SOURCE_OR_NAME",
            # `\\[` keeps rich (typer's help renderer) from reading [@REV] as markup.
            help="A catalog name (see `fleetctl list --catalog`), hf:ORG/NAME\\[@REV], path:DIR or pkg:PACKAGE.",
        )],
        name: Annotated[Optional[str], typer.Option(help="Store name for an hf:/path:/pkg: source.")] = None,
        task: Annotated[Optional[str], typer.Option(help="embed|rerank|classify|extract|generate|decide (else detected).")] = None,
        runtime: Annotated[Optional[str], typer.Option(help="Worker runtime, e.g. sentence-transformers, transformers, peft.")] = None,
        base: Annotated[Optional[str], typer.Option(help="LoRA adapters: the base model's name (else from adapter_config.json).")] = None,
        force: Annotated[bool, typer.Option("--force", help="Pull again even if the stored copy is up to date.")] = False,
        json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    ) -> None:
        """Pull a model into the store (FLEET_HOME/models); a no-op if it is up to date."""
        import msgspec

        from fleet.config import load_settings
        from fleet.pull import pull_model
        from fleet.store import Store

        err = Console(stderr=True, highlight=False, soft_wrap=True)
        progress = RichProgress(err)
        try:
            result = pull_model(
                Store(load_settings().store_path), target,
                name=name, task=task, runtime=runtime, base=base, force=force, progress=progress,
            )
        finally:
            progress.finish()
        m = result.manifest
        for rel in result.skipped:
            err.print(f"[dim]skipped {escape(rel)}[/]")
        if json:
            sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
            return
        size = human_size(m.size_bytes)
        if result.status == "up_to_date":
            line = f"{m.name} is already up to date ({len(m.files)} files, {size})"
        elif result.status == "updated":
            line = f"{m.name} is up to date; manifest metadata refreshed"
        else:
            line = f"pulled {m.name}: {m.task}/{m.runtime}, {len(m.files)} files, {size} -> {result.path}"
        print(line)
