"""`fleetctl serve`: run the daemon in the foreground."""

from __future__ import annotations

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
        import os

        from fleet.config import load_settings
        from daemon.logs import setup_logging
        from daemon.server import serve as run

        flags = {"host": host, "port": port, "workers": workers, "device": device, "nats": nats}
        # A flag is its FLEET_* variable for this process and its workers: a SIGHUP re-reads
        # config.toml under the same flags, so it never sees a change that did not happen.
        os.environ.update({f"FLEET_{key.upper()}": str(value) for key, value in flags.items() if value is not None})
        settings = load_settings(**flags)
        setup_logging(settings.log_level, home=settings.home_path)  # stderr, and FLEET_HOME/logs/fleetd.log
        run(settings)
