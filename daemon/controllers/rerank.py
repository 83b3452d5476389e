"""`POST /v1/rerank`: a query against documents with a cross-encoder, best first.

Takes the native / Cohere fields (`documents`, `top_n`, `return_documents`) and
TEI's (`texts`, `raw_scores`, `return_text`); see `fleet.protocol.RerankRequest`.
"""

from __future__ import annotations

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest
from fleet.protocol import RerankHit, RerankReply, RerankRequest, Usage
from fleet.messages import RerankResult

from daemon.controllers.common import decode_request
from daemon.controllers.embed import answer_headers, estimate_tokens
from daemon.core import Daemon
from daemon.http import reply

_result = msgspec.msgpack.Decoder(RerankResult)


def check_rerank(daemon: Daemon, req: RerankRequest) -> None:
    if req.documents is not None and req.texts is not None:
        raise BadRequest("send the documents as `documents` or as `texts`, not both")
    docs = req.documents if req.documents is not None else req.texts
    if docs is None:
        raise BadRequest("`documents` is missing: send the texts to rank against the query")
    if not docs:
        raise BadRequest("`documents` is empty: send at least one document")
    if len(docs) > daemon.settings.max_inputs:
        raise BadRequest(f"{len(docs)} documents is more than the limit of {daemon.settings.max_inputs} per request")
    if not req.query.strip():
        raise BadRequest("`query` is empty")
    if req.top_n is not None and req.top_n < 1:
        raise BadRequest(f"top_n must be at least 1, got {req.top_n}")


class RerankController(Controller):
    path = "/v1"

    @post("/rerank", status_code=200)
    async def rerank(self, request: Request, daemon: Daemon) -> Response:
        req, payload = await decode_request(request, RerankRequest)
        check_rerank(daemon, req)
        docs = req.docs
        # Each pair carries the query again and one more special token than a single text.
        tokens = estimate_tokens(payload, len(docs)) + len(req.query) * (len(docs) - 1) // 4 + len(docs)
        answer = await daemon.submit("rerank", req.model, payload, tokens=tokens, timeout_ms=req.timeout_ms)
        res = _result.decode(answer.body)
        index = np.frombuffer(res.index, dtype="<i4").tolist()
        scores = np.frombuffer(res.scores, dtype="<f4").tolist()
        if req.return_documents or req.return_text:
            hits = [
                RerankHit(i, s, docs[i] if req.return_documents else None, docs[i] if req.return_text else None)
                for i, s in zip(index, scores)
            ]
        else:
            hits = [RerankHit(i, s) for i, s in zip(index, scores)]
        out = RerankReply(req.model, hits, Usage(input_tokens=res.input_tokens))
        return reply(request, out, headers=answer_headers(answer))
