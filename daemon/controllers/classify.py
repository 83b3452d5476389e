"""`POST /v1/classify`: sequence classification with the model's own labels, best first."""

from __future__ import annotations

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest
from fleet.protocol import ClassifyReply, ClassifyRequest, LabelScore, Usage
from fleet.messages import ClassifyResult

from daemon.controllers.common import decode_request, with_model
from daemon.controllers.embed import answer_headers, check_inputs, estimate_tokens
from daemon.core import Daemon
from daemon.http import reply

_result = msgspec.msgpack.Decoder(ClassifyResult)


class ClassifyController(Controller):
    path = "/v1"

    @post("/classify", status_code=200)
    async def classify(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "classify", *await decode_request(request, ClassifyRequest))
        check_inputs(daemon, req.inputs)
        if req.top_k is not None and req.top_k < 1:
            raise BadRequest(f"top_k must be at least 1, got {req.top_k}")
        answer = await daemon.submit("classify", req.model, payload, tokens=estimate_tokens(payload, len(req.inputs)),
                                     timeout_ms=req.timeout_ms)
        res = _result.decode(answer.body)
        top = np.frombuffer(res.top, dtype="<i4").reshape(res.shape).tolist()
        scores = np.frombuffer(res.scores, dtype="<f4").reshape(res.shape).tolist()
        labels = res.labels
        results = [[LabelScore(labels[j], s) for j, s in zip(row_top, row_scores)]
                   for row_top, row_scores in zip(top, scores)]
        out = ClassifyReply(req.model, results, Usage(input_tokens=res.input_tokens))
        return reply(request, out, headers=answer_headers(answer))
