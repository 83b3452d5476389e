"""Where a model loads: one pure decision over one look at the device.

A worker that wants a model it does not hold takes one `DeviceSnapshot`
(its own models, its peers' models and loads, free memory, what waits in
every lane, the clocks), under its device's load lock, and calls
`decide_load` once; `runtimes.worker` applies the verdict (STYLE.md 3).

Verdicts, by scope (who they are about):

* `LOAD` (after evicting `evict`, this worker's own models): here, now.
* `ELSEWHERE`: another worker serves this model (it holds or is loading it,
  or the herd rule leaves it to its holders, or another device has room
  without evicting). Not here; the requests stay queued for that worker, and
  this one may block until new work comes or the lane would starve.
* `WAIT`: here, but not now: the room is held by models with more waiting
  requests (their queues drain first). The requests stay queued.
* `ASK_PEERS`: here, once the idle models in `evict_peers` ((worker, model)
  pairs, other workers of this device) are gone: this worker asks their
  holders through their control lanes and waits.
* `TOO_LARGE`: never on this device, even with every unpinned model of every
  worker gone: the model's requests are answered `model_too_large`.

Units: bytes; monotonic ns for lane waits, wall seconds for `loaded_at`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import (
    EXPLICIT_DEMAND, TOO_LARGE, WAIT, ResidentView, eviction_order, fits_on_device, plan_load, too_large_reason,
)
from fleet.runtimes.policy import UNMEASURED_LOAD_MS, LinearCost, find_copies, should_load_copy

LOAD, ELSEWHERE, ASK_PEERS = "load", "elsewhere", "ask_peers"
__all__ = ["LOAD", "ELSEWHERE", "WAIT", "ASK_PEERS", "TOO_LARGE", "DeviceSnapshot", "LaneDemand", "LoadVerdict",
           "decide_load", "find_peer_models_to_evict"]


@dataclass(frozen=True)
class LaneDemand:
    """What waits in one model's lane."""

    depth: int = 0
    tokens: int = 0
    oldest_enqueue_ns: int = 0


@dataclass(frozen=True)
class DeviceSnapshot:
    """Everything one load decision reads, taken at one moment by one worker."""

    worker: int
    device: str
    budget_bytes: int
    #: Free memory on the device right now (other processes use it too).
    free_now_bytes: int
    #: This worker's resident models, and those of the other live workers of this device.
    own: tuple[ResidentView, ...] = ()
    peers: tuple[ResidentView, ...] = ()
    #: model -> worker id, for loads the other workers of this device have announced.
    peer_loading: Mapping[str, int] = field(default_factory=dict)
    #: (worker id, decoded info blob) of the other live workers, every device (the herd rule reads them).
    infos: tuple[tuple[int, dict], ...] = ()
    #: Other devices of this daemon -> bytes free in their budgets.
    room_elsewhere: Mapping[str, int] = field(default_factory=dict)
    #: model -> its lane now (models with nothing queued may be absent).
    demand: Mapping[str, LaneDemand] = field(default_factory=dict)
    #: This worker's own batch-cost fits (model -> LinearCost), used while no holder has published one.
    own_costs: Mapping[str, LinearCost] = field(default_factory=dict)
    now_ns: int = 0
    now_s: float = 0.0
    max_wait_ns: int = 2_000_000_000
    #: model -> since when (monotonic ns) its lane has been behind (`runtimes.policy.behind`:
    #: the interactive head waited past the batch target) at every look this worker took.
    behind_since: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadVerdict:
    kind: str
    #: LOAD: this worker's models to evict first, in order.
    evict: tuple[str, ...] = ()
    #: ASK_PEERS: (worker id, model) of idle peer models whose eviction makes room.
    evict_peers: tuple[tuple[int, str], ...] = ()
    reason: str = ""


def starving(demand: LaneDemand | None, snap: DeviceSnapshot) -> bool:
    return demand is not None and demand.depth > 0 and snap.now_ns - demand.oldest_enqueue_ns > snap.max_wait_ns


def replica_wanted(demand: LaneDemand | None, held: ResidentView, snap: DeviceSnapshot) -> bool:
    """A second copy on one device helps only when its holder cannot keep up:

    * the lane starves although the holder has been serving for a whole wait bound
      (a backlog left by the first load drains without one); or
    * rent or buy: since the holder loaded it, the lane has been behind at every
      look for as long as a load of the model takes (`behind_since`). The waiting has
      then cost what a copy costs, and a holder behind that long stays behind: a
      steady closed-loop load whose head waits seconds but never starves, while
      this worker of the same device idles (issue 27: two workers of one thread
      under a 16-connection flood, the second one held nothing all along).
    Either way the copy must fit without evicting (`decide_load` 2)."""
    serving_s = snap.now_s - held.loaded_at
    if starving(demand, snap) and serving_s > snap.max_wait_ns / 1e9:
        return True
    since = snap.behind_since.get(held.name)
    if since is None:
        return False
    behind_s = min((snap.now_ns - since) / 1e9, serving_s)
    return behind_s >= (held.reload_s or UNMEASURED_LOAD_MS / 1e3)


def copy_wanted(name: str, demand: LaneDemand | None, snap: DeviceSnapshot) -> bool:
    """The herd rule for a model this worker does not hold: a starving lane is served
    anyway (choose_lane 1); an empty one only where no other worker has the model;
    otherwise `should_load_copy` over the copies the other workers publish, with the
    batch cost a holder fitted (this worker's own fit while no holder has one)."""
    copies = find_copies(snap.infos, name)
    if demand is None or demand.depth == 0:
        return copies.holders == 0
    if starving(demand, snap):
        return True
    cost = copies.cost if copies.cost is not None else snap.own_costs.get(name)
    return should_load_copy(demand.tokens, copies.holders, cost, copies.load_ms)


def find_peer_models_to_evict(snap: DeviceSnapshot, incoming: Footprint, own_left: list[ResidentView]
                              ) -> tuple[tuple[int, str], ...] | None:
    """The idle, unpinned models of other workers of this device whose eviction (with
    `own_left`, this worker's models after its own evictions) makes room for
    `incoming`, fewest first in eviction order; None when even all of them do not."""
    idle = sorted((r for r in snap.peers if not r.pinned and r.waiting == 0), key=eviction_order)
    left = own_left + list(snap.peers)
    free = snap.free_now_bytes + sum(r.footprint.weights_bytes for r in snap.own if r not in own_left)
    chosen: list[tuple[int, str]] = []
    for victim in idle:
        if fits_on_device(snap.budget_bytes, free, left, incoming, snap.worker):
            break
        left.remove(victim)
        free += victim.footprint.weights_bytes
        chosen.append((victim.worker, victim.name))
    return tuple(chosen) if chosen and fits_on_device(snap.budget_bytes, free, left, incoming, snap.worker) else None


def decide_load(snap: DeviceSnapshot, name: str, estimate: Footprint, *, explicit: bool = False) -> LoadVerdict:
    """Should this worker load `name` (which it does not hold), and what must go first?

    `explicit`: an operator asked (load / pin through the control lane): the
    herd rule does not apply and this worker's busy unpinned models may go.

    1. Another worker of this device is loading it: ELSEWHERE (never two loads of one model at once).
    2. Another worker of this device holds it: ELSEWHERE, unless that holder cannot keep
       up (`replica_wanted`) and a copy fits without evicting.
    3. Lazy loads follow the herd rule across devices (`copy_wanted`): ELSEWHERE when
       the workers holding it keep up with its queue.
    4. Memory (`plan_load` over the whole device): LOAD after evicting this worker's
       least useful models; ELSEWHERE for a lazy load that would evict here while another
       device has room; WAIT when this worker's busier models hold the room.
    5. Not enough even then: ASK_PEERS when idle models of other workers of this device
       hold the room; WAIT when their busy ones do; TOO_LARGE only when the budget or
       the device's free memory cannot take it with every unpinned model gone.
    """
    demand = snap.demand.get(name)
    # 1.
    if name in snap.peer_loading:
        return LoadVerdict(ELSEWHERE, reason=f"{name} is being loaded by worker {snap.peer_loading[name]} "
                                             f"of {snap.device}")
    # 2.
    held = next((v for v in snap.peers if v.name == name), None)
    if held is not None:
        if explicit or not replica_wanted(demand, held, snap):
            return LoadVerdict(ELSEWHERE, reason=f"{name} is resident on worker {held.worker} of {snap.device}")
        plan = plan_load(name, held.footprint, list(snap.own + snap.peers), worker=snap.worker, device=snap.device,
                         budget_bytes=snap.budget_bytes, free_now_bytes=snap.free_now_bytes)
        if plan.verdict != LOAD or plan.evict:
            return LoadVerdict(ELSEWHERE, reason=f"no room for a second copy of {name} without evicting; "
                                                 f"worker {held.worker} serves it")
        return LoadVerdict(LOAD)
    # 3.
    if not explicit and not copy_wanted(name, demand, snap):
        return LoadVerdict(ELSEWHERE, reason=f"{name} is held or being loaded by other workers, which keep up "
                                             "with its queue")
    # 4.
    residents = list(snap.own + snap.peers)
    waiting = EXPLICIT_DEMAND if explicit else (demand.depth if demand is not None else 0)
    plan = plan_load(name, estimate, residents, worker=snap.worker, device=snap.device,
                     budget_bytes=snap.budget_bytes, free_now_bytes=snap.free_now_bytes, incoming_waiting=waiting)
    if plan.verdict == LOAD:
        if plan.evict and not explicit:
            roomy = next((d for d in sorted(snap.room_elsewhere) if snap.room_elsewhere[d] >= estimate.total_bytes),
                         None)
            if roomy is not None:
                return LoadVerdict(ELSEWHERE, reason=f"{roomy} has room for {name} without evicting; its worker "
                                                     "loads it")
        return LoadVerdict(LOAD, plan.evict)
    if plan.verdict == WAIT:
        return LoadVerdict(WAIT, reason=plan.reason)
    # 5. plan_load moves only this worker's models; the device's other workers hold the rest.
    own_left = [r for r in snap.own if r.pinned]
    peers_ask = find_peer_models_to_evict(snap, estimate, own_left)
    if peers_ask is not None:
        names = ", ".join(f"{m} (worker {w})" for w, m in peers_ask)
        return LoadVerdict(ASK_PEERS, evict_peers=peers_ask,
                           reason=f"{name} waits for idle models of other workers to be evicted: {names}")
    movable = [r for r in residents if not r.pinned]
    fixed = [r for r in residents if r.pinned]
    free_all = snap.free_now_bytes + sum(r.footprint.weights_bytes for r in movable)
    if movable and fits_on_device(snap.budget_bytes, free_all, fixed, estimate, snap.worker):
        busy = ", ".join(f"{r.name} (worker {r.worker}, {r.waiting} waiting)" for r in movable if r.waiting)
        return LoadVerdict(WAIT, reason=f"{name} waits for room held by busier models: {busy}")
    return LoadVerdict(TOO_LARGE, reason=too_large_reason(name, estimate, fixed, device=snap.device,
                                                          budget_bytes=snap.budget_bytes, free_now_bytes=free_all))
