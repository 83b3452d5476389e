"""Promotion (issue 39, items 2-3): a candidate takes an alias only when an evaluation says
it is no worse, and a package records why.

On a real daemon at the shipped settings (tests/alias_models.py), with an evaluation file
labelled by tone-v1 itself:
- promoting `tone-worse` (tone-v1 with its labels swapped) over tone-v1 is refused 409
  `promotion_refused`, every metric's numbers for both versions in the message, the alias
  unchanged, the refused attempt's package kept and in the history;
- promoting `tone-same` (the same numbers) switches the alias and writes a package with the
  candidate's source, every file's sha256, licence, owner, both versions' metrics and the
  file's hash, the serving profile, the measured capacity and the rollback target; `fleetctl
  history` shows it, `fleetctl rollback` goes back and is recorded;
- `--force` promotes past a regression only with a reason, and the package says it was forced;
- the metrics themselves against hand-computed values (fleet.evaluation, pure).

Before: there was no promotion; a new version reached clients by a pull under a new name.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from fleet.evaluation import (
    classification_metrics, compare, expected_calibration_error, parse_eval, retrieval_metrics, span_f1,
)
from tests.alias_models import TEXTS


def eval_file(d) -> str:
    """TEXTS labelled as tone-v1 labels them: tone-v1 scores 1.0 on every metric but ECE."""
    r = httpx.post(d.url + "/v1/classify", json={"model": "tone-v1", "inputs": TEXTS, "top_k": 1}, timeout=60)
    lines = [json.dumps({"text": t, "label": row[0]["label"]}) for t, row in zip(TEXTS, r.json()["results"])]
    return "\n".join(lines) + "\n"


def promote(d, candidate: str, text: str, **extra) -> httpx.Response:
    return httpx.post(d.url + "/v1/promotions", json={"candidate": candidate, "alias": "support-tone", "eval": text,
                                                      "owner": "ml-team", **extra}, headers=d.admin, timeout=300)


def version(d) -> str:
    return httpx.get(d.url + "/v1/aliases/support-tone", timeout=30).json()["version"]


@pytest.fixture(scope="module")
def evaluation(tone_box) -> str:
    assert httpx.put(tone_box.url + "/v1/aliases/support-tone", json={"version": "tone-v1"}, headers=tone_box.admin,
                     timeout=120).status_code == 200
    return eval_file(tone_box)


def test_a_regressing_candidate_is_refused_with_both_versions_numbers(tone_box, evaluation) -> None:
    d = tone_box
    r = promote(d, "tone-worse", evaluation, reason="new labels")
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "promotion_refused"
    # Every metric that regressed, candidate vs current, with the numbers.
    assert "accuracy 0.0000 vs 1.0000" in error["message"]
    assert "macro_f1 0.0000 vs 1.0000" in error["message"]
    assert "support-tone still points at tone-v1" in error["message"]
    assert version(d) == "tone-v1"
    history = httpx.get(d.url + "/v1/aliases/support-tone/history", timeout=30).json()
    refused = history["events"][-1]
    assert refused["kind"] == "refused" and refused["version"] == "tone-v1"
    assert history["packages"][refused["package"]]["candidate_metrics"]["accuracy"] == 0.0
    # Forcing takes a reason, and says so in the package.
    r = promote(d, "tone-worse", evaluation, force=True)
    assert r.status_code == 400 and "reason" in r.json()["error"]["message"]
    assert version(d) == "tone-v1"


def test_a_candidate_no_worse_is_promoted_with_its_package_then_rolled_back(tone_box, evaluation,
                                                                             tmp_path) -> None:
    d = tone_box
    path = tmp_path / "eval.jsonl"
    path.write_text(evaluation)
    env = {"FLEET_URL": d.url, "FLEET_HOME": str(d.home), "PATH": "/usr/bin:/bin", "FLEET_OWNER": "ml-team"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    out = cli("promote", "tone-same", "--as", "support-tone", "--eval", str(path), "--json")
    assert out.returncode == 0, out.stderr
    package = json.loads(out.stdout)
    assert version(d) == "tone-same"
    assert package["kind"] == "promote" and package["owner"] == "ml-team" and not package["forced"]
    assert package["replaced"] == package["rollback_target"] == "tone-v1"
    facts = package["candidate"]
    stored = json.loads((d.home / "models" / "tone-same" / "manifest.json").read_text())
    assert facts["source"] == stored["source"] and facts["licence"] == "unknown"
    assert {f["path"]: f["sha256"] for f in facts["files"]} == {f["path"]: f["sha256"] for f in stored["files"]}
    ev = package["evaluation"]
    assert ev["file_sha256"] == hashlib.sha256(evaluation.encode()).hexdigest() and ev["lines"] == len(TEXTS)
    assert ev["candidate"] == ev["current"] and ev["candidate"]["accuracy"] == 1.0 and ev["regressions"] == []
    assert package["serving_profile"] and package["capacity"]["tokens"] > 0
    assert (d.home / "models" / ".promotions" / f"{package['id']}.json").is_file()
    history = cli("history", "support-tone")
    assert history.returncode == 0 and package["id"] in history.stdout and "accuracy 1.0000 (was 1.0000)" in \
        history.stdout.replace("\n", " ")
    back = cli("rollback", "support-tone", "--reason", "just checking")
    assert back.returncode == 0 and "support-tone -> tone-v1 (was tone-same)" in back.stdout
    assert version(d) == "tone-v1"
    events = httpx.get(d.url + "/v1/aliases/support-tone/history", timeout=30).json()["events"]
    assert [(e["kind"], e["version"]) for e in events[-2:]] == [("promote", "tone-same"), ("rollback", "tone-v1")]


def test_force_with_a_reason_promotes_past_a_regression_and_says_so(tone_box, evaluation) -> None:
    d = tone_box
    r = promote(d, "tone-worse", evaluation, force=True, reason="labels renamed on purpose")
    assert r.status_code == 200, r.text
    assert r.json()["forced"] and r.json()["evaluation"]["regressions"]
    assert version(d) == "tone-worse"
    assert httpx.post(d.url + "/v1/aliases/support-tone/rollback", json={}, headers=d.admin,
                      timeout=30).json()["alias"]["version"] == "tone-v1"


@pytest.mark.parametrize("text, words", [
    ("not json\n", "line 1: not JSON"),
    ('{"text": "a"}\n', "line 1: `label` must be a non-empty string"),
    ("\n\n", "no lines"),
])
def test_a_bad_evaluation_file_is_a_400_naming_its_line(tone_box, evaluation, text, words) -> None:
    r = promote(tone_box, "tone-same", text)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert version(tone_box) == "tone-v1"


def test_promoting_is_the_operators(tone_box, evaluation) -> None:
    r = httpx.post(tone_box.url + "/v1/promotions", json={"candidate": "tone-same", "alias": "support-tone",
                                                          "eval": evaluation}, timeout=30)
    assert r.status_code == 401


# ---- the metrics, by hand -------------------------------------------------------------------

def test_classification_metrics_and_calibration_error() -> None:
    gold = ["a", "a", "b", "b"]
    m = classification_metrics(gold, ["a", "b", "b", "b"], np.array([0.9, 0.6, 0.8, 0.7]))
    assert m["accuracy"] == 0.75
    # F1(a) = 2/3 (tp 1, fn 1), F1(b) = 0.8 (tp 2, fp 1).
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.8) / 2)
    # Bins: 0.6 (wrong), 0.7 (right), 0.8 (right), 0.9 (right): |0-.6| + |1-.7| + |1-.8| + |1-.9|, / 4.
    assert m["ece"] == pytest.approx((0.6 + 0.3 + 0.2 + 0.1) / 4)
    assert expected_calibration_error(np.array([1.0]), np.array([True])) == 0.0


def test_retrieval_metrics_by_hand() -> None:
    # Query 0: its relevant document ranks 1st; query 1: 3rd of three.
    m = retrieval_metrics([np.array([0.9, 0.1, 0.2]), np.array([0.9, 0.5, 0.1])], [[0, 1, 2], [0, 1, 2]],
                          [{0}, {2}])
    assert m["mrr"] == pytest.approx((1 + 1 / 3) / 2)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / np.log2(4)) / 2)


def test_span_f1_and_the_pairs_form() -> None:
    assert span_f1([{(0, 3, "ORG")}], [{(0, 3, "ORG"), (5, 7, "PER")}])["span_f1"] == pytest.approx(2 / 3)
    ev = parse_eval('{"query": "q1", "positive": "d1"}\n{"query": "q2", "positive": "d2"}\n'
                    '{"query": "q3", "positive": "d1"}\n', "embed")
    assert ev.documents == ["d1", "d2"] and ev.relevant == [{0}, {1}, {0}]
    assert compare({"accuracy": 0.8, "ece": 0.2}, {"accuracy": 0.85, "ece": 0.1}, 0.06) == ["ece 0.2000 vs 0.1000"]


def test_a_canary_promotion_keeps_the_version_until_promoted_whole(tone_box, evaluation) -> None:
    d = tone_box
    r = promote(d, "tone-same", evaluation, canary_percent=25)
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "canary" and r.json()["rollback_target"] is None
    alias = httpx.get(d.url + "/v1/aliases/support-tone", timeout=30).json()
    assert (alias["version"], alias["canary"], alias["canary_percent"]) == ("tone-v1", "tone-same", 25)
    r = promote(d, "tone-same", evaluation)
    assert r.status_code == 200 and r.json()["kind"] == "promote"
    alias = httpx.get(d.url + "/v1/aliases/support-tone", timeout=30).json()
    assert (alias["version"], alias["canary"], alias["previous"]) == ("tone-same", None, "tone-v1")
    assert httpx.post(d.url + "/v1/aliases/support-tone/rollback", json={}, headers=d.admin,
                      timeout=30).json()["alias"]["version"] == "tone-v1"


def test_an_embedder_is_evaluated_on_retrieval_pairs(tone_box, tmp_path) -> None:
    """nDCG@10 and MRR through the embed path: a copy of MiniLM against MiniLM itself."""
    d = tone_box
    assert httpx.post(d.url + "/api/copy", json={"source": "all-minilm-l6-v2", "destination": "minilm-next"},
                      headers=d.admin, timeout=60).status_code == 200
    assert httpx.put(d.url + "/v1/aliases/search-embed", json={"version": "all-minilm-l6-v2"}, headers=d.admin,
                     timeout=120).status_code == 200
    pairs = [("how do I reset my password", "Open settings, choose security, then reset the password."),
             ("where is my invoice", "Invoices are under billing, one per month."),
             ("cancel my subscription", "To cancel, open billing and end the plan."),
             ("the app crashes on start", "If the app crashes at launch, reinstall it.")]
    text = "".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in pairs)
    r = httpx.post(d.url + "/v1/promotions", json={"candidate": "minilm-next", "alias": "search-embed", "eval": text},
                   headers=d.admin, timeout=300)
    assert r.status_code == 200, r.text
    ev = r.json()["evaluation"]
    assert ev["metrics"] == ["ndcg@10", "mrr"] and ev["candidate"] == ev["current"]
    assert ev["candidate"]["mrr"] > 0.5  # MiniLM finds most of its answers first


@pytest.mark.parametrize("value", [0, -3, 2.5, "64", True, 1 << 21])
def test_a_generate_lines_max_tokens_is_a_positive_whole_number_or_a_400_naming_its_line(value) -> None:
    from fleet.errors import BadRequest

    line = '{"prompt": "hi", "expected": "x", "max_tokens": %s}\n'
    ev = parse_eval('{"prompt": "hi", "expected": "x"}\n' + line % 64, "generate")
    assert ev.max_tokens == [None, 64] and ev.line_numbers == [1, 2]
    with pytest.raises(BadRequest, match="evaluation line 2: `max_tokens` must be a whole number from 1 to"):
        parse_eval('{"prompt": "hi", "expected": "x"}\n' + line % json.dumps(value), "generate")
