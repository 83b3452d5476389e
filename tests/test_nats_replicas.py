"""Several boxes on a three-server NATS cluster: replicated streams, a dead server, a rolling restart.

Three clustered `nats-server -js` on 127.0.0.1 (one JetStream meta group) and two real
`fleetctl serve --nats` boxes (one CPU worker each, the real all-MiniLM-L6-v2), each
given all three URLs, at the shipped settings. Before the boxes start, the shared
streams exist with one copy, as a box of the last release left them: the boxes raise
them to three in place. Load goes through box A; each scenario counts requests sent,
answered 200, answered otherwise (by code), wrong answers, and replies box A dropped as
second answers. Run in file order (the first scenario checks what the boxes' start did).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.daemon.cluster import REPLY_STREAM, STREAM, consumer_name
from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon, wait_until_ready
from tests.nats_fixture import NatsCluster, connect, stream_place, wait_all_current
from tests.nats_load import Load, Tally, cluster_view, references

pytestmark = [pytest.mark.nats, pytest.mark.slow]

#: The shared streams: work, replies, the box bucket's and the object store's.
SHARED = (STREAM, REPLY_STREAM, "KV_fleet_boxes", "OBJ_fleet_payloads")
#: Load kept going after a fault this long: past a Raft election (~4-5 s here), the
#: shipped ack wait (5 s) and a reconnect, so what the fault held is answered under load.
AFTER_FAULT_S = 12.0


def box_env(cluster: NatsCluster, box: str) -> dict[str, str]:
    # The shipped NATS settings: only where to find NATS (all three servers), the box's name and size.
    return {"FLEET_NATS": cluster.urls, "FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1"}


async def streams_of_the_last_release(urls: str) -> None:
    """The shared streams with one copy, as a box of the last release created them."""
    from nats.js.api import ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig

    nc = await connect(urls)
    try:
        # A fresh cluster's first stream create can take past nats.py's 5 s on a loaded
        # machine (the meta group places it): one that timed out failed the module's setup.
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=["fleet.work.>"], retention=RetentionPolicy.WORK_QUEUE,
                                         storage=StorageType.FILE))
        await js.add_stream(StreamConfig(name=REPLY_STREAM, subjects=["fleet.reply.*.*.*"],
                                         storage=StorageType.FILE))
        await js.create_key_value(bucket="fleet_boxes", ttl=6.0, history=1, storage=StorageType.FILE)
        await js.create_object_store("fleet_payloads", ObjectStoreConfig(ttl=900.0, storage=StorageType.FILE))
    finally:
        await nc.close()


class Boxes:
    def __init__(self, cluster: NatsCluster, a: DaemonProc, b: DaemonProc) -> None:
        self.cluster, self.a, self.b = cluster, a, b
        self.refs = references(a.url)


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("replicas")
    cluster = NatsCluster(root / "nats")
    a = b = None
    try:
        cluster.start()
        asyncio.run(streams_of_the_last_release(cluster.urls))
        for s in SHARED:
            assert asyncio.run(stream_place(cluster.urls, s)).replicas == 1
        a = start_daemon(root / "a", extra_env=box_env(cluster, "box-a"), wait_ready=False)
        b = start_daemon(root / "b", extra_env=box_env(cluster, "box-b"), wait_ready=False)
        wait_until_ready(a)
        wait_until_ready(b)
        yield Boxes(cluster, a, b)
    finally:
        for d in (a, b):  # both drain at once, then each is waited for
            if d is not None and d.proc.poll() is None:
                d.proc.terminate()
        for d in (a, b):
            if d is not None:
                d.stop()
        cluster.stop()


def duplicates_at_a(boxes: Boxes) -> int:
    return cluster_view(boxes.a.url)["box-a"]["duplicates"]


def test_streams_of_the_last_release_are_raised_to_three_replicas_in_place(boxes: Boxes) -> None:
    urls = boxes.cluster.urls
    for s in SHARED:
        place = asyncio.run(wait_all_current(urls, s))
        assert place.replicas == 3 and place.names() == {"n1", "n2", "n3"}, (s, place)
    # The consumers were declared with num_replicas 0: they follow their stream.
    consumer = asyncio.run(wait_all_current(urls, STREAM, consumer_name(DEFAULT_MODEL)))
    assert consumer.replicas == 3 and consumer.names() == {"n1", "n2", "n3"}, consumer
    # One line, from the box that raised them (the other found them raised, or raised the rest).
    lines = [line for d in (boxes.a, boxes.b) for line in d.log().splitlines() if "replicas changed in place" in line]
    assert lines and all(line.count("(had 1)") >= 1 for line in lines), lines
    assert sum(d.log().count("replicas changed in place") <= 1 for d in (boxes.a, boxes.b)) == 2
    assert f"{STREAM} (had 1)" in "\n".join(lines)
    print("\n".join(lines))
    assert {b["replicas"] for b in cluster_view(boxes.a.url).values()} == {3}


async def load_through_a_fault(boxes: Boxes, fault, *, after_s: float = AFTER_FAULT_S) -> Load:
    """Load through box A; once 20 answers came back, `fault()` (in a thread), then load for `after_s` more."""
    load = Load(boxes.a.url, boxes.refs, concurrency=8, n_texts=2)
    running = asyncio.ensure_future(load.run())
    try:
        while len(load.replies) < 20:
            assert not running.done(), "the load ended before the fault"
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, fault)
        await asyncio.sleep(after_s)
    finally:
        load.stop()
        await running
    return load


def test_kill_9_of_the_work_streams_leader_under_load_answers_every_request_once(boxes: Boxes) -> None:
    cluster = boxes.cluster
    dup0 = duplicates_at_a(boxes)
    killed: dict[str, object] = {}

    def kill_the_leader() -> None:
        leader = asyncio.run(stream_place(cluster.urls, STREAM)).leader
        killed["name"], killed["t"] = leader, time.monotonic()
        cluster.server(leader).kill()

    load = asyncio.run(load_through_a_fault(boxes, kill_the_leader))
    tally = load.tally(duplicates_at_a(boxes) - dup0)
    print(f"kill -9 of {STREAM}'s leader ({killed['name']}) under load: {tally}")
    assert load.answered_once_each()
    assert tally.ok == tally.sent and tally.wrong == 0, str(tally)
    assert sum(r.at > killed["t"] for r in load.replies) > 20, "nothing was answered after the kill"
    # The killed server comes back and catches up: every copy current again, a leader elected.
    server = cluster.server(str(killed["name"]))
    t0 = time.monotonic()
    server.start()
    for s in (STREAM, REPLY_STREAM):
        place = asyncio.run(wait_all_current(cluster.urls, s))
        assert server.name in place.names(), place
    print(f"{server.name} rejoined, copies current in {time.monotonic() - t0:.1f} s; "
          f"{STREAM} now led by {asyncio.run(stream_place(cluster.urls, STREAM)).leader}")


def test_a_rolling_restart_of_all_three_servers_under_load_answers_every_request_once(boxes: Boxes) -> None:
    cluster = boxes.cluster
    dup0 = duplicates_at_a(boxes)
    restarts: list[str] = []

    def restart_each() -> None:
        for server in cluster.servers:
            server.stop()  # SIGTERM: the server steps down and leaves cleanly
            time.sleep(1.0)
            server.start()
            for s in (STREAM, REPLY_STREAM, "KV_fleet_boxes"):
                asyncio.run(wait_all_current(cluster.urls, s))
            restarts.append(server.name)

    load = asyncio.run(load_through_a_fault(boxes, restart_each, after_s=AFTER_FAULT_S / 2))
    tally: Tally = load.tally(duplicates_at_a(boxes) - dup0)
    print(f"rolling restart of {', '.join(restarts)} under load: {tally}")
    assert restarts == ["n1", "n2", "n3"]
    assert load.answered_once_each()
    assert tally.ok == tally.sent and tally.wrong == 0, str(tally)
    assert {b["replicas"] for b in cluster_view(boxes.a.url).values()} == {3}
    # The boxes never restarted: the same processes served it all.
    assert boxes.a.proc.poll() is None and boxes.b.proc.poll() is None
