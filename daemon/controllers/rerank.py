"""`POST /v1/rerank` and Cohere's `POST /v2/rerank`: a query against documents
with a cross-encoder, best first.

Takes the native / Cohere / Jina fields (`documents` as strings or `{text}`,
`top_n`, `return_documents`) and TEI's (`texts`, `raw_scores`, `return_text`);
see `fleet.protocol.RerankRequest`. Each result carries `relevance_score`
(Cohere's and Jina's name) and `score` (the same number).
"""

from __future__ import annotations

import secrets

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest, Unsupported
from fleet.protocol import (
    CohereApiVersion, CohereBilledUnits, CohereMeta, CohereRerankReply, RerankDocument, RerankHit, RerankReply,
    RerankRequest, Usage,
)
from fleet.messages import RerankResult

from daemon.broker import Answer
from daemon.controllers.common import decode_request, with_model
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
    if req.rank_fields not in (None, ["text"]):
        raise Unsupported("rank_fields: fleet ranks documents on their `text` only", param="rank_fields")
    if req.relevant_spans is not None and req.relevant_spans.get("mode", "disabled") != "disabled":
        raise Unsupported("relevant_spans: fleet's rerankers score whole documents", param="relevant_spans")


async def run_rerank(daemon: Daemon, req: RerankRequest, payload: bytes) -> tuple[list[RerankHit], Usage, Answer]:
    """Queue one rerank request; its hits, best first, with documents as asked."""
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
            RerankHit(i, s, s, RerankDocument(docs[i]) if req.return_documents else None,
                      docs[i] if req.return_text else None)
            for i, s in zip(index, scores)
        ]
    else:
        hits = [RerankHit(i, s, s) for i, s in zip(index, scores)]
    return hits, Usage(input_tokens=res.input_tokens), answer


class RerankController(Controller):
    @post("/v1/rerank", status_code=200)
    async def rerank(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "rerank", *await decode_request(request, RerankRequest))
        hits, usage, answer = await run_rerank(daemon, req, payload)
        return reply(request, RerankReply(req.model, hits, usage), headers=answer_headers(answer))

    @post("/v2/rerank", status_code=200)
    async def cohere_rerank(self, request: Request, daemon: Daemon) -> Response:
        """Cohere's v2 API: the same ranking, with Cohere's `id` and `meta` (one search unit per request)."""
        req, payload = with_model(daemon, "rerank", *await decode_request(request, RerankRequest))
        hits, usage, answer = await run_rerank(daemon, req, payload)
        meta = CohereMeta(CohereApiVersion("2"), CohereBilledUnits(search_units=1))
        out = CohereRerankReply(secrets.token_hex(16), hits, meta, req.model, usage)
        return reply(request, out, headers=answer_headers(answer))
