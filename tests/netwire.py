"""A network cable with faults, in user space: `tc netem` where the kernel has no netem.

Run as `python -m tests.netwire OUTER INNER NETNS`: it opens the TAP device OUTER in
this (the root) network namespace and INNER in namespace NETNS, then copies Ethernet
frames between them both ways, each frame delayed by `delay_ms` ± `jitter_ms` (uniform,
so frames may overtake each other, as with netem's jitter) and dropped with probability
`loss`. Lines on stdin set them: "DELAY_MS JITTER_MS LOSS" (e.g. "100 50 0.02"; "0 0 0"
is a plain cable); each is answered with the frames forwarded and dropped under the
previous setting. On stdin's end it prints those counts once more and exits.

Frames, not bytes: TCP above it sees real loss (retransmits) and real reordering. The
kernel of the machine these tests were written on has no netem (CONFIG_NET_SCH_NETEM
is not set); TAP devices (CONFIG_TUN) it has.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import selectors
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000
FRAME_BYTES = 65536


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def enter_netns(name: str) -> None:
    """This (still single-threaded) process moves into network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


class Faults:
    """The wire's faults, set from the stdin thread, read by the copying loop."""

    def __init__(self) -> None:
        self.delay_s = self.jitter_s = self.loss = 0.0
        self.forwarded = self.dropped = 0

    def set(self, line: str) -> None:
        delay_ms, jitter_ms, loss = (float(x) for x in line.split())
        self.delay_s, self.jitter_s, self.loss = delay_ms / 1000.0, jitter_ms / 1000.0, loss


def copy_frames(a: int, b: int, faults: Faults, done: threading.Event, rng: random.Random) -> None:
    """Until `done`: every frame read from one end is written to the other at its time
    (counted in `faults.forwarded`), or dropped (`faults.dropped`)."""
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    due: list[tuple[float, int, int, bytes]] = []  # (send at, tie-breaker, to fd, frame)
    n = 0
    while not done.is_set():
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, to, frame = heapq.heappop(due)
            try:
                os.write(to, frame)
                faults.forwarded += 1
            except OSError:  # that end's link is down (a cut): the frame is lost, as on a wire
                faults.dropped += 1
        wait = min(0.05, max(0.0, due[0][0] - now)) if due else 0.05
        for key, _ in sel.select(wait):
            while True:
                try:
                    frame = os.read(key.fd, FRAME_BYTES)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if faults.loss and rng.random() < faults.loss:
                    faults.dropped += 1
                    continue
                at = time.monotonic()
                if faults.delay_s or faults.jitter_s:
                    at += max(0.0, faults.delay_s + rng.uniform(-faults.jitter_s, faults.jitter_s))
                n += 1
                heapq.heappush(due, (at, n, key.data, frame))


def main() -> None:
    outer, inner, netns = sys.argv[1:4]
    a = open_tap(outer)
    enter_netns(netns)
    b = open_tap(inner)
    faults, done = Faults(), threading.Event()
    loop = threading.Thread(target=copy_frames, args=(a, b, faults, done, random.Random(0)))
    loop.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            # The counts are of the faults set before this line.
            print(f"set {line.strip()} after forwarded {faults.forwarded} dropped {faults.dropped}", flush=True)
            faults.set(line)
            faults.forwarded = faults.dropped = 0
    done.set()
    loop.join()
    print(f"forwarded {faults.forwarded} dropped {faults.dropped}", flush=True)


if __name__ == "__main__":
    main()
