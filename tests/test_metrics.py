"""Metrics: what the recorders put in the Prometheus text a scraper reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from fleet.daemon.metrics import OTHER_MODEL, Metrics


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_requests_count_and_latency_land_in_the_right_buckets():
    m = Metrics()
    m.observe_request("minilm", "embed", "ok", 0.004, queue_ms=1.5, inference_ms=2.0)
    m.observe_request("minilm", "embed", "ok", 0.2, queue_ms=150.0, inference_ms=40.0)
    m.observe_request("minilm", "embed", "timeout", 30.0, queue_ms=30_000.0)
    m.observe_request("", "embed", "bad_request", 0.0002)
    s = scrape(m)
    assert value(s, "fleet_requests_total", model="minilm", task="embed", status="ok") == 2
    assert value(s, "fleet_requests_total", model="minilm", task="embed", status="timeout") == 1
    assert value(s, "fleet_requests_total", model="-", task="embed", status="bad_request") == 1
    assert value(s, "fleet_request_duration_seconds_bucket", model="minilm", task="embed", le="0.005") == 1
    assert value(s, "fleet_request_duration_seconds_bucket", model="minilm", task="embed", le="0.25") == 2
    assert value(s, "fleet_request_duration_seconds_count", model="minilm", task="embed") == 3
    # ms in, seconds out; the timed-out request waited but never ran.
    assert value(s, "fleet_queue_wait_seconds_count", model="minilm") == 3
    assert value(s, "fleet_queue_wait_seconds_sum", model="minilm") == (1.5 + 150 + 30_000) / 1000
    assert value(s, "fleet_inference_duration_seconds_count", model="minilm") == 2
    assert value(s, "fleet_inference_duration_seconds_bucket", model="minilm", le="0.0025") == 1
    # The refused request never reached a lane.
    assert value(s, "fleet_queue_wait_seconds_count", model="-") == 0


def test_lanes_batches_models_devices_workers():
    m = Metrics()
    m.set_lane("minilm", 12, 0.25)
    m.set_lane("minilm", 3, 0.05)
    m.observe_batch("minilm", 32, 900)
    m.observe_batch("minilm", 1, 20)
    m.model_loaded("minilm")
    m.model_loaded("minilm")  # a second copy on another GPU
    m.model_evicted("minilm")
    m.model_loaded("bge-reranker")
    m.model_evicted("bge-reranker", reason="worker_exit")
    m.set_device_memory("cuda:0", 3 << 30, 20 << 30)
    m.worker_restarted("cuda:0")
    m.worker_restarted("cuda:0")
    s = scrape(m)
    assert value(s, "fleet_lane_depth", model="minilm") == 3
    assert value(s, "fleet_lane_oldest_wait_seconds", model="minilm") == 0.05
    assert value(s, "fleet_batch_items_count", model="minilm") == 2
    assert value(s, "fleet_batch_items_bucket", model="minilm", le="32.0") == 2
    assert value(s, "fleet_batch_items_bucket", model="minilm", le="16.0") == 1
    assert value(s, "fleet_batch_tokens_sum", model="minilm") == 920
    assert value(s, "fleet_model_loads_total", model="minilm") == 2
    assert value(s, "fleet_model_resident", model="minilm") == 1
    assert value(s, "fleet_model_evictions_total", model="minilm", reason="lru") == 1
    assert value(s, "fleet_model_evictions_total", model="bge-reranker", reason="worker_exit") == 1
    assert value(s, "fleet_model_resident", model="bge-reranker") == 0
    assert value(s, "fleet_device_memory_used_bytes", device="cuda:0") == 3 << 30
    assert value(s, "fleet_device_memory_budget_bytes", device="cuda:0") == 20 << 30
    assert value(s, "fleet_worker_restarts_total", worker="cuda:0") == 2
    assert value(s, "process_resident_memory_bytes") > 0


def test_instances_do_not_share_a_registry():
    a, b = Metrics(), Metrics(process_metrics=False)
    a.observe_request("minilm", "embed", "ok", 0.01)
    assert value(scrape(a), "fleet_requests_total", model="minilm", task="embed", status="ok") == 1
    sb = scrape(b)
    assert not any(name == "fleet_requests_total" for name, _ in sb)
    assert not any(name.startswith("process_") for name, _ in sb)


def test_client_chosen_model_names_cannot_grow_series_without_bound():
    m = Metrics(max_models=3)
    for i in range(50):
        m.observe_request(f"random-{i}", "embed", "model_not_found", 0.001)
    s = scrape(m)
    models = {dict(labels)["model"] for name, labels in s if name == "fleet_requests_total"}
    assert models == {"random-0", "random-1", "random-2", OTHER_MODEL}
    assert value(s, "fleet_requests_total", model=OTHER_MODEL, task="embed", status="model_not_found") == 47


def test_openmetrics_on_request():
    m = Metrics(process_metrics=False)
    m.worker_restarted("cpu:0")
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert b'fleet_worker_restarts_total{worker="cpu:0"} 1.0' in body
    assert body.endswith(b"# EOF\n")
