"""Commands to workers through their control lanes (protocol: fleet.control): which
worker should act on a model, and one command to one worker, answered like a request.

The admin routes (controllers.admin), the store's owner (daemon.owner), aliases and
Ollama's keep_alive all act on workers this way; the daemon never loads a model itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from fleet.control import LOAD, PIN, Command, CommandDone, control_lane, decode_done
from fleet.errors import BadRequest, Unavailable

from fleet.daemon import codec

if TYPE_CHECKING:
    from fleet.daemon.core import Daemon


def device_room(worker: dict[str, Any], workers: list[dict[str, Any]]) -> int:
    """Budget left on `worker`'s device: its budget minus what every worker of the device uses."""
    used = sum(w.get("used_bytes", 0) for w in workers if w["device"] == worker["device"])
    return worker.get("budget_bytes", 0) - used


def choose_worker(workers: list[dict[str, Any]], name: str, device: str | None) -> dict[str, Any]:
    """The worker that should hold `name`: one already holding it (on `device`
    if given), else the one of `device` (or of any device) with the most room."""
    live = [w for w in workers if w["up"]]
    if not live:
        raise Unavailable("no worker is up yet; retry in a moment")
    if device is not None:
        live = [w for w in live if w["device"] == device]
        if not live:
            devices = ", ".join(sorted({w["device"] for w in workers if w["up"]}))
            raise BadRequest(f"no worker runs on device {device!r} (workers run on: {devices})")
    holders = [w for w in live if name in w["models"]]
    if holders:
        return holders[0]
    return max(live, key=lambda w: (device_room(w, workers), -w["worker"]))


async def send(daemon: Daemon, worker: dict[str, Any], op: str, name: str) -> dict[str, Any]:
    """One command to one worker, through its control lane; its answer as a dict."""
    timeout_s = daemon.settings.load_timeout_ms / 1000.0 if op in (LOAD, PIN) else daemon.timeout_s(None)
    answer = await daemon.broker.submit(control_lane(worker["worker"]), codec.encode_msgpack(Command(op, name)),
                                        tokens=1, timeout_s=timeout_s)
    done: CommandDone = decode_done(bytes(answer.body))
    return {"worker": worker["worker"], **msgspec.structs.asdict(done)}


async def holders(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    return [w for w in await daemon.workers() if w["up"] and name in w["models"]]
