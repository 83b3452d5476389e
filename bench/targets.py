"""What the bench sends to each kind of server, and how it reads the reply.

A target is a kind plus a URL. Kinds:
  fleet       fleet's native API, MessagePack in and out (`/v1/embed`, `/v1/rerank`)
  fleet-json  the same endpoints with JSON bodies
  openai      any OpenAI-compatible server (`/v1/embeddings`, `/v1/completions`)
  infinity    infinity-emb's OpenAI-style route (`/embeddings`)
  tei         text-embeddings-inference's `/embed` (JSON; its reply carries no token count)
  ollama      Ollama's `/api/embed` (JSON; `prompt_eval_count` is its token count)
Requests are prepared once, before a run, as complete HTTP request bytes
(`Payload`), from fixed windows over the corpus so every target gets the same
inputs in the same order. Replies are decoded only as far as `usage` (the
tensor bytes are skipped by msgspec, never converted), which both checks the
reply is well formed and records the server's own token count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec

from fleet.bench.httpclient import Endpoint, build_request

KINDS = ("fleet", "fleet-json", "openai", "infinity", "tei", "ollama")
TASKS = ("embed", "rerank", "generate")
MSGPACK, JSON = "application/msgpack", "application/json"

#: Prepared requests per run; requests cycle through them.
POOL_SIZE = 512


@dataclass(frozen=True)
class Payload:
    request: bytes
    #: Input tokens (bench tokenizer count; see bench/tokens.py).
    tokens: int
    inputs: int


class _Usage(msgspec.Struct):
    input_tokens: int = -1
    prompt_tokens: int = -1
    completion_tokens: int = -1


class _UsageOnly(msgspec.Struct):
    usage: _Usage = msgspec.field(default_factory=_Usage)


class _OllamaCount(msgspec.Struct):
    prompt_eval_count: int = -1


_mp_usage = msgspec.msgpack.Decoder(_UsageOnly)
_js_usage = msgspec.json.Decoder(_UsageOnly)
_ollama_count = msgspec.json.Decoder(_OllamaCount)
#: TEI's `/embed` answers a bare array of vectors: checked as one, the numbers left unparsed.
_tei_vectors = msgspec.json.Decoder(list[msgspec.Raw])


def reply_tokens(kind: str, task: str, body: bytes) -> int:
    """The server's reported token count for one reply (-1 if it reports none).

    Raises msgspec.DecodeError on a malformed reply: the generator counts that
    as an error, not a success.
    """
    if kind == "tei":
        _tei_vectors.decode(body)
        return -1
    if kind == "ollama":
        return _ollama_count.decode(body).prompt_eval_count
    # Generation goes through the JSON completions route for every kind (see _body).
    msgpack = kind == "fleet" and task != "generate"
    usage = (_mp_usage if msgpack else _js_usage).decode(body).usage
    if task == "generate":
        return usage.completion_tokens
    return usage.input_tokens if usage.input_tokens >= 0 else usage.prompt_tokens


def default_path(kind: str, task: str) -> str:
    if kind in ("fleet", "fleet-json"):
        return {"embed": "/v1/embed", "rerank": "/v1/rerank", "generate": "/v1/completions"}[task]
    if kind == "openai":
        if task == "rerank":
            raise ValueError("OpenAI-compatible servers have no rerank endpoint; use --target fleet")
        return {"embed": "/v1/embeddings", "generate": "/v1/completions"}[task]
    if kind == "infinity":
        if task != "embed":
            raise ValueError("the infinity peer is benched for --task embed only")
        return "/embeddings"
    if kind in ("tei", "ollama"):
        if task != "embed":
            raise ValueError(f"the {kind} target is benched for --task embed only")
        return "/embed" if kind == "tei" else "/api/embed"
    raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(KINDS)}")


def _body(kind: str, task: str, model: str, texts: list[str], query: str, encoding: str) -> tuple[bytes, str]:
    if task == "generate":
        doc = {"model": model, "prompt": texts[0] if len(texts) == 1 else texts, "max_tokens": 16}
        return msgspec.json.encode(doc), JSON
    if kind in ("fleet", "fleet-json"):
        if task == "embed":
            doc = {"model": model, "inputs": texts}
        else:
            doc = {"model": model, "query": query, "documents": texts}
        if kind == "fleet":
            return msgspec.msgpack.encode(doc), MSGPACK
        return msgspec.json.encode(doc), JSON
    if kind == "tei":  # one model per server: no model field
        return msgspec.json.encode({"inputs": texts}), JSON
    if kind == "ollama":
        return msgspec.json.encode({"model": model, "input": texts}), JSON
    doc = {"model": model, "input": texts, "encoding_format": encoding}
    return msgspec.json.encode(doc), JSON


def request_windows(n_texts: int, batch: int, *, seed: int = 7, pool_size: int = POOL_SIZE) -> list[list[int]]:
    """Corpus indices for `pool_size` requests of `batch` inputs, cycling through a shuffled corpus.

    Every target (HTTP or in-process) sends these same windows, in this order.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    order = list(range(n_texts))
    random.Random(seed).shuffle(order)
    return [[order[(j * batch + k) % n_texts] for k in range(batch)] for j in range(pool_size)]


def build_payloads(
    kind: str,
    task: str,
    url: str,
    model: str,
    texts: list[str],
    lengths: list[int],
    batch: int,
    *,
    encoding: str = "base64",
    api_key: str = "",
    seed: int = 7,
    pool_size: int = POOL_SIZE,
) -> list[Payload]:
    """Prepared HTTP requests over `request_windows`; rerank queries come from the next window."""
    ep = Endpoint(url)
    path = ep.with_default_path(default_path(kind, task))
    windows = request_windows(len(texts), batch, seed=seed, pool_size=pool_size)
    out: list[Payload] = []
    for j, idx in enumerate(windows):
        chunk = [texts[i] for i in idx]
        tokens = sum(lengths[i] for i in idx)
        query = ""
        if task == "rerank":
            qi = windows[(j + 1) % len(windows)][0]
            query = texts[qi]
            # A cross-encoder reads query + document for every document.
            tokens += lengths[qi] * batch
        body, ctype = _body(kind, task, model, chunk, query, encoding)
        accept = MSGPACK if ctype == MSGPACK else JSON
        out.append(Payload(build_request(ep, path, body, ctype, accept, api_key), tokens, batch))
    return out
