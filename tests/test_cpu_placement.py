"""CPU placement: thread counts and pinning per device (pure table), and a real
daemon whose two CPU workers each compute on their own core."""

from __future__ import annotations

import os

import httpx
import pytest

from fleet.daemon.supervisor import Placement, place_on_cpus
from tests.conftest import start_daemon

CASES = [
    # (usable CPUs, devices, FLEET_CPU_THREADS) -> placement
    ([0, 1], ["cpu"], 0, Placement((), (((), 2),))),
    ([0, 1], ["cpu", "cpu"], 0, Placement((), (((0,), 1), ((1,), 1)))),
    ([0, 1, 2, 3], ["cpu"], 0, Placement((0,), (((1, 2, 3), 3),))),
    (list(range(8)), ["cpu", "cpu"], 0, Placement((0,), (((1, 2, 3, 4), 4), ((5, 6, 7), 3)))),
    (list(range(8)), ["cuda:0", "cpu", "cpu"], 0, Placement((0,), (((), 0), ((1, 2, 3, 4), 4), ((5, 6, 7), 3)))),
    (list(range(16)), ["cuda:0", "cuda:1"], 0, Placement((), (((), 0), ((), 0)))),
    ([0, 1], ["cpu"] * 3, 0, Placement((), (((), 1), ((), 1), ((), 1)))),
    ([0, 1], ["cpu", "cpu"], 2, Placement((), (((), 2), ((), 2)))),
    ([2, 3, 5, 7], ["cpu"], 0, Placement((2,), (((3, 5, 7), 3),))),
]


@pytest.mark.parametrize("cpus,devices,threads,want", CASES)
def test_place_on_cpus(cpus, devices, threads, want) -> None:
    assert place_on_cpus(cpus, devices, cpu_threads=threads) == want


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the placement checked here is the 2-CPU one")
def test_two_cpu_workers_each_compute_on_their_own_core(tmp_path) -> None:
    d = start_daemon(tmp_path / "home", extra_env={"FLEET_CPU_THREADS": "0"}, args=["--workers", "2"])
    try:
        ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
        slots = ps["slots"]
        cpus = sorted(os.sched_getaffinity(0))
        assert [(s["cpus"], s["threads"]) for s in slots] == [([cpus[0]], 1), ([cpus[1]], 1)]
        for s in slots:
            assert os.sched_getaffinity(s["pid"]) == set(s["cpus"])
            # Every thread of the worker (torch's too) took its pin.
            for tid in os.listdir(f"/proc/{s['pid']}/task"):
                assert os.sched_getaffinity(int(tid)) == set(s["cpus"])
        r = httpx.post(d.url + "/v1/embed", json={"inputs": ["hello"]}, timeout=60)
        assert r.status_code == 200
    finally:
        d.stop()
