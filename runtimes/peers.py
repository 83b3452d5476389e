"""The other workers of this daemon, as one worker's residency deals with them.

Apart from the residency (runtimes.residency), which owns this worker's models:
every peer owns its own (STYLE.md 5), so all a worker does with them is read what
they publish (their info blobs in the worker table, runtimes.info: what they hold,
load and use) and ask (an `evict` command in a peer's control lane, fleet.control),
then read again. A peer whose heartbeat is older than PEER_STALE_NS is not counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import msgspec

from fleet.control import EVICT, Command, control_lane
from fleet.local_queue import QueueFull
from fleet.runtimes.footprint import Footprint
from fleet.runtimes.memory import IDLE_NAP_S, PEER_STALE_NS, NotNow, ResidentView

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode
_decode_info = msgspec.msgpack.Decoder().decode

#: A worker asks a peer to evict one model at most once per this many seconds.
PEER_ASK_S = 1.0
#: How long an explicit load waits for asked peers to drop their idle models.
PEER_EVICT_WAIT_S = 2.0


class PeersAsked(NotNow):
    """Idle models of other workers of this device hold the room; their holders were asked to evict them."""

    def __init__(self, message: str, victims: tuple[tuple[int, str], ...]) -> None:
        super().__init__(message)
        self.victims = victims


class Peers(NamedTuple):
    """What the other live workers publish, as a load decision reads it (runtimes.placement.DeviceSnapshot)."""

    #: The models resident on this worker's device, held by peers.
    residents: tuple[ResidentView, ...]
    #: model -> the peer of this device loading it now.
    loading: dict[str, int]
    #: (wid, decoded info) of every other live worker, every device.
    infos: tuple[tuple[int, dict], ...]
    #: Every other device's room: its largest published budget less what its workers use (bytes).
    room: dict[str, int]


def read_peers(queue: Any, worker_id: int, device: str, waiting: dict[str, int]) -> Peers:
    """One read of the worker table: the other live workers' info blobs, this device's
    peers' models as the policy sees them (`waiting`: model -> items queued for it)."""
    peers: list[ResidentView] = []
    loading: dict[str, int] = {}
    infos: list[tuple[int, dict]] = []
    budget: dict[str, int] = {}
    used: dict[str, int] = {}
    now = time.monotonic_ns()
    for w in queue.workers():
        if w.wid == worker_id or not w.info or now - w.last_heartbeat_ns > PEER_STALE_NS:
            continue
        info = _decode_info(w.info)
        infos.append((w.wid, info))
        if w.device != device:
            budget[w.device] = max(budget.get(w.device, 0), int(info.get("budget_bytes", 0)))
            used[w.device] = used.get(w.device, 0) + int(info.get("used_bytes", 0))
            continue
        act = int(info.get("activation_bytes", 0))
        for n, m in info.get("models", {}).items():
            peers.append(ResidentView(n, w.wid, Footprint(int(m.get("bytes", 0)), act), bool(m.get("pinned")),
                                      float(m.get("last_used", 0.0)), float(m.get("load_ms", 0.0)) / 1e3,
                                      waiting.get(n, 0), float(m.get("loaded_at", 0.0))))
        if info.get("loading"):
            loading[info["loading"]] = w.wid
    return Peers(tuple(peers), loading, tuple(infos), {d: budget[d] - used[d] for d in budget})


def peer_infos(queue: Any, worker_id: int) -> list[tuple[int, dict]]:
    """(wid, decoded info) of the other live workers, every device."""
    now = time.monotonic_ns()
    return [(w.wid, _decode_info(w.info)) for w in queue.workers()
            if w.wid != worker_id and w.info and now - w.last_heartbeat_ns <= PEER_STALE_NS]


def peers_used_bytes(queue: Any, worker_id: int, device: str) -> int:
    """What the other live workers of `device` publish as used (their cache reserves included)."""
    now = time.monotonic_ns()
    return sum(int(_decode_info(w.info).get("used_bytes", 0)) for w in queue.workers()
               if w.wid != worker_id and w.device == device and w.info
               and now - w.last_heartbeat_ns <= PEER_STALE_NS)


def ask_peers_to_evict(queue: Any, asked: dict[tuple[int, str], int], victims: tuple[tuple[int, str], ...], *,
                       now_ns: int, device: str) -> None:
    """Put an `evict` command into each holder's control lane (fleet.control): the
    holder drops the model only if it is still idle and unpinned. Asked at most once
    per PEER_ASK_S for one (worker, model) (`asked`: when each was last asked,
    clock ns); the reply goes to request id 0, which no caller waits on."""
    for wid, model in victims:
        if now_ns - asked.get((wid, model), -(1 << 62)) < PEER_ASK_S * 1e9:
            continue
        asked[(wid, model)] = now_ns
        log.info("asking worker %d of %s to evict idle %s", wid, device, model)
        try:
            queue.put(queue.lane_id(control_lane(wid)), _encode(Command(EVICT, model)), tokens=1, request_id=0)
        except QueueFull as exc:  # asked again on a later attempt; the lane waits meanwhile
            log.warning("cannot ask worker %d to evict %s: %s", wid, model, exc.message)


def await_peer_evictions(queue: Any, worker_id: int, victims: tuple[tuple[int, str], ...]) -> None:
    """Wait up to PEER_EVICT_WAIT_S for the asked peers to publish their models gone."""
    deadline = time.monotonic() + PEER_EVICT_WAIT_S
    while time.monotonic() < deadline:
        infos = dict(peer_infos(queue, worker_id))
        if not any(m in infos.get(w, {}).get("models", {}) for w, m in victims):
            return
        time.sleep(IDLE_NAP_S)
