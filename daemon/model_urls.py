"""Per-model base URLs (`/models/<name>/...`), `?model=` on POST routes, and TEI's and
TGI's root `POST /`: plain ASGI in front of the hot route and the Litestar app.

TEI and TGI serve one model, so their clients are configured with a URL, not a
model name (`InferenceClient(model="http://host:7744/models/NAME")`, langchain's
`HuggingFaceEndpoint(endpoint_url=...)`), and send a placeholder `model` where
the wire has one (`"tgi"`, `"dummy"`). fleet serves many; these rules let such a
client pick its model by URL:

- `/models/<name>/<route>` is `/<route>` as if the daemon held only `<name>`:
  the body's `model` is set to `<name>` (any other value the client sent is
  named in `X-Fleet-Ignored-Fields`), `GET` routes get `?model=<name>`, and
  `GET /v1/models` lists that model alone (it reads `SCOPE_MODEL`). Ollama's
  `/api/*` is not served there: Ollama clients name their models.
- `POST /<route>?model=<name>` on any route is the same: the URL's model is
  applied, never ignored, and taken out of the query. Where the body is not a
  JSON object (no `model` to set) it stays in the query, and the route refuses
  it (daemon.query: a route takes the query parameters it declares). The Files and
  Batches routes (`NO_MODEL_POSTS`), whose bodies name no model, refuse a model in
  the URL at once, before their body (an upload) is read.
- `POST /` is dispatched as TEI and TGI dispatch it, by the model's task
  (`root_route`): embed (sparse for SPLADE; `/similarity` for a
  `{"inputs": {"source_sentence", ...}}` body), predict, rerank, TGI's
  generate (streamed with `stream: true`; the non-streamed answer is TGI's
  one-item list: `SCOPE_ROOT`), and HF's token classification for taggers.
  The model is the URL's, else the body's, else the one default the body's
  shape allows (`root_model`).

Each route keeps its one handler: only the scope (path, query, headers) and the
body are rewritten here, before the routes see them. Requests that use none of
these rules pass through untouched and unread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

from fleet.errors import BadRequest, FleetError, ModelNotFound, NotFound

from fleet.daemon import codec, fields
from fleet.daemon.defaults import choose_default_model, stored_tasks
from fleet.daemon.core import Daemon
from fleet.daemon.hot import ClientGone, read_body
from fleet.daemon.http import error_parts

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

PREFIX = "/models/"
#: Scope keys the routes read: the model a per-model URL names; that `POST /` was dispatched.
SCOPE_MODEL = "fleet.model"
SCOPE_ROOT = "fleet.root"
#: TGI's generation parameters: a `parameters` object holding one of them is a generation.
TGI_PARAMETERS = frozenset({
    "best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p", "typical_p",
    "do_sample", "max_new_tokens", "return_full_text", "stop", "truncate", "watermark", "details",
    "decoder_input_details", "seed", "top_n_tokens", "grammar", "adapter_id",
})
#: Tasks a bare `{"inputs": ...}` at the root may mean, when the body names no model.
ROOT_TASKS = ("embed", "classify", "extract", "generate")
#: POST routes whose body names no model (a batch's lines and an uploaded file name
#: their own): a model in the URL means nothing there and is refused before the body is read.
NO_MODEL_POSTS = ("/v1/files", "/v1/batches")


def root_route(task: str, runtime: str, body: dict[str, Any]) -> str:
    """The route `POST /` runs for a model of `task` (TEI's and TGI's own dispatch)."""
    if task == "embed":
        if isinstance(body.get("inputs"), dict):
            return "/similarity"
        return "/embed_sparse" if runtime == "splade" else "/embed"
    if task == "generate":
        return "/generate_stream" if body.get("stream") is True else "/generate"
    route = {"classify": "/predict", "rerank": "/rerank", "extract": "/pipeline/token-classification"}.get(task)
    if route is None:
        raise BadRequest(f"POST / has no route for a {task} model")
    return route


def body_tasks(body: dict[str, Any]) -> tuple[str, ...]:
    """The tasks a root body's shape allows: TEI's rerank and similarity bodies, zero-shot
    classification (`candidate_labels`), TGI's generation (a `stream` flag or generation
    parameters), else any of ROOT_TASKS."""
    if "query" in body:
        return ("rerank",)
    if isinstance(body.get("inputs"), dict):
        return ("embed",)
    params = body.get("parameters")
    if isinstance(params, dict) and "candidate_labels" in params:  # zero-shot classification
        return ("classify",)
    if "stream" in body or (isinstance(params, dict) and TGI_PARAMETERS.intersection(params)):
        return ("generate",)
    return ROOT_TASKS


def root_model(daemon: Daemon, body: dict[str, Any]) -> str:
    """The model a root request that names none runs on: the default of the one task
    its shape allows; several possible tasks with a default each are a 400 naming them."""
    stored = stored_tasks(daemon.store)
    found: dict[str, str] = {}
    for task in body_tasks(body):
        try:
            found[task] = choose_default_model(task, daemon.settings.default_models, stored)
        except BadRequest:
            continue
    if len(found) == 1:
        return next(iter(found.values()))
    if not found:
        raise BadRequest("POST / runs one model and this body names none: send `model`, or use the model's "
                         "own URL /models/NAME/", param="model")
    listed = ", ".join(f"{name} ({task})" for task, name in found.items())
    raise BadRequest(f"POST / runs one model, as TEI and TGI do, and this body could be for {listed}: use the "
                     f"model's own URL /models/NAME/ (for example /models/{next(iter(found.values()))}/), or "
                     f"send `model`", param="model")


def split_query_model(scope: Any) -> tuple[list[tuple[str, str]], list[str]]:
    """(the query's other parameters, blank ones too, in order; the values it gives `model`)."""
    query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return [(k, v) for k, v in query if k != "model"], [v for k, v in query if k == "model"]


def with_query(scope: Any, query: list[tuple[str, str]]) -> Any:
    return {**scope, "query_string": urlencode(query, quote_via=quote).encode()}


def without_query_model(scope: Any, model: str) -> tuple[Any, bool]:
    """(`scope` without `model` in its query string, whether the query named another model
    than `model`): once the body's `model` is set, the query's is applied, so the route
    never sees it (daemon.query refuses what a route does not declare)."""
    rest, named = split_query_model(scope)
    if not named:
        return scope, False
    return with_query(scope, rest), any(v != model for v in named)


def with_header(send: Send, name: bytes, value: str) -> Send:
    """`send` that adds `value` to the reply's header `name` (comma-joined with the route's own)."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            for i, (k, v) in enumerate(headers):
                if k.lower() == name:
                    headers[i] = (k, v + b"," + value.encode("latin-1"))
                    break
            else:
                headers.append((name, value.encode("latin-1")))
            message = {**message, "headers": headers}
        await send(message)

    return sending


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` once, then the client's own messages (disconnects)."""
    sent = False

    async def receiving() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receiving


class ModelUrls:
    """ASGI: the rules of the module doc, then `app`."""

    def __init__(self, app: Any, daemon: Daemon) -> None:
        self.app = app
        self.daemon = daemon

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        # The common request (the hot route's too) passes with three tests; the rest is `route`'s.
        path = scope.get("path", "")
        if path.startswith(PREFIX) or path == "/" or b"model=" in scope.get("query_string", b""):
            await self.route(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def route(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        model = None
        if path.startswith(PREFIX):
            name, _, rest = path[len(PREFIX):].partition("/")
            rest = "/" + rest
            if not name:
                await self.app(scope, receive, send)
                return
            if rest == "/api" or rest.startswith("/api/"):
                await self.refuse(scope, send, NotFound(
                    f"no route {method} {path}: Ollama clients name their model; give them the daemon's own "
                    f"URL, not /models/{name}/"))
                return
            model = unquote(name)
            scope = {**scope, "path": rest, "raw_path": rest.encode(), SCOPE_MODEL: model}
        elif method == "POST" and b"model=" in scope.get("query_string", b""):
            query = dict(parse_qsl(scope["query_string"].decode("latin-1")))
            if query.get("model"):
                model = query["model"]
                scope = {**scope, SCOPE_MODEL: model}
        if model is None and not (method == "POST" and path == "/"):
            await self.app(scope, receive, send)
            return
        if method != "POST":
            if model is not None:  # the URL's model in place of the query's; the rest kept as sent
                scope = with_query(scope, [*split_query_model(scope)[0], ("model", model)])
            await self.app(scope, receive, send)
            return
        if model is not None and scope["path"].startswith(NO_MODEL_POSTS):
            await self.refuse(scope, send, BadRequest(
                f"POST {scope['path']} takes no model (the lines of a batch and an uploaded file name their own): "
                f"call it at the daemon's own URL, without /models/{model}/ or ?model=", param="model"))
            return
        headers = dict(scope["headers"])
        msgpack = codec.is_msgpack(headers.get(b"content-type", b"").decode("latin-1"))
        try:
            body = await read_body(receive, self.daemon.settings.max_body_bytes, headers.get(b"content-length"))
            scope, body, ignored = self.rewrite(scope, body, model, msgpack=msgpack)
        except ClientGone:
            return
        except FleetError as exc:
            await self.refuse(scope, send, exc)
            return
        if ignored:
            send = with_header(send, fields.IGNORED_FIELDS_HEADER.lower().encode(), "model")
        await self.app(scope, replay(body, receive), send)

    def rewrite(self, scope: Any, body: bytes, model: str | None, *,
                msgpack: bool) -> tuple[Any, bytes, bool]:
        """(scope, body, whether a different `model` the client sent was ignored): the
        body's `model` set to the URL's (and `?model=` taken out of the query), and `POST /`
        routed to its task's route. A body that is not a JSON object is left as it is, and
        so is the query: the route refuses a `model` it does not take."""
        obj = fields.plain(body, msgpack=msgpack) if body else None
        if not isinstance(obj, dict):
            if scope["path"] == "/":
                raise BadRequest("POST / takes a JSON object (TEI's or TGI's request body)")
            return scope, body, False  # not ours to judge: the route refuses it in its own words
        sent = obj.get("model")
        ignored = model is not None and sent not in (None, "", model)
        if model is not None:
            obj["model"] = model
            scope, other = without_query_model(scope, model)
            ignored = ignored or other
        if scope["path"] == "/":
            name = model or (sent if isinstance(sent, str) and sent else root_model(self.daemon, obj))
            # An alias routes by its version's task (an alias keeps one task: daemon.aliases).
            version = self.daemon.aliases.resolve(name)
            manifest = self.daemon.store.get(version) if self.daemon.store.exists(version) else None
            if manifest is None:
                raise ModelNotFound(f"unknown model {name!r}", hint="fleetctl list shows what is pulled",
                                    param="model")
            obj["model"] = name
            route = root_route(manifest.task, manifest.runtime, obj)
            scope = {**scope, "path": route, "raw_path": route.encode(), SCOPE_ROOT: True}
        body = codec.encode(obj, msgpack=msgpack)
        scope = {**scope}
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
            (b"content-length", str(len(body)).encode())]
        return scope, body, ignored

    async def refuse(self, scope: Any, send: Send, exc: FleetError) -> None:
        """The error in the shape of the route it names (OpenAI's on OpenAI routes:
        `daemon.http.error_parts`, as the app and the hot route answer). Its messages
        hold the client's own names only, no filesystem path to hide."""
        headers = dict(scope["headers"])
        msgpack = codec.reply_is_msgpack(headers.get(b"accept", b"").decode("latin-1"),
                                         headers.get(b"content-type", b"").decode("latin-1"))
        body, _ = error_parts(exc, method=scope["method"], path=scope["path"], msgpack=msgpack, private=())
        await send({"type": "http.response.start", "status": exc.status, "headers": [
            (b"content-type", (codec.MSGPACK if msgpack else codec.JSON).encode()),
            (b"content-length", str(len(body)).encode()),
        ]})
        await send({"type": "http.response.body", "body": body})
