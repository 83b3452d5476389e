"""The Ollama API on fleet's port: `/api/version|tags|ps|show|embed|embeddings|chat|generate|pull|delete`.

Apps that speak Ollama (its Python and JS clients, Open WebUI, Continue, ...)
work against `fleetctl serve` unchanged; shapes follow Ollama's docs/api.md
(ollama_wire). Every route runs on fleet's own machinery:

* Generation queues one `fleet.protocol.GenerateRequest` through
  `daemon.text_stream.TextStream`, streamed or not (`stream` defaults to true,
  as in Ollama: NDJSON lines, then one with `done`, `done_reason` and the stats).
  The worker always streams its pieces to the daemon, so both replies are built
  the same way and the time to the first piece is measured for the stats.
  `/api/generate` renders the model's chat template around `prompt` (and
  `system`) unless `raw` is set or the model has none.
* Embeddings run through `daemon.tasks.embed` (`/api/embed` normalised,
  the legacy `/api/embeddings` not, as in Ollama).
* `keep_alive` maps onto the admin path (controllers.ollama_keep; controllers.admin, fleet.control):
  negative = load now and keep resident for the life of this daemon process (a pin
  on the worker, never persisted: persisted pins are the operator's, made through
  `POST /v1/models/{name}/pin` or `fleetctl pin`), 0 = unload once answered (a
  client's keep is released first; a model the operator pinned or preloads is
  refused with 400, before anything runs), any other duration = fleet's LRU
  eviction (no timer). A request with no prompt / messages / input only applies it
  (Ollama's load/unload idiom). Keeping and unloading are the operator's
  (daemon.operator): without the admin key, a negative or 0 `keep_alive` is not
  applied (LRU, named in `X-Fleet-Ignored-Fields`), so one user of a shared box
  cannot hold memory against, or unload the models of, the others.
* `/api/pull` pulls catalog or stored names only (never a source given by the
  client) through `fleet.pull`, reporting progress as Ollama's status lines;
  `/api/delete` releases, unloads and removes a model from the store. Both are the
  operator's (daemon.operator); a pull that adds a model past `store_max_models`
  is refused (507).

Durations are nanoseconds: `total_duration` is the daemon's wall time,
`load_duration` the worker's load time when this request found the model not
resident, `prompt_eval_duration` the time to the first piece of text less queue
and load, `eval_duration` the rest of the time in the model.

Errors answer `{"error": "..."}` with the contract's status (Ollama clients read
that field); a failure after a stream started ends it with such a line.

Unknown fields are ignored, as Ollama ignores them, and named in the
`X-Fleet-Ignored-Fields` reply header with the known fields fleet accepts and
does not apply (`messages[i].thinking`, `verbose`, ...); options fleet does not
apply are named in `X-Fleet-Ignored-Options`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import numpy as np
from litestar import Controller, Request, Response, delete, get, head, post
from litestar.exceptions import HTTPException
from litestar.response import Stream

from fleet.catalog import load_catalog
from fleet.errors import BadRequest, FleetError, InsufficientStorage, ModelNotFound, Overloaded, SourceUnreachable
from fleet.protocol import ChatMessage, EmbedRequest, FunctionCall, GenerateRequest, TokenLogprob, ToolCall
from fleet.pull import pull_model
from fleet.store import Manifest, Progress

from fleet.daemon import codec, fields, tasks
from fleet.daemon.broker import Answer
from fleet.daemon.controllers.ollama_facts import capabilities, details, facts
from fleet.daemon.controllers import tool_calls
from fleet.daemon.controllers.ollama_keep import apply_keep, client_keep, keep_after, keep_before
from fleet.daemon.controllers.ollama_wire import (
    API_VERSION, IGNORED_MESSAGE, IGNORED_OPTIONS_HEADER, ChatBody, ChatLine, EmbedBody, EmbeddingsBody,
    EmbeddingsReply, EmbedReply, ErrorLine, GenerateBody, GenerateLine, Keep, NameBody, OllamaFunction,
    OllamaToolCall, PsReply, ReplyMessage,
    RunningModel, ShowReply, Stats, TagModel, TagsReply, created_at, forever, iso_utc, logprob_fields,
    ollama_name, output_format, read_options, refuse_unsupported, sampling, store_name,
)
from fleet.daemon.controllers.ollama_wire import Progress as ProgressLine
from fleet.daemon.core import Daemon
from fleet.daemon.http import PRIVATE_PATHS, body_is_msgpack, hide_paths
from fleet.daemon.offload import build_reply
from fleet.daemon.operator import operator_only
from fleet.daemon.owner import delete_model, detached, retire_copies
from fleet.daemon.tasks import check_generate, token_logprobs
from fleet.daemon.text_stream import TextStream

log = logging.getLogger("fleet.daemon")

NDJSON = "application/x-ndjson"
_json = msgspec.json.Encoder()
#: Pull progress lines are sent at most this often per file (seconds), plus each file's last.
PROGRESS_EVERY_S = 0.1


def line(obj: Any) -> bytes:
    return codec.json_line(obj) + b"\n"


def json_reply(obj: Any, headers: dict[str, str] | None = None, status: int = 200) -> Response:
    return Response(content=_json.encode(obj), status_code=status, media_type=codec.JSON, headers=headers)


def on_error(request: Request, exc: Exception) -> Response:
    """Every error of an /api route in Ollama's shape, with the contract's status."""
    headers = {}
    if isinstance(exc, FleetError):
        status, message = exc.status, shown(request, exc)
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, HTTPException):
        status, message = exc.status_code, str(exc.detail)
    else:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        status, message = 500, f"internal error: {type(exc).__name__}"
    return json_reply(ErrorLine(message), headers=headers, status=status)


def shown(request: Request, exc: FleetError) -> str:
    """The message a client reads: the store and FLEET_HOME named as such, never by path."""
    message = hide_paths(exc.message, request.app.state.get(PRIVATE_PATHS, ()))
    if message != exc.message:
        log.warning("%s on %s %s: %s", exc.code, request.method, request.url.path, exc.message)
    return message


def room_for_model(daemon: Daemon, name: str) -> None:
    """A model added through the API (pull, copy, create) must fit `store_max_models`."""
    limit = daemon.settings.store_max_models
    if daemon.store.exists(name):
        return
    held = len(daemon.store.names())
    if held >= limit:
        raise InsufficientStorage(f"the store holds {held} models, its limit (store_max_models = {limit}): "
                                  f"delete one first (ollama rm, fleetctl rm), or raise store_max_models")


def pullable(daemon: Daemon, name: str, catalog: Any) -> None:
    """A stored model that is not in the catalog is pulled again from its recorded source;
    one pulled from a folder that is gone has none: said by its name, not the folder's."""
    if name in catalog:
        return
    source = daemon.store.get(name).source
    if source.startswith("path:") and not Path(source[len("path:"):]).is_dir():
        raise SourceUnreachable(f"model '{name}' was pulled from a folder that is no longer there: there is nothing "
                                "to pull it from again; the stored model is kept as it is")


async def decode(request: Request, type_: type[Any]) -> tuple[Any, list[str]]:
    """(request, the unknown fields it dropped): Ollama ignores unknown fields."""
    body = await request.body()
    if not body.strip():
        raise BadRequest("missing request body")
    return codec.decode_lenient(body, type_, msgpack=body_is_msgpack(request))


def stored_manifest(daemon: Daemon, ollama: str) -> Manifest:
    name = store_name(ollama)
    try:
        return daemon.store.get(name)
    except ModelNotFound:
        raise not_found(ollama, name) from None


def serving(daemon: Daemon, ollama: str, task: str) -> str:
    """The store name of `ollama`, which must serve `task`."""
    name = store_name(ollama)
    try:
        daemon.manifest(name, task)
    except ModelNotFound:
        raise not_found(ollama, name) from None
    return name


def not_found(ollama: str, name: str) -> ModelNotFound:
    """Ollama's words (its clients match "not found, try pulling it first"), then how
    fleet's operator pulls it."""
    return ModelNotFound(f"model '{ollama}' not found, try pulling it first (ollama pull {ollama}, "
                         f"or on the daemon's box: fleetctl pull {name})")


def ignored_headers(options: list[str], dropped: list[str]) -> dict[str, str]:
    """`X-Fleet-Ignored-Options` (options fleet does not apply) and `X-Fleet-Ignored-Fields`
    (unknown fields, and known ones fleet does not apply)."""
    headers = fields.ignored_header(dropped)
    if options:
        headers[IGNORED_OPTIONS_HEADER] = ",".join(fields.shown(o) for o in options)
    return headers


def message_fields(messages: list[Any]) -> list[str]:
    """Message fields fleet accepts and does not apply (earlier thinking, a tool's name)."""
    return [f"messages[{i}].{name}" for i, m in enumerate(messages) for name in fields.set_fields(m, IGNORED_MESSAGE)]


# ---- timing ----------------------------------------------------------------------------------

class Clock:
    """One request's timeline, for Ollama's durations (ns). Start it with `Clock.start`."""

    def __init__(self, name: str) -> None:
        self.t0 = time.perf_counter_ns()
        self.name = name
        self.was_loaded = False
        self.first = 0

    @classmethod
    async def start(cls, daemon: Daemon, name: str) -> Clock:
        clock = cls(name)
        clock.was_loaded = name in await daemon.loaded_models()
        return clock

    async def load_ns(self, daemon: Daemon) -> int:
        if self.was_loaded:
            return 0
        ms = max((float(m.get("load_ms", 0.0)) for w in await daemon.workers() if w["up"]
                  for n, m in w["models"].items() if n == self.name), default=0.0)
        return int(ms * 1e6)

    async def stats(self, daemon: Daemon, answer: Answer, input_tokens: int, output_tokens: int) -> Stats:
        total = time.perf_counter_ns() - self.t0
        load = await self.load_ns(daemon)
        inference = int(answer.inference_ms * 1e6)
        queue = int(answer.queue_ms * 1e6)
        prompt = min(inference, max(0, self.first - self.t0 - queue - load)) if self.first else 0
        return Stats(total, load, input_tokens, prompt, output_tokens, max(0, inference - prompt))


# ---- generation ----------------------------------------------------------------------------------

Frame = Callable[..., Any]


async def run_text(daemon: Daemon, name: str, req: GenerateRequest, keep: Keep, stream: bool, frame: Frame,
                   headers: dict[str, str]) -> Response | Stream:
    """Queue one generation and answer it as NDJSON lines or one object.
    `frame(text, done, done_reason=None, stats=None, logprobs=None)` builds a reply object."""
    clock = await Clock.start(daemon, name)
    check_generate(req)  # bad input changes nothing: checked before keep_alive pins anything
    payload = codec.encode_msgpack(req)
    await keep_before(daemon, name, keep)
    text = TextStream(daemon, req, payload)
    await text.started()  # an error before any text raises here: the client gets its status
    clock.first = time.perf_counter_ns()

    async def last(whole: str, logprobs: list[TokenLogprob] | None = None, calls: list | None = None) -> Any:
        res = text.result
        # A turn that ended in calls is a "stop" to Ollama's clients (they read the calls).
        reason = "stop" if res.finish_reason == "tool_calls" else res.finish_reason
        return frame(whole, True, reason,
                     await clock.stats(daemon, text.task.result(), res.input_tokens, res.output_tokens), logprobs,
                     res.length_limit or None, calls)

    if not stream:
        async for _ in text.deltas():
            pass
        done = await last(text.result.text, token_logprobs(text.result.logprobs), ollama_calls(text.result))
        await keep_after(daemon, name, keep)
        return json_reply(done, {**headers, **tasks.length_limit_headers(text.result)})

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for piece, logprobs in text.deltas():
                yield line(frame(piece, False, logprobs=token_logprobs(logprobs)))
            calls = ollama_calls(text.result)
            if calls:  # as Ollama streams them: on a line of their own before the last
                yield line(frame("", False, tool_calls=calls))
            yield line(await last(""))
        except FleetError as exc:
            yield line(ErrorLine(exc.message))
            return
        await keep_after(daemon, name, keep)

    return Stream(lines(), media_type=NDJSON, headers=headers)


def ollama_calls(res: Any) -> list[OllamaToolCall] | None:
    """A result's calls in Ollama's shape (arguments as objects). A call a length limit
    cut (its arguments as written so far, which do not parse) has no such shape: it is
    left out, and `done_reason` "length" says the turn was cut."""
    out = []
    for c in res.tool_calls:
        try:
            out.append(OllamaToolCall(OllamaFunction(c.name, json.loads(c.arguments))))
        except ValueError:
            continue
    return out or None


def history_calls(calls: list[Any] | None, where: str) -> list[ToolCall] | None:
    """An assistant turn's Ollama `tool_calls` (arguments as an object or JSON text)."""
    if not calls:
        return None
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"`{where}[{j}]` must be {{\"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", {})
        out.append(ToolCall(FunctionCall(fn["name"], args if isinstance(args, str) else json.dumps(args)),
                            id=str(call.get("id", ""))))
    return out


class GenerateFrame:
    def __init__(self, label: str) -> None:
        self.label = label

    def __call__(self, text: str, done: bool, done_reason: str | None = None, stats: Stats | None = None,
                 logprobs: list[TokenLogprob] | None = None, length_limit: str | None = None,
                 tool_calls: list | None = None) -> Any:
        return GenerateLine(self.label, created_at(), text, done, done_reason, logprobs=logprobs,
                            length_limit=length_limit, **(msgspec.structs.asdict(stats) if stats else {}))


class ChatFrame:
    def __init__(self, label: str) -> None:
        self.label = label

    def __call__(self, text: str, done: bool, done_reason: str | None = None, stats: Stats | None = None,
                 logprobs: list[TokenLogprob] | None = None, length_limit: str | None = None,
                 tool_calls: list | None = None) -> Any:
        return ChatLine(self.label, created_at(), ReplyMessage("assistant", text, tool_calls), done, done_reason,
                        logprobs=logprobs, length_limit=length_limit,
                        **(msgspec.structs.asdict(stats) if stats else {}))


def prompt_request(daemon: Daemon, name: str, body: GenerateBody, **kwargs: Any) -> GenerateRequest:
    """`/api/generate`'s prompt as fleet sends it: through the model's chat template
    (with `system`) unless `raw` is set or the model has no template."""
    if body.raw:
        if body.system:
            raise BadRequest("raw mode does not support template, system, or context")
        return GenerateRequest(model=name, prompt=body.prompt, **kwargs)
    manifest = daemon.manifest(name, "generate")
    if not facts(daemon.store, manifest).template:
        prompt = f"{body.system}\n\n{body.prompt}" if body.system else body.prompt
        return GenerateRequest(model=name, prompt=prompt, **kwargs)
    messages = ([ChatMessage("system", body.system)] if body.system else []) + [ChatMessage("user", body.prompt)]
    return GenerateRequest(model=name, messages=messages, **kwargs)


# ---- pull ------------------------------------------------------------------------------------------

class LineProgress(Progress):
    """fleet.pull's progress as Ollama status lines, handed from the pulling
    thread to the event loop (`call_soon_threadsafe`: the queue is the loop's)."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, out: asyncio.Queue[ProgressLine]) -> None:
        self.name, self.loop, self.out = name, loop, out
        self.total = self.completed = 0
        self.sent_at = 0.0

    def emit(self, status: str, **fields: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, ProgressLine(status, **fields))

    def _progress(self) -> None:
        self.sent_at = time.monotonic()
        self.emit(f"pulling {self.name}", digest=self.name, total=self.total, completed=self.completed)

    def start(self, description: str, total_bytes: int) -> None:
        self.total, self.completed = total_bytes, 0
        self._progress()

    def advance(self, nbytes: int) -> None:
        self.completed += nbytes
        if time.monotonic() - self.sent_at >= PROGRESS_EVERY_S:
            self._progress()

    def finish(self) -> None:
        self._progress()


# ---- the routes ------------------------------------------------------------------------------------

class OllamaRootController(Controller):
    """`GET /` and `HEAD /`: Ollama's liveness answer. Its CLI checks `HEAD /` before
    every command and desktop apps probe `GET /` to test a server URL; both only
    read the status. Left out of the OpenAPI document, as Ollama leaves them out of its own."""

    path = "/"

    @get("/", include_in_schema=False)
    async def alive(self) -> Response:
        return Response(content=b"fleet is running (Ollama API under /api)", media_type="text/plain")

    @head("/", include_in_schema=False, media_type="text/plain")
    async def alive_head(self) -> None:
        return None


class OllamaController(Controller):
    path = "/api"
    # The app's handlers are keyed by these classes: the same keys here replace them for /api.
    exception_handlers = {FleetError: on_error, HTTPException: on_error, Exception: on_error}

    @get("/version")
    async def api_version(self) -> Response:
        return json_reply({"version": API_VERSION})

    @get("/tags")
    async def api_tags(self, daemon: Daemon) -> Response:
        models = []
        for m in daemon.store.list():
            f = facts(daemon.store, m)
            models.append(TagModel(ollama_name(m.name), ollama_name(m.name), iso_utc(m.created_at), m.size_bytes,
                                   f.digest, details(m, f)))
        return json_reply(TagsReply(models))

    @get("/ps")
    async def api_ps(self, daemon: Daemon) -> Response:
        # A model held by several workers is one entry: its bytes summed, VRAM for copies on a GPU.
        held: dict[str, list[Any]] = {}
        for w in await daemon.workers():
            if not w["up"]:
                continue
            for name, m in w["models"].items():
                entry = held.setdefault(name, [0, 0])
                size = int(m.get("bytes", 0))
                entry[0] += size
                entry[1] += size if w["device"].startswith("cuda") else 0
        out = []
        for name, (size, vram) in sorted(held.items()):
            try:
                manifest = daemon.store.get(name)
            except FleetError:
                continue  # removed from the store while resident: nothing to describe it by
            f = facts(daemon.store, manifest)
            out.append(RunningModel(ollama_name(name), ollama_name(name), size, f.digest, details(manifest, f),
                                    vram, forever(), f.context_length))
        return json_reply(PsReply(out))

    @post("/show", status_code=200)
    async def api_show(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, NameBody)
        manifest = stored_manifest(daemon, body.target)
        f = facts(daemon.store, manifest)
        modelfile = f"# {manifest.name}: fleet {manifest.task} model ({manifest.runtime})\n" \
                    f"FROM {ollama_name(manifest.name)}\n"
        if f.template:
            modelfile += f'TEMPLATE """{f.template}"""\n'
        parameters = f"num_ctx {f.context_length}" if f.context_length else ""
        return json_reply(ShowReply(modelfile, parameters, f.template, details(manifest, f), f.info,
                                    capabilities(manifest, f), iso_utc(manifest.created_at)),
                          ignored_headers([], dropped + fields.set_fields(body, ("verbose",))))

    @post("/generate", status_code=200)
    async def api_generate(self, request: Request, daemon: Daemon) -> Response | Stream:
        body, dropped = await decode(request, GenerateBody)
        name = serving(daemon, body.model, "generate")
        refuse_unsupported(body.model, {"images": body.images, "think": body.think, "suffix": body.suffix,
                                        "template": body.template, "context": body.context})
        keep, dropped = client_keep(request, body.keep_alive, dropped)
        opts, ignored = read_options(body.options)
        frame = GenerateFrame(body.model)
        headers = ignored_headers(ignored, dropped)
        if not body.prompt:
            reason = await apply_keep(daemon, name, keep)
            return json_reply(frame("", True, reason), headers)
        req = prompt_request(daemon, name, body, stream=True, format=output_format(body.format),
                             **logprob_fields(body.logprobs, body.top_logprobs), **sampling(opts))
        return await run_text(daemon, name, req, keep, body.stream, frame, headers)

    @post("/chat", status_code=200)
    async def api_chat(self, request: Request, daemon: Daemon) -> Response | Stream:
        body, dropped = await decode(request, ChatBody)
        name = serving(daemon, body.model, "generate")
        messages = body.messages or []
        refuse_unsupported(body.model, {"think": body.think, "images": any(m.images for m in messages)})
        keep, dropped = client_keep(request, body.keep_alive, dropped)
        opts, ignored = read_options(body.options)
        frame = ChatFrame(body.model)
        headers = ignored_headers(ignored, dropped + message_fields(messages))
        if not messages:
            reason = await apply_keep(daemon, name, keep)
            return json_reply(frame("", True, reason), headers)
        turns = [ChatMessage(m.role, m.content, history_calls(m.tool_calls, f"messages[{i}].tool_calls"),
                             name=m.tool_name) for i, m in enumerate(messages)]
        # Ollama has no tool_choice: the model calls tools or answers, as it chooses ("auto").
        req = GenerateRequest(model=name, messages=turns, stream=True, format=output_format(body.format),
                              tools=tool_calls.chat_tools(body.tools), **logprob_fields(body.logprobs,
                                                                                       body.top_logprobs),
                              **sampling(opts))
        return await run_text(daemon, name, req, keep, body.stream, frame, headers)

    @post("/embed", status_code=200)
    async def api_embed(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, EmbedBody)
        name = serving(daemon, body.model, "embed")
        keep, dropped = client_keep(request, body.keep_alive, dropped)
        _, ignored = read_options(body.options)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        if not inputs or inputs == [""]:
            await apply_keep(daemon, name, keep)
            return json_reply(EmbedReply(body.model, [], 0, 0, 0), ignored_headers(ignored, dropped))
        req = EmbedRequest(model=name, inputs=inputs, truncate=body.truncate, prompt_name=body.prompt_name,
                           prompt=body.prompt, dimensions=body.dimensions, output_dtype=body.output_dtype)
        vectors, answer, tokens, clock = await embed_texts(daemon, req, keep)
        stats = await clock.stats(daemon, answer, tokens, 0)
        headers = ignored_headers(ignored, dropped + tasks.ignored_fields(req))
        # Lists and JSON of up to max_inputs rows: off the event loop when large (daemon.offload).
        return await build_reply(vectors.size, lambda: json_reply(EmbedReply(
            body.model, vectors.tolist(), stats.total_duration, stats.load_duration, tokens), headers))

    @post("/embeddings", status_code=200)
    async def api_embeddings(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, EmbeddingsBody)
        name = serving(daemon, body.model, "embed")
        keep, dropped = client_keep(request, body.keep_alive, dropped)
        _, ignored = read_options(body.options)
        headers = ignored_headers(ignored, dropped)
        if not body.prompt:
            await apply_keep(daemon, name, keep)
            return json_reply(EmbeddingsReply([]), headers)
        req = EmbedRequest(model=name, inputs=[body.prompt], normalize=False, prompt_name=body.prompt_name,
                           dimensions=body.dimensions)
        vectors, *_ = await embed_texts(daemon, req, keep)
        return json_reply(EmbeddingsReply(vectors[0].tolist()), headers)

    @post("/pull", status_code=200, guards=[operator_only])
    async def api_pull(self, request: Request, daemon: Daemon) -> Response | Stream:
        body, dropped = await decode(request, NameBody)
        name = store_name(body.target)
        headers = ignored_headers([], dropped + fields.set_fields(body, ("insecure",)))
        catalog = load_catalog(daemon.settings.home)
        # Only names fleet knows: a source (hf:, path:, pkg:) is the operator's to choose, not a client's.
        if name not in catalog and not daemon.store.exists(name):
            raise ModelNotFound(f"model '{body.target}' is neither in fleet's catalog (models.toml) nor stored",
                                hint="fleetctl list --catalog shows what can be pulled")
        pullable(daemon, name, catalog)
        room_for_model(daemon, name)
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue[ProgressLine] = asyncio.Queue()

        def work() -> str:
            result = pull_model(daemon.store, name, catalog=catalog, progress=LineProgress(name, loop, progress))
            loop.call_soon_threadsafe(progress.put_nowait, ProgressLine("verifying sha256 digest"))
            daemon.store.verify(name)
            return result.status

        async def run() -> None:
            if await asyncio.to_thread(work) != "up_to_date":
                await retire_copies(daemon, name)  # the next request loads the new files (daemon.owner)
            daemon.forget(name)

        if not body.stream:
            await run()
            return json_reply(ProgressLine("success"), headers)

        async def lines() -> AsyncIterator[bytes]:
            yield line(ProgressLine("pulling manifest"))
            task = detached(run(), name)  # runs to its end if the client leaves
            while not task.done() or not progress.empty():
                nxt = asyncio.ensure_future(progress.get())
                await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    yield line(nxt.result())
                else:
                    nxt.cancel()
            try:
                task.result()
            except FleetError as exc:
                yield line(ErrorLine(shown(request, exc)))
                return
            except Exception as exc:  # the status line is sent: the error can only be the last line
                yield line(ErrorLine(f"internal error: {type(exc).__name__}"))
                return
            yield line(ProgressLine("success"))

        return Stream(lines(), media_type=NDJSON, headers=headers)

    @delete("/delete", status_code=200, guards=[operator_only])
    async def api_delete(self, request: Request, daemon: Daemon) -> Response:
        body, dropped = await decode(request, NameBody)
        await delete_model(daemon, stored_manifest(daemon, body.target).name)
        return Response(content=b"", status_code=200, headers=ignored_headers([], dropped))


async def embed_texts(daemon: Daemon, req: EmbedRequest, keep: Keep) -> tuple[np.ndarray, Answer, int, Clock]:
    name = req.model
    clock = await Clock.start(daemon, name)
    await keep_before(daemon, name, keep)
    res, answer = await tasks.embed(daemon, req, codec.encode_msgpack(req))
    await keep_after(daemon, name, keep)
    return tasks.vectors(res), answer, res.input_tokens, clock
