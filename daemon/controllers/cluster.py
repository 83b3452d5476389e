"""`GET /v1/cluster`: every box in the NATS cluster, from the `fleet_boxes` heartbeats."""

from __future__ import annotations

from urllib.parse import urlsplit

from litestar import Controller, Request, Response, get

from fleet.errors import BadRequest

from fleet.daemon.core import Daemon
from fleet.daemon.http import reply


def public_url(url: str) -> str:
    """A NATS URL without user:password@ (never echo credentials)."""
    parts = [urlsplit(u.strip()) for u in url.split(",") if u.strip()]
    return ",".join(f"{p.scheme}://{p.hostname}" + (f":{p.port}" if p.port else "") for p in parts)


class ClusterController(Controller):
    path = "/v1"

    @get("/cluster")
    async def cluster(self, request: Request, daemon: Daemon) -> Response:
        if daemon.cluster is None:
            raise BadRequest("this daemon is not in a cluster", hint="start it with `fleetctl serve --nats nats://HOST:4222`")
        return reply(request, {
            "box": daemon.box,
            "nats": public_url(daemon.settings.nats),
            "joined": daemon.cluster.joined,
            "boxes": daemon.cluster.boxes(),
        })
