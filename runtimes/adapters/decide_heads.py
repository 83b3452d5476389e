"""What the decision checkpoints with their own heads share (runtimes/adapters/decide_laya.py,
runtimes/adapters/decide_bev.py): a question read back into the parts their packages render
themselves, and the answer put into fleet's order with fleet's calibration over the
checkpoint's own.

A `DecideQuestion` carries each option as the line the causal LM reads ("name:
description", "Yes: what counts as yes"); a checkpoint trained on its package's
wording must read its package's lines instead ("level 2: ...", "<option>..."), so
the runtime takes the parts back out of the lines (`question_parts`): the daemon
rendered them by one rule (daemon/systemone.py), and it is undone here by the same.
Both packages list a noul's options false first, fleet's answers list yes first:
`fleet_order` turns one into the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.decisions import DecideQuestion, DecideRequest, decide_temperatures, temperature_key
from fleet.runtimes.adapters.decide import softmax


@dataclass(frozen=True)
class Parts:
    """One question as a package takes it: `keys` are the answer's keys in the
    package's option order (choice: the option names; score: "0".."n-1"; noul:
    "false", "true"), `descriptions` each option's text (None: none given; a score's
    levels are their text)."""

    kind: str
    instructions: str
    keys: list[str]
    descriptions: list[str | None]


def described(line: str, name: str) -> str | None:
    """The description in `line` ("name: description"), None where the line is the name alone.
    An empty description reads as none, as both packages read it."""
    return line[len(name) + 2 :] or None if len(line) > len(name) else None


def question_parts(q: DecideQuestion) -> Parts:
    if q.kind == "noul":
        yes, no = q.options
        return Parts("noul", q.text, ["false", "true"], [described(no, "No"), described(yes, "Yes")])
    if q.kind == "score":
        return Parts("score", q.text, [str(i) for i in range(len(q.options))], list(q.options))
    return Parts("choice", q.text, list(q.names), [described(line, name) for line, name in zip(q.options, q.names)])


def state_value(req: DecideRequest) -> Any:
    """The state as sent: text, or the object or array the daemon wrote as compact JSON
    (each package renders JSON its own way)."""
    return json.loads(req.state) if req.state_json else req.state


def fleet_order(kind: str, p: np.ndarray) -> np.ndarray:
    """A package's option order (noul: false, true) in fleet's (noul: yes, no)."""
    return p[::-1] if kind == "noul" else p


def answer(spec: Any, kind: str, logits: np.ndarray, shipped: float, raw: bool) -> np.ndarray:
    """One question's answer in fleet's order from its option logits in the package's:
    a softmax over the temperature fleet calibrated for its kind and option count
    (`fleetctl calibrate`), else the one the checkpoint ships (`shipped`); for a `raw`
    request the logits before any temperature, twice (the head reads one order)."""
    z = fleet_order(kind, logits.astype(np.float64))
    if raw:
        return np.tile(z, 2)
    t = float(decide_temperatures(spec).get(temperature_key(kind, len(z)), shipped))
    return softmax(z / t)
