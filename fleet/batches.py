"""The OpenAI Files and Batches API shapes (offline jobs, daemon/batches.py).

Field names, order, statuses and the per-line formats are OpenAI's, as its
SDK reads them (`openai.types.Batch`, `FileObject`, `BatchRequestCounts`,
`BatchError`, `BatchUsage`): absent values are `null`, as OpenAI sends them.
Request Structs forbid unknown fields (OpenAI refuses them with 400).
"""

from __future__ import annotations

import msgspec

#: Batch statuses, OpenAI's (`openai.types.Batch.status`).
VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
#: A batch in one of these is done: nothing runs for it any more.
FINAL = frozenset({FAILED, COMPLETED, EXPIRED, CANCELLED})

#: The routes a batch may run: OpenAI's and fleet's native inference endpoints.
ENDPOINTS = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions",
             "/v1/embed", "/v1/rerank", "/v1/classify", "/v1/extract", "/v1/generate",
             "/v1/systemone", "/v1/decisions")
#: The task of each endpoint (the model a line names must serve it).
ENDPOINT_TASK = {"/v1/embeddings": "embed", "/v1/chat/completions": "generate", "/v1/completions": "generate",
                 "/v1/embed": "embed", "/v1/rerank": "rerank", "/v1/classify": "classify",
                 "/v1/extract": "extract", "/v1/generate": "generate",
                 "/v1/systemone": "decide", "/v1/decisions": "decide"}


class FileObject(msgspec.Struct):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    #: Deprecated by OpenAI, still sent: a stored file is always "processed" here
    #: (an upload that fails validation is refused, never stored).
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(msgspec.Struct):
    id: str
    object: str = "file"
    deleted: bool = True


class FileList(msgspec.Struct):
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: str = "list"


class BatchRequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchError]
    object: str = "list"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class Batch(msgspec.Struct, kw_only=True):
    id: str
    object: str = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = msgspec.field(default_factory=BatchRequestCounts)
    usage: BatchUsage = msgspec.field(default_factory=BatchUsage)
    metadata: dict[str, str] | None = None


class BatchList(msgspec.Struct):
    data: list[Batch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: str = "list"


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's file expiry policy: `seconds` (3600 .. 2592000) after `anchor`."""

    anchor: str
    seconds: int


class BatchCancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/batches/{id}/cancel` takes no fields: its body is empty (as OpenAI's SDKs
    send it) or an empty object; a field in it is refused."""


class BatchCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


# ---- the lines of input, output and error files ----------------------------------------------

class RequestLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of an input file: one request to `url` with `body`, named by `custom_id`."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class LineResponse(msgspec.Struct, omit_defaults=True):
    status_code: int
    request_id: str
    body: msgspec.Raw
    #: fleet: what the route's reply headers said that its body does not
    #: (`X-Fleet-Ignored-Fields`: fields accepted and not applied). Absent when nothing.
    headers: dict[str, str] | None = None


class LineError(msgspec.Struct):
    code: str
    message: str


class OutputLine(msgspec.Struct):
    """One line of an output file (a 200 answer) or of an error file (any other
    answer, or a line that never ran: `error` set, `response` null)."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None
