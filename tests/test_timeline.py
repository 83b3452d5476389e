"""The request timeline (`X-Fleet-Timeline: 1`): real daemon, real worker, real weights.

Every process on the box stamps CLOCK_MONOTONIC, so a request's stamps from the
API process and from the worker fall in the order the request passed them.
"""

from __future__ import annotations

import time

import httpx
import msgspec

from fleet.bench import timeline as bench_timeline
from fleet.messages import WORKER_STAGES
from tests.conftest import DEFAULT_MODEL

MSGPACK = "application/msgpack"
#: The stages a request passes strictly in this order. `put` is when the request
#: learns its put is done: a worker may claim the item before (a put that found the
#: lock busy runs on the broker's queue thread), so it is ordered with the API's own.
WORKER_ORDER = ("checked", "claimed", "lingered", "decoded", "tokenized", "forward", "host", "ran", "collected",
                "resumed", "encoded")
API_ORDER = ("handler", "checked", "put", "collected", "resumed", "encoded")


def embed(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/embed", content=msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": ["hi there"]}),
                      headers={"Content-Type": MSGPACK, **headers}, timeout=60)


def test_a_request_that_asks_gets_every_stage_in_order(daemon) -> None:
    sent = time.monotonic_ns()
    r = embed(daemon.url, {"X-Fleet-Timeline": "1"})
    received = time.monotonic_ns()
    assert r.status_code == 200
    stamps = bench_timeline.parse_stamps(r.headers["X-Fleet-Timeline"])
    assert set(stamps) == {*API_ORDER, *WORKER_STAGES}
    for order in (API_ORDER, WORKER_ORDER):
        ns = [stamps[s] for s in order]
        assert ns == sorted(ns), stamps
    # The same clock as this process: the whole timeline lies inside the round trip.
    assert sent < stamps["handler"] and stamps["encoded"] < received
    assert stamps["woke"] <= stamps["claimed"]


def test_a_request_that_does_not_ask_gets_no_timeline(daemon) -> None:
    r = embed(daemon.url, {})
    assert r.status_code == 200
    assert "x-fleet-timeline" not in r.headers
    assert float(r.headers["X-Inference-Ms"]) > 0


def test_the_bench_tool_measures_every_stage(daemon) -> None:
    rows = bench_timeline.measure(daemon.url, ["hello", "a short query"], requests=5)
    table = bench_timeline.stage_table(rows)
    assert [s["n"] for s in table] == [5] * len(bench_timeline.STAGES)
    totals = bench_timeline.spans(rows)
    assert (totals["model (tokenize .. on host)"] < totals["round trip"]).all()


def test_the_latency_tool_alternates_fleet_and_in_process(daemon) -> None:
    """bench.inference_compare (issue 17's added-latency figure): each pair is one
    request to the real daemon and one encode in this process; the serving path
    per request is the round trip minus the worker's own inference."""
    from fleet.bench import inference_compare

    passive = inference_compare.Passive()  # the second line: fp32, OMP_WAIT_POLICY=PASSIVE, a child process
    try:
        runs = inference_compare.alternate(daemon.url, inference_compare.load_local(inference_compare.fast_dtype()),
                                           ["hello", "a short query"], 6, passive=passive, warmup=2)
    finally:
        passive.close()
    assert {k: len(v) for k, v in runs.items()} == {"rtt": 6, "inference": 6, "local": 6, "passive": 6}
    assert (runs["inference"] > 0).all() and (runs["local"] > 0).all() and (runs["passive"] > 0).all()
    assert (runs["rtt"] > runs["inference"]).all()  # the round trip holds the worker's run
    s = inference_compare.summarize(runs)
    assert s["path_p50_ms"] > 0 and s["n"] == 6
    assert s["added_p50_ms"] == s["rtt_p50_ms"] - s["local_p50_ms"]
    assert s["worker_over_local_p50"] > 0 and s["passive_p50_ms"] > 0
