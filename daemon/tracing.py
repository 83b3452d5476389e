"""OpenTelemetry traces of requests: off unless configured; nothing imported when off.

On when the standard variables ask for an exporter: `OTEL_TRACES_EXPORTER` (otlp,
console; "none" is off) or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), unless `OTEL_SDK_DISABLED=true`. The SDK and
the OTLP exporter are the `otel` extra (`pip install 'fleet-serve[otel]'`); the exporter
reads its own variables (endpoint, headers, protocol, `OTEL_BSP_*` batching).
`OTEL_SERVICE_NAME` names the service (default "fleet"); the box is `host.name`.

One trace per request, W3C `traceparent` from the client honoured (its span is the
parent). The spans are built from the stamps the request path writes anyway
(daemon.timeline: the API's stages, and the worker's WORKER_STAGES stamps carried in
its result Envelope), not from a second instrumentation of the hot path:

    POST /v1/embed                       SERVER, from the first byte to the last
      fleet.read_request                 body read, decoded, model checked
      fleet.enqueue                      into the model's lane
      fleet.queue_wait                   until a worker claimed it
      fleet.linger                       the worker waited for company
      fleet.worker.decode                payloads decoded
      fleet.worker.tokenize / .forward / .to_host   (adapters that stamp them)
      fleet.worker.run                   the rest of the batch
      fleet.reply                        ack, wake-up, collection on the loop
      fleet.resume / fleet.encode        the handler again, the reply body
      (NATS: fleet.publish, fleet.cluster_wait instead of enqueue .. reply)

Across boxes (NATS): the requesting box puts `traceparent` in the work message's
headers; the box that runs it records `fleet.remote <model>` (CONSUMER) under it, with
its own stages and its worker's beneath. Stamps are CLOCK_MONOTONIC: a box's own are
turned into wall time there; a remote worker's never reach the requesting box's spans.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from fleet.messages import WORKER_STAGES, EnvelopeIn

from fleet.daemon import timeline

log = logging.getLogger("fleet.daemon")

#: The tracer while tracing is on (`setup`); None: off, and every hook returns at once.
_tracer: Any = None
_provider: Any = None

#: A span per stage, named by the stage that ends it (from the stage before it).
STAGE_SPANS = {
    "checked": "fleet.read_request", "put": "fleet.enqueue", "claimed": "fleet.queue_wait",
    "lingered": "fleet.linger", "decoded": "fleet.worker.decode", "tokenized": "fleet.worker.tokenize",
    "forward": "fleet.worker.forward", "host": "fleet.worker.to_host", "ran": "fleet.worker.run",
    "collected": "fleet.reply", "resumed": "fleet.resume", "encoded": "fleet.encode",
    "published": "fleet.publish",
}
#: With NATS, the requesting box's wait: published to JetStream until the reply came back
#: (whichever box ran it records its own spans under `fleet.remote`).
CLUSTER_WAIT = "fleet.cluster_wait"
_WORKER = frozenset(WORKER_STAGES)
_envelope = msgspec.msgpack.Decoder(EnvelopeIn)


def wanted(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """The standard OTEL_ variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(box: str, provider: Any = None) -> bool:
    """Start tracing when the environment asks for it (or with `provider`: a configured
    SDK TracerProvider, as tests pass one with an in-memory exporter). True when on."""
    global _tracer, _provider
    if provider is None:
        if not wanted():
            return False
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            log.error("tracing is configured (OTEL_*) but OpenTelemetry is not installed: "
                      "pip install 'fleet-serve[otel]'; serving without traces")
            return False
        provider = TracerProvider(resource=Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "fleet"), "host.name": box}))
        for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
            name = name.strip().lower()
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif name == "console":
                provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            else:
                log.error("OTEL_TRACES_EXPORTER %r is not one fleet starts (otlp, console); ignored", name)
        log.info("tracing requests to %s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                 or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the exporter's default")
    _provider, _tracer = provider, provider.get_tracer("fleet")
    return True


def shutdown() -> None:
    """Export what is buffered (the daemon stops)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def on() -> bool:
    return _tracer is not None


def stage_spans(parent: Any, stamps: list[tuple[str, int]], *, worker: bool, served_by: str = "") -> None:
    """One span per stage under `parent` (a context) from this box's stamps, in time order;
    the worker's stages only when `worker` (a worker of this box ran it: same clock)."""
    offset = time.time_ns() - time.monotonic_ns()
    # Sent through NATS: the worker stamps the answer carried are the running box's (its
    # `fleet.remote` span has them, on its clock), even when that box is this one.
    through_nats = any(stage == "published" for stage, _ in stamps)
    worker = worker and not through_nats
    kept = sorted((ns, stage) for stage, ns in stamps if stage != "woke" and (worker or stage not in _WORKER))
    for (start, _), (end, stage) in zip(kept, kept[1:]):
        name = CLUSTER_WAIT if through_nats and stage == "collected" else STAGE_SPANS.get(stage)
        if name is None:
            continue
        attrs = {"fleet.worker": served_by} if stage in _WORKER and served_by else None
        span = _tracer.start_span(name, context=parent, start_time=start + offset, attributes=attrs)
        span.end(end_time=max(start, end) + offset)


def _own_box(served_by: str, box: str) -> bool:
    return served_by.rsplit("/", 1)[0] == box


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class TracingMiddleware:
    """ASGI: one SERVER span per HTTP request (the client's `traceparent` its parent),
    the stage spans under it, and the answer's batch (X-Batch-*, X-Served-By) on it.
    Installed by the server only when tracing is on."""

    def __init__(self, app: Callable[..., Awaitable[None]], box: str) -> None:
        self.app = app
        self.box = box

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _tracer is None:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, trace
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        from fleet.daemon.logs import REQUEST_ID

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        span = _tracer.start_span(f"{method} {path}", context=extract(carrier), kind=SpanKind.SERVER, attributes={
            "http.request.method": method, "url.path": path, "fleet.box": self.box})
        if (rid := REQUEST_ID.get()) is not None:
            span.set_attribute("fleet.request_id", rid)
        token = context.attach(trace.set_span_in_context(span))
        timeline.begin_traced()
        answer: dict[str, str] = {}
        status = 0

        async def traced_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                answer.update((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in message.get("headers", ())
                              if k.lower().startswith(b"x-"))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            served_by = answer.get("x-served-by", "")
            span.set_attribute("http.response.status_code", status)
            for header, key in (("x-served-by", "fleet.served_by"), ("x-batch-items", "fleet.batch.items"),
                                ("x-batch-tokens", "fleet.batch.tokens"), ("x-batch-adapters", "fleet.batch.adapters"),
                                ("x-queue-ms", "fleet.queue_ms"), ("x-inference-ms", "fleet.inference_ms")):
                if header in answer:
                    span.set_attribute(key, answer[header])
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            stage_spans(trace.set_span_in_context(span), timeline.current() or [],
                        worker=_own_box(served_by, self.box), served_by=served_by)
            span.end()
            context.detach(token)


def headers() -> dict[str, str]:
    """The current trace's W3C `traceparent` (and `tracestate`) for a NATS work message;
    {} when tracing is off or no request is traced."""
    if _tracer is None:
        return {}
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def begin_remote(nats_headers: dict[str, str], model: str, box: str) -> Any:
    """A work message from another box starts running here: `fleet.remote <model>` under
    the requester's span (its `traceparent`), the box's stages stamped for it. Returns the
    span, for `end_remote`; None when tracing is off or the message carries no trace."""
    if _tracer is None or "traceparent" not in nats_headers:
        return None
    from opentelemetry import context, trace
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    span = _tracer.start_span(f"fleet.remote {model}", context=extract(nats_headers), kind=SpanKind.CONSUMER,
                              attributes={"fleet.model": model, "fleet.box": box})
    context.attach(trace.set_span_in_context(span))  # this task's context: it serves this one message
    timeline.begin_traced()
    return span


def end_remote(span: Any, result: bytes) -> None:
    """The work message's result is on its way back: its stage spans (this box's clock,
    the worker's stamps from its Envelope), then the span ends."""
    if span is None:
        return
    from opentelemetry import trace

    stamps = list(timeline.current() or [])
    served_by = ""
    try:
        env = _envelope.decode(result)
        served_by = env.served_by
        stamps += [(stage, ns) for stage, ns in zip(WORKER_STAGES, env.stamps) if ns]
        span.set_attribute("fleet.served_by", served_by)
        if env.batch_items:
            span.set_attribute("fleet.batch.items", env.batch_items)
    except msgspec.DecodeError:
        pass
    stage_spans(trace.set_span_in_context(span), stamps, worker=True, served_by=served_by)
    span.end()
