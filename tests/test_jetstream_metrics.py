"""A model's JetStream backlog on `/metrics` (daemon/nats_lag.py), against JetStream itself.

One real box (`fleetctl serve --nats`, one worker, `nats_fetch_per_worker` 1) on a real
nats-server; its worker is stopped (SIGSTOP) so requests pile up in JetStream: the box
holds one, the rest wait. The gauges must equal what the model's consumer says, the
oldest wait must be the age of the first request sent, and all of it must fall back to
0 once the worker runs again and every request is answered.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon
from tests.nats_fixture import NatsServer, nats_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.nats, pytest.mark.slow]

WAITING = 6


@pytest.fixture(scope="module")
def box(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:  # noqa: F811
    d = start_daemon(tmp_path_factory.mktemp("box"), extra_env={
        "FLEET_NATS": nats_server.url, "FLEET_BOX": "box-m", "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1",
        "FLEET_NATS_FETCH_PER_WORKER": "1", "FLEET_NATS_HEARTBEAT_MS": "500",
        # The stopped worker must not be judged hung (killed at a lease) while the test reads.
        "FLEET_LEASE_MS": "60000"})
    yield d
    d.stop()


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("pending_messages", "unacked_messages", "consumer_lag_messages", "oldest_wait_seconds"):
        m = re.search(rf'^fleet_nats_{name}\{{model="{re.escape(DEFAULT_MODEL)}"\}} (\S+)$', text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def worker_pids(url: str) -> list[int]:
    """Worker pids as `/v1/ps` lists them."""
    ps = httpx.get(url + "/v1/ps", timeout=10).json()
    return [w["pid"] for w in ps["workers"] if w.get("pid")]


async def consumer_now(url: str) -> tuple[int, int]:
    import nats

    from fleet.daemon.cluster import STREAM, consumer_name

    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().consumer_info(STREAM, consumer_name(DEFAULT_MODEL))
        return info.num_pending, info.num_ack_pending
    finally:
        await nc.close()


def wait_for(what: str, url: str, ok, timeout_s: float = 20.0) -> dict[str, float]:
    """The model's gauges once `ok(gauges)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = gauges(url)
        if ok(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s; last {got}")
        time.sleep(0.2)


def test_backlog_age_and_lag_follow_jetstream(box: DaemonProc, nats_server: NatsServer) -> None:  # noqa: F811
    body = {"model": DEFAULT_MODEL, "inputs": ["warm up"]}
    assert httpx.post(box.url + "/v1/embed", json=body, timeout=60).status_code == 200
    g = wait_for("gauges of an idle model", box.url, lambda g: g.get("consumer_lag_messages") == 0.0)
    assert g["oldest_wait_seconds"] == 0.0
    pids = worker_pids(box.url)
    assert len(pids) == 1, pids

    os.kill(pids[0], signal.SIGSTOP)
    sent_at = time.time()
    pool = ThreadPoolExecutor(WAITING)
    try:
        sending = [pool.submit(httpx.post, box.url + "/v1/embed", timeout=120,
                               json={"model": DEFAULT_MODEL, "inputs": [f"text {i}"]}) for i in range(WAITING)]
        # The box holds one (its credit), the rest wait in JetStream; the age grows.
        g = wait_for("a backlog with an age", box.url,
                     lambda g: g.get("pending_messages") == WAITING - 1 and g.get("oldest_wait_seconds", 0) >= 1.5)
        waited = time.time() - sent_at
        assert g["unacked_messages"] == 1.0
        assert g["consumer_lag_messages"] == WAITING
        assert g["oldest_wait_seconds"] <= waited + 0.5, (g, waited)
        # The same numbers JetStream gives (nothing moves while the worker is stopped).
        assert asyncio.run(consumer_now(nats_server.url)) == (WAITING - 1, 1)
    finally:
        os.kill(pids[0], signal.SIGCONT)
        pool.shutdown(wait=True)
    assert [f.result().status_code for f in sending] == [200] * WAITING
    g = wait_for("the backlog gone", box.url, lambda g: g.get("consumer_lag_messages") == 0.0)
    assert g["pending_messages"] == 0.0 and g["oldest_wait_seconds"] == 0.0

