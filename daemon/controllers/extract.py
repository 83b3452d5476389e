"""`POST /v1/extract`: entity spans (token classification), offsets into the text as sent."""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, post

from fleet.protocol import Entity, ExtractReply, ExtractRequest, Usage
from fleet.messages import ExtractResult

from daemon.controllers.common import decode_request, with_model
from daemon.controllers.embed import answer_headers, check_inputs, estimate_tokens
from daemon.core import Daemon
from daemon.http import reply

_result = msgspec.msgpack.Decoder(ExtractResult)


class ExtractController(Controller):
    path = "/v1"

    @post("/extract", status_code=200)
    async def extract(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "extract", *await decode_request(request, ExtractRequest))
        check_inputs(daemon, req.inputs)
        answer = await daemon.submit("extract", req.model, payload, tokens=estimate_tokens(payload, len(req.inputs)),
                                     timeout_ms=req.timeout_ms)
        res = _result.decode(answer.body)
        if len(res.spans) != len(req.inputs):
            raise RuntimeError(f"extract: {len(res.spans)} span lists for {len(req.inputs)} inputs; this is a bug")
        # The worker sends offsets only; the text of each span is cut here from the input as sent.
        results = [[Entity(s.entity, text[s.start : s.end], s.start, s.end, s.score) for s in spans]
                   for text, spans in zip(req.inputs, res.spans)]
        out = ExtractReply(req.model, results, Usage(input_tokens=res.input_tokens))
        return reply(request, out, headers=answer_headers(answer))
