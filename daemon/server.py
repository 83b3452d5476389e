"""`fleetctl serve`: bind checks, then uvicorn on uvloop running the Litestar app."""

from __future__ import annotations

import logging

from fleetctl.config import Settings

from daemon.core import Daemon

log = logging.getLogger("fleet.daemon")


def serve(settings: Settings) -> None:
    import uvicorn

    from daemon.app import create_app
    from daemon.auth import check_bind

    check_bind(settings.host, settings.api_key)
    daemon = Daemon(settings)
    config = uvicorn.Config(
        create_app(daemon), host=settings.host, port=settings.port, loop="uvloop", http="httptools",
        lifespan="on", log_level="warning", access_log=False, timeout_graceful_shutdown=10,
    )
    uvicorn.Server(config).run()
