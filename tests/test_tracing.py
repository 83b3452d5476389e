"""OpenTelemetry traces (daemon/tracing.py).

In process, with the SDK's in-memory exporter: the HTTP middleware honours a client's
W3C traceparent and builds the stage spans from the request's stamps (a fake app stands
in for the route: what is checked is the span building), a remote answer's worker stamps
are left out, and a NATS work message's headers carry the trace to `fleet.remote`.

End to end, two real daemons joined through a real nats-server, each exporting with the
real OTLP/HTTP exporter (configured by the standard OTEL_ variables) to a collector in
this test process: a request sent to box A (which stores no model) runs on box B, and
its one trace holds A's API spans and B's `fleet.remote` and worker spans, under the
client's own span. (In-memory exporters cannot see into daemon subprocesses.) A
request to B alone holds its API and worker spans. Off by default: the API process then
imports no OpenTelemetry.
"""

from __future__ import annotations

import http.server
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleet.daemon import timeline, tracing
from fleet.messages import Envelope, WorkError
from tests.conftest import default_model_dir, start_daemon, wait_until_ready
from tests.gen_models import pull
from tests.nats_fixture import NatsServer, nats_server  # noqa: F401 (fixture)


#: The default model's weights under another name, stored only on box B.
B_MODEL = "minilm-b"


@pytest.fixture()
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.setup("box-a", provider=provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def call(app, headers: dict[str, str]) -> dict:
    scope = {"type": "http", "method": "POST", "path": "/v1/embed",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    sent = {}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.setdefault(message["type"], message)

    import asyncio

    asyncio.run(app(scope, receive, send))
    return sent


def fake_route(served_by: str):
    """What a route does for the spans: its stamps (daemon.timeline) and the answer's headers."""
    async def app(scope, receive, send):
        timeline.stamp("checked")
        timeline.stamp("put")
        worker_ns = worker_stamps()
        for stage, ns in worker_ns.items():  # as the broker adds the worker's stamps
            timeline.stamp(stage, ns)
        time.sleep(0.01)  # the worker's stamps are all before its answer is collected
        timeline.stamp("collected")
        timeline.stamp("resumed")
        headers = {}
        timeline.finish(headers)
        assert timeline.HEADER not in headers  # traced, not asked: no timeline in the reply
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"x-served-by", served_by.encode()), (b"x-batch-items", b"3"), (b"x-batch-tokens", b"42")]})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


def worker_stamps() -> dict[str, int]:
    """A batch's stamps from now on, 1 ms apart, in WORKER_STAGES order (woke before the put)."""
    now = time.monotonic_ns()
    return {"woke": now - 9_000_000, "claimed": now + 1_000_000, "lingered": now + 2_000_000,
            "decoded": now + 3_000_000, "tokenized": now + 4_000_000, "forward": now + 5_000_000,
            "host": now + 6_000_000, "ran": now + 7_000_000}


def test_a_request_span_under_the_clients_with_its_stages(spans: InMemorySpanExporter) -> None:
    header, trace_id, parent = traceparent()
    sent = call(tracing.TracingMiddleware(fake_route("box-a/0"), "box-a"), {"traceparent": header})
    assert sent["http.response.start"]["status"] == 200
    got = {s.name: s for s in spans.get_finished_spans()}
    root = got["POST /v1/embed"]
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == parent
    assert root.attributes["fleet.served_by"] == "box-a/0" and root.attributes["fleet.batch.items"] == "3"
    for name in ("fleet.read_request", "fleet.enqueue", "fleet.queue_wait", "fleet.linger", "fleet.worker.decode",
                 "fleet.worker.tokenize", "fleet.worker.forward", "fleet.worker.to_host", "fleet.worker.run",
                 "fleet.reply", "fleet.resume", "fleet.encode"):
        span = got[name]
        assert span.parent.span_id == root.context.span_id and span.context.trace_id == root.context.trace_id
        assert root.start_time <= span.start_time <= span.end_time
    assert got["fleet.worker.forward"].attributes["fleet.worker"] == "box-a/0"


def test_a_remote_boxs_worker_stamps_are_left_out(spans: InMemorySpanExporter) -> None:
    call(tracing.TracingMiddleware(fake_route("box-b/0"), "box-a"), {})
    names = {s.name for s in spans.get_finished_spans()}
    assert "POST /v1/embed" in names and not any(n.startswith("fleet.worker") or n == "fleet.queue_wait"
                                                   for n in names)


def test_nats_headers_carry_the_trace_to_the_running_box(spans: InMemorySpanExporter) -> None:
    from opentelemetry import context, trace

    root = tracing._tracer.start_span("POST /v1/embed")
    token = context.attach(trace.set_span_in_context(root))
    carried = tracing.headers()
    context.detach(token)
    root.end()
    assert carried["traceparent"].split("-")[1] == f"{root.context.trace_id:032x}"

    async def serve() -> None:  # a work message's task on the running box
        span = tracing.begin_remote(carried, "m", "box-b")
        timeline.stamp("put")
        stamps = worker_stamps()
        timeline.stamp("collected", stamps["ran"] + 1_000_000)  # broker.run's, after the batch
        result = msgspec.msgpack.encode(Envelope(1.0, 2.0, "box-b/0", WorkError("x", "y"),
                                                 tuple(stamps.values()), 2, 20))
        tracing.end_remote(span, result)

    import asyncio

    asyncio.run(serve())
    got = {s.name: s for s in spans.get_finished_spans()}
    remote = got["fleet.remote m"]
    assert remote.parent.span_id == root.context.span_id and remote.context.trace_id == root.context.trace_id
    assert got["fleet.worker.forward"].parent.span_id == remote.context.span_id
    assert got["fleet.queue_wait"].parent.span_id == remote.context.span_id
    assert tracing.begin_remote({}, "m", "box-b") is None  # a message without a trace


def test_off_by_default_imports_nothing() -> None:
    code = ("import sys; from fleet.daemon import server, app, tracing, cluster; "
            "assert not tracing.setup('box'); "
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none"}) and not tracing.wanted({})


class Collector:
    """An OTLP/HTTP trace receiver: what the daemons' exporters send, decoded."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse)

        self.spans: list[dict] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            collector.spans.append({
                                "service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "attrs": {a.key: a.value.string_value or a.value.int_value for a in s.attributes}})
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, trace_id: str) -> list[dict]:
        return [s for s in self.spans if s["trace"] == trace_id]


@pytest.mark.nats
@pytest.mark.slow
def test_one_trace_spans_the_api_the_worker_and_a_second_box(nats_server: NatsServer,  # noqa: F811
                                                               tmp_path: Path) -> None:
    collector = Collector()

    def env(box: str, **more: str) -> dict[str, str]:
        return {"FLEET_NATS": nats_server.url, "FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1",
                "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_SERVICE_NAME": f"fleet-{box}",
                "OTEL_BSP_SCHEDULE_DELAY": "100", **more}

    # Only B stores B_MODEL: what A is asked for it runs on B, through JetStream.
    pull(tmp_path / "b", default_model_dir(), B_MODEL)
    a = start_daemon(tmp_path / "a", extra_env=env("box-a"), wait_ready=False)
    b = start_daemon(tmp_path / "b", extra_env=env("box-b"), wait_ready=False)
    try:
        wait_until_ready(a)
        wait_until_ready(b)
        header, via_a, client_span = traceparent()
        deadline = time.monotonic() + 30
        while True:  # A learns of B's models from B's heartbeat
            r = httpx.post(a.url + "/v1/embed", json={"model": B_MODEL, "inputs": ["traced across boxes"]},
                           headers={"traceparent": header}, timeout=60)
            if r.status_code != 404 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-by"].startswith("box-b/")
        header_b, on_b, client_span_b = traceparent()
        r = httpx.post(b.url + "/v1/embed", json={"model": B_MODEL, "inputs": ["traced on one box"]},
                       headers={"traceparent": header_b}, timeout=60)
        assert r.status_code == 200 and r.headers["x-served-by"].startswith("box-b/")
        # B's JetStream lag on /metrics (its heartbeat reads its consumers).
        while f'fleet_nats_pending_messages{{model="{B_MODEL}"}}' not in httpx.get(b.url + "/metrics").text:
            assert time.monotonic() < deadline + 30, "no fleet_nats_pending_messages sample on B"
            time.sleep(0.5)
    finally:
        a.stop()
        b.stop()
    deadline = time.monotonic() + 20
    while not (collector.of(via_a) and collector.of(on_b)) and time.monotonic() < deadline:
        time.sleep(0.2)

    spans = collector.of(via_a)
    by_name = {(s["service"], s["name"]): s for s in spans}
    root = by_name[("fleet-box-a", "POST /v1/embed")]
    assert root["parent"] == client_span and root["attrs"]["fleet.served_by"].startswith("box-b/")
    for name in ("fleet.publish", "fleet.cluster_wait"):
        assert by_name[("fleet-box-a", name)]["parent"] == root["id"]
    assert not [s for s in spans if s["service"] == "fleet-box-a" and s["name"].startswith("fleet.worker")]
    remote = by_name[("fleet-box-b", f"fleet.remote {B_MODEL}")]
    assert remote["parent"] == root["id"]
    worker = [s for s in spans if s["service"] == "fleet-box-b" and s["name"].startswith("fleet.worker")]
    assert worker and all(s["parent"] == remote["id"] for s in worker)
    assert by_name[("fleet-box-b", "fleet.queue_wait")]["parent"] == remote["id"]
    assert all(s["start"] <= s["end"] for s in spans)

    # Asked of B, run by B (through JetStream too): B's API spans, B's run under them.
    spans_b = collector.of(on_b)
    root_b = next(s for s in spans_b if s["name"] == "POST /v1/embed")
    assert root_b["service"] == "fleet-box-b" and root_b["parent"] == client_span_b
    remote_b = next(s for s in spans_b if s["name"] == f"fleet.remote {B_MODEL}")
    assert remote_b["service"] == "fleet-box-b" and remote_b["parent"] == root_b["id"]
    assert {"fleet.enqueue", "fleet.queue_wait", "fleet.worker.run", "fleet.reply"} <= {
        s["name"] for s in spans_b if s["parent"] == remote_b["id"]}
