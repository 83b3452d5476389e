"""The machine's floor under the serving path: how long one process takes to wake another.

A lone client's request crosses four sleeping processes' wake-ups: client ->
API (TCP loopback), API -> worker (the queue's futex, local_queue/futex.py),
worker -> API (the results pipe), API -> client (TCP). Each is a process
asleep in the kernel, woken by another: on bare metal a few µs; on a VM whose
idle vCPU halts, an inter-processor interrupt to it and the hypervisor's
scheduling, tens to hundreds of µs. No code in fleet can take this part away,
so it is measured here, per mechanism, with the waker and the sleeper on
different CPUs (the case on a 2-core box: the other core is the idle one) and
on the same CPU.

Each round: the sleeper blocks; the waker idles `--gap-ms` (a lone client's
think time: the sleeper's CPU goes idle), stamps CLOCK_MONOTONIC and wakes it;
the sleeper stamps when it runs. Reported per mechanism and placement: p50 and
p90 µs from the wake call to the sleeper running, and the wake call's own µs.

Usage: flock /tmp/fleet-bench.lock python -m fleet.bench wakeups [--rounds 300] [--gap-ms 12]
       [--out bench/results/<time>-wakeups.json]
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import sys
import time

import numpy as np

from fleet.bench import report
from fleet.bench.cli import OUT, ROUNDS, bench, option
from fleet.local_queue import futex

#: Slots of the shared page: 0 the futex word, 1 the sleeper's stamp, 2 its round count.
WORD, STAMP, DONE = 0, 1, 2


def sleeper(kind: str, cpu: int | None, st: np.ndarray, addr: int, fd, rounds: int) -> None:
    """Block `rounds` times on `kind`; stamp each wake-up (the waker spins on DONE)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for i in range(rounds):
        if kind == "futex":
            while st[WORD] != i + 1:
                futex.wait(addr, int(st[WORD]), 1.0)
        elif kind == "pipe":
            os.read(fd, 1)
        else:
            fd.recv(1)
        st[STAMP] = time.monotonic_ns()
        st[DONE] = i + 1


def measure(kind: str, cpus: tuple[int, int] | None, rounds: int, gap_s: float) -> dict:
    """Wake-to-run and wake-call µs of `rounds` wake-ups by `kind` (futex, pipe, tcp);
    `cpus` (waker, sleeper) pins both, None leaves them to the scheduler."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    st = np.frombuffer(page, dtype=np.int64)
    addr = futex.low_word_address(memoryview(page), WORD * 8)
    ends: tuple = (None, None)
    if kind == "pipe":
        ends = os.pipe()
    elif kind == "tcp":
        with socket.create_server(("127.0.0.1", 0)) as srv:
            a = socket.create_connection(srv.getsockname())
            b, _ = srv.accept()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ends = (a, b)
    pid = os.fork()
    if pid == 0:
        try:
            sleeper(kind, cpus[1] if cpus else None, st, addr, ends[0] if kind == "pipe" else ends[1], rounds)
        finally:
            os._exit(0)
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    to_run, call = [], []
    try:
        for i in range(rounds):
            time.sleep(gap_s)
            t0 = time.monotonic_ns()
            if kind == "futex":
                st[WORD] = i + 1
                futex.wake_all(addr)
            elif kind == "pipe":
                os.write(ends[1], b"\1")
            else:
                ends[0].send(b"\1")
            t1 = time.monotonic_ns()
            while st[DONE] != i + 1:  # spin: a sleeping waker would add its own wake-up to the figure
                pass
            to_run.append(st[STAMP] - t0)
            call.append(t1 - t0)
    finally:
        os.waitpid(pid, 0)
        for end in ends:
            if isinstance(end, int):
                os.close(end)
            elif end is not None:
                end.close()
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    skip = min(20, rounds // 10)
    run_us, call_us = np.array(to_run[skip:]) / 1e3, np.array(call[skip:]) / 1e3
    return {"mechanism": kind, "placement": "scheduler" if cpus is None else
            ("same CPU" if cpus[0] == cpus[1] else "cross CPU"),
            "wake_to_run_us": {"p50": float(np.median(run_us)), "p90": float(np.percentile(run_us, 90))},
            "wake_call_us": {"p50": float(np.median(call_us)), "p90": float(np.percentile(call_us, 90))}}


@bench("wakeups", ROUNDS.but(default=300, help="wake-ups per mechanism and placement"),
       option("--gap-ms", type=float, default=12.0, help="the waker's idle before each wake-up"), OUT)
def main(args: argparse.Namespace) -> int:
    usable = sorted(os.sched_getaffinity(0))
    placements = [(usable[0], usable[1]), (usable[0], usable[0]), None] if len(usable) > 1 else [None]
    load_before = os.getloadavg()
    rows = [measure(kind, cpus, args.rounds, args.gap_ms / 1e3)
            for kind in ("futex", "pipe", "tcp") for cpus in placements]
    print(f"{'mechanism':10s} {'placement':10s} {'wake->run p50':>14s} {'p90':>8s} {'wake call p50':>14s}")
    for r in rows:
        print(f"{r['mechanism']:10s} {r['placement']:10s} {r['wake_to_run_us']['p50']:12.1f}us "
              f"{r['wake_to_run_us']['p90']:6.1f}us {r['wake_call_us']['p50']:12.1f}us")
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    doc = report.document("wakeups", "fleet.bench", args.argv) | {
        "settings": {"rounds": args.rounds, "gap_ms": args.gap_ms},
        "load_before": load_before, "load_after": load_after, "rows": rows}
    out = report.save(doc, args.out, "wakeups")
    print(f"results: {out}", file=sys.stderr)
    return 0
