"""Typed decisions (`POST /v1/systemone`, task `decide`) end to end: a real daemon
serving a tiny random Llama pulled with `--task decide`, driven over HTTP by the
official `typesafe-sdk`, judged by the `jevcompat` conformance suite, and checked
against a plain forward of the same folder (the prompt as runtimes/adapters/decide.py
documents it, each question's full sequence run alone, no cache). Beside it, a
tiny random DeBERTa-v3 NLI classifier pulled the same way (runtime `nli`), checked
against transformers' zero-shot classification pipeline on its folder; and a peft
LoRA of the Llama, pulled with it as its base, checked against the same plain forward
of its weights merged into the base.

One daemon serves the whole module (a few seconds to start; the models load at start),
with an API key, which every client sends as it would to the original server (so the
conformance suite also runs its auth checks).
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.arch_models import encoder
from tests.conftest import start_daemon
from tests.decide_plain import PlainForward
from tests.gen_models import build_llama, build_lora, pull

MODEL = "tiny-decider"
NLI = "tiny-nli"
LORA = "tiny-decider-lora"
GENERATOR = "tiny-generator"
GENERATOR_LORA = "tiny-generator-lora"
KEY = "decide-test-key-3f9a2c41b7e8"
AUTH = {"Authorization": f"Bearer {KEY}"}
TICKET = "I was charged twice for my March invoice and the refund has not arrived. Fix it today."
NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?",
        "criteria": {"true": "They want a refund"}}
CHOICE = {"type": "choice", "instructions": "Which team should handle this ticket?",
          "criteria": {"Billing": "Payments, invoices, refunds", "Technical": None, "Sales": "Pricing"}}
SCORE = {"type": "score", "instructions": {"scale": "frustration"},
         "criteria": ["Calm", "Frustrated", {"label": "Very angry"}, "Furious"]}
#: More options than the 26 single-token labels: read by each option's likelihood.
MANY = {"type": "choice", "instructions": "Which queue?",
        "criteria": {f"Queue {i:02d}": None for i in range(30)}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2048 positions: a 26-option question with descriptions is listed in full.
    return build_llama(tmp_path_factory.mktemp("decider") / "model", max_positions=2048)


@pytest.fixture(scope="module")
def nli_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encoder("deberta-v2", "seq", tmp_path_factory.mktemp("nli") / "model",
                   labels=["contradiction", "neutral", "entailment"], max_position_embeddings=512)


@pytest.fixture(scope="module")
def lora_folder(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora(folder, tmp_path_factory.mktemp("decider-lora") / "adapter", seed=3)


@pytest.fixture(scope="module")
def daemon(folder: Path, nli_folder: Path, lora_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("home")
    pull(home, folder, MODEL, "--task", "decide")
    pull(home, nli_folder, NLI, "--task", "decide")
    pull(home, lora_folder, LORA, "--base", MODEL)  # its task is its base's: decide
    pull(home, folder, GENERATOR)  # the same weights as a generator
    pull(home, lora_folder, GENERATOR_LORA, "--base", GENERATOR)  # the same adapter, of the generator
    # Two decision models: jev-latest is the configured one.
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": f"{MODEL},{NLI}", "FLEET_DEFAULT_MODELS": f"decide={MODEL}",
                                      "FLEET_API_KEY": KEY}, wait_ready=False)
    deadline = time.time() + 300
    while not ready(d):  # readiness needs the key too
        assert time.time() < deadline, d.tail()
        time.sleep(0.3)
    yield d
    d.stop()


def ready(d) -> bool:
    try:
        return httpx.get(d.url + "/readyz", headers=AUTH, timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def ask(d, questions: dict, state=TICKET, **extra) -> httpx.Response:
    return post(d, {"model": "jev-latest", "state": state, "questions": questions, **extra})


def post(d, body: dict) -> httpx.Response:
    return httpx.post(d.url + "/v1/systemone", json=body, headers=AUTH, timeout=60)


def vector(answer: dict) -> np.ndarray:
    if answer["type"] == "noul":
        return np.array([answer["noul"]])
    return np.array(list(answer["probabilities"].values()))


# ---- the official SDK and the conformance suite ---------------------------------------------

def test_official_sdk_calls_work_unchanged(daemon):
    from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

    with TypeSafeClient(api_key=KEY, base_url=daemon.url) as client:
        r = client.system_one(state={"document": TICKET}, questions={
            "refund": Noul(instructions=NOUL["instructions"], criteria=NOUL["criteria"]),
            "team": Choice(instructions=CHOICE["instructions"], criteria=CHOICE["criteria"]),
            "anger": Score(instructions="How frustrated is the customer?", criteria=SCORE["criteria"])})
        listed = client.models.list()
    assert r.model == MODEL  # jev-latest resolved: the reply names the model that answered
    assert r.usage.output_tokens == 0 and r.usage.input_tokens > 0
    assert 0 <= r.nouls["refund"].noul <= 1
    team = r.choices["team"]
    assert set(team.probabilities) == set(CHOICE["criteria"])
    assert math.isclose(sum(team.probabilities.values()), 1, abs_tol=1e-9)
    assert team.choice == max(team.probabilities, key=team.probabilities.get)
    p = np.array(list(team.probabilities.values()))
    assert math.isclose(team.confidence, (p.max() - 1 / 3) / (1 - 1 / 3), abs_tol=1e-9)
    anger = r.scores["anger"]
    assert anger.legend == dict(enumerate(SCORE["criteria"]))
    assert math.isclose(anger.score, sum(i * q for i, q in anger.probabilities.items()), abs_tol=1e-9)
    assert [m.name for m in listed.models] == ["jev-latest", MODEL, GENERATOR, NLI]


def test_jevcompat_musts_and_shoulds_pass(daemon):
    from jevcompat.runner import run

    report = run(daemon.url, key=KEY, timeout=60)
    failed = {r.id: [f.message for f in r.findings] for r in report.results if r.status == "fail"}
    assert not failed
    assert report.verdict == "conformant", report.summary()
    # With a key every requirement applies but auth.ignored-when-off (the one for servers without one).
    skipped = {r.id for r in report.results if r.status == "skip"}
    assert skipped == {"auth.ignored-when-off"}, skipped


# ---- semantics: a question never sees another ------------------------------------------------

def test_answers_do_not_move_with_other_questions(daemon):
    alone = {name: vector(ask(daemon, {"q": q}).json()["answers"]["q"])
             for name, q in (("refund", NOUL), ("team", CHOICE), ("anger", SCORE), ("queue", MANY))}
    together = ask(daemon, {"refund": NOUL, "team": CHOICE, "anger": SCORE, "queue": MANY}).json()["answers"]
    reordered = ask(daemon, {"Q 🙂": MANY, "x.y": SCORE, "team": CHOICE, "zz": NOUL}).json()["answers"]
    renamed = {"refund": "zz", "team": "team", "anger": "x.y", "queue": "Q 🙂"}
    for name, p in alone.items():
        assert np.abs(vector(together[name]) - p).max() <= 1e-5, name
        assert np.abs(vector(reordered[renamed[name]]) - p).max() <= 1e-5, name


def plain_forward(folder: Path, state: Any, model: Any = None) -> dict[str, np.ndarray]:
    """The answers to NOUL, CHOICE, SCORE and MANY (as "refund", "team", "anger",
    "queue") on `state` that each question's own full sequences give, run alone
    without a cache (tests/decide_plain.py). `model`: other weights on `folder`'s
    tokenizer (a LoRA merged into them)."""
    ref = PlainForward(folder, model)
    text = state if isinstance(state, str) else json.dumps(state, separators=(",", ":"))
    levels = ["Calm", "Frustrated", '{"label":"Very angry"}', "Furious"]
    return {
        "refund": ref.answer(text, NOUL["instructions"], ["Yes: They want a refund", "No"], ["Yes", "No"])[:1],
        "team": ref.answer(text, CHOICE["instructions"], ["Billing: Payments, invoices, refunds", "Technical",
                                                          "Sales: Pricing"], list(CHOICE["criteria"])),
        "anger": ref.answer(text, '{"scale":"frustration"}', levels, levels),
        "queue": ref.answer(text, "Which queue?", list(MANY["criteria"]), list(MANY["criteria"])),
    }


ALL = {"refund": NOUL, "team": CHOICE, "anger": SCORE, "queue": MANY}


def test_answers_match_a_plain_forward_of_each_question(daemon, folder):
    """The shared prefix, the packing of questions and rows into one sequence, the
    batch's padding and the two orders change nothing: each question's answer is what
    its own full sequences give, each run alone without a cache."""
    state = {"subject": "Charged twice", "body": TICKET}
    got = ask(daemon, ALL, state=state).json()["answers"]
    for name, p in plain_forward(folder, state).items():
        assert np.abs(vector(got[name]) - p).max() <= 1e-5, name


# ---- LoRA adapters, as on classifiers ---------------------------------------------------------

def test_a_lora_answers_as_its_merged_weights_not_as_its_base(daemon, folder, lora_folder):
    """A peft LoRA pulled with the decision model as its base, asked by its own name:
    its answers are those of its weights merged into the base (peft's
    `merge_and_unload`), not the base's. The base reads the state first, so its
    state's cache is kept: the adapter must read the state again with its own weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = ask(daemon, ALL).json()["answers"]
    reply = post(daemon, {"model": LORA, "state": TICKET, "questions": ALL})
    assert reply.status_code == 200 and reply.json()["model"] == LORA
    got = reply.json()["answers"]
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), lora_folder).merge_and_unload()
    for name, p in plain_forward(folder, TICKET, merged).items():
        assert np.abs(vector(got[name]) - p).max() <= 1e-5, name
    assert max(np.abs(vector(got[q]) - vector(base[q])).max() for q in ALL) > 1e-2


def test_base_and_lora_rows_mixed_in_batches_each_answer_as_alone(daemon):
    states = [f"Ticket {i}. {TICKET}" for i in range(3)]
    models = (MODEL, LORA)
    alone = {(m, s): post(daemon, {"model": m, "state": s, "questions": ALL}).json()["answers"]
             for m in models for s in states}
    jobs = [(m, s) for s in states for m in models] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: post(daemon, {"model": j[0], "state": j[1], "questions": ALL}), jobs))
    for job, reply in zip(jobs, together):
        for q in ALL:
            assert np.abs(vector(reply.json()["answers"][q]) - vector(alone[job][q])).max() <= 1e-5, (job, q)
    wrong = httpx.post(daemon.url + "/v1/generate", json={"model": LORA, "prompt": "hi", "max_tokens": 2},
                       headers=AUTH, timeout=60)
    assert wrong.status_code == 400 and "serves task 'decide', not 'generate'" in wrong.json()["error"]["message"]


def test_x_adapter_answers_at_its_own_temperatures_else_its_bases(daemon):
    """System One's `x_adapter` names a LoRA of the model: its answers are the adapter's,
    at the adapter's own calibration when it has one, else its base's, and the reply's
    `x_temperatures_from` says whose. A question of 30 options is one softmax of its
    scores, so at temperature T its probabilities are those at 1 raised to 1/T."""
    import signal

    from fleet.calibration import Calibration
    from fleet.catalog import manifest_entry, write_calibration
    from fleet.store import Store

    def many(**extra) -> dict:
        r = post(daemon, {"model": MODEL, "state": TICKET, "questions": {"q": MANY}, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def reload_until(changed) -> dict:
        daemon.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 60
        while not changed(got := many(x_adapter=LORA)):
            assert time.monotonic() < end, got
            time.sleep(0.2)
        return got

    def at(p: np.ndarray, t: float) -> np.ndarray:
        return p ** (1 / t) / (p ** (1 / t)).sum()

    named = many(x_adapter=LORA)
    by_name = post(daemon, {"model": LORA, "state": TICKET, "questions": {"q": MANY}}).json()
    base = vector(many()["answers"]["q"])
    p1 = vector(named["answers"]["q"])
    assert (named["model"], named["x_adapter"], named["x_temperatures_from"]) == (MODEL, LORA, None)
    assert by_name["x_temperatures_from"] is None and np.abs(vector(by_name["answers"]["q"]) - p1).max() <= 1e-5
    assert np.abs(p1 - base).max() > 1e-3
    catalog = daemon.home / "models.toml"
    kept = catalog.read_text() if catalog.exists() else None
    store = Store(daemon.home / "models")
    try:
        write_calibration(daemon.home, MODEL, Calibration(temperatures={"choice:27-255": 2.0}),
                          new_entry=manifest_entry(store.get(MODEL)))
        got = reload_until(lambda r: r["x_temperatures_from"] == MODEL)
        assert np.abs(vector(got["answers"]["q"]) - at(p1, 2.0)).max() <= 1e-6
        write_calibration(daemon.home, LORA, Calibration(temperatures={"choice:27-255": 0.5}),
                          new_entry=manifest_entry(store.get(LORA)))
        got = reload_until(lambda r: r["x_temperatures_from"] == LORA)
        assert np.abs(vector(got["answers"]["q"]) - at(p1, 0.5)).max() <= 1e-6
        assert np.abs(vector(many()["answers"]["q"]) - at(base, 2.0)).max() <= 1e-6  # the base keeps its own
    finally:
        catalog.unlink(missing_ok=True) if kept is None else catalog.write_text(kept)
        reload_until(lambda r: r["x_temperatures_from"] is None)


def test_x_adapter_is_understood_or_refused(daemon):
    r = post(daemon, {"model": MODEL, "x_adapter": NLI, "state": TICKET, "questions": {"q": NOUL}})
    assert r.status_code == 400 and r.json()["detail"]["error_type"] == "bad_request"
    assert f"has no LoRA adapter '{NLI}'; its adapters: {LORA}" in r.json()["detail"]["message"]
    r = post(daemon, {"model": MODEL, "x_adapter": 7, "state": TICKET, "questions": {"q": NOUL}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "x_adapter"]
    assert "x_temperatures_from" not in ask(daemon, {"q": NOUL}).json()


# ---- a stored generator answers from the weights it holds -----------------------------------

def generate(d, model: str, prompt: str) -> httpx.Response:
    return httpx.post(d.url + "/v1/generate", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0}, headers=AUTH, timeout=120)


def resident_bytes(d) -> tuple[dict[str, int], int]:
    """(bytes `/v1/ps` shows per resident model, summed over workers; the workers' used bytes)."""
    workers = httpx.get(d.url + "/v1/ps", headers=AUTH, timeout=30).json()["workers"]
    shown: dict[str, int] = {}
    for w in workers:
        for name, m in w["models"].items():
            shown[name] = shown.get(name, 0) + m["bytes"]
    return shown, sum(w["used_bytes"] for w in workers)


def test_a_generator_answers_as_its_decision_copy_from_the_weights_it_holds(daemon, folder):
    """GENERATOR is MODEL's folder stored as a generator. Its decisions equal MODEL's
    (the same weights stored as a decision model) to 1e-5, and reading them loads no
    second copy: /v1/ps shows no other model resident and the generator's bytes (and
    its worker's) grow by its kept states' caches only (the warm-up's and TICKET's,
    ~0.3 of this tiny model's weights), where a second copy would add the weights."""
    weights = (folder / "model.safetensors").stat().st_size
    first = generate(daemon, GENERATOR, TICKET)
    assert first.status_code == 200
    before, used_before = resident_bytes(daemon)
    reply = post(daemon, {"model": GENERATOR, "state": TICKET, "questions": ALL})
    assert reply.status_code == 200 and reply.json()["model"] == GENERATOR
    copy = post(daemon, {"model": MODEL, "state": TICKET, "questions": ALL}).json()["answers"]
    for q in ALL:
        assert np.abs(vector(reply.json()["answers"][q]) - vector(copy[q])).max() <= 1e-5, q
    end = time.monotonic() + 10
    while (after := resident_bytes(daemon))[0].get(GENERATOR) == before[GENERATOR]:  # published after the ack
        assert time.monotonic() < end, after
        time.sleep(0.1)
    shown, used = after
    assert set(shown) == set(before)
    assert 0 < shown[GENERATOR] - before[GENERATOR] < weights / 2
    assert used - used_before == shown[GENERATOR] - before[GENERATOR]
    assert generate(daemon, GENERATOR, TICKET).json()["text"] == first.json()["text"]


def test_a_generators_lora_answers_decisions_as_the_decision_models_lora(daemon):
    """The same peft adapter pulled for the generator and for the decision model: asked
    with `x_adapter` of the generator, its answers are the decision model's adapter's."""
    mine = post(daemon, {"model": GENERATOR, "x_adapter": GENERATOR_LORA, "state": TICKET, "questions": ALL})
    assert mine.status_code == 200, mine.text
    assert (mine.json()["model"], mine.json()["x_adapter"]) == (GENERATOR, GENERATOR_LORA)
    theirs = post(daemon, {"model": LORA, "state": TICKET, "questions": ALL}).json()["answers"]
    for q in ALL:
        assert np.abs(vector(mine.json()["answers"][q]) - vector(theirs[q])).max() <= 1e-5, q


def test_generation_and_decisions_in_one_lane_each_answer_as_alone(daemon):
    """Generation and decisions queued together in the generator's lane: the decisions
    run as a batch beside the generation rounds; none is lost, none changes. The
    generator's pin and metrics are its store name's, for both tasks."""
    pin = httpx.post(f"{daemon.url}/v1/models/{GENERATOR}/pin", headers=daemon.admin, timeout=60)
    assert pin.status_code == 200, pin.text
    states = [f"Ticket {i}. {TICKET}" for i in range(3)]
    texts = {s: generate(daemon, GENERATOR, s).json()["text"] for s in states}
    answers = {s: post(daemon, {"model": GENERATOR, "state": s, "questions": ALL}).json()["answers"] for s in states}
    jobs = [(kind, s) for s in states for kind in ("generate", "decide")] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda j: generate(daemon, GENERATOR, j[1]) if j[0] == "generate" else
                                post(daemon, {"model": GENERATOR, "state": j[1], "questions": ALL}), jobs))
    assert [r.status_code for r in replies] == [200] * len(jobs)
    for (kind, s), r in zip(jobs, replies):
        if kind == "generate":
            assert r.json()["text"] == texts[s]
        else:
            for q in ALL:
                assert np.abs(vector(r.json()["answers"][q]) - vector(answers[s][q])).max() <= 1e-5, (s, q)
    workers = httpx.get(daemon.url + "/v1/ps", headers=AUTH, timeout=30).json()["workers"]
    assert [w["models"][GENERATOR]["pinned"] for w in workers if GENERATOR in w["models"]] == [True]
    metrics = httpx.get(daemon.url + "/metrics", headers=AUTH, timeout=30).text
    for task in ("decide", "generate"):
        line = next(x for x in metrics.splitlines()
                    if x.startswith("fleet_requests_total{") and f'model="{GENERATOR}"' in x
                    and f'task="{task}"' in x and 'status="ok"' in x)
        assert float(line.rsplit(" ", 1)[1]) >= 2 * len(states), line
    unpin = httpx.delete(f"{daemon.url}/v1/models/{GENERATOR}/pin", headers=daemon.admin, timeout=60)
    assert unpin.status_code == 200, unpin.text


# ---- refusals: the contract's shapes, and nothing else changes --------------------------------

@pytest.mark.parametrize("body, loc", [
    ({"model": "jev-latest", "questions": {"q": NOUL}}, ["body", "state"]),
    ({"model": "jev-latest", "state": "x", "questions": {}}, ["body", "questions"]),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "boolean"}}}, ["body", "questions", "q"]),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "score", "criteria": {"0": "a"}}}},
     ["body", "questions", "q", "score", "criteria"]),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "score", "criteria": ["a", None]}}},
     ["body", "questions", "q", "score", "criteria", 1]),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {**MANY, "criteria": {str(i): None for i in range(256)}}}},
     ["body", "questions", "q", "choice", "criteria"]),
])
def test_invalid_requests_get_422_with_detail(daemon, body, loc):
    r = post(daemon, body)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/json")
    assert loc in [d["loc"] for d in r.json()["detail"]]


def test_other_refusals_carry_error_type_and_message(daemon):
    r = post(daemon, {"model": "no-such-model", "state": "x", "questions": {"q": NOUL}})
    assert r.status_code == 404 and r.json()["detail"]["error_type"] == "model_not_found"
    r = ask(daemon, {"where": {"type": "box", "instructions": "the dog"}})
    assert r.status_code == 400 and r.json()["detail"]["error_type"] == "unsupported"
    r = httpx.get(daemon.url + "/v1/systemone", headers=AUTH, timeout=30)
    assert r.status_code == 405 and set(r.json()["detail"]) == {"error_type", "message"}


def test_a_state_over_the_models_positions_is_413_and_fails_alone(daemon):
    """A too-long state sent beside a good request: 413 for it, the answer for the other."""
    long_state = " ".join(f"word{i}" for i in range(3000))  # ~4 tokens a word, past 2048 positions
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, daemon, {"q": NOUL}, state=s) for s in (long_state, TICKET) * 2]
        replies = [f.result() for f in futures]
    assert [r.status_code for r in replies] == [413, 200] * 2
    assert replies[0].json()["detail"]["error_type"] == "input_too_long"
    assert ask(daemon, {"q": CHOICE}).status_code == 200


def test_unknown_fields_are_ignored_and_named(daemon):
    r = ask(daemon, {"q": {**NOUL, "weight": 2}}, seed=7, x_trace_id="t")
    assert r.status_code == 200
    assert set(r.headers["x-fleet-ignored-fields"].split(",")) == {"seed", "x_trace_id", "questions.q.weight"}


# ---- OpenAI's Decisions shape: a translation onto the same path -------------------------------

def test_openai_decisions_give_the_same_answers_as_system_one(daemon):
    import openai
    from openai import OpenAI

    client = OpenAI(api_key=KEY, base_url=daemon.url + "/v1")
    levels = ["Calm", "Frustrated", "Very angry"]
    d = client.decisions.create(model="jev-latest", input=TICKET, questions=[
        {"type": "predicate", "instructions": NOUL["instructions"], "name": "refund"},
        {"type": "choice", "instructions": CHOICE["instructions"],
         "choices": [{"value": "Billing", "description": "Payments, invoices, refunds"}, {"value": "Technical"},
                     {"value": "Sales", "description": "Pricing"}]},
        {"type": "score", "instructions": "How frustrated is the customer?",
         "levels": [{"label": x} for x in levels]}])
    same = ask(daemon, {"refund": {"type": "noul", "instructions": NOUL["instructions"]}, "team": CHOICE,
                        "anger": {"type": "score", "instructions": "How frustrated is the customer?",
                                  "criteria": levels}}).json()["answers"]
    refund, team, anger = d.answers
    assert d.model == MODEL and refund.name == "refund" and team.name is None
    assert abs(refund.probability - same["refund"]["noul"]) <= 1e-5
    assert team.choice == same["team"]["choice"] and abs(team.confidence - same["team"]["confidence"]) <= 1e-5
    assert [(p.value, round(p.probability, 5)) for p in team.probabilities] == \
        [(k, round(v, 5)) for k, v in same["team"]["probabilities"].items()]
    assert [(p.label, p.value) for p in anger.probabilities] == [(x, i) for i, x in enumerate(levels)]
    assert abs(anger.score - same["anger"]["score"]) <= 1e-5
    assert d.usage.output_tokens == 0 and d.usage.total_tokens == d.usage.input_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.decisions.create(model="jev-latest", input=TICKET, questions=[
            {"type": "choice", "instructions": "?", "choices": [{"value": "only one"}]}])
    assert refused.value.body["code"] == "bad_request"
    with pytest.raises(openai.BadRequestError):
        client.decisions.create(model="jev-latest", input=TICKET, extra_body={"temprature": 1},
                                questions=[{"type": "predicate", "instructions": "?"}])


# ---- an NLI cross-encoder --------------------------------------------------------------------

def test_an_nli_cross_encoder_answers_as_the_zero_shot_pipeline(daemon, nli_folder):
    from transformers import pipeline

    names = ["Billing", "Technical", "Sales"]
    got = post(daemon, {"model": NLI, "state": TICKET, "questions": {
        "team": {"type": "choice", "instructions": CHOICE["instructions"], "criteria": dict.fromkeys(names)},
        "refund": {"type": "noul", "instructions": NOUL["instructions"]}}})
    assert got.status_code == 200 and got.json()["model"] == NLI
    answers = got.json()["answers"]
    zero_shot = pipeline("zero-shot-classification", model=str(nli_folder), device="cpu")
    team = zero_shot(TICKET, names, hypothesis_template=CHOICE["instructions"] + " {}", multi_label=False)
    expect = dict(zip(team["labels"], team["scores"]))
    assert max(abs(answers["team"]["probabilities"][n] - expect[n]) for n in names) <= 1e-5
    yes = zero_shot(TICKET, ["Yes"], hypothesis_template=NOUL["instructions"] + " {}", multi_label=True)
    assert abs(answers["refund"]["noul"] - yes["scores"][0]) <= 1e-5
    # The hypothesis pairs fit 512 positions; a state that does not is 413, alone.
    r = post(daemon, {"model": NLI, "state": " ".join(["refund"] * 600), "questions": {"refund": NOUL}})
    assert r.status_code == 413 and r.json()["detail"]["error_type"] == "input_too_long"


# ---- fleetctl decide ---------------------------------------------------------------------------

def test_fleetctl_decide_prints_one_line_per_answer(daemon):
    import os
    import subprocess
    import sys

    def decide(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleetctl", "decide", TICKET, *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "FLEET_URL": daemon.url, "FLEET_API_KEY": KEY})

    out = decide("--noul", NOUL["instructions"], "--choice", "Which team?|Billing|Technical|Sales",
                 "--score", "How angry?|Calm|Frustrated|Very angry")
    assert out.returncode == 0, out.stderr
    lines = [row.split("\t") for row in out.stdout.splitlines()]
    assert [(r[0], r[1]) for r in lines] == [(NOUL["instructions"], "noul"), ("Which team?", "choice"),
                                              ("How angry?", "score")]
    same = ask(daemon, {"c": {"type": "choice", "instructions": "Which team?",
                              "criteria": dict.fromkeys(["Billing", "Technical", "Sales"])}}).json()["answers"]["c"]
    assert lines[1][2] == same["choice"]
    assert f"answered by {MODEL}" in out.stderr
    refused = decide("--score", "How angry?|" + "|".join(f"level {i}" for i in range(11)))
    assert refused.returncode == 1 and "How angry?.score.criteria" in refused.stderr
    assert decide("--noul", "?", "--model", "no-such-model").returncode == 1


# ---- a batch file of decisions ------------------------------------------------------------------

def test_a_batch_of_decisions_answers_as_the_route_does(daemon, tmp_path):
    import openai

    client = openai.OpenAI(api_key=KEY, base_url=daemon.url + "/v1", max_retries=0)
    states = [f"Ticket {i}. {TICKET}" for i in range(6)]
    lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/systemone",
              "body": {"model": "jev-latest", "state": s, "questions": {"team": CHOICE, "refund": NOUL}}}
             for i, s in enumerate(states)]
    lines.insert(3, {"custom_id": "bad", "method": "POST", "url": "/v1/systemone",
                     "body": {"model": "jev-latest", "state": "x", "questions": {}}})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/systemone", completion_window="24h")
    end = time.monotonic() + 120
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < end, b
        time.sleep(0.2)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed" and b.model == MODEL, b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (7, 6, 1)
    out = {r["custom_id"]: r["response"] for r in map(json.loads, client.files.content(b.output_file_id).text.splitlines())}
    for i in (0, 5):
        alone = ask(daemon, {"team": CHOICE, "refund": NOUL}, state=states[i]).json()
        assert out[f"t{i}"]["status_code"] == 200
        for q in ("team", "refund"):
            assert np.abs(vector(out[f"t{i}"]["body"]["answers"][q]) - vector(alone["answers"][q])).max() <= 1e-5
    [bad] = map(json.loads, client.files.content(b.error_file_id).text.splitlines())
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 422
    assert bad["response"]["body"]["detail"][0]["loc"] == ["body", "questions"]
