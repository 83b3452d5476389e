"""Python clients for a fleet daemon: MessagePack transport, numpy arrays out,
typed errors from the contract's codes, bounded retries on 429/503.

    from fleetctl import Client
    with Client() as fleet:
        vectors = fleet.embed("all-minilm-l6-v2", ["hello", "world"])    # (2, 384) float32
        blocks = fleet.embed("all-minilm-l6-v2", ["hello"], output="tokens")  # [(t, 384)]
        for chunk in fleet.generate("tiny-llama", prompt="hi", stream=True):
            print(chunk.text, end="")

`AsyncClient` has the same methods as coroutines (and `generate(stream=True)`
returns an async iterator). Each client holds one httpx connection pool, so
keep one per process (or per thread for `Client`) rather than one per call.

Keys: `api_key`, else the operator's admin key when this user has it (`operator_key`:
`fleetctl pin`, `unpin` and the other verbs that change the daemon need it), else
`FLEET_API_KEY` (or the file `FLEET_API_KEY_FILE` names).

Retries: a 429 (`overloaded`) or 503 (`unavailable`) answer is retried up to
`retries` times, after the server's `Retry-After` seconds (capped at
`max_retry_wait_s`; 0.5 s doubling when the header is missing). Other errors
raise at once as their `fleet.errors` class (`ModelNotFound`, `BadRequest`, ...).
A streamed generation is retried only before its first event.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, NamedTuple

import httpx
import msgspec

from fleet.config import client_url
from fleet.errors import FleetError, Overloaded, Unauthorized, Unavailable, from_code
from fleet.protocol import (
    ClassifyReply, EmbedReplyMsgpack, EmbedSparseReply, EmbedTokensReplyMsgpack, Entity, ErrorBody, ErrorReply,
    ExtractReply, GenerateChunkReply, GenerateReply, LabelScore, ModelList, RerankHit, RerankReply, Usage,
)

MSGPACK = "application/msgpack"
#: Statuses worth retrying: the server is busy (429) or not ready yet (503).
RETRY_STATUSES = frozenset({429, 503})
SSE_DONE = "data: [DONE]"

_encode = msgspec.msgpack.Encoder().encode
_errors = msgspec.msgpack.Decoder(ErrorReply)
_json_errors = msgspec.json.Decoder(ErrorReply)
_any = msgspec.msgpack.Decoder()
_dense = msgspec.msgpack.Decoder(EmbedReplyMsgpack)
_tokens = msgspec.msgpack.Decoder(EmbedTokensReplyMsgpack)
_sparse = msgspec.msgpack.Decoder(EmbedSparseReply)
_rerank = msgspec.msgpack.Decoder(RerankReply)
_classify = msgspec.msgpack.Decoder(ClassifyReply)
_extract = msgspec.msgpack.Decoder(ExtractReply)
_generate = msgspec.msgpack.Decoder(GenerateReply)
_models = msgspec.msgpack.Decoder(ModelList)


class _Event(msgspec.Struct, frozen=True):
    """A server-sent event of a native stream: a chunk, or `{error}` when the
    generation failed after the stream started."""

    model: str = ""
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorBody | None = None


_event = msgspec.json.Decoder(_Event)


class Sparse(NamedTuple):
    """One input's sparse vector: vocabulary ids (int32, ascending) and weights (float32)."""

    indices: Any  # np.ndarray
    values: Any  # np.ndarray


# ---- what both clients share: building bodies, reading replies -------------------

def as_list(value: Any) -> list[Any]:
    """One `str` (or one image's bytes) where a list is expected is one input, not
    a sequence of characters (or of byte values)."""
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return [value]
    return list(value)


def image_item(item: Any) -> Any:
    """An `inputs` item as the contract spells it: text stays text, raw bytes
    (an encoded image file) become `{image: bytes}`."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return {"image": bytes(item)}
    return item


def embed_body(model: str, inputs: Sequence[Any], normalize: bool, truncate: bool, output: str,
               top_k: int | None, timeout_ms: int | None, **controls: Any) -> dict[str, Any]:
    """`controls`: prompt_name, prompt, dimensions, output_dtype (None = the server's default)."""
    body: dict[str, Any] = {"model": model, "inputs": [image_item(x) for x in as_list(inputs)], "normalize": normalize,
                            "truncate": truncate}
    if output != "dense":
        body["output"] = output
    return _optional(body, top_k=top_k, timeout_ms=timeout_ms, **controls)


def embed_result(raw: bytes, output: str) -> Any:
    """Dense: one (n, d) array of the reply's dtype (float32 unless `output_dtype` said
    otherwise; binary and ubinary: (n, ceil(d / 8)) packed bytes). Tokens: a list of
    (t_i, d) arrays. Sparse: a list of `Sparse`."""
    import numpy as np

    if output == "tokens":
        reply = _tokens.decode(raw)
        return [np.frombuffer(b, dtype="<f4").reshape(shape) for b, shape in zip(reply.embeddings, reply.shapes)]
    if output == "sparse":
        reply = _sparse.decode(raw)
        return [Sparse(np.frombuffer(v.indices, dtype="<i4"), np.frombuffer(v.values, dtype="<f4"))
                for v in reply.embeddings]
    from fleet.vectors import from_wire

    reply = _dense.decode(raw)
    return from_wire(reply.embeddings, reply.shape, reply.dtype)


def _optional(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Add the fields that were given (None = the server's default)."""
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def rerank_body(model: str, query: str, documents: Sequence[str], top_n: int | None, return_documents: bool,
                raw_scores: bool, truncate: bool, timeout_ms: int | None,
                instruction: str | None = None) -> dict[str, Any]:
    return _optional({"model": model, "query": query, "documents": as_list(documents),
                      "return_documents": return_documents, "raw_scores": raw_scores, "truncate": truncate},
                     top_n=top_n, timeout_ms=timeout_ms, instruction=instruction)


def classify_body(model: str, inputs: Sequence[str], top_k: int | None, multi_label: bool | None,
                  raw_scores: bool, truncate: bool, timeout_ms: int | None) -> dict[str, Any]:
    return _optional({"model": model, "inputs": as_list(inputs), "raw_scores": raw_scores, "truncate": truncate},
                     top_k=top_k, multi_label=multi_label, timeout_ms=timeout_ms)


def extract_body(model: str, inputs: Sequence[str], labels: Sequence[str] | None, truncate: bool,
                 timeout_ms: int | None) -> dict[str, Any]:
    return _optional({"model": model, "inputs": as_list(inputs), "truncate": truncate},
                     labels=list(labels) if labels is not None else None, timeout_ms=timeout_ms)


def generate_body(model: str, prompt: str | None, messages: Sequence[dict] | None, stream: bool,
                  options: dict[str, Any]) -> dict[str, Any]:
    return _optional({"model": model, "stream": stream, **options}, prompt=prompt,
                     messages=list(messages) if messages is not None else None)


def error_of(resp: httpx.Response, content: bytes) -> FleetError:
    """The typed error of a failed reply (`{error: {code, message}}` in either format; on
    `/v1/systemone`, System One's `{detail: ...}`)."""
    msgpack = resp.headers.get("content-type", "").startswith(MSGPACK)
    try:
        body = (_errors if msgpack else _json_errors).decode(content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        err = detail_error(content, msgpack) or FleetError(
            f"HTTP {resp.status_code}: {content[:200].decode(errors='replace')}")
    else:
        err = from_code(body.error.code, body.error.message)
    if isinstance(err, Overloaded):
        err.retry_after_s = retry_after_s(resp) or err.retry_after_s
    return err


#: System One's error types that are not fleet's codes (daemon.codec.DETAIL_TYPES, reversed).
_DETAIL_CODES = {"authentication_error": "unauthorized", "permission_error": "forbidden"}


def detail_error(content: bytes, msgpack: bool) -> FleetError | None:
    """System One's error body as its fleet error: `detail[]` (what does not fit the
    schema) as one `bad_request` naming each place, `detail: {error_type, message}` by type."""
    try:
        detail = (msgspec.msgpack.decode if msgpack else msgspec.json.decode)(content).get("detail")
    except (msgspec.DecodeError, AttributeError):
        return None
    if isinstance(detail, list):
        return from_code("bad_request", "; ".join(
            f"{'.'.join(map(str, d.get('loc', [])[1:])) or 'body'}: {d.get('msg')}" for d in detail))
    if isinstance(detail, dict) and isinstance(detail.get("message"), str):
        kind = str(detail.get("error_type"))
        return from_code(_DETAIL_CODES.get(kind, kind), detail["message"])
    return None


def retry_after_s(resp: httpx.Response) -> float | None:
    """Seconds from a `Retry-After` header given as a number (HTTP dates are not sent by fleet)."""
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def unreachable(url: str, exc: Exception) -> Unavailable:
    """No answer from `url`: named with where the URL came from when FLEET_URL set it (the
    CLI never falls back to another daemon), and, in a client-only install, that the daemon
    runs elsewhere."""
    import importlib.util

    named = " (FLEET_URL)" if os.environ.get("FLEET_URL", "").rstrip("/") == url.rstrip("/") else ""
    hint = "start it with `fleetctl serve`, or point FLEET_URL at it"
    if importlib.util.find_spec("uvicorn") is None:
        hint = ("this install is client-only (no `fleetctl serve` here): point FLEET_URL at a running daemon, "
                "or pip install 'fleet-serve[server]' to run one")
    return Unavailable(f"cannot reach the fleet daemon at {url}{named}: {exc}", hint=hint)


def sse_events(lines: Iterator[str]) -> Iterator[GenerateChunkReply]:
    """Chunks from server-sent event lines; an `error` event raises its error."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if line == SSE_DONE:
            return
        event = _event.decode(data)
        if event.error is not None:
            raise from_code(event.error.code, event.error.message)
        yield GenerateChunkReply(event.model, event.text, event.finish_reason, event.usage)


def env_api_key() -> str:
    """The key clients send: FLEET_API_KEY, else the file FLEET_API_KEY_FILE names (the
    systemd unit passes the key that way, as a credential), stripped like the daemon does."""
    key = os.environ.get("FLEET_API_KEY", "")
    path = os.environ.get("FLEET_API_KEY_FILE", "")
    if key or not path:
        return key
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise Unauthorized(f"cannot read FLEET_API_KEY_FILE {path}: {exc.strerror}",
                           hint="point FLEET_API_KEY_FILE at a readable file, or set FLEET_API_KEY") from None


def operator_key(url: str) -> str:
    """The operator's admin key for the daemon at `url` (fleet.admin.client_key):
    `FLEET_ADMIN_KEY`, else FLEET_HOME's `admin.key` when `url` is the daemon serving
    that home and this user may read the key; else "". The daemon takes it in place
    of the API key, so a client that has it sends it alone."""
    from fleet.admin import client_key
    from fleet.config import default_home

    return client_key(default_home(), url)


class _Base:
    def __init__(self, url: str | None, api_key: str | None, retries: int, max_retry_wait_s: float) -> None:
        self.url = (url or client_url()).rstrip("/")
        key = api_key if api_key is not None else (operator_key(self.url) or env_api_key())
        self.headers = {"Accept": MSGPACK}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.retries = max(0, retries)
        self.max_retry_wait_s = max_retry_wait_s

    def wait_s(self, resp: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before retrying `resp`, or None when it is final."""
        if resp.status_code not in RETRY_STATUSES or attempt >= self.retries:
            return None
        hinted = retry_after_s(resp)
        return min(self.max_retry_wait_s, hinted if hinted is not None else 0.5 * 2 ** attempt)


class Client(_Base):
    """Blocking client (one httpx.Client: connections are reused across calls)."""

    def __init__(self, url: str | None = None, *, api_key: str | None = None, timeout_s: float = 60.0,
                 retries: int = 3, max_retry_wait_s: float = 10.0) -> None:
        super().__init__(url, api_key, retries, max_retry_wait_s)
        self._http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout_s)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- transport ------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None) -> bytes:
        """The reply body of a successful request (retried on 429/503); raises its typed error."""
        content = None if body is None else _encode(body)
        headers = {"Content-Type": MSGPACK} if content is not None else None
        attempt = 0
        while True:
            try:
                resp = self._http.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None
            if resp.status_code < 400:
                return resp.content
            wait = self.wait_s(resp, attempt)
            if wait is None:
                raise error_of(resp, resp.content)
            time.sleep(wait)
            attempt += 1

    def get(self, path: str) -> Any:
        return _any.decode(self.request("GET", path))

    def post(self, path: str, body: Any = None) -> Any:
        return _any.decode(self.request("POST", path, body if body is not None else {}))

    # -- tasks ----------------------------------------------------------------------

    def embed(self, model: str, inputs: str | bytes | Sequence[Any], *, normalize: bool = True,
              truncate: bool = True, output: str = "dense", top_k: int | None = None,
              timeout_ms: int | None = None, prompt_name: str | None = None, prompt: str | None = None,
              dimensions: int | None = None, output_dtype: str | None = None) -> Any:
        """Texts (str) or images (encoded file bytes) -> see `embed_result`."""
        body = embed_body(model, inputs, normalize, truncate, output, top_k, timeout_ms, prompt_name=prompt_name,
                          prompt=prompt, dimensions=dimensions, output_dtype=output_dtype)
        return embed_result(self.request("POST", "/v1/embed", body), output)

    def rerank(self, model: str, query: str, documents: str | Sequence[str], *, top_n: int | None = None,
               return_documents: bool = False, raw_scores: bool = False, truncate: bool = True,
               timeout_ms: int | None = None, instruction: str | None = None) -> list[RerankHit]:
        """Documents best first; `instruction`: an LLM reranker's task instruction."""
        body = rerank_body(model, query, documents, top_n, return_documents, raw_scores, truncate, timeout_ms,
                           instruction)
        return _rerank.decode(self.request("POST", "/v1/rerank", body)).results

    def classify(self, model: str, inputs: str | Sequence[str], *, top_k: int | None = None,
                 multi_label: bool | None = None, raw_scores: bool = False, truncate: bool = True,
                 timeout_ms: int | None = None) -> list[list[LabelScore]]:
        body = classify_body(model, inputs, top_k, multi_label, raw_scores, truncate, timeout_ms)
        return _classify.decode(self.request("POST", "/v1/classify", body)).results

    def extract(self, model: str, inputs: str | Sequence[str], *, labels: Sequence[str] | None = None,
                truncate: bool = True, timeout_ms: int | None = None) -> list[list[Entity]]:
        body = extract_body(model, inputs, labels, truncate, timeout_ms)
        return _extract.decode(self.request("POST", "/v1/extract", body)).results

    def generate(self, model: str, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                 stream: bool = False, **options: Any) -> GenerateReply | Iterator[GenerateChunkReply]:
        """One generation (`options`: max_tokens, temperature, top_p, seed, stop,
        adapter, timeout_ms). `stream=True` returns an iterator of chunks: text
        deltas, the last one with `finish_reason` and `usage`."""
        body = generate_body(model, prompt, messages, stream, options)
        if not stream:
            return _generate.decode(self.request("POST", "/v1/generate", body))
        return self._stream(body)

    def _stream(self, body: dict[str, Any]) -> Iterator[GenerateChunkReply]:
        content = _encode(body)
        attempt = 0
        while True:
            try:
                with self._http.stream("POST", "/v1/generate", content=content,
                                       headers={"Content-Type": MSGPACK}) as resp:
                    if resp.status_code < 400:
                        yield from sse_events(resp.iter_lines())
                        return
                    wait = self.wait_s(resp, attempt)
                    if wait is None:
                        raise error_of(resp, resp.read())
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None
            time.sleep(wait)
            attempt += 1

    # -- offline jobs (OpenAI's Files and Batches API; shapes: fleet.batches) ---------

    def upload_batch_file(self, path: str | os.PathLike) -> dict[str, Any]:
        """`POST /v1/files` with purpose "batch": the file streams from disk (httpx's
        multipart reads it in pieces); the daemon checks it line by line."""
        with open(path, "rb") as f:
            try:
                resp = self._http.post("/v1/files", files={"file": (os.path.basename(path), f, "application/jsonl")},
                                       data={"purpose": "batch"}, timeout=None)
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None
        if resp.status_code >= 400:
            raise error_of(resp, resp.content)
        return _any.decode(resp.content)

    def create_batch(self, input_file_id: str, endpoint: str, *, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> dict[str, Any]:
        return self.post("/v1/batches", _optional({"input_file_id": input_file_id, "endpoint": endpoint,
                                                   "completion_window": completion_window}, metadata=metadata))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.get(f"/v1/batches/{batch_id}")

    def batches(self, *, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        """One page, newest first: `{data, has_more, first_id, last_id}`."""
        return self.get(f"/v1/batches?limit={int(limit)}" + (f"&after={after}" if after else ""))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self.post(f"/v1/batches/{batch_id}/cancel")

    def download_file(self, file_id: str, dest: str | os.PathLike) -> int:
        """A file's content streamed to `dest`; returns its bytes."""
        size = 0
        try:
            with self._http.stream("GET", f"/v1/files/{file_id}/content") as resp:
                if resp.status_code >= 400:
                    raise error_of(resp, resp.read())
                with open(dest, "wb") as out:
                    for chunk in resp.iter_bytes(1 << 20):
                        out.write(chunk)
                        size += len(chunk)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from None
        return size

    def decide(self, state: Any, questions: dict[str, dict[str, Any]], *, model: str = "jev-latest",
               timeout_ms: int | None = None) -> dict[str, Any]:
        """`POST /v1/systemone`: `questions` by id in System One's shape; the reply
        (`model`, `answers` by id, `usage`) as plain data."""
        body = _optional({"model": model, "state": state, "questions": questions}, x_timeout_ms=timeout_ms)
        return _any.decode(self.request("POST", "/v1/systemone", body))

    # -- models and state -------------------------------------------------------------

    def models(self) -> ModelList:
        return _models.decode(self.request("GET", "/v1/models"))

    def ps(self) -> dict[str, Any]:
        return self.get("/v1/ps")

    def top(self) -> dict[str, Any]:
        """`GET /v1/top`, with `batches`: the batch jobs running now (`/v1/batches`),
        or None when the daemon has no Batches API."""
        state = self.get("/v1/top")
        try:
            jobs = self.get("/v1/batches?limit=100")["data"]
        except FleetError as exc:
            if exc.code != "not_found":
                raise
            state["batches"] = None
        else:
            state["batches"] = [j for j in jobs if j.get("status") in RUNNING_BATCH]
        return state


#: OpenAI batch statuses of a job that is not over.
RUNNING_BATCH = ("validating", "in_progress", "finalizing", "cancelling")


class AsyncClient(_Base):
    """asyncio client (one httpx.AsyncClient: connections are reused across calls)."""

    def __init__(self, url: str | None = None, *, api_key: str | None = None, timeout_s: float = 60.0,
                 retries: int = 3, max_retry_wait_s: float = 10.0) -> None:
        super().__init__(url, api_key, retries, max_retry_wait_s)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout_s)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, body: Any = None) -> bytes:
        content = None if body is None else _encode(body)
        headers = {"Content-Type": MSGPACK} if content is not None else None
        attempt = 0
        while True:
            try:
                resp = await self._http.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None
            if resp.status_code < 400:
                return resp.content
            wait = self.wait_s(resp, attempt)
            if wait is None:
                raise error_of(resp, resp.content)
            await asyncio.sleep(wait)
            attempt += 1

    async def get(self, path: str) -> Any:
        return _any.decode(await self.request("GET", path))

    async def post(self, path: str, body: Any = None) -> Any:
        return _any.decode(await self.request("POST", path, body if body is not None else {}))

    async def embed(self, model: str, inputs: str | bytes | Sequence[Any], *, normalize: bool = True,
                    truncate: bool = True, output: str = "dense", top_k: int | None = None,
                    timeout_ms: int | None = None, prompt_name: str | None = None, prompt: str | None = None,
                    dimensions: int | None = None, output_dtype: str | None = None) -> Any:
        body = embed_body(model, inputs, normalize, truncate, output, top_k, timeout_ms, prompt_name=prompt_name,
                          prompt=prompt, dimensions=dimensions, output_dtype=output_dtype)
        return embed_result(await self.request("POST", "/v1/embed", body), output)

    async def rerank(self, model: str, query: str, documents: str | Sequence[str], *, top_n: int | None = None,
                     return_documents: bool = False, raw_scores: bool = False, truncate: bool = True,
                     timeout_ms: int | None = None, instruction: str | None = None) -> list[RerankHit]:
        body = rerank_body(model, query, documents, top_n, return_documents, raw_scores, truncate, timeout_ms,
                           instruction)
        return _rerank.decode(await self.request("POST", "/v1/rerank", body)).results

    async def classify(self, model: str, inputs: str | Sequence[str], *, top_k: int | None = None,
                       multi_label: bool | None = None, raw_scores: bool = False, truncate: bool = True,
                       timeout_ms: int | None = None) -> list[list[LabelScore]]:
        body = classify_body(model, inputs, top_k, multi_label, raw_scores, truncate, timeout_ms)
        return _classify.decode(await self.request("POST", "/v1/classify", body)).results

    async def extract(self, model: str, inputs: str | Sequence[str], *, labels: Sequence[str] | None = None,
                      truncate: bool = True, timeout_ms: int | None = None) -> list[list[Entity]]:
        body = extract_body(model, inputs, labels, truncate, timeout_ms)
        return _extract.decode(await self.request("POST", "/v1/extract", body)).results

    async def generate(self, model: str, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                       stream: bool = False, **options: Any) -> GenerateReply | AsyncIterator[GenerateChunkReply]:
        body = generate_body(model, prompt, messages, stream, options)
        if not stream:
            return _generate.decode(await self.request("POST", "/v1/generate", body))
        return self._stream(body)

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[GenerateChunkReply]:
        content = _encode(body)
        attempt = 0
        while True:
            try:
                async with self._http.stream("POST", "/v1/generate", content=content,
                                             headers={"Content-Type": MSGPACK}) as resp:
                    if resp.status_code < 400:
                        async for line in resp.aiter_lines():
                            if line == SSE_DONE:
                                return
                            for event in sse_events(iter((line,))):
                                yield event
                        return
                    wait = self.wait_s(resp, attempt)
                    if wait is None:
                        raise error_of(resp, await resp.aread())
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None
            await asyncio.sleep(wait)
            attempt += 1

    async def models(self) -> ModelList:
        return _models.decode(await self.request("GET", "/v1/models"))

    async def ps(self) -> dict[str, Any]:
        return await self.get("/v1/ps")


class FleetEmbeddings:
    """LangChain-style embeddings over a fleet model (the `Embeddings` interface's
    two methods; LangChain itself is not needed):

        emb = FleetEmbeddings("all-minilm-l6-v2")
        emb.embed_documents(["a", "b"])   # list[list[float]]
        emb.embed_query("a")              # list[float]
    """

    def __init__(self, model: str, *, client: Client | None = None, url: str | None = None,
                 batch_size: int = 256, normalize: bool = True) -> None:
        self.model = model
        self.client = client if client is not None else Client(url)
        self.batch_size = max(1, batch_size)
        self.normalize = normalize

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        texts = as_list(texts)
        out: list[list[float]] = []
        for lo in range(0, len(texts), self.batch_size):
            out += self.client.embed(self.model, texts[lo : lo + self.batch_size], normalize=self.normalize).tolist()
        return out

    def embed_query(self, text: str) -> list[float]:
        return self.client.embed(self.model, [text], normalize=self.normalize)[0].tolist()
