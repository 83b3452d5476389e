"""`POST /v1/embed` (native) and `POST /v1/embeddings` (OpenAI shape)."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest
from fleet.protocol import (
    EmbedReplyJson, EmbedReplyMsgpack, EmbedRequest, EmbedRequestJson, EmbedSparseReply, EmbedTokensReplyJson,
    EmbedTokensReplyMsgpack, ImageInput, ImageInputJson, OpenAIEmbedding, OpenAIEmbeddingsReply,
    OpenAIEmbeddingsRequest, OpenAIUsage, SparseVector, Usage,
)
from fleet.messages import (
    EmbedResult, EmbedResultRaw, SparseEmbedResult, SparseEmbedResultRaw, TokenEmbedResult, TokenEmbedResultRaw,
)

from daemon import codec, timeline
from daemon.broker import Answer
from daemon.controllers.common import default_model, with_model
from daemon.controllers.tokens import ids_to_texts
from daemon.core import Daemon
from daemon.http import reply, wants_msgpack

_result = msgspec.msgpack.Decoder(EmbedResult)
_result_raw = msgspec.msgpack.Decoder(EmbedResultRaw)
_tokens = msgspec.msgpack.Decoder(TokenEmbedResult)
_tokens_raw = msgspec.msgpack.Decoder(TokenEmbedResultRaw)
_sparse = msgspec.msgpack.Decoder(SparseEmbedResult)
_sparse_raw = msgspec.msgpack.Decoder(SparseEmbedResultRaw)

#: Batch-budget tokens an image costs (a ViT-B/16 at 224 px sees 197 patches;
#: the worker counts exactly, this only sizes batches).
IMAGE_TOKENS = 256


def answer_headers(answer: Answer) -> dict[str, str]:
    return {
        "X-Queue-Ms": f"{answer.queue_ms:.2f}",
        "X-Inference-Ms": f"{answer.inference_ms:.2f}",
        "X-Served-By": answer.served_by,
    }


def check_inputs(daemon: Daemon, inputs: list[str]) -> None:
    if not inputs:
        raise BadRequest("`inputs` is empty: send at least one text")
    if len(inputs) > daemon.settings.max_inputs:
        raise BadRequest(f"{len(inputs)} inputs is more than the limit of {daemon.settings.max_inputs} per request")


async def run_embed(daemon: Daemon, req: EmbedRequest, payload: bytes) -> Answer:
    """Queue an embed request. `payload` is the request as MessagePack (for
    MessagePack clients, the body exactly as received: no re-encoding; image
    bytes ride in it to the worker untouched)."""
    check_inputs(daemon, req.inputs)
    if req.top_k is not None and (req.output != "sparse" or req.top_k < 1):
        raise BadRequest(f"top_k takes a count >= 1 and only with output 'sparse', got top_k={req.top_k} "
                         f"with output {req.output!r}")
    return await daemon.submit("embed", req.model, payload, tokens=embed_tokens(req, payload),
                               timeout_ms=req.timeout_ms)


def embed_tokens(req: EmbedRequest, payload: bytes | memoryview) -> int:
    """Batch-budget tokens: texts from the payload size (`estimate_tokens`); with
    images, texts by their characters and each image as IMAGE_TOKENS."""
    images = sum(1 for x in req.inputs if x.__class__ is ImageInput)
    if not images:
        return estimate_tokens(payload, len(req.inputs))
    chars = sum(len(x) for x in req.inputs if x.__class__ is str)
    return chars // 4 + 2 * (len(req.inputs) - images) + IMAGE_TOKENS * images


def from_json(jreq: EmbedRequestJson) -> EmbedRequest:
    """The request with JSON's base64 images (plain or data URLs) as bytes. Only
    base64 is undone here; the image itself is decoded in the worker."""
    inputs = jreq.inputs
    if any(x.__class__ is ImageInputJson for x in inputs):
        inputs = [image_bytes(i, x) if x.__class__ is ImageInputJson else x for i, x in enumerate(inputs)]
    return EmbedRequest(jreq.model, inputs, jreq.normalize, jreq.truncate, jreq.output, jreq.top_k, jreq.timeout_ms)


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


def estimate_tokens(payload: bytes | memoryview, texts: int) -> int:
    """Token estimate for batch budgets: ~4 bytes of UTF-8 per token plus two
    special tokens per text. Workers count exactly; this only sizes batches."""
    return len(payload) // 4 + 2 * texts


async def embed_exchange(daemon: Daemon, body: bytes, *, msgpack_in: bool, msgpack_out: bool,
                         ) -> tuple[bytes, dict[str, str]]:
    """`POST /v1/embed`: the reply body and headers for a request body. The one
    implementation, for the Litestar route and for its plain-ASGI twin (daemon.hot)."""
    if msgpack_in:
        req = codec.decode(body, EmbedRequest, msgpack=True)
        payload = body
    else:
        req = from_json(codec.decode(body, EmbedRequestJson, msgpack=False))
        payload = codec.encode_msgpack(req)
    req, payload = with_model(daemon, "embed", req, payload)
    timeline.stamp("checked")
    answer = await run_embed(daemon, req, payload)
    headers = answer_headers(answer)
    if req.output == "tokens":
        out = tokens_reply(req.model, answer.body, msgpack=msgpack_out)
    elif req.output == "sparse":
        out = sparse_reply(req.model, answer.body, msgpack=msgpack_out)
    elif msgpack_out:
        res = _result_raw.decode(answer.body)
        out = EmbedReplyMsgpack(req.model, res.data, res.shape, Usage(input_tokens=res.input_tokens))
    else:
        res = _result.decode(answer.body)
        vectors = np.frombuffer(res.data, dtype="<f4").reshape(res.shape)
        out = EmbedReplyJson(req.model, vectors.tolist(), res.shape, Usage(input_tokens=res.input_tokens))
    content = codec.encode(out, msgpack=msgpack_out)
    timeline.finish(headers)
    return content, headers


class EmbedController(Controller):
    path = "/v1"

    @post("/embed", status_code=200)
    async def embed(self, request: Request, daemon: Daemon) -> Response:
        # Served by daemon.hot in `fleetctl serve`; this route is the same exchange
        # for the OpenAPI document and for apps built without the hot routes.
        timeline.begin(request.headers.get(timeline.HEADER))
        msgpack_out = wants_msgpack(request)
        content, headers = await embed_exchange(daemon, await request.body(), msgpack_out=msgpack_out,
                                                msgpack_in=codec.is_msgpack(request.headers.get("content-type")))
        return Response(content=content, media_type=codec.MSGPACK if msgpack_out else codec.JSON, headers=headers)

    @post("/embeddings", status_code=200)
    async def openai_embeddings(self, request: Request, daemon: Daemon) -> Response:
        body = await request.body()
        msgpack_in = codec.is_msgpack(request.headers.get("content-type"))
        oreq = codec.decode(body, OpenAIEmbeddingsRequest, msgpack=msgpack_in)
        if oreq.encoding_format not in ("float", "base64"):
            raise BadRequest(f"encoding_format must be 'float' or 'base64', not {oreq.encoding_format!r}",
                             param="encoding_format")
        model = oreq.model or default_model(daemon, "embed")
        req = EmbedRequest(model=model, inputs=await openai_texts(daemon, model, oreq.input))
        answer = await run_embed(daemon, req, codec.encode_msgpack(req))
        res = _result.decode(answer.body)
        vectors = np.frombuffer(res.data, dtype="<f4").reshape(res.shape)
        if oreq.dimensions is not None:
            vectors = shorten(vectors, oreq.dimensions)
        if oreq.encoding_format == "base64":
            data = [OpenAIEmbedding(base64.b64encode(row.tobytes()).decode(), i) for i, row in enumerate(vectors)]
        else:
            data = [OpenAIEmbedding(row, i) for i, row in enumerate(vectors.tolist())]
        usage = OpenAIUsage(prompt_tokens=res.input_tokens, total_tokens=res.input_tokens)
        return reply(request, OpenAIEmbeddingsReply(data, model, usage), headers=answer_headers(answer))


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
    return await ids_to_texts(daemon.store, daemon.manifest(model, "embed"), ids)


def shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """OpenAI `dimensions`: keep the leading components and re-normalise (Matryoshka-style)."""
    full = vectors.shape[1]
    if not 1 <= dimensions <= full:
        raise BadRequest(f"dimensions must be between 1 and {full} for this model, got {dimensions}",
                         param="dimensions")
    if dimensions == full:
        return vectors
    cut = np.ascontiguousarray(vectors[:, :dimensions])
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)


def tokens_reply(model: str, body: bytes, *, msgpack: bool):
    """Per-token vectors: MessagePack splices the worker's blocks in undecoded."""
    if msgpack:
        res = _tokens_raw.decode(body)
        return EmbedTokensReplyMsgpack(model, res.data, res.shapes, Usage(input_tokens=res.input_tokens))
    res = _tokens.decode(body)
    blocks = [np.frombuffer(b, dtype="<f4").reshape(shape).tolist() for b, shape in zip(res.data, res.shapes)]
    return EmbedTokensReplyJson(model, blocks, res.shapes, Usage(input_tokens=res.input_tokens))


def sparse_reply(model: str, body: bytes, *, msgpack: bool) -> EmbedSparseReply:
    if msgpack:
        res = _sparse_raw.decode(body)
        return EmbedSparseReply(model, res.vectors, res.dimension, Usage(input_tokens=res.input_tokens))
    res = _sparse.decode(body)
    vectors = [SparseVector(np.frombuffer(v.indices, dtype="<i4").tolist(),
                            np.frombuffer(v.values, dtype="<f4").tolist()) for v in res.vectors]
    return EmbedSparseReply(model, vectors, res.dimension, Usage(input_tokens=res.input_tokens))
