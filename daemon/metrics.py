"""Prometheus metrics for `/metrics`, on a registry this object owns.

The daemon makes one `Metrics` and calls the named recorders from where things
happen; nothing here reads daemon state. Each `Metrics` has its own
`CollectorRegistry` (never the process-global one), so tests and several apps
in one process do not collide.

Hot path: a recorder is a dict lookup for the label child plus the
prometheus-client increments; `.labels()` (validation, locking) runs once per
label set. Units: seconds and bytes, as Prometheus names them; the queue and
inference times arrive in ms (the `X-Queue-Ms` / `X-Inference-Ms` headers) and
are converted here.

Label safety: the `model` label can come from a client's request body. A name
gets its own series only if `known(name)` (the daemon: a model it stores, or a box
of its cluster does); any other is counted under `_unknown`, so junk names neither
grow memory nor use up the label budget. Past `max_models` known names, the rest
share `_other`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder

#: Request latency buckets, seconds: 1 ms .. 60 s.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
OTHER_MODEL = "_other"
UNKNOWN_MODEL = "_unknown"


class Metrics:
    def __init__(self, *, max_models: int = 256, process_metrics: bool = True,
                 known: Callable[[str], bool] = lambda name: True) -> None:
        # `*_created` series double the scrape size and no dashboard reads them.
        # The switch is process-wide in prometheus-client and must precede creation.
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        self.max_models = max_models
        self.known = known
        self._models: dict[str, str] = {}
        self._request_children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}
        self._lane_children: dict[str, tuple[Any, Any]] = {}
        self._batch_children: dict[str, tuple[Any, Any]] = {}
        self._generation_children: dict[str, tuple[Any, Any]] = {}

        self.requests = Counter(
            "fleet_requests", "Requests answered, by model, task and status (ok or the error code).",
            ("model", "task", "status"), registry=r)
        self.request_seconds = Histogram(
            "fleet_request_duration_seconds", "Time from receiving a request to answering it.",
            ("model", "task"), buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_seconds = Histogram(
            "fleet_queue_wait_seconds", "Time a request waited in its lane before a worker claimed it.",
            ("model",), buckets=LATENCY_BUCKETS_S, registry=r)
        self.inference_seconds = Histogram(
            "fleet_inference_duration_seconds", "Time the request's batch spent in the model.",
            ("model",), buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft_seconds = Histogram(
            "fleet_time_to_first_token_seconds",
            "Generation: time from queueing a request to its first generated token (queue wait + prefill).",
            ("model",), buckets=LATENCY_BUCKETS_S, registry=r)
        self.generated_tokens = Counter(
            "fleet_generated_tokens", "Generation: tokens generated for answered requests (rate() is tokens/s).",
            ("model",), registry=r)
        self.withdrawn_items = Counter(
            "fleet_withdrawn_items",
            "Queue items withdrawn before their answer was used (the client left, the request timed out, another "
            "piece of it failed, a shutdown), by stage: queued (left its lane unrun) or claimed (a worker held it: "
            "it stops at the next micro-batch boundary, or its answer is dropped).",
            ("model", "stage"), registry=r)
        self.lane_depth = Gauge(
            "fleet_lane_depth", "Items waiting (not yet claimed) in a model's lane.", ("model",), registry=r)
        self.lane_oldest_wait = Gauge(
            "fleet_lane_oldest_wait_seconds", "Age of the oldest waiting item in a model's lane.",
            ("model",), registry=r)
        self.batch_items = Histogram(
            "fleet_batch_items",
            "Inputs per batch a worker ran (texts, images, a rerank's documents; generation: sequences).",
            ("model",), buckets=BATCH_ITEM_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "fleet_batch_tokens",
            "Tokenizer tokens per batch a worker ran (generation: prompt and generated tokens of the step); "
            "the sum is the model's token total.",
            ("model",), buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.model_loads = Counter("fleet_model_loads", "Model loads onto a device.", ("model",), registry=r)
        self.model_evictions = Counter(
            "fleet_model_evictions", "Models taken off a device, by reason (lru, unload, worker_exit).",
            ("model", "reason"), registry=r)
        self.model_resident = Gauge(
            "fleet_model_resident", "Copies of a model resident on devices now.", ("model",), registry=r)
        self.device_memory_used = Gauge(
            "fleet_device_memory_used_bytes", "Device memory in use by fleet's models.", ("device",), registry=r)
        self.device_memory_budget = Gauge(
            "fleet_device_memory_budget_bytes", "Device memory fleet may use.", ("device",), registry=r)
        self.worker_restarts = Counter(
            "fleet_worker_restarts", "Worker processes restarted after dying.", ("worker",), registry=r)
        # Several boxes (--nats) only; read from each model's JetStream consumer at every heartbeat.
        self.nats_pending = Gauge(
            "fleet_nats_pending_messages", "Requests of a model waiting in JetStream, taken by no box yet.",
            ("model",), registry=r)
        self.nats_unacked = Gauge(
            "fleet_nats_unacked_messages", "Requests of a model a box took from JetStream and has not answered.",
            ("model",), registry=r)
        # What KEDA's nats-jetstream scaler reads for the consumer work_<model>: num_pending + num_ack_pending.
        self.nats_lag = Gauge(
            "fleet_nats_consumer_lag_messages",
            "Requests of a model in JetStream not yet answered (pending + unacked: KEDA's nats-jetstream lag).",
            ("model",), registry=r)
        self.nats_oldest_wait = Gauge(
            "fleet_nats_oldest_wait_seconds", "Age of the oldest request of a model waiting in JetStream, taken by no box.",
            ("model",), registry=r)
        if process_metrics:
            ProcessCollector(registry=r)

    def model_label(self, model: str) -> str:
        """The label `model` is counted under (itself, `_unknown` or `_other`): what else
        keys per-model state on client-given names (daemon.top) uses it too."""
        return self._model(model)

    def _model(self, model: str) -> str:
        label = self._models.get(model)
        if label is None:
            if not model:
                return "-"
            # Unknown names are not remembered: a model pulled later gets its own series.
            if not self.known(model):
                return UNKNOWN_MODEL
            if len(self._models) >= self.max_models:
                return OTHER_MODEL
            label = self._models[model] = model
        return label

    def observe_request(
        self, model: str, task: str, status: str, seconds: float,
        queue_ms: float | None = None, inference_ms: float | None = None,
    ) -> None:
        """One answered request. `status` is "ok" or the error code; `model` "" if none was resolved.

        Pass `queue_ms` / `inference_ms` only for the phases the request reached: one
        refused before queueing (bad_request, overloaded) never waited, one that timed
        out in its lane never ran.
        """
        model = self._model(model)
        key = (model, task, status)
        children = self._request_children.get(key)
        if children is None:
            children = self._request_children[key] = (
                self.requests.labels(model, task, status),
                self.request_seconds.labels(model, task),
                self.queue_seconds.labels(model),
                self.inference_seconds.labels(model),
            )
        count, total, queue, inference = children
        count.inc()
        total.observe(seconds)
        if queue_ms is not None:
            queue.observe(queue_ms / 1000.0)
        if inference_ms is not None:
            inference.observe(inference_ms / 1000.0)

    def observe_generation(self, model: str, ttft_s: float, tokens: int) -> None:
        """One answered generation: its time to first token and the tokens it generated."""
        label = self._model(model)
        children = self._generation_children.get(label)
        if children is None:
            children = self._generation_children[label] = (self.ttft_seconds.labels(label),
                                                           self.generated_tokens.labels(label))
        children[0].observe(ttft_s)
        children[1].inc(tokens)

    def withdrawn(self, model: str, queued: bool) -> None:
        """A queue item of `model` withdrawn: `queued` it left its lane unrun, else a worker held it."""
        self.withdrawn_items.labels(self._model(model), "queued" if queued else "claimed").inc()

    def set_lane(self, model: str, depth: int, oldest_wait_s: float) -> None:
        label = self._model(model)
        children = self._lane_children.get(label)
        if children is None:
            children = self._lane_children[label] = (self.lane_depth.labels(label), self.lane_oldest_wait.labels(label))
        children[0].set(depth)
        children[1].set(oldest_wait_s)

    def observe_batch(self, model: str, items: int, tokens: int) -> None:
        label = self._model(model)
        children = self._batch_children.get(label)
        if children is None:
            children = self._batch_children[label] = (self.batch_items.labels(label), self.batch_tokens.labels(label))
        children[0].observe(items)
        children[1].observe(tokens)

    def model_loaded(self, model: str) -> None:
        model = self._model(model)
        self.model_loads.labels(model).inc()
        self.model_resident.labels(model).inc()

    def model_evicted(self, model: str, reason: str = "lru") -> None:
        """A model left a device: `lru` (room for another), `unload` (asked), `worker_exit` (its worker died)."""
        model = self._model(model)
        self.model_evictions.labels(model, reason).inc()
        self.model_resident.labels(model).dec()

    def set_device_memory(self, device: str, used_bytes: int, budget_bytes: int) -> None:
        self.device_memory_used.labels(device).set(used_bytes)
        self.device_memory_budget.labels(device).set(budget_bytes)

    def worker_restarted(self, worker: str) -> None:
        self.worker_restarts.labels(worker).inc()

    def set_nats_lag(self, model: str, pending: int, unacked: int) -> None:
        label = self._model(model)
        self.nats_pending.labels(label).set(pending)
        self.nats_unacked.labels(label).set(unacked)
        self.nats_lag.labels(label).set(pending + unacked)

    def set_nats_oldest_wait(self, model: str, seconds: float) -> None:
        self.nats_oldest_wait.labels(self._model(model)).set(seconds)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape; OpenMetrics when the scraper's Accept asks for it."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

