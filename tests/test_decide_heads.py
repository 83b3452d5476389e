"""Decision checkpoints with their own heads (task `decide`): fleet's Laya runtime
(`laya`, runtimes/adapters/decide_laya.py) and bev-decider runtime (`bev`,
runtimes/adapters/decide_bev.py) against the real `laya` and `bev-decider` packages.

The references run in the isolated reference venv (scripts/setup_decide_ref.sh adds
them to GLiNER's, bench/.venv-gliner, whose transformers is older than fleet's) as a
subprocess, tests/decide_reference.py, which also builds the models: a tiny random checkpoint of
each family in its package's own layout (Laya's written by `laya.train.save_checkpoint`
with shipped temperatures, one of them below the package's floor; bev-decider's as
`bev_decider.load` reads it, bf16 weights). fleet pulls each folder with no task or
runtime given (recognised by its files) and serves it over HTTP; every probability
`/v1/systemone` answers must equal the package's own path on the same folder to
1e-5 (Laya's module-level rounding to 4 decimals is lifted in the reference so the
comparison sees what its path computes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import default_model_dir, start_daemon

ROOT = Path(__file__).resolve().parent.parent
REF_VENV = Path(os.environ.get("FLEET_DECIDE_REF_VENV", ROOT / "bench" / ".venv-gliner"))
REF_SCRIPT = Path(__file__).with_name("decide_reference.py")
TOL = 1e-5
FAMILIES = ("laya", "bev")

TICKET = "I was charged twice for my March invoice and the refund has not arrived. Fix it today."
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "angry": {"type": "noul", "instructions": "Is the customer angry?",
              "criteria": {"true": "They shout or threaten", "false": "They stay calm"}},
    "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
             "criteria": {"Billing": "Payments, invoices, refunds", "Technical": None, "Sales": "Pricing"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "medium", "high", "now"]},
    # Six levels: Laya's shipped 0.1 for this bucket is held to its floor, 0.5.
    "mood": {"type": "score", "instructions": "Mood?", "criteria": ["joy", "calm", "meh", "sad", "cross", "furious"]},
    # Twelve options overrun Laya's head budget (48 tokens): each is cut to 4.
    "queue": {"type": "choice", "instructions": "Which queue?",
              "criteria": {f"queue {i}": f"tickets about topic number {i}" for i in range(12)}},
}
JOBS = [
    {"state": TICKET, "questions": QUESTIONS},
    # JSON: each package renders it its own way (bev indented, Laya on one line).
    {"state": {"ticket": 7, "text": "Ça ne marche pas", "tags": ["x", 1.5], "ok": None},
     "questions": {k: QUESTIONS[k] for k in ("angry", "team", "urgency")}},
    # Laya reads its mask token in a state as a space.
    {"state": "the [MASK] box was broken", "questions": {k: QUESTIONS[k] for k in ("refund", "mood")}},
]


def ref_python() -> Path:
    """The reference venv's python with both packages, added on first use; skip (saying
    why) if they cannot be installed."""
    python = REF_VENV / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import laya.agent, bev_decider"],
                                           capture_output=True).returncode == 0:
        return python
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_decide_ref.sh"), str(REF_VENV)],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0 or not python.is_file():
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"the decision references could not be installed (scripts/setup_decide_ref.sh, "
                    f"needs PyPI): {why[0]}")
    return python


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    """family -> (its checkpoint folder, the package's answers to JOBS)."""
    base = tmp_path_factory.mktemp("decide-heads")
    done = subprocess.run([str(ref_python()), str(REF_SCRIPT), str(base), "--tokenizer", str(default_model_dir()),
                           "--corpus", str(ROOT / "bench" / "corpus.txt")], input=json.dumps(JOBS),
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    return {f: (base / f, answers[f]) for f in FAMILIES}


@pytest.fixture(scope="module")
def fleet(built, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("fleet-decide-heads")  # no catalog entry: a CPU serves them in float32
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for f in FAMILIES:  # no --task, no --runtime: the folder says what it is
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{built[f][0]}", "--name", f"tiny-{f}"],
                              env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join(f"tiny-{f}" for f in FAMILIES)})
    yield d
    d.stop()


def ask(d, family: str, job: dict) -> httpx.Response:
    return httpx.post(d.url + "/v1/systemone", json={"model": f"tiny-{family}", **job}, timeout=60)


def probabilities(answer: dict) -> dict[str, float]:
    return {"noul": answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]


def test_each_family_is_recognised_by_its_files(fleet):
    for f in FAMILIES:
        card = httpx.get(f"{fleet.url}/v1/models/tiny-{f}", timeout=30).json()
        assert (card["task"], card["runtime"], card["loaded"]) == ("decide", f, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_equal_the_package(fleet, built, family):
    replies = [ask(fleet, family, job) for job in JOBS]
    worst = 0.0
    for reply, want in zip(replies, built[family][1]):
        assert reply.status_code == 200, reply.text
        got = reply.json()["answers"]
        assert set(got) == set(want)
        for qid, answer in got.items():
            g, w = probabilities(answer), probabilities(want[qid])
            assert list(g) == list(w)
            diff = np.abs(np.array(list(g.values())) - np.array(list(w.values())))
            worst = max(worst, float(diff.max()))
            if answer["type"] == "choice":
                assert answer["choice"] == want[qid]["choice"]
    assert worst <= TOL
    # Not a coin toss: the tiny models' answers spread, so equality is evidence.
    spread = max(max(probabilities(a).values()) for a in replies[0].json()["answers"].values())
    assert spread > 0.4


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_do_not_move_with_other_questions(fleet, family):
    together = ask(fleet, family, JOBS[0]).json()["answers"]
    with ThreadPoolExecutor(4) as pool:
        alone = list(pool.map(lambda q: ask(fleet, family, {"state": TICKET, "questions": {q: QUESTIONS[q]}}),
                              list(QUESTIONS)))
    for qid, reply in zip(QUESTIONS, alone):
        g, w = probabilities(reply.json()["answers"][qid]), probabilities(together[qid])
        assert np.allclose(list(g.values()), list(w.values()), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_over_the_checkpoints_budget_is_413_and_fails_alone(fleet, family):
    """Laya reads 96 tokens a row, bev 160 of state: the package would cut the state; fleet refuses it."""
    long_state = " ".join(f"word{i}" for i in range(300))
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda s: ask(fleet, family, {"state": s, "questions": {"q": QUESTIONS["team"]}}),
                                [long_state, TICKET] * 2))
    assert [r.status_code for r in replies] == [413, 200] * 2
    assert replies[0].json()["detail"]["error_type"] == "input_too_long"


def test_an_option_over_bevs_limit_is_413_naming_the_option(fleet):
    """bev-decider reads 48 tokens an option (its config): the package would cut a longer one."""
    long = " ".join(f"word{i}" for i in range(40))
    r = ask(fleet, "bev", {"state": TICKET, "questions": {"q": {"type": "choice", "instructions": "Which?",
                                                                "criteria": {"a": long, "b": None}}}})
    assert r.status_code == 413 and "an option comes to" in r.json()["detail"]["message"]
    assert ask(fleet, "bev", {"state": TICKET, "questions": {"q": QUESTIONS["team"]}}).status_code == 200
