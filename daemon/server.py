"""`fleetctl serve`: bind checks, then uvicorn on uvloop running the Litestar app.

Shutdown (SIGTERM or SIGINT), in order:
1. `SystemdServer` says STOPPING=1; connections the kernel completed but
   uvicorn had not accepted yet are accepted (`accept_backlog`: closing the
   listener would reset them, losing requests their clients had sent); uvicorn
   closes its listening socket (new connections are refused) and asks open
   connections to close after their current response (idle ones at once; one
   whose next request has begun arriving, or that has sent nothing yet, gets its
   request answered first: daemon.connections); `Daemon.begin_drain` starts the
   drain bound (`drain_timeout_ms`, 10 s), and with NATS the box stops
   fetching work (the cluster's `stop_pulling` hook).
2. Requests in flight finish (workers still run). At the bound, those still
   waiting get `unavailable` (503) and their unclaimed items leave the queue;
   with NATS, held messages are nak'd for redelivery.
3. uvicorn waits for the responses (backstop: bound + GRACE_S), then runs the
   lifespan shutdown: SIGTERM to the workers (each finishes its batch, at most
   10 s before SIGKILL), the queue is unlinked.
4. uvicorn re-raises the signal it handled, so the process ends killed by
   SIGTERM: systemd logs `status=15/TERM`, which it counts as a clean stop
   (SuccessExitStatus includes SIGTERM by default; Restart=on-failure does not fire).
The whole stop takes at most bound + GRACE_S + ~12 s (TimeoutStopSec=60 in the unit).

SIGHUP (`systemctl reload`): `daemon.app.reload_now`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

from fleet.config import Settings
from fleet.errors import FleetError

from fleet.daemon.core import Daemon

log = logging.getLogger("fleet.daemon")

#: uvicorn's own drain limit past the daemon's bound: by then every waiter was
#: answered `unavailable`, so this only covers writing those answers out.
GRACE_S = 5.0


class LiveApp:
    """The ASGI app with its bearer-auth wrapper swappable on SIGHUP (api_key may change live;
    the admin key is taken in its place)."""

    def __init__(self, app: Any, api_key: str, admin_key: str = "") -> None:
        from fleet.daemon.auth import bearer_auth

        self._inner = app
        self._bearer_auth = bearer_auth
        self.app = bearer_auth(api_key, admin_key=admin_key)(app)

    def set_key(self, api_key: str, admin_key: str = "") -> None:
        self.app = self._bearer_auth(api_key, admin_key=admin_key)(self._inner)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


async def accept_backlog(servers: list[Any], protocol_factory: Callable[[], asyncio.Protocol]) -> int:
    """Accept every connection waiting in the listening sockets' backlogs (module doc, 1),
    served by `protocol_factory` like those the server accepted itself; how many."""
    loop = asyncio.get_running_loop()
    taken = 0
    for server in servers:
        for listening in server.sockets:
            listener = socket.socket(fileno=os.dup(listening.fileno()))
            try:
                listener.setblocking(False)
                while True:
                    try:
                        conn, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as exc:  # out of descriptors: the rest stay for the close
                        log.warning("stopping: could not accept a waiting connection: %s", exc)
                        break
                    await loop.connect_accepted_socket(protocol_factory, conn)
                    taken += 1
            finally:
                listener.close()
    return taken


def set_body_limit(litestar_app: Any, limit: int) -> None:
    """Apply a new `max_body_bytes` to a running Litestar app: each route handler caches
    the limit it resolved from its layers, so the app's value is set and the caches
    are dropped (they re-resolve on the next request)."""
    from litestar.types import Empty

    litestar_app.request_max_body_size = limit
    for route in litestar_app.routes:
        for handler in getattr(route, "route_handlers", ()):
            if hasattr(handler, "_resolved_request_max_body_size"):
                handler._resolved_request_max_body_size = Empty


def admin_key(settings: Settings, *, create: bool) -> str:
    """The operator's admin key (fleet.admin), made on the first start; "" when `admin = "open"`."""
    from fleet.admin import OPEN, ensure_key, key_path, read_key

    if settings.admin == OPEN:
        return ""
    path = key_path(settings.home, settings.admin_key_file)
    return ensure_key(path) if create else read_key(path, strict=True)


def serve(settings: Settings) -> None:
    import uvicorn

    from fleet.daemon.access import AccessLog
    from fleet.daemon.app import create_app
    from fleet.daemon.auth import check_bind
    from fleet.daemon.clients import ClientMiddleware
    from fleet.daemon.home import claim_home
    from fleet.daemon.connections import connection_limits, guarded_protocol
    from fleet.daemon.departures import DepartureMiddleware
    from fleet.daemon.guard import BrowserGuard
    from fleet.daemon.controllers.embed import embed_exchange
    from fleet.daemon.hot import HotRoutes
    from fleet.daemon.http import PRIVATE_PATHS
    from fleet.daemon.logs import RequestIdMiddleware
    from fleet.daemon.mcp_http import McpRoute
    from fleet.daemon.model_urls import ModelUrls
    from fleet.daemon.operator import OperatorMark
    from fleet.daemon.spill import UpstreamRoutes
    from fleet.daemon.upstreams import Upstreams
    from fleet.daemon.notify import SystemdServer
    from fleet.catalog import load_catalog

    check_bind(settings.host, settings.api_key)
    # A models.toml that does not load stops `serve` here with one line naming it (the
    # app's start would read it too, as a traceback in the log).
    load_catalog(settings.home)
    if settings.nats:
        from fleet.daemon.cluster import check_access, check_settings

        # NATS settings that lose work, then NATS servers that refuse this box's credentials
        # or whose certificate it does not trust: one line naming what failed, exit 1.
        check_settings(settings)
        check_access(settings)
    # Before anything starts: a second daemon on this FLEET_HOME stops here, naming the first.
    claim_home(settings)
    # The home is this daemon's now: its admin key, made on the first start (0600).
    operator_key = admin_key(settings, create=True)
    daemon = Daemon(settings)
    litestar_app = create_app(daemon)
    litestar_app.state[PRIVATE_PATHS] = ((str(settings.store_path), "<store>"), (str(settings.home_path), "<home>"))
    # Models routed to upstreams (daemon.upstreams): a config that does not check out stops here.
    upstreams = Upstreams(settings, daemon.metrics.registry)
    daemon.upstreams = upstreams
    daemon.reload_hooks.append(upstreams.reload)
    # A batch's lines take the routes HTTP requests take, in this process (daemon.batches),
    # with the upstream layer (daemon.spill) in front of them: a line of a remote model goes there.
    routes = UpstreamRoutes(HotRoutes(litestar_app, daemon, embed_exchange), daemon, upstreams)
    daemon.dispatch = routes
    # Request id outermost (401s and every log line of a request carry it); the
    # browser guard before auth (preflights carry no key); auth wraps the whole app,
    # so 404/405 answers are guarded too; /healthz stays open. Inside auth, the hot
    # route (daemon.hot) before the Litestar app, and before it the per-model URLs and
    # the root dispatch (daemon.model_urls), which rewrite a request for either; before
    # them, the request's client (its fair share of a lane: daemon.clients) and whether it
    # is still there (a request whose client left withdraws its work: daemon.departures).
    # Inside auth, before the per-model URLs' rewrite, the operator's mark (daemon.operator):
    # the routes that change the daemon read it, whatever URL reached them. Inside it, MCP's
    # `/mcp` (daemon.mcp_http), whose tool calls run the routes through `daemon.dispatch`.
    marked = OperatorMark(McpRoute(ClientMiddleware(DepartureMiddleware(ModelUrls(routes, daemon))), daemon),
                          key=operator_key, mode=settings.admin)
    guarded = LiveApp(marked, settings.api_key, operator_key)
    browser_guard = BrowserGuard(guarded, bind_host=settings.host, allowed_hosts=settings.allowed_hosts,
                                 cors_origins=settings.cors_origins)
    # OpenTelemetry spans only when the OTEL_ variables ask for them (daemon.tracing): inside
    # the request id (on the span), outside everything else (refusals are traced too).
    from fleet.daemon import tracing

    traced = tracing.TracingMiddleware(browser_guard, daemon.box) if tracing.setup(daemon.box) else browser_guard
    # The access log inside the request id (its lines carry it), outside the rest (daemon.access).
    app = RequestIdMiddleware(AccessLog(traced, daemon.settings))

    def on_reload(new: Settings) -> None:
        nonlocal operator_key
        try:  # a rotated key file applies on SIGHUP; one that cannot be read keeps the current key
            operator_key = admin_key(settings, create=False)
        except FleetError as exc:
            log.error("reload: keeping the current admin key: %s", exc.message)
        marked.configure(key=operator_key, mode=settings.admin)
        guarded.set_key(new.api_key, operator_key)
        browser_guard.configure(new.allowed_hosts, new.cors_origins)
        set_body_limit(litestar_app, new.max_body_bytes)
        server.config.timeout_graceful_shutdown = new.drain_timeout_ms / 1000.0 + GRACE_S

    daemon.reload_hooks.append(on_reload)
    bound_s = settings.drain_timeout_ms / 1000.0

    class FleetServer(SystemdServer):
        """SystemdServer (STOPPING=1) that also starts the daemon's drain bound."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            taken = await accept_backlog(self.servers, functools.partial(
                config.http_protocol_class, config=config, server_state=self.server_state,
                app_state=self.lifespan.state))
            if taken:
                log.info("stopping: accepted %d connection(s) waiting in the listen backlog", taken)
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and daemon._loop is not None:
                # A signal handler runs between bytecodes of the loop's thread: hand over.
                daemon._loop.call_soon_threadsafe(daemon.begin_drain, daemon.settings.drain_timeout_ms / 1000.0)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="uvloop", http=guarded_protocol(connection_limits(settings)),
        lifespan="on", log_config=None, log_level="warning", access_log=False,
        timeout_graceful_shutdown=bound_s + GRACE_S, timeout_keep_alive=settings.keep_alive_timeout_ms / 1000.0,
    )
    server = FleetServer(config)
    daemon.is_serving = lambda: server.started
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
    if not server.started:
        # Whatever stopped the start (the app's lifespan, a port in use): `serve` exits 1 with
        # one line (fleetctl.app), after what had started was stopped; the log has the rest.
        raise FleetError(f"the daemon did not start: {daemon.startup_error or 'see the log above'}",
                         hint="fleetctl doctor checks this box")
