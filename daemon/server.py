"""`fleetctl serve`: bind checks, then uvicorn on uvloop running the Litestar app."""

from __future__ import annotations

import logging

from fleetctl.config import Settings

from daemon.core import Daemon

log = logging.getLogger("fleet.daemon")


def serve(settings: Settings) -> None:
    import uvicorn

    from daemon.app import create_app
    from daemon.auth import bearer_auth, check_bind
    from daemon.logs import RequestIdMiddleware
    from daemon.notify import SystemdServer

    check_bind(settings.host, settings.api_key)
    daemon = Daemon(settings)
    # Request id outermost (401s and every log line of a request carry it); auth
    # wraps the whole app, so 404/405 answers are guarded too; /healthz stays open.
    app = RequestIdMiddleware(bearer_auth(settings.api_key)(create_app(daemon)))
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="uvloop", http="httptools",
        lifespan="on", log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=10,
    )
    # SystemdServer says STOPPING=1 on SIGTERM, then uvicorn drains as usual.
    server = SystemdServer(config)
    daemon.is_serving = lambda: server.started
    server.run()
