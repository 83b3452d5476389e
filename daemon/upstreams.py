"""Upstreams: the servers a box sends a model's requests to when its catalog entry says
`route = "spill"` or `"remote"` (DESIGN.md, "Upstreams"; the decision and the ASGI
layer are daemon/spill.py).

An upstream is a `[[upstream]]` of config.toml (`fleet.config.UpstreamConfig`):
another fleet box (`kind = "fleet"`: the request goes to the same route there) or an
OpenAI-compatible server (`kind = "openai"`: the OpenAI routes only, JSON, the model
renamed to the entry's `upstream_model`). Its key is read from `key_file` or the
`key_env` variable at start and again on SIGHUP; it never appears on a command line
or in a reply.

A request sent upstream keeps its request id (`X-Request-Id`), its client
(`X-Fleet-Client`: an upstream honours it from a loopback peer, as every fleet box
does) and what is left of its deadline: a native body's `timeout_ms` becomes the
milliseconds left, and the call is cut there (closing the connection withdraws the
work on a fleet upstream: daemon.departures). The reply is relayed as the upstream
wrote it (streams as they come), with `X-Served-By: upstream/<name>` (a fleet
upstream's own `X-Served-By` moves to `X-Upstream-Served-By`).

Circuit: an upstream that gives no answer (refused, reset, cut off mid-body) or
answers 503 is marked down for `upstream_down_ms` (10 s): requests meanwhile do not
try it. After that the next request tries it again. 429 (the upstream is full) is
not an answer either, but does not mark it down.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from fleet.catalog import load_catalog
from fleet.config import Settings, UpstreamConfig
from fleet.errors import BadRequest

log = logging.getLogger("fleet.upstreams")

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}\Z")
#: Seconds to open a connection to an upstream: past it the upstream counts as failed.
CONNECT_S = 2.0
#: A fleet upstream answers `timeout` itself at the deadline it was given; the call
#: waits this much longer for that answer before cutting it.
DEADLINE_SLACK_S = 0.5
#: Reply headers never relayed: hop-by-hop ones, those the relay writes itself, and the
#: request id (the box the client asked adds its own, which is the same id).
DROP_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date",
                          b"server", b"x-request-id", b"x-served-by", b"content-encoding"})


@dataclass(frozen=True)
class Rule:
    """A model's route (its catalog entry): where its requests run."""

    mode: str  # spill | remote
    spill_after_ms: int
    upstream: str | None
    upstream_model: str | None


@dataclass
class Upstream:
    """One upstream's settings, key, connection pool and circuit."""

    config: UpstreamConfig
    key: str = ""
    down_until: float = 0.0
    #: False from a failure until an answer: a window that ran out is a retry, not "up".
    healthy: bool = True
    last_error: str = ""
    spilled: int = 0
    errors: int = 0
    client: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    def is_up(self, now: float) -> bool:
        return now >= self.down_until

    def url_for(self, path: str) -> str:
        base = self.config.url.rstrip("/")
        if self.config.kind == "openai":  # its base URL ends in /v1, as OpenAI clients take it
            return base + path.removeprefix("/v1")
        return base + path

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
                                            follow_redirects=False)
        return self.client


def read_key(config: UpstreamConfig) -> str:
    """The upstream's key from its file or environment variable ("" when it names neither)."""
    if config.key_file and config.key_env:
        raise BadRequest(f"upstream {config.name!r}: give key_file or key_env, not both")
    if config.key_file:
        try:
            return Path(config.key_file).read_text().strip()
        except OSError as exc:
            raise BadRequest(f"upstream {config.name!r}: cannot read key_file {config.key_file}: "
                             f"{exc.strerror}") from None
    if config.key_env:
        key = os.environ.get(config.key_env, "").strip()
        if not key:
            raise BadRequest(f"upstream {config.name!r}: the environment variable {config.key_env} "
                             "(key_env) is not set")
        return key
    return ""


def check_upstream(config: UpstreamConfig) -> None:
    if not _NAME.match(config.name):
        raise BadRequest(f"upstream name {config.name!r}: lowercase letters, digits, '.', '_', '-' (at most 64)")
    parts = urlsplit(config.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"upstream {config.name!r}: url must be http:// or https:// with a host, "
                         f"got {config.url!r}")


def load_rules(home: str, names: set[str]) -> dict[str, Rule]:
    """Models whose catalog entry routes them off this box, by name."""
    rules: dict[str, Rule] = {}
    for entry in load_catalog(home).all():
        if entry.route == "local":
            continue
        if entry.upstream is not None and entry.upstream not in names:
            raise BadRequest(f"models.toml: {entry.name!r} names upstream {entry.upstream!r}, which config.toml "
                             f"does not define ({', '.join(sorted(names)) or 'no [[upstream]] at all'})")
        if not names:
            raise BadRequest(f"models.toml: {entry.name!r} has route = {entry.route!r}, and config.toml "
                             "defines no [[upstream]]")
        rules[entry.name] = Rule(entry.route, entry.spill_after_ms, entry.upstream, entry.upstream_model)
    return rules


class Upstreams:
    """The configured upstreams and the models routed to them (state for daemon.spill)."""

    def __init__(self, settings: Settings, registry: Any) -> None:
        self.settings = settings
        seen: set[str] = set()
        for config in settings.upstream:
            check_upstream(config)
            if config.name in seen:
                raise BadRequest(f"upstream {config.name!r} is defined twice in config.toml")
            seen.add(config.name)
        self.upstreams = [Upstream(c, read_key(c)) for c in settings.upstream]
        self.by_name = {u.name: u for u in self.upstreams}
        self.rules = load_rules(settings.home, seen)
        self._metrics(registry)

    def _metrics(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.spilled_total = Counter(
            "fleet_spilled_requests", "Requests answered by an upstream, by model, upstream and route "
            "(spill: the local wait was past the bound or the model cannot load here; remote: always).",
            ("model", "upstream", "route"), registry=registry)
        self.errors_total = Counter(
            "fleet_upstream_errors", "Calls to an upstream that gave no answer, by reason (connect, broken, "
            "busy: 429 or 503, timeout).", ("upstream", "reason"), registry=registry)
        self.up_gauge = Gauge("fleet_upstream_up", "0 from an upstream's failure (circuit: marked down, then "
                              "retried) until it answers again.",
                              ("upstream",), registry=registry)
        for u in self.upstreams:
            self.up_gauge.labels(u.name).set(1)

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def rule(self, model: str) -> Rule | None:
        return self.rules.get(model)

    def candidates(self, rule: Rule, *, native: bool) -> list[Upstream]:
        """The upstreams a request of `rule` may go to now, in config order: up, and able to
        take the route (an OpenAI-compatible one takes the OpenAI routes only)."""
        now = time.monotonic()
        pool = [self.by_name[rule.upstream]] if rule.upstream else self.upstreams
        return [u for u in pool if u.is_up(now) and not (native and u.config.kind == "openai")]

    def why_none(self, rule: Rule, *, native: bool) -> str:
        """Why `candidates` is empty, in words for the error reply."""
        now = time.monotonic()
        pool = [self.by_name[rule.upstream]] if rule.upstream else self.upstreams
        parts = []
        for u in pool:
            if native and u.config.kind == "openai":
                parts.append(f"{u.name} is OpenAI-compatible and takes the OpenAI routes only "
                             "(/v1/embeddings, /v1/chat/completions, /v1/completions)")
            elif not u.is_up(now):
                parts.append(f"{u.name} is marked down for {u.down_until - now:.1f} s more ({u.last_error})")
            else:
                parts.append(f"{u.name}: {u.last_error or 'no answer'}")
        return "; ".join(parts)

    def failed(self, u: Upstream, reason: str, detail: str, *, mark_down: bool) -> None:
        u.errors += 1
        u.last_error = detail
        self.errors_total.labels(u.name, reason).inc()
        if mark_down:
            u.down_until = time.monotonic() + self.settings.upstream_down_ms / 1000.0
            u.healthy = False
            self.up_gauge.labels(u.name).set(0)
            log.warning("upstream %s marked down for %.1f s: %s", u.name, self.settings.upstream_down_ms / 1000.0,
                        detail)

    def answered(self, u: Upstream, model: str, route: str) -> None:
        u.spilled += 1
        if not u.healthy:
            u.healthy, u.down_until = True, 0.0
            self.up_gauge.labels(u.name).set(1)
        self.spilled_total.labels(model, u.name, route).inc()

    def reload(self, settings: Settings) -> None:
        """SIGHUP: the catalog's routes and the keys again (a rotated key file applies);
        a change that does not check out is logged and the current ones kept."""
        try:
            rules = load_rules(settings.home, set(self.by_name))
            keys = {u.name: read_key(u.config) for u in self.upstreams}
        except BadRequest as exc:
            log.error("reload: keeping the current upstream routes and keys: %s", exc.message)
            return
        self.rules = rules
        for u in self.upstreams:
            u.key = keys[u.name]

    def view(self) -> list[dict[str, Any]]:
        """Each upstream for `GET /v1/top`: its state and counts since the start."""
        now = time.monotonic()
        return [{"name": u.name, "kind": u.config.kind, "up": u.healthy,
                 "down_s": round(max(0.0, u.down_until - now), 1), "spilled": u.spilled, "errors": u.errors,
                 "last_error": u.last_error,
                 "models": sorted(m for m, r in self.rules.items() if r.upstream in (None, u.name))}
                for u in self.upstreams]


def upstream_body(body: bytes, *, msgpack: bool, kind: str, native: bool, left_ms: int,
                  rename: str | None) -> tuple[bytes, bool]:
    """The body an upstream gets, and whether it is MessagePack: a native route's
    `timeout_ms` set to what is left of the deadline; the model renamed; JSON for an
    OpenAI-compatible server. Unchanged bytes when nothing changes."""
    if not native and not rename and (kind == "fleet" or not msgpack):
        return body, msgpack
    data = msgspec.msgpack.decode(body) if msgpack else msgspec.json.decode(body)
    if native:
        data["timeout_ms"] = max(1, left_ms)
    if rename:
        data["model"] = rename
    if kind == "openai":
        return msgspec.json.encode(data), False
    return (msgspec.msgpack.encode(data) if msgpack else msgspec.json.encode(data)), msgpack


def reply_headers(raw: list[tuple[bytes, bytes]], name: str) -> list[tuple[bytes, bytes]]:
    """An upstream's reply headers as relayed (module doc)."""
    out = [(k.lower(), v) for k, v in raw if k.lower() not in DROP_HEADERS]
    out += [(b"x-upstream-served-by", v) for k, v in raw if k.lower() == b"x-served-by"]
    out.append((b"x-served-by", f"upstream/{name}".encode()))
    return out
