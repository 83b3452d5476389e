"""`POST /v1/extract`: entity spans (token classification), offsets into the text as sent."""

from __future__ import annotations

from litestar import Controller, Request, Response, post

from fleet.protocol import ExtractReply, ExtractRequest

from fleet.daemon import tasks
from fleet.daemon.controllers.common import decode_request, with_model
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, reply


class ExtractController(Controller):
    path = "/v1"

    @post("/extract", status_code=200)
    async def extract(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "extract", *await decode_request(request, ExtractRequest))
        results, usage, answer = await tasks.extract(daemon, req, payload)
        return reply(request, ExtractReply(req.model, results, usage), headers=answer_headers(answer))
