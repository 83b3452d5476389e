"""`POST /v1/embed` (native) and `POST /v1/embeddings` (OpenAI shape)."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from fleetctl.errors import BadRequest
from fleetctl.protocol import (
    EmbedReplyJson, EmbedReplyMsgpack, EmbedRequest, OpenAIEmbedding, OpenAIEmbeddingsReply,
    OpenAIEmbeddingsRequest, OpenAIUsage, Usage,
)
from runtimes.messages import EmbedResult, EmbedResultRaw

from daemon import codec
from daemon.broker import Answer
from daemon.core import Daemon
from daemon.http import reply, wants_msgpack

_result = msgspec.msgpack.Decoder(EmbedResult)
_result_raw = msgspec.msgpack.Decoder(EmbedResultRaw)


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
    MessagePack clients, the body exactly as received: no re-encoding)."""
    check_inputs(daemon, req.inputs)
    return await daemon.submit("embed", req.model, payload, tokens=estimate_tokens(payload, len(req.inputs)),
                               timeout_ms=req.timeout_ms)


def estimate_tokens(payload: bytes | memoryview, texts: int) -> int:
    """Token estimate for batch budgets: ~4 bytes of UTF-8 per token plus two
    special tokens per text. Workers count exactly; this only sizes batches."""
    return len(payload) // 4 + 2 * texts


class EmbedController(Controller):
    path = "/v1"

    @post("/embed", status_code=200)
    async def embed(self, request: Request, daemon: Daemon) -> Response:
        body = await request.body()
        msgpack_in = codec.is_msgpack(request.headers.get("content-type"))
        req = codec.decode(body, EmbedRequest, msgpack=msgpack_in)
        answer = await run_embed(daemon, req, body if msgpack_in else codec.encode_msgpack(req))
        headers = answer_headers(answer)
        if wants_msgpack(request):
            res = _result_raw.decode(answer.body)
            out = EmbedReplyMsgpack(req.model, res.data, res.shape, Usage(input_tokens=res.input_tokens))
            return reply(request, out, headers=headers)
        res = _result.decode(answer.body)
        vectors = np.frombuffer(res.data, dtype="<f4").reshape(res.shape)
        out = EmbedReplyJson(req.model, vectors.tolist(), res.shape, Usage(input_tokens=res.input_tokens))
        return reply(request, out, headers=headers)

    @post("/embeddings", status_code=200)
    async def openai_embeddings(self, request: Request, daemon: Daemon) -> Response:
        body = await request.body()
        msgpack_in = codec.is_msgpack(request.headers.get("content-type"))
        oreq = codec.decode(body, OpenAIEmbeddingsRequest, msgpack=msgpack_in)
        if oreq.encoding_format not in ("float", "base64"):
            raise BadRequest(f"encoding_format must be 'float' or 'base64', not {oreq.encoding_format!r}")
        inputs = [oreq.input] if isinstance(oreq.input, str) else oreq.input
        req = EmbedRequest(model=oreq.model, inputs=inputs)
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
        return reply(request, OpenAIEmbeddingsReply(data, oreq.model, usage), headers=answer_headers(answer))


def shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """OpenAI `dimensions`: keep the leading components and re-normalise (Matryoshka-style)."""
    full = vectors.shape[1]
    if not 1 <= dimensions <= full:
        raise BadRequest(f"dimensions must be between 1 and {full} for this model, got {dimensions}")
    if dimensions == full:
        return vectors
    cut = np.ascontiguousarray(vectors[:, :dimensions])
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)
