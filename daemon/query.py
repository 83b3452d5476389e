"""Query parameters are understood or refused: each route takes those its handler
declares (its signature, as Litestar parsed it), and a request naming any other is a
400 naming it and the closest one the route takes (`daemon.fields.check_query`), in
the route's error shape, before the handler runs: it changes nothing.

The table is read once, when the app is built (`declared_query`): Litestar's
`KwargsModel` of each (route, method) already holds the query parameters it will
parse (`expected_query_params`, dependencies' included). Per request the check is
one look at the raw query string; a request that has one costs a dict lookup and
a set test per name, on the raw bytes (no decoding, no Litestar parse) unless a
name is not plainly one the route declares.

The one exception, for every route: `model` on a GET (or DELETE) of a per-model
URL (`/models/<name>/...`, `daemon.model_urls`). `ModelUrls` puts it there itself,
the URL's model in place of whatever the client sent: `/info` applies it,
`GET /v1/models` reads the URL's model from the scope, the other routes answer as
at the root (a client configured with a per-model URL keeps working). On a POST,
`ModelUrls` takes `?model=` out of the query once it has set the body's `model`;
where it could not (a body that is not a JSON object), `model` stays and is
refused like any other parameter the route does not take.

No exception for any peer's client: the OpenAI, Ollama, Cohere and
huggingface_hub (TEI, TGI) SDKs send query parameters only to the Files and
Batches lists, which declare them; Azure OpenAI's `api-version` goes with
`/openai/deployments/...` URLs fleet does not serve; Prometheus scrapes and the
Kubernetes probes (deploy/kubernetes) send none. `/metrics`, `/healthz`,
`/readyz`, `/openapi.json`, `/docs` and Litestar's own OPTIONS answers are
checked like every other route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

from litestar import Litestar, Request
from litestar.routes import HTTPRoute

from fleet.daemon import fields
from fleet.daemon.model_urls import SCOPE_MODEL

#: ModelUrls' own query parameter on the GET and DELETE routes of a per-model URL.
URL_MODEL = "model"


class Declared(NamedTuple):
    """The query parameters a route handler declares: their names, and the same as bytes
    (the common request, plain ASCII names the route takes, is let through on its raw
    query string: no decoding, no parse)."""

    names: frozenset[str]
    raw: frozenset[bytes]


def declared_query(app: Litestar) -> dict[Any, Declared]:
    """Each route handler of `app` (Litestar's own OPTIONS answers too) -> the query
    parameters it declares (aliases: `Parameter(query="...")`)."""
    names: dict[Any, frozenset[str]] = {}
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler, kwargs_model in route.route_handler_map.values():
            # One handler on several paths declares the same parameters on each.
            declared = {p.field_alias for p in kwargs_model.expected_query_params}
            names[handler] = names.get(handler, frozenset()) | declared
    return {handler: Declared(n, frozenset(name.encode("latin-1") for name in n)) for handler, n in names.items()}


def refuse_undeclared(table: dict[Any, Declared]) -> Callable[[Request], Awaitable[None]]:
    """The app's `before_request` hook: a 400 for a query parameter the route does not
    declare. `table` is `declared_query`'s, filled once the app's routes are registered.

    Litestar runs the `before_request` of the closest layer only: a controller or
    handler that sets its own replaces this one (tests/test_strict_fields.py walks
    every route and fails on it)."""

    async def check(request: Request) -> None:
        scope = request.scope
        query = scope.get("query_string")
        if not query:
            return
        declared = table.get(scope["route_handler"])
        if declared is None:
            raise RuntimeError(f"{scope['method']} {scope['path']}: a handler registered after the query table "
                               "was built, this is a bug")
        raw = declared.raw
        for part in query.split(b"&"):
            if part.partition(b"=")[0] not in raw:
                break
        else:
            return
        # Decoded (`%6Cimit` is `limit`), blank values too (`?verbose` names `verbose`), in the order sent.
        known = declared.names
        if URL_MODEL not in known and scope.get(SCOPE_MODEL) is not None and scope["method"] != "POST":
            known = known | {URL_MODEL}
        sent = (k for k, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))
        fields.check_query(sent, known, f"{scope['method']} {scope['path']}")

    return check
