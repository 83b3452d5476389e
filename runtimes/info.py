"""The worker's info blob: what the daemon (`/v1/ps`, metrics, readiness) and the
other workers (load decisions, runtimes.placement) read about this worker.

Written whole by its worker into its record of the queue's worker table
(`LocalQueue.set_worker_info`), at most INFO_BYTES of MessagePack.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import msgspec

from fleet.local_queue.queue import INFO_BYTES
from fleet.runtimes.policy import CostModel
from fleet.runtimes.residency import Residency
from fleet.runtimes.state import BatchStats

_encode = msgspec.msgpack.Encoder().encode


def decision_info(spec: Any) -> dict[str, Any]:
    """A decision model's live temperatures and where they came from (fleet.calibration);
    nothing for other tasks."""
    if spec.task != "decide":
        return {}
    return {"decide_temperatures": spec.extra.get("decide_temperatures") or {},
            "calibration": spec.extra.get("calibration")}


def worker_info(residency: Residency, costs: dict[str, CostModel], last_batch: BatchStats, batch_seq: int,
                batch_ring: deque) -> dict:
    models = residency.models
    return {
        "device": residency.device,
        "budget_bytes": residency.memory.budget_bytes,
        "used_bytes": residency.used_bytes(),
        "activation_bytes": max((r.footprint.activation_bytes for r in models.values()), default=0),
        "loading": residency.loading,
        "loading_since_ns": residency.loading_since_ns,
        "models": {
            name: {
                "task": r.adapter.spec.task,
                "dtype": r.adapter.dtype,
                "profile": r.adapter.spec.extra.get("profile", "default"),  # tuned device class or "default"
                # The live settings (a SIGHUP may have changed them since the load) and each one's
                # source (fleet.catalog.PROFILE_SOURCES).
                "settings": dataclasses.asdict(r.adapter.spec.profile),
                "profile_from": r.adapter.spec.extra.get("profile_from", {}),
                "bytes": r.weights_shown() + r.adapter.reserved_bytes(),  # cache reserve included
                "loaded_at": r.loaded_at,
                "last_used": r.last_used,
                "served": r.served,
                "tokens": r.tokens,
                "micro_batches": r.micro_batches,
                "dropped": r.dropped,  # items left unfinished between micro-batches: nobody waited
                "interjected": r.interjected,  # other clients' items run between micro-batches
                "load_ms": round(r.load_ms, 1),
                "pinned": name in residency.pinned,
                "cost": cost_info(costs.get(name)),
                "loras": r.adapter.attached_loras(),  # LoRA adapters attached to it (runtimes.lora)
                **engine_info(r.adapter),
                **decision_info(r.adapter.spec),
            }
            for name, r in models.items()
        },
        "last_batch": {
            "model": last_batch.model,
            "items": last_batch.items,
            "tokens": last_batch.tokens,
            "padded": last_batch.padded,
            "ms": round(last_batch.ms, 2),
            "at": last_batch.at,
            "returned": last_batch.returned,
            "loras": last_batch.loras,
            **({"prompt_tokens": last_batch.prompt_tokens, "generated_tokens": last_batch.generated_tokens}
               if last_batch.prompt_tokens or last_batch.generated_tokens else {}),
        },
        "loads": residency.loads,
        "unservable": residency.unservable,  # pins this worker was to keep and cannot: name -> why
        "evictions": residency.evictions,
        "batches": batches_info(batch_seq, batch_ring),
    }


def engine_info(adapter) -> dict:
    """What runs the model's forward and how it was chosen (runtimes/adapters/engines.py), whether
    it replays a traced graph (runtimes/adapters/traced.py), up to what size a forward runs on one
    thread (runtimes/adapters/threads.py), and a forward's fixed cost in tokens, where
    micro-batches cut (`Adapter.fixed_tokens`); {} when none applies."""
    out = {}
    if getattr(adapter, "fixed_tokens", None) is not None:
        out["fixed_tokens"] = round(adapter.fixed_tokens)
    if adapter.choice is not None:
        out["engine"] = adapter.choice.info()
    if (why := getattr(adapter, "traced_why", None)) is not None:
        compiled = adapter.compiled
        out["forward"] = compiled.info() if compiled is not None else {"traced": False, "why": why[:160]}
    threads = getattr(adapter, "threads", None)
    if threads is not None:
        out["threads"] = {"threads": threads.full, "one_thread_up_to_tokens": threads.small_tokens}
    return out


def batches_info(batch_seq: int, batch_ring: deque) -> dict:
    """The batch ring, compact (the whole blob must fit INFO_BYTES): model names
    once, then flat [model index, items, tokens] triples, oldest first; `seq` is
    the number of batches run so far (the last entry's sequence)."""
    names: dict[str, int] = {}
    flat: list[int] = []
    for model, items, tokens in batch_ring:
        flat += (names.setdefault(model, len(names)), items, tokens)
    return {"seq": batch_seq, "models": list(names), "ring": flat}


def cost_info(cost: CostModel | None) -> dict:
    if cost is None:
        return {"a_ms": 0.0, "b_ms_per_1k_tokens": 0.0, "samples": 0}
    a, b = cost.fit()
    return {"a_ms": round(a, 3), "b_ms_per_1k_tokens": round(b * 1e3, 3), "samples": cost.samples}


#: What a resident model's entry keeps when the whole blob does not fit INFO_BYTES:
#: what the daemon and the peers act on (placement's bytes, costs and load times,
#: pins) and what `fleetctl ps` lists per model; the settings, the engine verdict and
#: the counters go first.
SUMMARY = ("task", "dtype", "bytes", "loaded_at", "last_used", "served", "tokens", "load_ms", "pinned", "cost",
           "loras")


def encode_info(info: dict, residency: Residency) -> bytes:
    """`info` as MessagePack within INFO_BYTES."""
    blob = _encode(info)
    if len(blob) <= INFO_BYTES:
        return blob
    # Too many resident models for the worker record: each keeps its SUMMARY; then
    # names only, most recently used first, as many as fit (the batch must not fail).
    info["models"] = {name: {k: m[k] for k in SUMMARY if k in m} for name, m in info["models"].items()}
    blob = _encode(info)
    if len(blob) <= INFO_BYTES:
        return blob
    models = residency.models
    names = sorted(models, key=lambda n: models[n].last_used, reverse=True)
    while True:
        info["models"] = {name: {} for name in names}
        blob = _encode(info)
        if len(blob) <= INFO_BYTES:
            break
        if not names:  # what is left to cut: the reasons of unservable pins (their names stay)
            info["unservable"] = dict.fromkeys(info["unservable"], "")
            return _encode(info)
        names.pop()
    return blob
