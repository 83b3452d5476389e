"""OpenAI's Batches API: `POST /v1/batches`, `GET /v1/batches` (cursor pages),
`GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel` (daemon/batches.py)."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post

from fleet.batches import BatchCancelRequest, BatchCreateRequest, BatchList

from fleet.daemon import codec
from fleet.daemon.controllers.files import batches_of
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack, reply


class BatchesController(Controller):
    path = "/v1/batches"

    @post("", status_code=200)
    async def create(self, request: Request, daemon: Daemon) -> Response:
        req = codec.decode(await request.body(), BatchCreateRequest, msgpack=body_is_msgpack(request))
        return reply(request, batches_of(daemon).create(req))

    @get("", status_code=200)
    async def list_batches(self, request: Request, daemon: Daemon, after: str | None = None,
                           limit: int = 20) -> Response:
        page, more = batches_of(daemon).list(after=after, limit=limit)
        return reply(request, BatchList(page, more, page[0].id if page else None, page[-1].id if page else None))

    @get("/{batch_id:str}", status_code=200)
    async def retrieve(self, request: Request, daemon: Daemon, batch_id: str) -> Response:
        return reply(request, batches_of(daemon).get(batch_id))

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(self, request: Request, daemon: Daemon, batch_id: str) -> Response:
        if body := await request.body():
            codec.decode(body, BatchCancelRequest, msgpack=body_is_msgpack(request))
        return reply(request, batches_of(daemon).cancel(batch_id))
