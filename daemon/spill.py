"""Spill: which requests leave this box for an upstream (daemon/upstreams.py), and the
ASGI layer that sends them.

Routes that spill: `POST /v1/embed`, `/v1/generate` (native; to fleet upstreams) and
`/v1/embeddings`, `/v1/chat/completions`, `/v1/completions` (OpenAI's; to fleet and
OpenAI-compatible upstreams), when the body names a model whose catalog entry says
`route = "spill"` or `"remote"`. Everything else stays here, and so does a request
through a per-model URL (`/models/NAME/...`), one without `model` (a default), and
every request of a box in a NATS cluster (the cluster spreads its work already).

The decision (`should_spill`, pure):
- `remote`: always upstream, batch lines too.
- batch lines (`BATCH_WORK`) never spill: they wait behind interactive work by design.
- `spill`: upstream when the model is not stored here, or when the local lane's
  expected wait (`expected_wait_ms`: the age of its oldest waiting item, or its queued
  tokens at the rate its workers run, whichever is larger) is past the entry's
  `spill_after_ms`. Otherwise it runs here; and if here answers, before anything was
  sent, that the model cannot run now (`model_not_found`, `model_too_large`, or
  `overloaded`: the queue is full), it goes upstream instead.

Answered once: a request runs here or upstream, and goes to the other side only when
no answer came (refused, reset, 429/503 from the upstream; the local refusals above),
never after an answer arrived. When no upstream can take a spilled request it runs
here; a `remote` one gets 503 `unavailable` naming each upstream and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec

from fleet.errors import ClientClosed, FleetError, ModelNotFound, Timeout, Unavailable

from fleet.daemon import codec
from fleet.daemon.clients import client_of
from fleet.daemon.defaults import default_model
from fleet.daemon.core import BATCH_WORK, Daemon
from fleet.daemon.departures import DEPARTURE
from fleet.daemon.hot import ClientGone, read_body
from fleet.daemon.http import error_parts
from fleet.daemon.logs import REQUEST_ID
from fleet.daemon.model_urls import SCOPE_MODEL
from fleet.daemon.pieces import INITIAL_PIECE_TOKENS
from fleet.daemon.upstreams import CONNECT_S, DEADLINE_SLACK_S, Rule, Upstream, Upstreams, reply_headers, upstream_body

log = logging.getLogger("fleet.upstreams")

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

#: Route -> (task, native). Native routes carry `timeout_ms`; OpenAI's go to both kinds.
PATHS = {"/v1/embed": ("embed", True), "/v1/generate": ("generate", True), "/v1/embeddings": ("embed", False),
         "/v1/chat/completions": ("generate", False), "/v1/completions": ("generate", False)}
#: Local answers that say the model cannot run here now: a `spill` request goes upstream.
REROUTE_CODES = frozenset({"model_not_found", "model_too_large", "overloaded"})
REROUTE_STATUSES = frozenset({404, 429, 507})
#: The lanes' stats are read at most this often (one read serves every request meanwhile).
STATS_TTL_S = 0.02
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
#: A request's tokens, guessed from its body before the route counts them (~4 characters
#: a token, as the daemon's own estimate; the body's syntax makes it an overestimate).
BYTES_PER_TOKEN = 4.0


class Peek(msgspec.Struct):
    """What the decision reads of a body; other fields are the route's business."""

    model: str = ""
    timeout_ms: int | None = None
    stream: bool = False


_peek_json = msgspec.json.Decoder(Peek)
_peek_msgpack = msgspec.msgpack.Decoder(Peek)


def should_spill(mode: str, *, batch: bool, missing: bool, wait_ms: float, bound_ms: float) -> bool:
    """Does a request of a model routed `mode` go upstream (module doc)?"""
    if mode == "remote":
        return True
    if mode != "spill" or batch:
        return False
    return missing or wait_ms > bound_ms


def expected_wait_ms(depth: int, tokens: int, claimed: int, item_tokens: float, oldest_age_ms: float,
                     tokens_per_ms: float, workers: int) -> float:
    """How long a request joining a lane would wait before its batch runs: the age of the
    lane's oldest waiting item (the wait it gives now), or the work ahead of it (queued
    tokens, and the claimed items' at `item_tokens` each) at the rate the lane's workers
    read tokens, whichever is larger (a burst queues faster than its head ages, and a
    batch that is running holds the next one back)."""
    drain = (tokens + claimed * item_tokens) / (tokens_per_ms * max(1, workers))
    return max(oldest_age_ms if depth > 0 else 0.0, drain)


class LaneWatch:
    """The local lanes' stats, read through `Broker.call` (never waiting for the queue's
    lock on the loop) at most every STATS_TTL_S."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.read_at = 0.0
        self.stats: dict[str, Any] = {}
        #: Lane -> tokens per queued item at the last read that saw some (claimed ones are such items).
        self.item_tokens: dict[str, float] = {}
        #: Lane -> tokens sent to it here since the last read began (requests a read shared by
        #: a burst does not see yet: without them a burst on an idle lane would all stay).
        self.pending: dict[str, float] = {}
        self._reading: asyncio.Future | None = None

    async def wait_ms(self, lane: str) -> float:
        if time.monotonic() - self.read_at > STATS_TTL_S:
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._read())
            await asyncio.shield(self._reading)
        s = self.stats.get(lane)
        sizing = self.daemon.sizing
        # Before an answer said how fast the lane goes: the pieces' own first guess (daemon.pieces).
        rate = sizing.rates.get(lane) or INITIAL_PIECE_TOKENS / sizing.target_ms
        pending = self.pending.get(lane, 0.0)
        if s is None:
            return expected_wait_ms(0, int(pending), 0, 0.0, 0.0, rate, sizing.window)
        age_ms = (time.monotonic_ns() - s.oldest_enqueue_ns) / 1e6 if s.depth else 0.0
        return expected_wait_ms(s.depth, s.tokens + int(pending), s.claimed, self.item_tokens.get(lane, 0.0),
                                age_ms, rate, sizing.window)

    def admit(self, lane: str, tokens: float) -> None:
        """A request of `lane` stays here (counted until a read sees it queued)."""
        self.pending[lane] = self.pending.get(lane, 0.0) + tokens

    async def _read(self) -> None:
        seen = dict(self.pending)
        try:
            d = self.daemon
            if d.queue is not None and d.broker is not None:
                self.stats = {s.model: s for s in await d.broker.call(d.queue.lane_stats)}
                self.item_tokens.update({m: s.tokens / s.depth for m, s in self.stats.items() if s.depth})
            for lane, tokens in seen.items():
                left = self.pending.get(lane, 0.0) - tokens
                if left > 0:
                    self.pending[lane] = left
                else:
                    self.pending.pop(lane, None)
            self.read_at = time.monotonic()
        finally:
            self._reading = None


class Held:
    """A `send` that holds a local refusal the request may go upstream for (REROUTE_STATUSES)
    until the route is done; anything else passes at once."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.held: list[Any] | None = None
        self.passing = False

    async def __call__(self, message: Any) -> None:
        if self.held is None and not self.passing:
            if message["type"] == "http.response.start" and message["status"] in REROUTE_STATUSES:
                self.held = [message]
                return
            self.passing = True
        if self.held is not None:
            self.held.append(message)
        else:
            await self.send(message)

    def code(self) -> str:
        body = b"".join(m.get("body", b"") for m in self.held or () if m["type"] == "http.response.body")
        for decode in (msgspec.json.decode, msgspec.msgpack.decode):
            try:
                error = decode(body).get("error")
                return error.get("code", "") if isinstance(error, dict) else ""
            except (msgspec.DecodeError, AttributeError):
                continue
        return ""

    async def release(self) -> None:
        for message in self.held or ():
            await self.send(message)


class UpstreamRoutes:
    """ASGI: requests of upstream-routed models to their upstream (module doc), the rest
    to `app` (the hot routes and the Litestar app)."""

    def __init__(self, app: Any, daemon: Daemon, upstreams: Upstreams) -> None:
        self.app = app
        self.daemon = daemon
        self.upstreams = upstreams
        self.lanes = LaneWatch(daemon)

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if not self.upstreams.active:  # no model routed off the box: one test, on the hot path too
            await self.app(scope, receive, send)
            return
        spec = PATHS.get(scope.get("path", ""))
        if (spec is None or scope["type"] != "http" or scope["method"] != "POST" or scope.get(SCOPE_MODEL)
                or self.daemon.cluster is not None):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        msgpack_in = codec.is_msgpack(content_type)
        msgpack_out = codec.reply_is_msgpack(headers.get(b"accept", b"").decode("latin-1"), content_type)
        try:
            body = await read_body(receive, self.daemon.settings.max_body_bytes, headers.get(b"content-length"))
        except ClientGone:
            return
        except FleetError as exc:
            await self._error(send, exc, scope["path"], msgpack_out)
            return
        again = replay(body, receive)
        try:
            peek = (_peek_msgpack if msgpack_in else _peek_json).decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            peek = None  # the route answers what is wrong with it
        task, native = spec
        model = peek.model if peek is not None else ""
        if peek is not None and not model:
            try:  # the default model of the task, as the route picks it (named to the upstream)
                model = default_model(self.daemon, task)
            except FleetError:
                pass  # the route says why
        rule = self.upstreams.rule(model) if model else None
        if rule is None:
            await self.app(scope, again, send)
            return
        batch = BATCH_WORK.get()
        try:
            left_s = batch.left_s() if batch is not None and peek.timeout_ms is None else \
                self.daemon.timeout_s(peek.timeout_ms)
        except FleetError:
            await self.app(scope, again, send)  # a timeout_ms out of range: the route says so
            return
        call = Call(self, scope, send, body, model, rule, native, started + left_s, msgpack_in, msgpack_out,
                    stream=peek.stream, named=bool(peek.model))
        missing, wait_ms, lane = False, 0.0, ""
        if rule.mode == "spill" and batch is None:
            try:
                lane = self.daemon.lane_of(self.daemon.manifest(model, task))
                wait_ms = await self.lanes.wait_ms(lane)
            except ModelNotFound:
                missing = True
            except FleetError:
                await self.app(scope, again, send)  # e.g. a model of another task: answered here
                return
        if should_spill(rule.mode, batch=batch is not None, missing=missing, wait_ms=wait_ms,
                        bound_ms=rule.spill_after_ms):
            if await call.upstream():
                return
            if rule.mode == "remote":
                await self._error(send, Unavailable(
                    f"model {model!r} runs on an upstream (route = \"remote\") and none can take the request "
                    f"now: {self.upstreams.why_none(rule, native=native)}"), scope["path"], msgpack_out)
                return
            # No upstream could: here after all, within what is left of the deadline.
            await self.app(scope, replay(call.local_body(), receive), send)
            return
        if lane:
            self.lanes.admit(lane, len(body) / BYTES_PER_TOKEN)
        held = Held(send)
        await self.app(scope, again, held)
        if held.held is not None:
            if rule.mode == "spill" and batch is None and held.code() in REROUTE_CODES and await call.upstream():
                return
            await held.release()

    async def _error(self, send: Send, exc: FleetError, path: str, msgpack: bool) -> None:
        body, headers = error_parts(exc, method="POST", path=path, msgpack=msgpack, private=())
        await send({"type": "http.response.start", "status": exc.status, "headers": [
            (b"content-type", (codec.MSGPACK if msgpack else codec.JSON).encode()),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the route: the body read here, then the client's own (disconnects)."""
    sent = False

    async def again() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


class Call:
    """One request on its way upstream: tries each candidate until one answers."""

    def __init__(self, routes: UpstreamRoutes, scope: Any, send: Send, body: bytes, model: str, rule: Rule,
                 native: bool, deadline: float, msgpack_in: bool, msgpack_out: bool, *, stream: bool,
                 named: bool) -> None:
        self.routes, self.scope, self.send, self.body, self.model, self.rule = routes, scope, send, body, model, rule
        self.native, self.deadline, self.msgpack_in, self.msgpack_out = native, deadline, msgpack_in, msgpack_out
        self.stream = stream
        #: The model's name upstream: the entry's `upstream_model`, else its own when the body left it out.
        self.rename = rule.upstream_model or (None if named else model)

    def local_body(self) -> bytes:
        """The body to run here after the upstreams gave no answer: a native route's
        `timeout_ms` is what is left of the deadline (it does not start again)."""
        if not self.native:
            return self.body
        left_ms = int((self.deadline - time.monotonic()) * 1000)
        return upstream_body(self.body, msgpack=self.msgpack_in, kind="fleet", native=True, left_ms=left_ms,
                             rename=None)[0]

    async def upstream(self) -> bool:
        """True once an upstream answered (the answer is sent); False when none could.
        The client leaving meanwhile ends the call (and withdraws the work upstream)."""
        departure = DEPARTURE.get()
        try:
            if departure is None:
                return await self._try_each()
            return await departure.wait(self.model, self._try_each())
        except ClientClosed:
            return True  # nobody to answer
        except Timeout as exc:
            await self.routes._error(self.send, exc, self.scope["path"], self.msgpack_out)
            return True

    async def _try_each(self) -> bool:
        ups = self.routes.upstreams
        for u in ups.candidates(self.rule, native=self.native):
            if await self._one(u):
                ups.answered(u, self.model, self.rule.mode)
                return True
        return False

    async def _one(self, u: Upstream) -> bool:
        ups = self.routes.upstreams
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            raise Timeout(f"model {self.model!r}: the deadline passed before upstream {u.name} was asked")
        kind = u.config.kind
        content, msgpack = upstream_body(self.body, msgpack=self.msgpack_in, kind=kind, native=self.native,
                                         left_ms=int(left_s * 1000), rename=self.rename)
        media = codec.MSGPACK if msgpack else codec.JSON
        headers = {"content-type": media, "accept": codec.MSGPACK if self.msgpack_out and kind == "fleet" else
                   codec.JSON, "accept-encoding": "identity", "x-request-id": REQUEST_ID.get() or "",
                   "x-fleet-client": client_of(self.scope).removeprefix("name:")}
        if u.key:
            headers["authorization"] = f"Bearer {u.key}"
        if not headers["x-request-id"]:
            del headers["x-request-id"]
        slack = DEADLINE_SLACK_S if self.native and kind == "fleet" else 0.0
        http = u.http()
        request = http.build_request("POST", u.url_for(self.scope["path"]), content=content, headers=headers,
                                     timeout=httpx.Timeout(left_s + slack, connect=min(CONNECT_S, left_s)))
        try:
            resp = await http.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            ups.failed(u, "connect", f"no connection in {CONNECT_S:g} s: {exc}", mark_down=True)
            return False
        except httpx.TimeoutException:
            ups.failed(u, "timeout", "no answer within the request's deadline", mark_down=False)
            raise Timeout(f"model {self.model!r}: upstream {u.name} did not answer within the deadline") \
                from None
        except httpx.HTTPError as exc:
            ups.failed(u, "connect", f"{type(exc).__name__}: {exc}", mark_down=True)
            return False
        if resp.status_code in (429, 503):
            await resp.aclose()
            ups.failed(u, "busy", f"answered {resp.status_code}", mark_down=resp.status_code == 503)
            return False
        ctype = resp.headers.get("content-type", "")
        if self.stream and resp.status_code == 200 and ctype.startswith(STREAM_TYPES):
            await self._stream(u, resp)
            return True
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            ups.failed(u, "broken", f"the answer was cut off: {type(exc).__name__}", mark_down=True)
            return False
        finally:
            await resp.aclose()
        raw = reply_headers(resp.headers.raw, u.name)
        if kind == "openai" and self.msgpack_out and ctype.startswith(codec.JSON):
            try:
                content = codec.encode_msgpack(msgspec.json.decode(content))
                raw = [(k, v) for k, v in raw if k != b"content-type"] + [(b"content-type", codec.MSGPACK.encode())]
            except msgspec.DecodeError:
                pass
        await self.send({"type": "http.response.start", "status": resp.status_code,
                         "headers": [*raw, (b"content-length", str(len(content)).encode())]})
        await self.send({"type": "http.response.body", "body": content})
        return True

    async def _stream(self, u: Upstream, resp: httpx.Response) -> None:
        """A stream as it comes; one cut off midway ends here (it was answered: never again)."""
        await self.send({"type": "http.response.start", "status": resp.status_code,
                         "headers": reply_headers(resp.headers.raw, u.name)})
        try:
            async for chunk in resp.aiter_bytes():
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            self.routes.upstreams.failed(u, "broken", f"a stream was cut off: {type(exc).__name__}", mark_down=True)
        finally:
            await resp.aclose()
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
