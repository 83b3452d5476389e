"""`POST /v1/classify`: sequence classification with the model's own labels, best first."""

from __future__ import annotations

from litestar import Controller, Request, Response, post

from fleet.protocol import ClassifyReply, ClassifyRequest

from fleet.daemon import tasks
from fleet.daemon.controllers.common import decode_request, with_model
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, reply


class ClassifyController(Controller):
    path = "/v1"

    @post("/classify", status_code=200)
    async def classify(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "classify", *await decode_request(request, ClassifyRequest))
        results, usage, answer = await tasks.classify(daemon, req, payload)
        return reply(request, ClassifyReply(req.model, results, usage), headers=answer_headers(answer))
