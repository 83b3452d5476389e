"""`POST /v1/rerank` and Cohere's `POST /v2/rerank`: a query against documents
with a cross-encoder, best first.

Takes the native / Cohere / Jina fields (`documents` as strings or `{text}`,
`top_n`, `return_documents`) and TEI's (`texts`, `raw_scores`, `return_text`);
see `fleet.protocol.RerankRequest`. Each result carries `relevance_score`
(Cohere's and Jina's name) and `score` (the same number). Unknown fields are
refused on both routes (Cohere's API refuses them too); Cohere's fields fleet
accepts and does not apply are named in `X-Fleet-Ignored-Fields`.

Cohere v1 documents may be objects of string fields beyond `text` (`{"text",
"title", ...}`), ranked on `rank_fields` (default `text`) in their order, and
come back whole with `return_documents` (Cohere keeps every field). Such a body
of `POST /v1/rerank` is read by `structured_documents`: each document becomes
the text it is ranked on, the request runs as the native one, and the results
carry the documents as sent. Fields of the documents that were neither ranked
on nor returned are named in `X-Fleet-Ignored-Fields` (`documents[].title`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import msgspec
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest
from fleet.protocol import (
    CohereApiVersion, CohereBilledUnits, CohereMeta, CohereRerankReply, RerankReply, RerankRequest, Usage,
)

from fleet.daemon import codec, fields, tasks
from fleet.daemon.broker import Answer
from fleet.daemon.controllers.common import decode_request, with_model
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply

#: RerankRequest fields accepted and not applied: named in the reply's `X-Fleet-Ignored-Fields`.
IGNORED_RERANK = ("max_tokens_per_doc", "max_chunks_per_doc", "priority")
#: Cohere's default `rank_fields`: a document is ranked on its `text`.
TEXT = "text"


class StructuredHit(msgspec.Struct, frozen=True, omit_defaults=True):
    """A ranked document of a body with object documents: `document` as it was sent."""

    index: int
    relevance_score: float
    score: float
    document: dict[str, str] | None = None
    text: str | None = None


class StructuredRerankReply(msgspec.Struct, frozen=True):
    model: str
    results: list[StructuredHit]
    usage: Usage


@dataclass(frozen=True)
class StructuredDocuments:
    """A Cohere v1 body with object documents, read (`structured_documents`)."""

    #: The native request: each document the text it is ranked on, no `rank_fields`.
    req: RerankRequest
    #: Each document as sent (a string one as `{"text": it}`).
    documents: list[dict[str, str]]
    #: Fields of the documents not ranked on: not applied unless the documents come back.
    unranked: list[str]


def rerank_headers(req: RerankRequest, answer: Answer, more: list[str] = ()) -> dict[str, str]:
    return {**answer_headers(answer), **fields.ignored_header([*fields.set_fields(req, IGNORED_RERANK), *more])}


def rank_text(doc: dict[str, str], names: list[str]) -> str:
    """What a document is ranked on: its one rank field's value, or each rank field as a
    `name: value` line in `rank_fields` order (the YAML Cohere's guide writes structured
    documents as), so the model reads which value is which."""
    if len(names) == 1:
        return doc[names[0]]
    return "\n".join(f"{name}: {doc[name]}" for name in names)


def structured_documents(body: bytes, *, msgpack: bool) -> StructuredDocuments | None:
    """The Cohere v1 reading of a `/v1/rerank` body whose documents are objects with
    fields beyond `text`, or whose `rank_fields` names other fields; None for any other
    body (the native reading answers it). Documents lacking a rank field, and fields
    that are not strings, are refused naming them."""
    obj = fields.plain(body, msgpack=msgpack)
    if not isinstance(obj, dict) or not isinstance(docs := obj.get("documents"), list):
        return None
    names = obj.get("rank_fields")
    objects = any(isinstance(d, dict) and d.keys() - {TEXT} for d in docs)
    if not objects and names in (None, [TEXT]):
        return None
    if names is None:
        names = [TEXT]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise BadRequest("rank_fields must be a list of the documents' field names", param="rank_fields")
    documents: list[dict[str, str]] = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            doc = {TEXT: doc}
        elif not isinstance(doc, dict):
            raise BadRequest(f"documents[{i}] must be a string or an object of string fields", param="documents")
        for key, value in doc.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise BadRequest(f"documents[{i}].{fields.shown(str(key))} must be a string (Cohere's documents "
                                 f"are strings or objects of string fields)", param="documents")
        if missing := [n for n in names if n not in doc]:
            typos = [fields.Unknown(f"documents[{i}].{key}", key, tuple(names)) for key in doc if key not in names]
            if typo := next((u for u in typos if u.suggestion in missing), None):
                raise fields.refusal([typo])  # {"txt": ...}: a misspelled rank field, named as such
            raise BadRequest(f"documents[{i}] has no {', '.join(map(fields.shown, missing))} field: rank_fields "
                             f"names the fields every document is ranked on", param="documents")
        documents.append(doc)
    native = {k: v for k, v in obj.items() if k != "rank_fields"}
    native["documents"] = [rank_text(doc, names) for doc in documents]
    req = codec.decode(codec.encode(native, msgpack=msgpack), RerankRequest, msgpack=msgpack)
    unranked = list(dict.fromkeys(k for doc in documents for k in doc if k not in names))
    return StructuredDocuments(req, documents, unranked)


class RerankController(Controller):
    @post("/v1/rerank", status_code=200)
    async def rerank(self, request: Request, daemon: Daemon) -> Response:
        body, msgpack_in = await request.body(), body_is_msgpack(request)
        try:
            req = codec.decode(body, RerankRequest, msgpack=msgpack_in)
        except BadRequest:
            # Objects with more fields than `text` are Cohere v1's documents.
            if (structured := structured_documents(body, msgpack=msgpack_in)) is None:
                raise
            return await rerank_structured(request, daemon, structured)
        if req.rank_fields not in (None, [TEXT]) and (structured := structured_documents(
                body, msgpack=msgpack_in)) is not None:
            return await rerank_structured(request, daemon, structured)
        req, payload = with_model(daemon, "rerank", req, body if msgpack_in else codec.encode_msgpack(req))
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


async def rerank_structured(request: Request, daemon: Daemon, structured: StructuredDocuments) -> Response:
    """A Cohere v1 body with object documents: ranked as the native request, answered
    with each document as it was sent."""
    req, payload = with_model(daemon, "rerank", structured.req, codec.encode_msgpack(structured.req))
    hits, usage, answer = await tasks.rerank(daemon, req, payload)
    docs = structured.documents
    results = [StructuredHit(h.index, h.relevance_score, h.score, docs[h.index] if req.return_documents else None,
                             h.text) for h in hits]
    unused = [] if req.return_documents else [f"documents[].{name}" for name in structured.unranked]
    return reply(request, StructuredRerankReply(req.model, results, usage),
                 headers=rerank_headers(req, answer, unused))
