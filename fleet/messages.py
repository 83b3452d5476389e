"""What workers write back through `local_queue` (results), per task.

A queue item's payload is the task's request Struct from `fleet.protocol`,
MessagePack-encoded (for MessagePack clients: the very bytes they sent). Its
result is one of the Structs below, chosen by the item's status. Tensors are raw
little-endian bytes with a shape, never lists.
"""

from __future__ import annotations

import msgspec

#: Item statuses written by `ack` (local_queue treats them as opaque u8 values).
STATUS_OK = 0
STATUS_ERROR = 1


class WorkError(msgspec.Struct, frozen=True, array_like=True):
    code: str
    message: str


class EmbedResult(msgspec.Struct, frozen=True, array_like=True):
    data: bytes  # `dtype` values (fleet.vectors.WIRE_DTYPES), C order, little-endian
    shape: tuple[int, int]  # (inputs, values per row: bytes for binary and ubinary)
    input_tokens: int
    dtype: str = "float32"
    dimensions: int = 0  # each vector's length (after `dimensions`); 0 = shape[1]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """Every result a worker acks: timings, who ran it, and the task's result.

    Encoded by the worker with `body` set to a result Struct; decoded by the
    daemon with `EnvelopeIn`, where `body` stays undecoded (msgspec.Raw) until
    the reply is built, so tensor bytes are copied once, into the reply.
    """

    queue_ms: float
    inference_ms: float
    served_by: str
    body: object
    #: The worker's stage stamps for this item's batch (CLOCK_MONOTONIC ns, the
    #: clock every process on the box shares), in WORKER_STAGES order; 0 = not
    #: stamped. Read only for requests that ask for a timeline (`X-Fleet-Timeline`).
    stamps: tuple[int, ...] = ()
    #: The batch this item ran in (the `X-Batch-*` reply headers): its inputs (texts,
    #: images, a rerank's documents; generation: the sequences in the step that
    #: finished it), the tokens its tokenizer gave them (the sum of the results'
    #: `input_tokens`; generation: prompt and generated tokens of those sequences) and
    #: the LoRA adapters mixed into it (store names; empty: the base model alone).
    #: 0 = not a batch (errors).
    batch_items: int = 0
    batch_tokens: int = 0
    loras: tuple[str, ...] = ()
    #: The batch's size in the daemon's token estimate (daemon.tasks.estimate_tokens,
    #: made before any tokenizer ran), which batches are budgeted in: the unit
    #: daemon.pieces measures a model's rate in, to cut requests by the same estimate.
    batch_estimate: int = 0


class EnvelopeIn(msgspec.Struct, frozen=True, array_like=True):
    queue_ms: float
    inference_ms: float
    served_by: str
    body: msgspec.Raw
    stamps: tuple[int, ...] = ()
    batch_items: int = 0
    batch_tokens: int = 0
    loras: tuple[str, ...] = ()
    batch_estimate: int = 0


#: What `Envelope.stamps` marks, in order: the step that served the batch began
#: (the worker woke), its head was claimed, lingering for more ended, the payloads
#: were decoded; the adapter's last micro-batch was tokenized, through the forward
#: and pooling, its vectors on the host (`BatchContext.marks`: adapters that stamp);
#: the batch's results were out of the adapter.
WORKER_STAGES = ("woke", "claimed", "lingered", "decoded", "tokenized", "forward", "host", "ran")


class EmbedResultRaw(msgspec.Struct, frozen=True, array_like=True):
    """`EmbedResult` as the daemon reads it for MessagePack replies (bytes left encoded)."""

    data: msgspec.Raw
    shape: tuple[int, int]
    input_tokens: int
    dtype: str = "float32"
    dimensions: int = 0


class TokenEmbedResult(msgspec.Struct, frozen=True, array_like=True):
    """`output: "tokens"`: per input, its tokens' vectors as one float32 block
    (C order, little-endian) of shape `shapes[i]` (padding left out)."""

    data: list[bytes]
    shapes: list[tuple[int, int]]
    input_tokens: int


class TokenEmbedResultRaw(msgspec.Struct, frozen=True, array_like=True):
    """`TokenEmbedResult` as the daemon reads it for MessagePack replies (blocks left encoded)."""

    data: msgspec.Raw
    shapes: list[tuple[int, int]]
    input_tokens: int


class SparseVec(msgspec.Struct, frozen=True):
    """One input's sparse weights, encoded exactly as the reply's
    `fleet.protocol.SparseVector` (a map), so the daemon splices them into
    MessagePack replies undecoded."""

    indices: bytes  # int32, little-endian, ascending vocabulary ids
    values: bytes  # float32, little-endian, one per index


class SparseEmbedResult(msgspec.Struct, frozen=True, array_like=True):
    vectors: list[SparseVec]
    dimension: int  # vocabulary size
    input_tokens: int


class SparseEmbedResultRaw(msgspec.Struct, frozen=True, array_like=True):
    vectors: msgspec.Raw
    dimension: int
    input_tokens: int


class RerankResult(msgspec.Struct, frozen=True, array_like=True):
    """One rerank request's answer, best first, already cut to `top_n`."""

    index: bytes  # int32, little-endian: document indices, best first
    scores: bytes  # float32, little-endian, same order
    input_tokens: int


class ClassifyResult(msgspec.Struct, frozen=True, array_like=True):
    """Top-k labels per input: `top[i, j]` indexes `labels`, `scores[i, j]` is its score."""

    labels: list[str]  # the model's id2label, in id order
    top: bytes  # int32 (n, k), C order, little-endian
    scores: bytes  # float32 (n, k), C order, little-endian
    shape: tuple[int, int]
    input_tokens: int


class EntitySpan(msgspec.Struct, frozen=True, array_like=True):
    entity: str
    start: int  # characters into the input as sent (Python str indices)
    end: int
    score: float


class ExtractResult(msgspec.Struct, frozen=True, array_like=True):
    spans: list[list[EntitySpan]]  # per input, in text order
    input_tokens: int


#: Status of a partial result (`LocalQueue.emit`): more records for the same
#: request follow; the item's final `ack` ends them.
STATUS_PARTIAL = 2


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token (`logprobs` asked): its exact bytes (a token may hold
    part of a UTF-8 character), its log-probability, and the most likely tokens
    at that step, best first, with theirs."""

    token: bytes
    logprob: float
    top_tokens: list[bytes] = []
    top_logprobs: list[float] = []
    #: The token's id in the model's vocabulary, and those of `top_tokens` (TGI's details).
    id: int = -1
    top_ids: list[int] = []


class CalledTool(msgspec.Struct, frozen=True, array_like=True):
    """A tool call parsed from a generation: the function's name, its arguments as JSON text."""

    name: str
    arguments: str


class GenerateResult(msgspec.Struct, frozen=True, array_like=True):
    text: str  # the whole generated text, already cut before a stop string (without tool calls)
    finish_reason: str  # stop | length | tool_calls
    input_tokens: int
    output_tokens: int
    #: Per token of `text`, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    #: The server's limit that ended it (finish_reason "length" on a request with no
    #: max_tokens): "context" (the model's context is full) or "memory" (no room for its
    #: key/value cache to grow on the device); "" when the client's limit, a stop or the model did.
    length_limit: str = ""
    #: The tool calls the model made (requests with `tools`), in its order.
    tool_calls: list[CalledTool] = []
    #: From admission to the first generated token (its prefill), ms: with the queue wait,
    #: the time to first token a client saw.
    first_token_ms: float = 0.0


class CallPiece(msgspec.Struct, frozen=True, array_like=True):
    """A streamed piece of the `index`-th tool call: `arguments` starts at character
    `start` of the call's final arguments (its first piece, start 0, names the call)."""

    index: int
    name: str
    start: int
    arguments: str


class GenerateChunk(msgspec.Struct, frozen=True, array_like=True):
    """A streamed piece of a generation: `text` starts at character `start` of
    the final text; `logprobs` are those of the tokens this piece completes;
    `calls`, the pieces of tool calls written since the last chunk.
    The final `GenerateResult` holds the whole text (and every logprob and call),
    so a reader that missed a chunk still ends with the right answer."""

    start: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    calls: list[CallPiece] = []
