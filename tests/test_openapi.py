"""The OpenAPI 3.1 document covers every route; /docs works offline; schemathesis finds
no server error (issue 15, deliverable 5).

The document is read from a real daemon (`GET /openapi.json`); schemathesis then
generates requests for every documented operation, in JSON and in MessagePack,
against that daemon over loopback, and checks that none answers 5xx.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, reject, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from fleet.daemon.controllers.openapi import OPERATIONS, build_document, routes_of
from tests.conftest import start_daemon


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx, value) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # an integer past 64 bits has no MessagePack form: no client can send it
        reject()


def app_routes() -> list[tuple[str, str]]:
    from fleet.daemon.app import create_app
    from fleet.daemon.core import Daemon
    from fleet.config import Settings

    return routes_of(create_app(Daemon(Settings(home="/nonexistent-fleet-home"))))


#: Routes whose success has an empty body, as in the servers they copy (Ollama's delete, copy, blobs).
EMPTY_REPLIES = {("DELETE", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/blobs/{digest}")}
#: POST routes that read no body: OpenAI's batch cancel; Ollama's push, refused whatever it sends.
NO_BODY = {("POST", "/v1/batches/{batch_id}/cancel"), ("POST", "/api/push")}
#: Routes that never succeed (documented with their error only).
ALWAYS_REFUSED = {("POST", "/api/push")}


def test_every_route_is_in_the_document_with_its_shapes():
    routes = app_routes()
    assert len(routes) >= 35
    missing = [r for r in routes if r not in OPERATIONS]
    assert not missing, f"routes without an entry in daemon/controllers/openapi.OPERATIONS: {missing}"
    stale = [r for r in OPERATIONS if r not in routes]
    assert not stale, f"OPERATIONS names routes the app does not serve: {stale}"
    doc = build_document(routes)
    assert doc["openapi"] == "3.1.0"
    for method, path in routes:
        op = doc["paths"][path][method.lower()]
        assert op["summary"] != "undocumented"
        success = [status for status in op["responses"] if status.startswith("2")]
        assert bool(success) != ((method, path) in ALWAYS_REFUSED), (method, path)
        for status in success:
            assert "content" in op["responses"][status] or (method, path) in EMPTY_REPLIES, (method, path)
        assert "4XX" in op["responses"] and "5XX" in op["responses"]
        if method == "POST" and not path.startswith("/v1/models/"):
            if (method, path) in NO_BODY:
                assert "requestBody" not in op, (method, path)
            else:
                content = op["requestBody"]["content"]
                assert content and all(media["schema"] for media in content.values()), (method, path)
    # Every $ref points at a component that exists.
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"].rsplit("/", 1)[1])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and refs <= set(doc["components"]["schemas"])


def test_each_route_documents_the_query_parameters_it_takes():
    """The document lists, for every route, exactly the query parameters the daemon's
    query check lets through (daemon.query: each handler's declared ones)."""
    from fleet.daemon.app import create_app
    from fleet.daemon.core import Daemon
    from fleet.daemon.controllers.openapi import openapi_path
    from fleet.daemon.query import declared_query
    from fleet.config import Settings

    app = create_app(Daemon(Settings(home="/nonexistent-fleet-home")))
    table = declared_query(app)
    checked = 0
    for route in app.routes:
        for method, (handler, _) in getattr(route, "route_handler_map", {}).items():
            op = OPERATIONS.get((method, openapi_path(route.path)))
            if op is None:  # HEAD, OPTIONS and the docs page's files: not in the document
                assert not table[handler].names, (method, route.path)
                continue
            assert {name for name, _, _ in op.query} == table[handler].names, (method, route.path)
            checked += 1
    assert checked == len(OPERATIONS)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("fleet-openapi"))
    yield d
    d.stop()


def test_the_daemon_serves_the_document_and_an_offline_docs_page(served):
    doc = httpx.get(served.url + "/openapi.json", timeout=30)
    assert doc.status_code == 200 and doc.headers["content-type"].startswith("application/json")
    assert doc.json()["paths"]["/v1/embed"]["post"]["requestBody"]["content"]["application/msgpack"]
    page = httpx.get(served.url + "/docs", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    for asset in ("/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"):
        r = httpx.get(served.url + asset, timeout=30)
        assert r.status_code == 200 and len(r.content) > 10_000, asset
    assert httpx.get(served.url + "/docs/..%2Fopenapi.py", timeout=30).status_code == 404
    assert httpx.get(served.url + "/docs/index.html", timeout=30).status_code == 404


#: Examples per operation and generation mode (positive: valid per the schema; negative: not).
EXAMPLES = 20


@pytest.mark.slow
def test_no_request_makes_a_server_error(served):
    """Whatever schemathesis sends to each documented operation, valid or not, in JSON or
    MessagePack, the answer is never 5xx (`internal` is for real server faults only), and
    the daemon keeps serving afterwards."""
    api = schemathesis.openapi.from_url(served.url + "/openapi.json")
    failures: list[str] = []
    ran = 0
    for result in api.get_all_operations():
        operation = result.ok()
        definition = operation.definition.raw
        # Negative data needs something to break: a body or a parameter.
        varies = "requestBody" in definition or "parameters" in definition
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if varies else (GenerationMode.POSITIVE,):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None, derandomize=True)
            def probe(case):
                # As the operator: the routes that change the daemon are probed past their key check.
                case.call_and_validate(checks=[not_a_server_error], headers=served.admin, timeout=60)

            try:
                probe()
                ran += 1
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect every failure, then report
                failures.append(f"{operation.label} ({mode.value}): {type(exc).__name__}: {str(exc)[:600]}")
    assert ran >= 60, f"only {ran} operation/mode runs"  # 39 operations, 28 with a body or parameter
    assert not failures, "\n\n".join(failures)
    assert httpx.post(served.url + "/v1/embed", json={"model": "all-minilm-l6-v2", "inputs": ["still here"]},
                      timeout=60).status_code == 200
