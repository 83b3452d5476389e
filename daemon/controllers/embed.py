"""`POST /v1/embed` (native; a Cohere v1 body is answered as Cohere: controllers.cohere)
and `POST /v1/embeddings` (OpenAI shape, with Jina's `task`)."""

from __future__ import annotations

import base64
import time

import msgspec
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest
from fleet.protocol import (
    EmbedReplyJson, EmbedReplyMsgpack, EmbedRequest, EmbedRequestJson, EmbedSparseReply, EmbedTokensReplyJson,
    EmbedTokensReplyMsgpack, ImageInput, ImageInputJson, OpenAIEmbedding, OpenAIEmbeddingsReply,
    OpenAIEmbeddingsRequest, OpenAIUsage, SparseVector, Usage,
)

from fleet.daemon import codec, fields, tasks, timeline, token_replies
from fleet.daemon.controllers import cohere
from fleet.daemon.controllers.common import with_model
from fleet.daemon.defaults import default_model
from fleet.daemon.controllers.tokens import ids_to_texts
from fleet.daemon.core import Daemon
from fleet.daemon.http import answer_headers, body_is_msgpack, reply
from fleet.daemon.offload import build_reply

_json = msgspec.json.Encoder().encode

#: OpenAI embeddings fields accepted and not applied: named in `X-Fleet-Ignored-Fields`.
IGNORED_OPENAI = ("user",)


#: Jina's `task` (on `/v1/embeddings`) -> the prompt names it means, best first
#: (jina-embeddings-v3 names its task adapters so; other models by their own prompt names).
JINA_PROMPTS: dict[str, tuple[str, ...]] = {
    "retrieval.query": ("retrieval.query", "query", "search_query"),
    "retrieval.passage": ("retrieval.passage", "passage", "document", "search_document", "corpus"),
    "text-matching": ("text-matching",),
    "classification": ("classification",),
    "separation": ("separation", "clustering"),
}


def from_json(jreq: EmbedRequestJson) -> EmbedRequest:
    """The request with JSON's base64 images (plain or data URLs) as bytes. Only
    base64 is undone here; the image itself is decoded in the worker."""
    inputs = jreq.inputs
    if any(x.__class__ is ImageInputJson for x in inputs):
        inputs = [image_bytes(i, x) if x.__class__ is ImageInputJson else x for i, x in enumerate(inputs)]
    return EmbedRequest(jreq.model, inputs, jreq.normalize, jreq.truncate, jreq.output, jreq.top_k, jreq.timeout_ms,
                        prompt_name=jreq.prompt_name, prompt=jreq.prompt, dimensions=jreq.dimensions,
                        output_dtype=jreq.output_dtype, adapter=jreq.adapter)


def image_bytes(index: int, item: ImageInputJson) -> ImageInput:
    text = item.image
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest(f"input {index}: a data URL image must be base64 (data:<type>;base64,<data>)")
    try:
        return ImageInput(base64.b64decode(text, validate=True))
    except ValueError:
        raise BadRequest(f"input {index}: `image` is not valid base64") from None


async def embed_exchange(daemon: Daemon, body: bytes, *, content_type: str | None, accept: str | None,
                         ) -> tuple[bytes, dict[str, str], bool]:
    """`POST /v1/embed`: the reply body, its headers and whether it is MessagePack, for a
    request body and its Content-Type and Accept. The one implementation, for the
    Litestar route and for its plain-ASGI twin (daemon.hot)."""
    # A JSON body with Cohere's `texts` and no `inputs` is Cohere v1's (looked at only
    # when the native reading fails or finds no inputs).
    try:
        req, msgpack_in, msgpack_out = codec.decode_negotiated(body, content_type, accept, EmbedRequest,
                                                               EmbedRequestJson)
        if not msgpack_in:
            req = from_json(req)
    except BadRequest:
        if codec.is_msgpack(content_type) or (creq := cohere.v1_body(body)) is None:
            raise
        return await cohere_v1(daemon, creq, codec.reply_is_msgpack(accept, content_type))
    if msgpack_in:
        payload = body
    else:
        if not req.inputs and (creq := cohere.v1_body(body)) is not None:
            return await cohere_v1(daemon, creq, msgpack_out)
        payload = codec.encode_msgpack(req)
    req, payload = with_model(daemon, "embed", req, payload)
    # Per-token vectors: refused before the work when the reply would be over its bound.
    token_replies.check_before(daemon, req, "raw" if msgpack_out else "json")
    if (stamps := timeline.STAMPS.get()) is not None:
        stamps.append(("checked", time.monotonic_ns()))
    # MessagePack replies splice the worker's tensor bytes in undecoded (raw).
    res, answer = await tasks.embed(daemon, req, payload, raw=msgpack_out)
    headers = answer_headers(answer)
    headers.update(fields.ignored_header(tasks.ignored_fields(req)))
    usage = Usage(input_tokens=res.input_tokens)
    if req.output == "tokens":
        values = token_replies.check_after(daemon, req.model, res.shapes, "raw" if msgpack_out else "json")
        if msgpack_out:
            out = EmbedTokensReplyMsgpack(req.model, res.data, res.shapes, usage)
        else:
            # One input's lists at a time, off the event loop when large (daemon.token_replies).
            content = await build_reply(values, lambda: codec.encode(EmbedTokensReplyJson(
                req.model, token_replies.encoded_blocks(res, _json), res.shapes, usage), msgpack=False))
            timeline.finish(headers)
            return content, headers, False
    elif req.output == "sparse":
        out = EmbedSparseReply(req.model, res.vectors if msgpack_out else
                               [SparseVector(i, v) for i, v in tasks.sparse_vectors(res)], res.dimension, usage)
    elif msgpack_out:
        out = EmbedReplyMsgpack(req.model, res.data, res.shape, usage, res.dtype, res.dimensions or res.shape[1])
    else:
        vectors = tasks.vectors(res)
        # Lists and JSON of up to max_inputs rows: off the event loop when large (daemon.offload).
        content = await build_reply(vectors.size, lambda: codec.encode(EmbedReplyJson(
            req.model, vectors.tolist(), res.shape, usage, res.dtype, res.dimensions or res.shape[1]), msgpack=False))
        timeline.finish(headers)
        return content, headers, False
    content = codec.encode(out, msgpack=msgpack_out)
    timeline.finish(headers)
    return content, headers, msgpack_out


async def cohere_v1(daemon: Daemon, creq: cohere.CohereEmbedRequest, msgpack_out: bool,
                    ) -> tuple[bytes, dict[str, str], bool]:
    content, headers = await cohere.exchange_v1(daemon, creq, msgpack_out=msgpack_out)
    return content, headers, msgpack_out


class EmbedController(Controller):
    path = "/v1"

    @post("/embed", status_code=200)
    async def embed(self, request: Request, daemon: Daemon) -> Response:
        # Served by daemon.hot in `fleetctl serve`; this route is the same exchange
        # for the OpenAPI document and for apps built without the hot routes.
        timeline.begin(request.headers.get(timeline.HEADER))
        content, headers, msgpack_out = await embed_exchange(daemon, await request.body(),
                                                             content_type=request.headers.get("content-type"),
                                                             accept=request.headers.get("accept"))
        return Response(content=content, media_type=codec.MSGPACK if msgpack_out else codec.JSON, headers=headers)

    @post("/embeddings", status_code=200)
    async def openai_embeddings(self, request: Request, daemon: Daemon) -> Response:
        oreq = codec.decode(await request.body(), OpenAIEmbeddingsRequest, msgpack=body_is_msgpack(request))
        if oreq.encoding_format not in ("float", "base64"):
            raise BadRequest(f"encoding_format must be 'float' or 'base64', not {oreq.encoding_format!r}",
                             param="encoding_format")
        if oreq.encoding_format == "base64" and oreq.output_dtype != "float32":
            # The openai SDK asks base64 unless told otherwise and reads it as float32.
            raise BadRequest(f"output_dtype {oreq.output_dtype!r} needs encoding_format 'float' (integers in "
                             "JSON): OpenAI clients read base64 as float32", param="output_dtype")
        model = oreq.model or default_model(daemon, "embed")
        prompt_name, ignored = tasks.mapped_prompt(daemon, model, "task", oreq.task, JINA_PROMPTS, oreq.prompt,
                                                   oreq.prompt_name)
        req = EmbedRequest(model=model, inputs=await openai_texts(daemon, model, oreq.input), prompt_name=prompt_name,
                           prompt=oreq.prompt, dimensions=oreq.dimensions, output_dtype=oreq.output_dtype)
        res, answer = await tasks.embed(daemon, req, codec.encode_msgpack(req))
        vectors = tasks.vectors(res)
        usage = OpenAIUsage(prompt_tokens=res.input_tokens, total_tokens=res.input_tokens)
        not_applied = [*ignored, *tasks.ignored_fields(req), *fields.set_fields(oreq, IGNORED_OPENAI)]
        headers = {**answer_headers(answer), **fields.ignored_header(not_applied)}
        if oreq.encoding_format == "base64":
            data = [OpenAIEmbedding(base64.b64encode(row.tobytes()).decode(), i) for i, row in enumerate(vectors)]
            return reply(request, OpenAIEmbeddingsReply(data, model, usage), headers=headers)
        # Lists and JSON of up to max_inputs rows: off the event loop when large (daemon.offload).
        return await build_reply(vectors.size, lambda: reply(request, OpenAIEmbeddingsReply(
            [OpenAIEmbedding(row, i) for i, row in enumerate(vectors.tolist())], model, usage), headers=headers))


async def openai_texts(daemon: Daemon, model: str, value: str | list) -> list[str]:
    """OpenAI `input` as texts: a text, texts, one text as token ids, or several as id lists."""
    if value.__class__ is str:
        return [value]
    if not value:
        raise BadRequest("`input` is empty: send at least one text", param="input")
    kind = value[0].__class__
    if any(x.__class__ is not kind for x in value):
        raise BadRequest("`input` mixes texts, token ids and lists of token ids: send one kind", param="input")
    if kind is str:
        return value
    ids = [value] if kind is int else value
    return await ids_to_texts(daemon.store, daemon.manifest(model, "embed"), ids, daemon.settings.max_token_ids)
