"""`POST /v1/rerank` and Cohere's `POST /v2/rerank`: a query against documents
with a cross-encoder, best first.

Takes the native / Cohere / Jina fields (`documents` as strings or `{text}`,
`top_n`, `return_documents`) and TEI's (`texts`, `raw_scores`, `return_text`);
see `fleet.protocol.RerankRequest`. Each result carries `relevance_score`
(Cohere's and Jina's name) and `score` (the same number). Unknown fields are
refused on both routes (Cohere's API refuses them too); Cohere's fields fleet
accepts and does not apply are named in `X-Fleet-Ignored-Fields`.
"""

from __future__ import annotations

import secrets

from litestar import Controller, Request, Response, post

from fleet.protocol import (
    CohereApiVersion, CohereBilledUnits, CohereMeta, CohereRerankReply, RerankReply, RerankRequest,
)

from daemon import fields, tasks
from daemon.broker import Answer
from daemon.controllers.common import decode_request, with_model
from daemon.core import Daemon
from daemon.http import answer_headers, reply

#: RerankRequest fields accepted and not applied: named in the reply's `X-Fleet-Ignored-Fields`.
IGNORED_RERANK = ("max_tokens_per_doc", "max_chunks_per_doc", "priority")


def rerank_headers(req: RerankRequest, answer: Answer) -> dict[str, str]:
    return {**answer_headers(answer), **fields.ignored_header(fields.set_fields(req, IGNORED_RERANK))}


class RerankController(Controller):
    @post("/v1/rerank", status_code=200)
    async def rerank(self, request: Request, daemon: Daemon) -> Response:
        req, payload = with_model(daemon, "rerank", *await decode_request(request, RerankRequest))
        hits, usage, answer = await tasks.rerank(daemon, req, payload)
        return reply(request, RerankReply(req.model, hits, usage), headers=rerank_headers(req, answer))

    @post("/v2/rerank", status_code=200)
    async def cohere_rerank(self, request: Request, daemon: Daemon) -> Response:
        """Cohere's v2 API: the same ranking, with Cohere's `id` and `meta` (one search unit per request)."""
        req, payload = with_model(daemon, "rerank", *await decode_request(request, RerankRequest))
        hits, usage, answer = await tasks.rerank(daemon, req, payload)
        meta = CohereMeta(CohereApiVersion("2"), CohereBilledUnits(search_units=1))
        out = CohereRerankReply(secrets.token_hex(16), hits, meta, req.model, usage)
        return reply(request, out, headers=rerank_headers(req, answer))
