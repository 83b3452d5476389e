"""The load decision as a table: one `DeviceSnapshot` in, one verdict out (runtimes.placement)."""

from __future__ import annotations

import pytest

from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import ResidentView
from fleet.runtimes.placement import (
    ASK_PEERS, ELSEWHERE, LOAD, TOO_LARGE, WAIT, DeviceSnapshot, LaneDemand, decide_load,
)
from fleet.runtimes.policy import LinearCost

MB = 1 << 20
NOW_S = 1000.0
NOW_NS = 50_000_000_000
WAIT_NS = 2_000_000_000


def r(name: str, mb: int, worker: int = 1, *, pinned: bool = False, waiting: int = 0, last_used: float = 0.0,
      loaded_at: float = 0.0, reload_s: float = 0.0) -> ResidentView:
    return ResidentView(name, worker, Footprint(mb * MB), pinned, last_used, reload_s, waiting, loaded_at)


def lane(depth: int, *, waited_s: float = 0.1, tokens: int = 100) -> LaneDemand:
    return LaneDemand(depth, tokens, NOW_NS - int(waited_s * 1e9))


def snap(own=(), peers=(), *, budget_mb=100, free_mb=1 << 20, demand=None, loading=None, infos=(), room=None,
         own_costs=None, behind_s=None) -> DeviceSnapshot:
    """`behind_s`: model -> seconds its lane has been behind at every look."""
    behind = {m: NOW_NS - int(s * 1e9) for m, s in (behind_s or {}).items()}
    return DeviceSnapshot(1, "cuda:0", budget_mb * MB, free_mb * MB, tuple(own), tuple(peers), loading or {},
                          tuple(infos), room or {}, demand or {"x": lane(1)}, own_costs or {}, NOW_NS, NOW_S,
                          WAIT_NS, behind)


def holder_info(model: str, *, samples: int = 10, a_ms: float = 1.0, b_per_1k: float = 1.0,
                load_ms: float = 500.0) -> dict:
    return {"models": {model: {"load_ms": load_ms,
                               "cost": {"a_ms": a_ms, "b_ms_per_1k_tokens": b_per_1k, "samples": samples}}}}


X = Footprint(30 * MB)

CASES = [
    # (case, snapshot, explicit, expected kind, expected evict, expected peer evictions)
    ("fits: load", snap(), False, LOAD, (), ()),
    ("evicts own idle, least recently used first",
     snap([r("a", 40, last_used=2), r("b", 40, last_used=1)]), False, LOAD, ("b",), ()),
    ("a peer of the device is loading it", snap(loading={"x": 2}), False, ELSEWHERE, (), ()),
    ("a peer of the device holds it and keeps up", snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 60)]), False,
     ELSEWHERE, (), ()),
    ("a peer holds it but the lane starves: a second copy that fits",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 60)], demand={"x": lane(5, waited_s=3)}), False, LOAD, (), ()),
    ("the lane starves but the holder has only just loaded it",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 1)], demand={"x": lane(5, waited_s=3)}), False, ELSEWHERE, (), ()),
    ("rent or buy: behind at every look for longer than the holder's load took: a copy",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 60, reload_s=2.0)], demand={"x": lane(16, waited_s=1.5)},
          behind_s={"x": 2.5}), False, LOAD, (), ()),
    ("rent or buy: behind for less than a load: the holder's",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 60, reload_s=2.0)], demand={"x": lane(16, waited_s=1.5)},
          behind_s={"x": 1.5}), False, ELSEWHERE, (), ()),
    ("rent or buy: behind since before the holder finished loading counts from then",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 1, reload_s=2.0)], demand={"x": lane(16, waited_s=1.5)},
          behind_s={"x": 10}), False, ELSEWHERE, (), ()),
    ("rent or buy: an unmeasured load counts as UNMEASURED_LOAD_MS",
     snap(peers=[r("x", 30, 2, loaded_at=NOW_S - 60)], demand={"x": lane(16, waited_s=1.5)},
          behind_s={"x": 0.6}), False, LOAD, (), ()),
    ("rent or buy: a copy that would evict is not bought",
     snap([r("a", 50)], [r("x", 30, 2, loaded_at=NOW_S - 60, reload_s=2.0)], demand={"x": lane(16, waited_s=1.5)},
          behind_s={"x": 10}), False, ELSEWHERE, (), ()),
    ("a second copy never evicts",
     snap([r("a", 50)], [r("x", 30, 2, loaded_at=NOW_S - 60)], demand={"x": lane(5, waited_s=3)}), False,
     ELSEWHERE, (), ()),
    ("explicit: a peer holds it", snap(peers=[r("x", 30, 2)]), True, ELSEWHERE, (), ()),
    ("herd: another device's holder keeps up with a short queue", snap(infos=[(7, holder_info("x"))]), False,
     ELSEWHERE, (), ()),
    ("herd: a long queue is worth a copy",
     snap(infos=[(7, holder_info("x"))], demand={"x": lane(50, tokens=1_000_000)}), False, LOAD, (), ()),
    ("herd: a starving lane is served whatever holds it",
     snap(infos=[(7, holder_info("x"))], demand={"x": lane(1, waited_s=3)}), False, LOAD, (), ()),
    ("herd: with no published fit, this worker's own fit sizes the queue",
     snap(infos=[(7, holder_info("x", samples=0))], demand={"x": lane(50, tokens=1_000_000)},
          own_costs={"x": LinearCost(1.0, 0.001)}), False, LOAD, (), ()),
    ("herd does not apply to an explicit load", snap(infos=[(7, holder_info("x"))]), True, LOAD, (), ()),
    ("another device has room: do not evict here",
     snap([r("a", 80)], room={"cuda:1": 50 * MB}), False, ELSEWHERE, (), ()),
    ("another device has room but nothing is evicted here: load", snap(room={"cuda:1": 50 * MB}), False, LOAD,
     (), ()),
    ("own busier model holds the room: wait", snap([r("a", 80, waiting=4)]), False, WAIT, (), ()),
    ("explicit evicts own busy models", snap([r("a", 80, waiting=4)]), True, LOAD, ("a",), ()),
    ("an idle model of a peer holds the room: ask it",
     snap(peers=[r("p", 80, 2)]), False, ASK_PEERS, (), ((2, "p"),)),
    ("only as many peer models as needed, in eviction order",
     snap(peers=[r("p", 40, 2, last_used=5), r("q", 40, 3, last_used=1)]), False, ASK_PEERS, (), ((3, "q"),)),
    ("own idle models go before asking peers",
     snap([r("a", 40)], [r("p", 40, 2)]), False, LOAD, ("a",), ()),
    ("a busy model of a peer holds the room: wait", snap(peers=[r("p", 80, 2, waiting=3)]), False, WAIT, (), ()),
    ("pinned models leave no room: too large", snap([r("a", 80, pinned=True)]), False, TOO_LARGE, (), ()),
    ("a peer's pinned model leaves no room: too large", snap(peers=[r("p", 80, 2, pinned=True)]), False,
     TOO_LARGE, (), ()),
    ("bigger than the whole budget", snap(budget_mb=20), False, TOO_LARGE, (), ()),
]


@pytest.mark.parametrize("case,snapshot,explicit,kind,evict,peers", CASES, ids=[c[0] for c in CASES])
def test_decide_load(case, snapshot, explicit, kind, evict, peers):
    verdict = decide_load(snapshot, "x", X, explicit=explicit)
    assert (verdict.kind, verdict.evict, verdict.evict_peers) == (kind, evict, peers), verdict.reason


def test_verdicts_that_are_not_a_load_say_why():
    assert "worker 2" in decide_load(snap(loading={"x": 2}), "x", X).reason
    assert "a (worker 2, 4 waiting)" in decide_load(snap(peers=[r("a", 80, 2, waiting=4)]), "x", X).reason
    too_large = decide_load(snap([r("a", 80, pinned=True)]), "x", X).reason
    assert "x needs 30.0 MiB" in too_large and "a (80.0 MiB, pinned)" in too_large


def test_the_same_snapshot_gives_the_same_verdict():
    s = snap(peers=[r("p", 40, 2, last_used=5), r("q", 40, 3, last_used=1)])
    assert decide_load(s, "x", X) == decide_load(s, "x", X)
