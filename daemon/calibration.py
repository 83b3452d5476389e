"""`POST /v1/models/{model}/calibration`: fit a decision model's temperatures from
labelled examples, store them in its catalog entry and make them live (`fleetctl
calibrate`; fleet.calibration has the method).

Body: `{"examples": [...], "write": true, "file_sha256": "..."}`. An example is a
System One request without its model (`state`, `questions`) and `labels`: per
question id its right answer, `true`/`false` for a noul question, the option's name
for a choice, the level's index (or its text, when the levels are text) for a
score. A question without a label is not counted; a label for no question, or one
that names no option, is a 400 naming the example. Each example runs as one raw
decision request on the one request path (its scores before any temperature), at
most CONCURRENCY at a time, beside everyone else's traffic.

The fit replaces the temperature of each bucket with at least MIN_QUESTIONS
labelled questions and keeps the others. With `write` (the default) the result is
written to FLEET_HOME/models.toml (`[models."<name>".calibration]`) and every
worker holding the model takes it before the reply (the PROFILE command a SIGHUP
sends): the next answer uses it. The reply is the report either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import msgspec
import numpy as np

from fleet.calibration import MIN_QUESTIONS, Calibration, calibration_extra, fit
from fleet.catalog import load_catalog, manifest_entry, write_calibration
from fleet.decisions import temperature_key
from fleet.errors import BadRequest, FleetError

from fleet.daemon import systemone, tasks
from fleet.daemon.core import Daemon, live_profiles

#: Examples in flight at once: enough to fill micro-batches, few enough to leave room.
CONCURRENCY = 32
#: Most examples one calibration reads.
MAX_EXAMPLES = 20_000


class CalibrateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    examples: list[dict[str, Any]]
    write: bool = True
    #: The labelled file's sha256 (the CLI sends it); default: the examples' own.
    file_sha256: str | None = None


def labelled(example: dict[str, Any], i: int, model: str) -> tuple[systemone.Parsed, list[int | None]]:
    """An example checked: its parsed request, and per question its label's option index
    (None: not labelled)."""
    where = f"examples[{i}]"
    if not isinstance(example, dict):
        raise BadRequest(f"{where}: an example is an object with state, questions and labels")
    unknown = sorted(set(example) - {"state", "questions", "labels"})
    if unknown:
        raise BadRequest(f"{where}: unknown field(s) {', '.join(unknown)} (an example has state, questions, labels)")
    labels = example.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise BadRequest(f"{where}: `labels` must map question ids to their right answers")
    try:
        parsed = systemone.parse({"model": model, "state": example.get("state"), "questions": example.get("questions")})
    except systemone.Invalid as exc:
        raise BadRequest(f"{where}: {exc.message}") from None
    if parsed.unsupported:
        raise BadRequest(f"{where}: {parsed.unsupported}")
    if stray := sorted(set(labels) - set(parsed.ids)):
        raise BadRequest(f"{where}: labels for no question: {', '.join(map(repr, stray))}")
    indices: list[int | None] = []
    for qid, kind, keys, levels in zip(parsed.ids, parsed.kinds, parsed.names, parsed.levels):
        if qid not in labels:
            indices.append(None)
            continue
        indices.append(label_index(labels[qid], kind, keys, levels, f"{where}.labels.{qid}"))
    return parsed, indices


def label_index(value: Any, kind: str, keys: list[str], levels: list[Any], where: str) -> int:
    if kind == "noul":
        if isinstance(value, bool):
            return 0 if value else 1
        raise BadRequest(f"{where}: a noul question's label is true or false, not {value!r}")
    if kind == "choice":
        if isinstance(value, str) and value in keys:
            return keys.index(value)
        raise BadRequest(f"{where}: {value!r} is none of the options ({', '.join(keys)})")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(levels):
        return value
    if isinstance(value, str) and value in levels:
        return levels.index(value)
    raise BadRequest(f"{where}: a score label is a level's index (0-{len(levels) - 1}) or its text, not {value!r}")


def temperatures_now(daemon: Daemon, name: str, workers: list[dict[str, Any]]) -> dict[str, float]:
    """The temperatures `name` answers with now: a worker's live ones, else the catalog's;
    a LoRA adapter with none of its own answers at its base's (runtimes/adapters/decide.py)."""
    for view in live_profiles(workers, name):
        if view.decide_temperatures is not msgspec.UNSET:
            return dict(view.decide_temperatures)
    entry = load_catalog(daemon.settings.home).find(name)
    own = dict(calibration_extra(entry.calibration if entry is not None else None)["decide_temperatures"] or {})
    base = daemon.store.get(name).base
    return own if own or base is None else temperatures_now(daemon, base, workers)


async def calibrate(daemon: Daemon, name: str, req: CalibrateRequest) -> dict[str, Any]:
    manifest = daemon.store.get(name)
    if manifest.task != "decide" and not daemon.also_serves(manifest, "decide"):
        raise BadRequest(f"{name!r} serves {manifest.task!r}: only decision models and transformers generators have temperatures",
                         param="model")
    if not req.examples:
        raise BadRequest("`examples` is empty: send labelled examples (fleetctl calibrate MODEL FILE.jsonl)")
    if len(req.examples) > MAX_EXAMPLES:
        raise BadRequest(f"{len(req.examples)} examples is more than {MAX_EXAMPLES} in one calibration")
    checked = [labelled(ex, i, name) for i, ex in enumerate(req.examples)]
    if not any(x is not None for _, idx in checked for x in idx):
        raise BadRequest("no example labels any of its questions")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def scores(parsed: systemone.Parsed) -> np.ndarray:
        async with gate:
            res, _ = await tasks.decide(daemon, msgspec.structs.replace(parsed.request(name), raw=True))
        return np.frombuffer(res.probs, dtype="<f8")

    started = time.monotonic()
    raws = await asyncio.gather(*(scores(parsed) for parsed, _ in checked))
    groups: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {}
    for (parsed, indices), flat in zip(checked, raws):
        at = 0
        for q, label in zip(parsed.questions, indices):
            n = len(q.options)
            if label is not None and n > 1:
                groups.setdefault(temperature_key(q.kind, n), []).append((flat[at : at + n], flat[at + n : at + 2 * n],
                                                                          label))
            at += 2 * n
    before = temperatures_now(daemon, name, await daemon.workers())
    fits, ece_before, ece_after = fit(groups, before)
    after = {**before, **{f.key: round(f.t_after, 4) for f in fits if f.fitted}}
    report: dict[str, Any] = {
        "model": name, "examples": len(req.examples), "questions": sum(f.questions for f in fits),
        "seconds": round(time.monotonic() - started, 2), "min_questions": MIN_QUESTIONS,
        "ece_before": round(ece_before, 4), "ece_after": round(ece_after, 4),
        "buckets": [{"key": f.key, "questions": f.questions, "fitted": f.fitted,
                     "temperature_before": round(f.t_before, 4), "temperature_after": round(f.t_after, 4),
                     "nll_before": round(f.nll_before, 4), "nll_after": round(f.nll_after, 4),
                     "ece_before": round(f.ece_before, 4), "ece_after": round(f.ece_after, 4)} for f in fits],
        "temperatures": after, "written": None, "live": False,
    }
    if req.write and any(f.fitted for f in fits):
        digest = req.file_sha256 or hashlib.sha256(msgspec.json.encode(req.examples)).hexdigest()
        cal = Calibration(temperatures=after, source="fleetctl calibrate", calibrated_at=time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), file_sha256=digest, examples=len(req.examples),
            questions=report["questions"], ece_before=report["ece_before"], ece_after=report["ece_after"])
        try:
            entry = load_catalog(daemon.settings.home).find(name)
        except FleetError as exc:
            raise BadRequest(f"models.toml cannot be read, so the calibration was not written: {exc.message}") from None
        path = await asyncio.to_thread(write_calibration, daemon.settings.home, name, cal,
                                       new_entry=None if entry is not None else manifest_entry(manifest))
        await daemon.reprofile_workers()
        report["written"] = str(path)
        report["live"] = any(True for _ in live_profiles(await daemon.workers(), name))
    return report
