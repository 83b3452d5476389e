"""The Litestar app: controllers, the daemon as a dependency, errors mapped once."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator

from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException

from fleetctl.errors import FleetError

from daemon.controllers.admin import AdminController
from daemon.controllers.classify import ClassifyController
from daemon.controllers.cluster import ClusterController
from daemon.controllers.embed import EmbedController
from daemon.controllers.extract import ExtractController
from daemon.controllers.generate import GenerateController
from daemon.controllers.models import HealthController, MetricsController, ModelsController
from daemon.controllers.rerank import RerankController
from daemon.core import Daemon
from daemon.http import on_fleet_error, on_http_error, on_unexpected
from daemon.notify import announce_ready, watchdog_loop


def create_app(daemon: Daemon) -> Litestar:
    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        daemon.start(asyncio.get_running_loop())
        tasks = [
            # READY=1 only once uvicorn listens AND the preloaded models are resident.
            asyncio.create_task(announce_ready(lambda: daemon.is_serving() and daemon.readiness()[0],
                                               status=f"serving on {daemon.settings.url}")),
            asyncio.create_task(watchdog_loop(daemon.healthy)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await daemon.leave_cluster()
            daemon.stop()

    return Litestar(
        route_handlers=[EmbedController, RerankController, ClassifyController, ExtractController, GenerateController,
                        ModelsController, AdminController, ClusterController, MetricsController, HealthController],
        dependencies={"daemon": Provide(lambda: daemon, use_cache=True, sync_to_thread=False)},
        exception_handlers={FleetError: on_fleet_error, HTTPException: on_http_error, Exception: on_unexpected},
        lifespan=[lifespan],
        request_max_body_size=daemon.settings.max_body_bytes,
        openapi_config=None,
        # Logging is set up once by daemon.logs (JSON lines off a TTY); Litestar must not replace it.
        logging_config=None,
        debug=False,
    )
