"""Boxes and NATS servers each in its own network namespace, on bridges of this machine.

`Net` makes, and always removes, namespaces `f<tag>-<member>`, veth pairs and two
bridges in the root namespace: the client network `f<tag>c` (10.X.0.0/24; the root
namespace is 10.X.0.1 on it, so this test process reaches every member) and the route
network `f<tag>r` (10.X.1.0/24, no address in the root namespace: NATS servers route
to each other over it, so it can be cut without cutting their clients). Nothing is
routed or forwarded anywhere: no traffic leaves the machine. A member may be attached
through a `tests.netwire` cable instead of a veth (faults in user space where the
kernel has no netem). Needs root and `ip` (iproute2); `available()` says why not.

Every name carries `tag` (from this process's pid), so two runs never meet; `close()`
kills what still runs in its namespaces (started by these tests) and deletes them all.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def available() -> str:
    """'' when network namespaces, veth pairs and bridges can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: tests.netwire's cable is two TAP devices"
    name = f"fprobe{os.getpid() % 100000}"
    try:
        out = ip("netns", "add", name, check=False)
        if out.returncode != 0:
            return f"`ip netns add` is not permitted here: {out.stderr.strip()}"
        out = ip("link", "add", name, "type", "bridge", check=False)
        if out.returncode != 0:
            return f"cannot make a bridge here: {out.stderr.strip()}"
        return ""
    finally:
        ip("link", "del", name, check=False)
        ip("netns", "del", name, check=False)


@dataclass
class Member:
    """One namespace: its name, its address on the client network, and where its links end."""

    netns: str
    addr: str
    #: Root-namespace ends of its links: on the client network, and (servers) the route network.
    client_link: str
    route_link: str = ""
    route_addr: str = ""
    wire: subprocess.Popen | None = None


@dataclass
class Net:
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    members: dict[str, Member] = field(default_factory=dict)
    subnet: str = ""
    _bridges: list[str] = field(default_factory=list)

    @property
    def client_bridge(self) -> str:
        return f"f{self.tag}c"

    @property
    def route_bridge(self) -> str:
        return f"f{self.tag}r"

    def open(self) -> None:
        """The two bridges, on a 10.X subnet no route of this machine uses yet."""
        routes = ip("-4", "route", "show", "table", "all").stdout
        x = next(x for x in range(200, 250) if f"10.{x}." not in routes)
        self.subnet = f"10.{x}"
        for bridge in (self.client_bridge, self.route_bridge):
            ip("link", "add", bridge, "type", "bridge")
            self._bridges.append(bridge)
            ip("link", "set", bridge, "up")
        ip("addr", "add", f"{self.subnet}.0.1/24", "dev", self.client_bridge)

    def add(self, name: str, host: int, *, routes: bool = False, wire: bool = False) -> Member:
        """Namespace for `name`, on the client network as 10.X.0.<host> (through a netwire
        cable with `wire`), and with `routes` also on the route network as 10.X.1.<host>."""
        netns = f"f{self.tag}-{name}"
        ip("netns", "add", netns)
        member = self.members[name] = Member(netns, f"{self.subnet}.0.{host}", f"f{self.tag}{name}c")
        ip("link", "set", "lo", "up", netns=netns)
        if wire:
            member.wire = self._wire(member.client_link, "eth0", netns)
        else:
            ip("link", "add", member.client_link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", member.client_link, "master", self.client_bridge, "up")
        ip("addr", "add", f"{member.addr}/24", "dev", "eth0", netns=netns)
        ip("link", "set", "eth0", "up", netns=netns)
        if routes:
            member.route_link, member.route_addr = f"f{self.tag}{name}r", f"{self.subnet}.1.{host}"
            ip("link", "add", member.route_link, "type", "veth", "peer", "name", "eth1", "netns", netns)
            ip("link", "set", member.route_link, "master", self.route_bridge, "up")
            ip("addr", "add", f"{member.route_addr}/24", "dev", "eth1", netns=netns)
            ip("link", "set", "eth1", "up", netns=netns)
        return member

    def _wire(self, outer: str, inner: str, netns: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "tests.netwire", outer, inner, netns], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"tests.netwire did not start: {line!r} (exit {proc.wait()})")
        return proc

    def set_wire(self, name: str, delay_ms: float, jitter_ms: float, loss: float) -> tuple[int, int]:
        """The faults of `name`'s cable (both directions), like `tc qdisc ... netem delay
        DELAY_MS JITTER_MS loss LOSS` on a link. Returns (forwarded, dropped) frames under
        the faults set before."""
        wire = self.members[name].wire
        assert wire is not None and wire.stdin is not None and wire.stdout is not None, f"{name} has no wire"
        wire.stdin.write(f"{delay_ms} {jitter_ms} {loss}\n")
        wire.stdin.flush()
        words = wire.stdout.readline().split()
        assert words[:1] == ["set"], f"tests.netwire did not take the setting: {words}"
        return int(words[-3]), int(words[-1])

    def cut(self, name: str, network: str = "client") -> None:
        """`name`'s link to that network goes down (its end in the root namespace)."""
        member = self.members[name]
        ip("link", "set", member.client_link if network == "client" else member.route_link, "down")

    def restore(self, name: str, network: str = "client") -> None:
        member = self.members[name]
        link = member.client_link if network == "client" else member.route_link
        ip("link", "set", link, "master", self.client_bridge if network == "client" else self.route_bridge, "up")

    def close(self) -> str:
        """Remove everything made here (also after a failure); returns the wires' counts."""
        counts = []
        for name, member in self.members.items():
            if member.wire is not None and member.wire.poll() is None:
                member.wire.stdin.close()
                try:
                    counts.append(f"{name}: {member.wire.stdout.read().strip()}")
                    member.wire.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    member.wire.kill()
            for pid in ip("netns", "pids", member.netns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # what our tests started in our namespace
                except ProcessLookupError:
                    pass
        for member in self.members.values():
            for link in (member.client_link, member.route_link):
                if link:
                    ip("link", "del", link, check=False)
            ip("netns", "del", member.netns, check=False)
        for bridge in self._bridges:
            ip("link", "del", bridge, check=False)
        time.sleep(0.1)
        return "; ".join(counts)
