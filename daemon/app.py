"""The Litestar app: controllers, the daemon as a dependency, errors mapped once."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator

from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException

from fleet.errors import FleetError

from fleet.daemon.batches import Batches
from fleet.daemon.controllers.admin import AdminController
from fleet.daemon.controllers.aliases import AliasesController
from fleet.daemon.controllers.promotions import PromotionsController
from fleet.daemon.controllers.batches import BatchesController
from fleet.daemon.controllers.calibration import CalibrationController
from fleet.daemon.controllers.classify import ClassifyController
from fleet.daemon.controllers.cohere import CohereEmbedController
from fleet.daemon.controllers.decisions import DecisionsController
from fleet.daemon.controllers.cluster import ClusterController
from fleet.daemon.controllers.docs import DocsController
from fleet.daemon.controllers.embed import EmbedController
from fleet.daemon.controllers.extract import ExtractController
from fleet.daemon.controllers.files import FilesController
from fleet.daemon.controllers.generate import GenerateController
from fleet.daemon.controllers.models import HealthController, MetricsController, ModelsController
from fleet.daemon.controllers.ollama import OllamaController, OllamaRootController
from fleet.daemon.controllers.ollama_create import OllamaCreateController, sweep_blobs_loop
from fleet.daemon.controllers.rerank import RerankController
from fleet.daemon.controllers.responses import ResponsesController
from fleet.daemon.controllers.store import StoreController
from fleet.daemon.controllers.systemone import SystemOneController
from fleet.daemon.controllers.tei import TeiController
from fleet.daemon.controllers.tgi import TgiController
from fleet.daemon.controllers.top import TopController
from fleet.daemon.core import Daemon
from fleet.daemon.http import on_fleet_error, on_http_error, on_unexpected
from fleet.daemon.notify import announce_ready, notify, watchdog_loop
from fleet.daemon.query import declared_query, refuse_undeclared

log = logging.getLogger("fleet.daemon")

#: How often worker-side metrics are read between scrapes (Daemon.refresh_gauges):
#: a worker's batch ring (runtimes.state.BATCH_RING) must not wrap in between.
METRICS_REFRESH_S = 0.5


async def refresh_loop(daemon: Daemon) -> None:
    while True:
        await asyncio.sleep(METRICS_REFRESH_S)
        try:
            # Without waiting for the queue lock on the loop (Broker.read).
            if daemon.broker is not None:
                await daemon.broker.read(daemon.refresh_gauges)
        except Exception:  # metrics must never take the daemon down
            log.exception("refreshing metrics failed")


def reload_now(daemon: Daemon) -> None:
    """SIGHUP, on the loop: RELOADING=1, apply, READY=1 (systemd's reload protocol).
    Requests keep flowing meanwhile: the reload is synchronous and short, nothing is
    stopped or re-created. A config that does not parse is logged and changes nothing."""
    notify(RELOADING=1, STATUS="reloading models.toml and config.toml")
    try:
        applied, restart = daemon.reload()
        status = f"serving on {daemon.settings.url}; reloaded" + (
            f" ({', '.join(restart)} need a restart)" if restart else "")
    except Exception as exc:
        log.error("reload failed, nothing changed: %s: %s", type(exc).__name__, exc)
        status = f"serving on {daemon.settings.url}; reload failed: {type(exc).__name__}"
    notify(READY=1, STATUS=status)


def create_app(daemon: Daemon) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        try:
            daemon.start(loop)
            # Offline jobs: batches left unfinished by the last stop resume now.
            daemon.batches = Batches(daemon, daemon.dispatch or app)
            await daemon.batches.start()
        except BaseException as exc:
            # What started stops (workers, the queue), so the process can exit: uvicorn
            # then ends `serve`, which exits 1 naming this (daemon.server).
            daemon.startup_error = f"{type(exc).__name__}: {exc}"
            if daemon.batches is not None:
                await daemon.batches.stop()
            daemon.stop()
            raise

        async def ready() -> bool:
            return daemon.is_serving() and (await daemon.readiness())[0]

        loop.add_signal_handler(signal.SIGHUP, reload_now, daemon)
        tasks = [
            asyncio.create_task(refresh_loop(daemon)),
            # READY=1 only once uvicorn listens AND the preloaded models are resident.
            asyncio.create_task(announce_ready(ready, status=f"serving on {daemon.settings.url}")),
            asyncio.create_task(watchdog_loop(daemon.healthy)),
            # Blobs uploaded for `ollama create` that no model came to use (fleet.blobs).
            asyncio.create_task(sweep_blobs_loop(daemon)),
        ]
        try:
            yield
        finally:
            # Runs after uvicorn's HTTP drain (server.py): every request has been
            # answered (or got `unavailable` at the drain bound), so the workers may go now.
            loop.remove_signal_handler(signal.SIGHUP)
            for task in tasks:
                task.cancel()
            await daemon.batches.stop()
            await daemon.leave_cluster()
            daemon.stop()

    # Each handler's query parameters, read once the routes are all registered (below).
    query_table: dict = {}
    app = Litestar(
        route_handlers=[EmbedController, RerankController, ClassifyController, ExtractController, GenerateController,
                        ModelsController, AdminController, ClusterController, MetricsController, HealthController,
                        TeiController, OllamaController, OllamaRootController, DocsController,
                        CohereEmbedController, TgiController, OllamaCreateController, TopController,
                        ResponsesController, SystemOneController, DecisionsController, StoreController],
        dependencies={"daemon": Provide(lambda: daemon, use_cache=True, sync_to_thread=False)},
        exception_handlers={FleetError: on_fleet_error, HTTPException: on_http_error, Exception: on_unexpected},
        before_request=refuse_undeclared(query_table),
        lifespan=[lifespan],
        request_max_body_size=daemon.settings.max_body_bytes,
        openapi_config=None,
        # Logging is set up once by daemon.logs (JSON lines off a TTY); Litestar must not replace it.
        logging_config=None,
        debug=False,
    )
    for controller in (FilesController, BatchesController):  # offline jobs (daemon/batches.py)
        app.register(controller)
    for controller in (AliasesController, PromotionsController):  # versions behind names (daemon/aliases.py)
        app.register(controller)
    app.register(CalibrationController)  # decision models' temperatures (daemon/calibration.py)
    query_table.update(declared_query(app))
    return app
