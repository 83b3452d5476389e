"""`fleetctl batch submit | ls | show | cancel | get`: offline jobs on the running
daemon (OpenAI's Batches API, daemon/batches.py).

`submit FILE.jsonl` uploads the file (streamed; the daemon checks it line by line),
creates the batch and prints its id; `--wait` follows it with a live progress bar
(lines done of total, tokens/s, ETA, errors) on stderr until it is final. Data goes
to stdout, progress and hints to stderr; `--json` prints the batch object.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from fleet.errors import BadRequest
from fleetctl.tables import FitTable

#: Statuses of a batch that is over (OpenAI's).
FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.5

err = Console(stderr=True, highlight=False, soft_wrap=True)


def endpoint_of(path: Path) -> str:
    """The `url` of the file's first request line (every line of a batch has the batch's endpoint)."""
    try:
        with path.open("rb") as f:
            for raw in f:
                if raw.strip():
                    url = json.loads(raw).get("url")
                    if isinstance(url, str):
                        return url
                    break
    except (OSError, ValueError, AttributeError) as exc:
        raise BadRequest(f"cannot read the endpoint from {path}: {exc}",
                         hint="give it: --endpoint /v1/embeddings") from None
    raise BadRequest(f"{path} has no request line with a `url`", hint="give it: --endpoint /v1/embeddings")


class _Rate(ProgressColumn):
    """tokens/s over the last polls, and errors so far (kept in the task's fields)."""

    def render(self, task: Task) -> Text:
        rate, errors = task.fields.get("tokens_s", 0.0), task.fields.get("errors", 0)
        text = Text(f"{rate:,.0f} tokens/s", style="cyan")
        if errors:
            text.append(f"  {errors} errors", style="red")
        return text


def follow(client: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch is final, with a live progress bar on stderr; Ctrl-C stops
    watching only (the batch runs on)."""
    counts = batch["request_counts"]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f}"),
               _Rate(), TimeRemainingColumn())
    seen: list[tuple[float, int]] = []  # (time, total tokens) of the last polls
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(batch["status"], total=counts["total"] or 1)
        try:
            while True:
                counts = batch["request_counts"]
                now, tokens = time.monotonic(), (batch.get("usage") or {}).get("total_tokens", 0)
                seen = [*seen, (now, tokens)][-10:]
                rate = (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0]) if len(seen) > 1 else 0.0
                paused = any(e.get("code") == "disk_full" for e in ((batch.get("errors") or {}).get("data") or []))
                bar.update(task, description=f"{batch['status']}{' (paused: disk full)' if paused else ''}",
                           completed=counts["completed"] + counts["failed"], total=counts["total"] or 1,
                           tokens_s=rate, errors=counts["failed"])
                if batch["status"] in FINAL:
                    return batch
                time.sleep(POLL_S)
                batch = client.batch(batch["id"])
        except KeyboardInterrupt:
            err.print(f"stopped watching; the batch runs on: fleetctl batch show {batch['id']}  "
                      f"(or fleetctl batch cancel {batch['id']})")
            raise typer.Exit(130) from None


def summary(b: dict[str, Any]) -> str:
    c = b["request_counts"]
    return (f"{b['id']} {b['status']}: {c['completed']} of {c['total']} lines answered 200, "
            f"{c['failed']} with errors")


def batches_table(batches: list[dict[str, Any]], title: str = "Batches") -> FitTable:
    """The batch id is what the next command takes: whole at any width; at 80 columns
    the created time and the endpoint give way."""
    t = FitTable(title)
    t.add_column("batch")
    t.add_column("status", drop=5)
    t.add_column("endpoint", drop=2)
    t.add_column("done", drop=4, justify="right")
    t.add_column("total", drop=4, justify="right")
    t.add_column("errors", drop=3, justify="right")
    t.add_column("created", drop=1)
    for b in batches:
        c = b["request_counts"]
        t.add_row(b["id"], b["status"], b["endpoint"], str(c["completed"] + c["failed"]), str(c["total"]),
                  str(c["failed"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"])))
    return t


def register(app: typer.Typer) -> None:
    batch_app = typer.Typer(help="Offline jobs: OpenAI's Batches API on the daemon's lanes (below interactive "
                                 "requests).", no_args_is_help=True, rich_markup_mode=None)
    app.add_typer(batch_app, name="batch")

    @batch_app.command()
    def submit(file: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL: one request per line."),
               endpoint: str | None = typer.Option(None, "--endpoint", "-e",
                                                   help="The route every line calls (default: the first line's url)."),
               window: str = typer.Option("24h", "--window", help="Completion window: 24h, or N s/m/h."),
               wait: bool = typer.Option(False, "--wait", help="Follow it with a progress bar until it is final."),
               as_json: bool = typer.Option(False, "--json", help="Print the batch object as JSON.")) -> None:
        """Upload FILE and start a batch; prints its id."""
        from fleetctl.client import Client

        with Client(timeout_s=600) as client:
            f = client.upload_batch_file(file)
            b = client.create_batch(f["id"], endpoint or endpoint_of(file), completion_window=window)
            if wait:
                b = follow(client, b)
        if as_json:
            print(json.dumps(b, indent=2))
        else:
            print(b["id"])
        if wait:
            err.print(summary(b))
            for e in ((b.get("errors") or {}).get("data") or [])[:5]:
                err.print(f"[red]{e.get('code')}[/]: {e.get('message')}")
            if b["status"] != "completed":
                raise typer.Exit(1)
            err.print(f"[dim]fleetctl batch get {b['id']} -o out.jsonl[/]")

    @batch_app.command("ls")
    def ls(limit: int = typer.Option(20, "--limit", min=1, max=100, help="How many, newest first."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
        """List batches, newest first."""
        from fleetctl.client import Client

        with Client() as client:
            page = client.batches(limit=limit)
        if as_json:
            print(json.dumps(page["data"], indent=2))
        else:
            # Piped output is for other programs: every column, none cut (a terminal gets what fits).
            Console(highlight=False, width=None if sys.stdout.isatty() else 4096).print(batches_table(page["data"]))

    @batch_app.command()
    def show(batch_id: str, as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
        """A batch's status, counts, files and errors."""
        from fleetctl.client import Client

        with Client() as client:
            b = client.batch(batch_id)
        if as_json:
            print(json.dumps(b, indent=2))
            return
        print(summary(b))
        usage = b.get("usage") or {}
        print(f"endpoint {b['endpoint']} · model {b.get('model') or '-'} · window {b['completion_window']} · "
              f"tokens in {usage.get('input_tokens', 0)} out {usage.get('output_tokens', 0)}")
        print(f"output file {b.get('output_file_id') or '-'} · error file {b.get('error_file_id') or '-'}")
        for e in (b.get("errors") or {}).get("data") or []:
            print(f"error {e.get('code')}: {e.get('message')}")

    @batch_app.command()
    def cancel(batch_id: str) -> None:
        """Cancel a batch: no new line starts; what is done is kept, the rest answered batch_cancelled."""
        from fleetctl.client import Client

        with Client() as client:
            b = client.cancel_batch(batch_id)
        print(f"{b['id']} {b['status']}")

    @batch_app.command()
    def get(batch_id: str,
            output: Path = typer.Option(..., "--output", "-o", help="Where the output lines (200 answers) go."),
            errors: Path | None = typer.Option(None, "--errors", help="Where the error lines go.")) -> None:
        """Download a finished batch's results (JSONL, OpenAI's line format)."""
        from fleetctl.client import Client

        with Client(timeout_s=600) as client:
            b = client.batch(batch_id)
            if b["status"] not in FINAL:
                raise BadRequest(f"batch {batch_id} is {b['status']}: its results are not final yet",
                                 hint=f"fleetctl batch submit --wait follows one; or fleetctl batch show {batch_id}")
            if b.get("output_file_id"):
                size = client.download_file(b["output_file_id"], output)
                err.print(f"{b['request_counts']['completed']} output lines ({size:,} bytes) -> {output}")
            else:
                output.write_bytes(b"")
                err.print(f"no output lines -> {output}")
            if b.get("error_file_id"):
                if errors is not None:
                    client.download_file(b["error_file_id"], errors)
                    err.print(f"error lines -> {errors}")
                else:
                    err.print(f"[yellow]the batch has error lines[/]: fleetctl batch get {batch_id} -o {output} "
                              f"--errors errors.jsonl")


def running_batches(client: Any) -> list[dict[str, Any]]:
    """The batches not final yet, newest first (among the last 100); [] from a daemon
    without the Batches API."""
    from fleet.errors import FleetError

    try:
        page = client.batches(limit=100)
    except FleetError as exc:
        if exc.code in ("not_found", "method_not_allowed"):
            return []
        raise
    return [b for b in page["data"] if b["status"] not in FINAL]
