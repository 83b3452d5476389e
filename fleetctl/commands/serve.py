"""`fleetctl serve`: run the daemon in the foreground."""

from __future__ import annotations

from typing import Any

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        host: str = typer.Option(None, help="Bind address (default 127.0.0.1; others need FLEET_API_KEY)."),
        port: int = typer.Option(None, help="Port (default 7744)."),
        workers: int = typer.Option(None, help="Worker processes (default: one per GPU, else one CPU worker)."),
        device: str = typer.Option(None, help="auto | cpu | cuda:K"),
        nats: str = typer.Option(None, help="NATS URL to join a cluster, e.g. nats://127.0.0.1:4222"),
    ) -> None:
        """Start the daemon: HTTP API plus worker processes."""
        from fleet.daemon.logs import setup_logging
        from fleet.daemon.server import serve as run

        settings = flag_settings({"host": host, "port": port, "workers": workers, "device": device, "nats": nats})
        setup_logging(settings.log_level, home=settings.home_path)  # stderr, and FLEET_HOME/logs/fleetd.log
        run(settings)


def flag_settings(flags: dict[str, Any]):
    """The daemon's settings under `serve`'s flags. A flag given is also its FLEET_*
    variable for this process and its workers: a SIGHUP re-reads config.toml under the
    same flags (fleet.config.load_settings), so it never reports a change that did not
    happen (`--port 7800` read as "port needs a restart")."""
    import os

    from fleet.config import load_settings

    os.environ.update({f"FLEET_{key.upper()}": str(value) for key, value in flags.items() if value is not None})
    return load_settings(**flags)
