"""Aliases across boxes (issue 39): with `--nats` the alias table lives in the JetStream
KV bucket `fleet_aliases`, and every box routes by it.

Two real `fleetctl serve --nats` boxes on one real nats-server, at the shipped settings
(`nats_heartbeat_ms` 2 000), each storing all-MiniLM-L6-v2 and a copy of it:
- a switch made on either box is followed by the other within one heartbeat, and the
  other box's replies name the new version; a rollback too;
- switches made on both boxes at once all land, one after the other (compare-and-set):
  none is lost, and both boxes end on the same version;
- the history of changes made on either box, and a promotion's package, read the same on
  both boxes (the API and `fleetctl history`).

Before: there was no alias; then, aliases were per box only.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon, wait_until_ready
from tests.nats_fixture import NatsServer, nats_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.nats

COPY = "minilm-copy"
ALIAS = "text-embedding-3-small"
#: The shipped `nats_heartbeat_ms`: a box follows a change within one.
HEARTBEAT_S = 2.0


@pytest.fixture(scope="module")
def two_boxes(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
              ) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    root = tmp_path_factory.mktemp("alias-boxes")
    started = []
    for box in ("box-a", "box-b"):
        store = Store(root / box / "models")
        store.clone(pull_model(store, DEFAULT_MODEL, weights_check=False).manifest, COPY)
        started.append(start_daemon(root / box, wait_ready=False, extra_env={
            "FLEET_NATS": nats_server.url, "FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1"}))
    try:
        for d in started:
            wait_until_ready(d)
        yield started[0], started[1]
    finally:
        for d in started:
            d.stop()


def version_at(d: DaemonProc) -> str | None:
    found = [a for a in httpx.get(d.url + "/v1/aliases", timeout=10).json()["aliases"] if a["name"] == ALIAS]
    return found[0]["version"] if found else None


def followed_within(d: DaemonProc, version: str, since: float) -> float:
    """Seconds from `since` until `d` routes the alias to `version` (polled every 20 ms)."""
    while version_at(d) != version:
        assert time.monotonic() - since < 10 * HEARTBEAT_S, f"{d.url} still routes {ALIAS} to {version_at(d)}"
        time.sleep(0.02)
    return time.monotonic() - since


def embed_version(d: DaemonProc) -> str:
    r = httpx.post(d.url + "/v1/embed", json={"model": ALIAS, "inputs": ["hello"]}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-fleet-model-version"]


def put(d: DaemonProc, version: str) -> httpx.Response:
    return httpx.put(f"{d.url}/v1/aliases/{ALIAS}", json={"version": version, "warm": False}, headers=d.admin,
                     timeout=30)


def test_every_box_follows_a_switch_and_a_rollback_within_one_heartbeat(two_boxes) -> None:
    a, b = two_boxes
    for here, there, version in [(a, b, DEFAULT_MODEL), (b, a, COPY)]:
        t0 = time.monotonic()
        assert put(here, version).status_code == 200
        assert followed_within(there, version, t0) < HEARTBEAT_S
        assert embed_version(there) == version
    t0 = time.monotonic()
    r = httpx.post(f"{a.url}/v1/aliases/{ALIAS}/rollback", json={}, headers=a.admin, timeout=30)
    assert r.status_code == 200 and r.json()["alias"]["version"] == DEFAULT_MODEL
    assert followed_within(b, DEFAULT_MODEL, t0) < HEARTBEAT_S
    assert embed_version(b) == DEFAULT_MODEL


def test_switches_made_on_both_boxes_at_once_all_land_in_order(two_boxes) -> None:
    a, b = two_boxes
    assert put(a, DEFAULT_MODEL).status_code == 200
    start = httpx.get(f"{a.url}/v1/aliases/{ALIAS}", timeout=10).json()["change"]
    jobs = [(a, COPY), (b, DEFAULT_MODEL)] * 6
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: put(*job), jobs))
    assert [r.status_code for r in answers] == [200] * len(jobs)
    changes = sorted(r.json()["alias"]["change"] for r in answers)
    # Each change read the one before it: none overwrote another unseen.
    assert changes == list(range(start + 1, start + 1 + len(jobs)))
    final = max(answers, key=lambda r: r.json()["alias"]["change"]).json()["alias"]["version"]
    t0 = time.monotonic()
    for d in (a, b):
        followed_within(d, final, t0)
        assert httpx.get(f"{d.url}/v1/aliases/{ALIAS}", timeout=10).json()["change"] == start + len(jobs)


def test_the_history_and_a_promotion_package_read_the_same_on_every_box(two_boxes) -> None:
    a, b = two_boxes
    alias = "shared-history"
    for d, version in [(a, DEFAULT_MODEL), (b, COPY)]:
        r = httpx.put(f"{d.url}/v1/aliases/{alias}", json={"version": version, "warm": False}, headers=d.admin,
                      timeout=30)
        assert r.status_code == 200, r.text
    pairs = [("where is my invoice", "Invoices are under billing, one per month."),
             ("cancel my subscription", "To cancel, open billing and end the plan.")]
    text = "".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in pairs)
    r = httpx.post(a.url + "/v1/promotions", json={"candidate": DEFAULT_MODEL, "alias": alias, "eval": text},
                   headers=a.admin, timeout=300)
    assert r.status_code == 200, r.text
    package = r.json()
    want = [("set", DEFAULT_MODEL), ("set", COPY), ("promote", DEFAULT_MODEL)]
    for d in (a, b):
        history = httpx.get(f"{d.url}/v1/aliases/{alias}/history", timeout=30).json()
        assert [(e["kind"], e["version"]) for e in history["events"]] == want, d.url
        assert history["packages"][package["id"]]["candidate_metrics"] == package["evaluation"]["candidate"]
        r = httpx.get(f"{d.url}/v1/promotions/{package['id']}", timeout=30)
        assert r.status_code == 200 and r.json() == package, r.text
    out = subprocess.run([sys.executable, "-m", "fleetctl", "history", alias], capture_output=True, text=True,
                         env={"FLEET_URL": b.url, "PATH": "/usr/bin:/bin"}, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and package["id"] in out.stdout, out.stderr
