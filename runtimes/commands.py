"""This worker's control lane: admin commands (fleet.control) applied to its residency.

The daemon's admin routes, and peers of the device asking for room
(`Residency.ask_peers_to_evict`), put `Command`s into `ctl:<worker>`; the step
loop serves them before any lane (`serve_control`), each acked with a
`CommandDone` or a `WorkError` as soon as it is done. A load or pin whose load
runs beside serving while other work waits (runtimes.loading) keeps its claim
(the heartbeat renews it) and is answered when the load settles (`settle`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec

from fleet.control import CONTROL_BATCH, EVICT, LOAD, OPS, PIN, PROFILE, UNLOAD, UNPIN, Command, CommandDone
from fleet.control import decode_command as _decode_command
from fleet.errors import BadRequest, FleetError
from fleet.messages import STATUS_ERROR, STATUS_OK, Envelope, WorkError
from fleet.runtimes.base import Adapter
from fleet.runtimes.loading import LoadRuns, PendingLoad
from fleet.runtimes.memory import NotNow
from fleet.runtimes.peers import PeersAsked
from fleet.runtimes.residency import Residency

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode


def serve_control(queue, lane: int, residency: Residency, *, lease_ms: int, served_by: str) -> int:
    """Handle the commands queued in this worker's control `lane` (protocol:
    fleet.control), each acked as soon as it is done. Returns items answered."""
    claims = queue.claim(lane, worker=residency.worker_id, max_items=CONTROL_BATCH, max_tokens=1 << 30,
                         lease_ms=lease_ms)
    for c in claims:
        answer(queue, residency, c.item_id, c.payload, time.perf_counter(), served_by=served_by)
    return len(claims)


def settle(queue, residency: Residency, *, served_by: str) -> None:
    """Once per step: settle the load that ran beside serving if it is done
    (`Residency.settle_load`), then answer the commands that waited for a load."""
    residency.settle_load()
    while residency.settled:
        load = residency.settled.pop(0)
        for item_id, cmd, started in load.waiters:
            answer(queue, residency, item_id, cmd, started, served_by=served_by, waited=load)


def answer(queue, residency: Residency, item_id: int, cmd: bytes | Command, started: float, *, served_by: str,
           waited: PendingLoad | None = None) -> None:
    """Apply one command (`started`: perf_counter when claimed) and ack it, unless its
    load runs beside serving now: then it waits for that load (`settle`)."""
    try:
        cmd = cmd if isinstance(cmd, Command) else _decode_command(cmd)
        body = apply_command(residency, cmd, started, waited)
        status = STATUS_OK
    except LoadRuns as runs:
        runs.load.waiters.append((item_id, cmd, started))
        return
    except FleetError as exc:
        body, status = WorkError(exc.code, exc.message), STATUS_ERROR
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        body, status = WorkError("bad_request", f"undecodable control command: {exc}"), STATUS_ERROR
    except NotNow as exc:
        body, status = WorkError("overloaded", f"{exc}; retry shortly"), STATUS_ERROR
    except Exception as exc:  # the worker stays up; the caller learns why
        log.exception("control command failed")
        body, status = WorkError("internal", f"{type(exc).__name__}: {exc}"), STATUS_ERROR
    queue.ack_many([(item_id, _encode(Envelope(0.0, 0.0, served_by, body)), status)])


def apply_command(residency: Residency, cmd: Command, started: float | None = None,
                  waited: PendingLoad | None = None) -> CommandDone:
    """Apply one control command to this worker's models. `waited`: the load the
    command waited for (its model's: the load's outcome is the command's)."""
    name, op, device = cmd.model, cmd.op, residency.device
    if op in (LOAD, PIN):
        evicted: list[str] = []
        if waited is not None and waited.name == name:
            if waited.error is not None:
                raise waited.error
            was, evicted = False, list(waited.evicted)
        else:
            was = name in residency.models
        t0 = time.perf_counter() if started is None else started
        try:
            resident = residency.ensure(name, pin=op == PIN, explicit=True, evicted=evicted)
        except PeersAsked as asked:
            # An operator is waiting: give the peers a moment to drop their idle
            # models (they serve their control lanes every step), then try once more.
            residency.await_peer_evictions(asked.victims)
            resident = residency.ensure(name, pin=op == PIN, explicit=True, evicted=evicted)
        ms = 0.0 if was else (time.perf_counter() - t0) * 1e3
        return CommandDone(op, name, device, True, name in residency.pinned, resident.footprint.weights_bytes,
                           round(ms, 1), evicted, was)
    if op == UNLOAD:
        if name in residency.pinned:
            raise BadRequest(f"{name} is pinned on {device}; unpin it first (fleetctl unpin {name})")
        return CommandDone(op, name, device, False, already=not residency.unload(name))
    if op == EVICT:
        return residency.evict_if_idle(name)
    if op == UNPIN:
        was = residency.unpin(name)
        resident = residency.models.get(name)
        return CommandDone(op, name, device, resident is not None, False,
                           resident.footprint.weights_bytes if resident else 0, already=not was)
    if op == PROFILE:
        return CommandDone(op, name, device, bool(residency.models), changed=reprofile(residency))
    raise BadRequest(f"unknown control op {op!r} (known: {', '.join(OPS)})")


def reprofile(residency: Residency) -> list[str]:
    """Give each resident model the profile its catalog entry names now (a tuned profile
    written while serving, an edited models.toml): the worker reads `spec.profile` at
    every batch, so batch settings apply from the next one; the weights keep the engine
    and dtype they were loaded in until the next load (the change says so). Returns what
    changed, per model."""
    if residency.profile_of is None:
        return []
    changed = []
    for name, r in residency.models.items():
        spec = r.adapter.spec
        try:
            profile, which, sources, calibration = residency.profile_of(name)
        except FleetError as exc:
            # This model's entry or manifest cannot be read now (its files left the store
            # while it was resident): it keeps its profile, the others still get theirs.
            log.warning("reload: %s keeps its profile: %s", name, exc.message)
            continue
        if calibration != {k: spec.extra.get(k) for k in calibration}:
            # Decision temperatures apply from the next batch (runtimes/adapters/decide.py reads them per batch).
            spec = r.adapter.spec = dataclasses.replace(spec, extra={**spec.extra, **calibration})
            temps = calibration["decide_temperatures"] or {}
            changed.append(f"{name}: decision temperatures " +
                           (", ".join(f"{k} {v:g}" for k, v in temps.items()) or "1.0 (no calibration)"))
        changed += recalibrate_loras(residency, r.adapter)
        if profile == spec.profile and which == spec.extra.get("profile") and sources == spec.extra.get("profile_from"):
            continue
        diffs = [f"{k} {getattr(spec.profile, k)} -> {getattr(profile, k)}"
                 for k in profile.__dataclass_fields__ if getattr(profile, k) != getattr(spec.profile, k)]
        if later := [k for k in ("engine", "dtype") if getattr(profile, k) != getattr(spec.profile, k)]:
            diffs.append(f"({' and '.join(later)} at the next load)")
        r.adapter.spec = dataclasses.replace(spec, profile=profile,
                                             extra={**spec.extra, "profile": which, "profile_from": sources})
        changed.append(f"{name}: profile {which}" + (": " + ", ".join(diffs) if diffs else ""))
    if changed:
        residency.publish()
    return changed


def recalibrate_loras(residency: Residency, adapter: Adapter) -> list[str]:
    """The LoRA adapters attached to `adapter` take their entries' calibration now
    (a decision adapter answers at its own temperatures when it has them: runtimes/adapters/decide.py)."""
    bank = getattr(adapter, "loras", None)
    changed = []
    for name, attached in (bank.attached.items() if bank is not None else ()):
        try:
            calibration = residency.profile_of(name)[3]
        except FleetError as exc:
            log.warning("reload: LoRA adapter %s keeps its calibration: %s", name, exc.message)
            continue
        if calibration != {k: attached.extra.get(k) for k in calibration}:
            attached.extra = {**attached.extra, **calibration}
            temps = calibration["decide_temperatures"] or {}
            changed.append(f"{name}: decision temperatures " +
                           (", ".join(f"{k} {v:g}" for k, v in temps.items()) or "its base's (no calibration)"))
    return changed
