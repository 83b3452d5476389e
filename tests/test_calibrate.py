"""Decision temperatures fitted from labelled answers (`fleetctl calibrate`,
`POST /v1/models/{model}/calibration`, fleet.calibration).

The fit itself on synthetic scores with a known temperature; then a real daemon
serving a tiny random Llama (read by scoring) and a tiny random NLI cross-encoder,
both pulled with `--task decide`: the report's "before" must be the calibration
error of the answers `/v1/systemone` gave (so the raw scores the fit reads are the
ones the answers come from), and after `fleetctl calibrate` the very next answers
must carry the new temperatures (no reload, no restart), with `/v1/models` and
`fleetctl ps` saying where they came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet.calibration import answer_probs, ece, fit, fit_temperature
from tests.arch_models import encoder
from tests.conftest import start_daemon
from tests.gen_models import build_llama, pull

MODEL = "tiny-calibrated"
NLI = "tiny-nli-calibrated"
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
    "team": {"type": "choice", "instructions": "Which team handles it?",
             "criteria": {"billing": "Invoices and refunds", "technical": None, "sales": "Pricing"}},
    "mood": {"type": "score", "instructions": "How upset is the customer?",
             "criteria": ["calm", "annoyed", "angry", "furious"]},
}
STATES = [f"Ticket {i}: " + text for i, text in enumerate([
    "I was charged twice for March.", "The app crashes when I log in.", "How much is the team plan?",
    "Refund my order now, this is the third time I ask!", "Thanks, the fix works.", "Where is my invoice?",
    "Your API returns 500 since this morning.", "Can I get a discount for 50 seats?", "Cancel my subscription.",
    "The export button does nothing.", "I love the product, no complaints.", "Why was my card declined?",
    "Password reset mail never arrives.", "Do you offer a yearly price?", "I want my money back, today.",
    "The dashboard is slow.", "Please update my billing address.", "Is there an on-premise version?",
    "Your support never answers.", "The sync lost my files!", "Can I pay by bank transfer?",
    "Two-factor login fails.", "Upgrade me to enterprise.", "Charge reversed, thank you.",
])]


def test_the_fit_recovers_a_known_temperature_and_lowers_the_calibration_error():
    rng = np.random.default_rng(7)
    z = rng.normal(0, 3, size=(4000, 4))
    true_t = 0.5
    p = answer_probs(z, z, true_t)
    labels = (p.cumsum(axis=1) > rng.random((len(z), 1))).argmax(axis=1)
    t = fit_temperature(z, z, labels)
    assert abs(t - true_t) < 0.05, t
    # Answered at 1.0 the model is under-confident; at the fitted temperature it is not.
    fits, before, after = fit({"choice:3-5": list(zip(z, z, labels))}, {})
    assert fits[0].fitted and abs(fits[0].t_after - t) < 1e-6 and fits[0].t_before == 1.0
    assert after < 0.03 < before, (before, after)
    # Two orders that disagree average like the workers' answers do.
    assert np.allclose(answer_probs(z[:3], z[:3, ::-1], 1.0).sum(axis=1), 1.0)
    # A bucket with too few questions keeps its temperature.
    few, _, _ = fit({"noul:1-2": list(zip(z[:3, :2], z[:3, :2], labels[:3] % 2))}, {"noul:1-2": 0.7})
    assert not few[0].fitted and few[0].t_after == 0.7


def test_ece_is_zero_for_a_perfectly_calibrated_bin_and_counts_the_gap_otherwise():
    assert ece(np.full(10, 0.8), np.array([1] * 8 + [0] * 2)) == pytest.approx(0.0)
    assert ece(np.full(10, 0.9), np.zeros(10, dtype=bool)) == pytest.approx(0.9)


# ---- through a real daemon ------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("home")
    pull(home, build_llama(tmp_path_factory.mktemp("llama") / "model", max_positions=512), MODEL, "--task", "decide")
    pull(home, encoder("deberta-v2", "seq", tmp_path_factory.mktemp("nli") / "model",
                       labels=["contradiction", "neutral", "entailment"], max_position_embeddings=512),
         NLI, "--task", "decide")
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": f"{MODEL},{NLI}"})
    yield d
    d.stop()


def admin(d) -> dict[str, str]:
    return {"Authorization": f"Bearer {(d.home / 'admin.key').read_text().strip()}"}


def answers(d, model: str) -> list[dict]:
    out = []
    for state in STATES:
        r = httpx.post(d.url + "/v1/systemone", json={"model": model, "state": state, "questions": QUESTIONS},
                       timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["answers"])
    return out


def probs(answer: dict) -> np.ndarray:
    if answer["type"] == "noul":
        return np.array([answer["noul"], 1 - answer["noul"]])
    return np.array(list(answer["probabilities"].values()))


def own_labels(replies: list[dict]) -> list[dict]:
    """Each question labelled with the model's own top answer: right every time, so a
    well-calibrated model would be sure of it (a random model read in two option orders
    that disagree is not, at any temperature: the fit finds the best it can)."""
    labels = []
    for a in replies:
        labels.append({"refund": a["refund"]["noul"] >= 0.5, "team": a["team"]["choice"],
                       "mood": int(np.argmax(probs(a["mood"])))})
    return labels


def ece_of(replies: list[dict], labels: list[dict]) -> float:
    top, right = [], []
    for a, lab in zip(replies, labels):
        for qid, want in (("refund", 0 if lab["refund"] else 1), ("team", list(QUESTIONS["team"]["criteria"]).index(
                lab["team"])), ("mood", lab["mood"])):
            p = probs(a[qid])
            top.append(p.max())
            right.append(int(np.argmax(p)) == want)
    return ece(np.array(top), np.array(right))


def write_examples(path: Path, labels: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"state": s, "questions": QUESTIONS, "labels": lab}) + "\n"
                            for s, lab in zip(STATES, labels)))
    return path


def test_calibrate_reads_the_scores_the_answers_come_from_and_applies_the_fit_at_once(daemon, tmp_path):
    before = answers(daemon, MODEL)
    labels = own_labels(before)
    file = write_examples(tmp_path / "labelled.jsonl", labels)
    env = {**os.environ, "FLEET_HOME": str(daemon.home), "FLEET_URL": daemon.url}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "calibrate", MODEL, str(file), "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # "Before" is the error of the answers the route gave: the raw scores are theirs.
    assert report["ece_before"] == pytest.approx(ece_of(before, labels), abs=2e-4)
    assert report["questions"] == 3 * len(STATES)
    fitted = {b["key"]: b for b in report["buckets"]}
    assert set(fitted) == {"noul:1-2", "choice:3-5", "score:3-5"}
    for b in fitted.values():  # each bucket moved to its least NLL (1.0 was among the candidates)
        assert b["fitted"] and b["temperature_before"] == 1.0 and b["temperature_after"] != 1.0, b
        assert b["nll_after"] < b["nll_before"], b
    assert report["ece_after"] < report["ece_before"]
    assert report["live"] and report["written"] == str(daemon.home / "models.toml")
    assert f'[models."{MODEL}".calibration]' in (daemon.home / "models.toml").read_text()
    # Live at once: the next answers are the fitted ones (their error is the report's "after").
    after = answers(daemon, MODEL)
    assert ece_of(after, labels) == pytest.approx(report["ece_after"], abs=2e-4)
    assert all(not np.allclose(probs(a["team"]), probs(b["team"])) for a, b in zip(before, after))
    # Shown where they came from: the live profile, the model list, `fleetctl ps`.
    detail = httpx.get(f"{daemon.url}/v1/models/{MODEL}", timeout=10).json()
    view = detail["profiles"][0]
    assert view["decide_temperatures"] == report["temperatures"]
    assert view["calibration"]["source"] == "fleetctl calibrate"
    assert view["calibration"]["examples"] == len(STATES)
    cards = {m["id"]: m for m in httpx.get(daemon.url + "/v1/models", timeout=10).json()["data"]}
    assert cards[MODEL]["temperatures_live"] is True and cards[MODEL]["decide_temperatures"] == report["temperatures"]
    assert cards[NLI]["decide_temperatures"] == {} and cards[NLI]["calibration"] is None
    assert "decide_temperatures" not in detail or detail["task"] == "decide"
    ps = subprocess.run([sys.executable, "-m", "fleetctl", "ps"], env={**env, "COLUMNS": "120"},
                        capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0, ps.stderr
    assert "temperatures (from)" in ps.stdout and "fleetctl calibrate" in ps.stdout
    assert "never calibrated" in ps.stdout  # the NLI model


def test_the_nli_answerer_reads_the_same_raw_scores(daemon):
    before = answers(daemon, NLI)
    labels = own_labels(before)
    examples = [{"state": s, "questions": QUESTIONS, "labels": lab} for s, lab in zip(STATES, labels)]
    r = httpx.post(f"{daemon.url}/v1/models/{NLI}/calibration", json={"examples": examples, "write": False},
                   headers=admin(daemon), timeout=300)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["ece_before"] == pytest.approx(ece_of(before, labels), abs=2e-4)
    assert report["written"] is None and not report["live"]
    assert f'"{NLI}"' not in (daemon.home / "models.toml").read_text()


@pytest.mark.parametrize("body, status, words", [
    ({"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"nope": True}}]}, 400, "labels for no question"),
    ({"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"team": "marketing"}}]}, 400,
     "none of the options"),
    ({"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"refund": "yes"}}]}, 400, "true or false"),
    ({"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"mood": 9}}]}, 400, "level's index"),
    ({"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"mood": 1}, "extra": 1}]}, 400, "unknown field"),
    ({"examples": [], "write": True}, 400, "empty"),
    ({"examples": [], "typo": True}, 400, "typo"),
])
def test_a_bad_calibration_is_refused_and_changes_nothing(daemon, body, status, words):
    toml = (daemon.home / "models.toml").read_bytes() if (daemon.home / "models.toml").exists() else b""
    r = httpx.post(f"{daemon.url}/v1/models/{MODEL}/calibration", json=body, headers=admin(daemon), timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.text
    assert ((daemon.home / "models.toml").read_bytes() if (daemon.home / "models.toml").exists() else b"") == toml


def test_calibration_is_the_operators_and_for_decision_models_only(daemon):
    body = {"examples": [{"state": "x", "questions": QUESTIONS, "labels": {"mood": 1}}]}
    assert httpx.post(f"{daemon.url}/v1/models/{MODEL}/calibration", json=body, timeout=30).status_code == 401
    r = httpx.post(f"{daemon.url}/v1/models/no-such-model/calibration", json=body, headers=admin(daemon), timeout=30)
    assert r.status_code == 404, r.text
