"""Typed decisions across boxes: two real `fleetctl serve --nats` boxes on one real
nats-server, at the shipped settings. Box B stores a tiny random Llama twice, as a
decision model (`--task decide`) and as a generator; box A stores neither. A decision
asked of box A goes through JetStream to box B (`X-Served-By` names it) and answers
as one box does: as box B asked directly, and as each question's own full sequences
run alone (tests/decide_plain.py, the reference tests/test_decide.py holds one box
to), for the decision model and for the generator that reads decisions from its own
weights (box B's heartbeat names it in `decides`).

Box B also stores a peft LoRA adapter of the generator. Asked of box A, by its own
name (`model`) or as the generator's `adapter`, a generation and a decision answer
200 as box B's own answer, run by box B in the generator's lane with the adapter
attached (and not as the generator alone: the adapter really changes the answer).
With a box C that stores the generator but not the adapter, box B's own requests for
its adapter are all answered by box B: they are queued under the adapter's name, which
only box B pulls, not in the generator's, which box C pulls too.

Before: nothing sent a decision through NATS; a generator stored on another box was
refused as "serves task 'generate'". An adapter stored only on box B was queued there
under its own name, and box B's worker answered 500 ("no runtime adapter for task
generate with runtime peft"); as the generator's `adapter` box A answered 404. Box B
queued its own adapter requests under the generator's name, and box C took some of them
and failed them (it cannot attach an adapter it does not store).
"""

from __future__ import annotations

import time
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DaemonProc, start_daemon, wait_until_ready
from tests.gen_models import build_llama, build_lora, pull
from tests.nats_fixture import NatsServer, nats_server  # noqa: F401 (a fixture)
from tests.test_decide import ALL, TICKET, plain_forward, vector

pytestmark = pytest.mark.nats

MODEL = "tiny-decider"
GENERATOR = "tiny-generator"
ADAPTER = "tiny-generator-style"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("decider") / "model", max_positions=2048)


@pytest.fixture(scope="module")
def two_boxes(nats_server: NatsServer, folder: Path,  # noqa: F811
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    root = tmp_path_factory.mktemp("decide-boxes")
    pull(root / "box-b", folder, MODEL, "--task", "decide")
    pull(root / "box-b", folder, GENERATOR)
    pull(root / "box-b", build_lora(folder, root / "style", seed=41), ADAPTER, "--base", GENERATOR)
    started = [start_daemon(root / box, wait_ready=False, extra_env={
        "FLEET_NATS": nats_server.url, "FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1"})
        for box in ("box-a", "box-b")]
    try:
        for d in started:
            wait_until_ready(d)
        yield started[0], started[1]
    finally:
        for d in started:
            d.stop()


@pytest.fixture(scope="module")
def base_only_box(two_boxes, nats_server: NatsServer, folder: Path,  # noqa: F811
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """Box C: the generator alone, no adapter of it; pulling in the same JetStream as box B."""
    home = tmp_path_factory.mktemp("decide-boxes") / "box-c"
    pull(home, folder, GENERATOR)
    c = start_daemon(home, extra_env={
        "FLEET_NATS": nats_server.url, "FLEET_BOX": "box-c", "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1"})
    try:
        end = time.monotonic() + 60  # until box B has read box C's heartbeat: it pulls the generator's work
        while not any(e["box"] == "box-c" for e in httpx.get(two_boxes[1].url + "/v1/cluster", timeout=10).json()["boxes"]):
            assert time.monotonic() < end
            time.sleep(0.5)
        yield c
    finally:
        c.stop()


def decide(d: DaemonProc, model: str) -> httpx.Response:
    return httpx.post(d.url + "/v1/systemone", json={"model": model, "state": TICKET, "questions": ALL}, timeout=120)


@pytest.mark.parametrize("model", [MODEL, GENERATOR])
def test_a_decision_through_another_box_answers_as_one_box(two_boxes, folder: Path, model: str) -> None:
    a, b = two_boxes
    end = time.monotonic() + 60
    while (via_a := decide(a, model)).status_code == 404:  # until box A has read box B's heartbeat
        assert time.monotonic() < end, via_a.text
        time.sleep(0.5)
    assert via_a.status_code == 200, via_a.text
    assert via_a.headers["x-served-by"].startswith("box-b/") and via_a.json()["model"] == model
    at_b = decide(b, model)
    assert at_b.status_code == 200, at_b.text
    reference = plain_forward(folder, TICKET)
    for q in ALL:
        assert np.abs(vector(via_a.json()["answers"][q]) - vector(at_b.json()["answers"][q])).max() <= 1e-5, q
        assert np.abs(vector(via_a.json()["answers"][q]) - reference[q]).max() <= 1e-5, q


def through_a(a: DaemonProc, route: str, body: dict) -> httpx.Response:
    """`body` posted to box A once box A has read box B's heartbeat (404 until then)."""
    end = time.monotonic() + 60
    while (r := httpx.post(a.url + route, json=body, timeout=120)).status_code == 404:
        assert time.monotonic() < end, r.text
        time.sleep(0.5)
    return r


@pytest.mark.parametrize("named", [{"model": ADAPTER}, {"model": GENERATOR, "adapter": ADAPTER}],
                         ids=["as-model", "as-adapter"])
def test_an_adapter_on_another_box_generates_as_on_its_own_box(two_boxes, named: dict) -> None:
    a, b = two_boxes
    body = {**named, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.0}
    via_a = through_a(a, "/v1/generate", body)
    assert via_a.status_code == 200, via_a.text
    assert via_a.headers["x-served-by"].startswith("box-b/")
    at_b = httpx.post(b.url + "/v1/generate", json=body, timeout=120)
    assert at_b.status_code == 200, at_b.text
    alone = {k: v for k, v in body.items() if k != "adapter"} | {"model": GENERATOR}
    base = httpx.post(b.url + "/v1/generate", json=alone, timeout=120)
    assert base.status_code == 200, base.text
    assert via_a.json()["text"] == at_b.json()["text"] != base.json()["text"]


def test_an_adapter_on_another_box_decides_as_on_its_own_box(two_boxes) -> None:
    a, b = two_boxes
    via_a = through_a(a, "/v1/systemone", {"model": ADAPTER, "state": TICKET, "questions": ALL})
    assert via_a.status_code == 200, via_a.text
    assert via_a.headers["x-served-by"].startswith("box-b/")
    at_b, base = decide(b, ADAPTER), decide(b, GENERATOR)
    assert at_b.status_code == 200 and base.status_code == 200, (at_b.text, base.text)
    own = [np.abs(vector(via_a.json()["answers"][q]) - vector(at_b.json()["answers"][q])).max() for q in ALL]
    apart = [np.abs(vector(at_b.json()["answers"][q]) - vector(base.json()["answers"][q])).max() for q in ALL]
    assert max(own) <= 1e-5 and max(apart) > 1e-3, (own, apart)


def test_an_adapter_runs_only_on_a_box_that_stores_it(two_boxes, base_only_box) -> None:
    _, b = two_boxes
    bodies = [{"model": ADAPTER, "prompt": f"request {i} of the quick brown fox", "max_tokens": 4,
               "temperature": 0.0} for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda body: httpx.post(b.url + "/v1/generate", json=body, timeout=120), bodies))
    assert [(r.status_code, r.headers.get("x-served-by", "")[:6]) for r in replies] == [(200, "box-b/")] * 12, \
        [r.text for r in replies if r.status_code != 200]
