"""Promotion's extract, rerank and generate evaluations end to end (issue 39, item 2).

On the session's tone daemon (tests/alias_models.py), at the shipped settings, with tiny
models built here and pulled through the daemon's API. Each task has a version `*-a` and
a broken twin, and an evaluation file labelled by what `*-a` itself answers, so `*-a`
scores 1.0 and the twin less by construction:
- extract: `ner-a`, a token-classification BERT, and `ner-swapped`, the same weights with
  PER and LOC named the other way round (the same spans under the wrong labels);
- rerank: `rr-a`, a one-logit BERT cross-encoder, and `rr-flip`, its head negated (every
  ranking reversed);
- generate: `gen-a` and `gen-b`, tiny Llamas of two seeds (other greedy answers).
With the twin on the alias, promoting `*-a` is a better candidate and switches it; then
promoting the twin back is refused 409 with the task's metric named, the alias unchanged.

A short context (`short-a`, `short-b`: tiny Llamas of 128 positions, `short-a` never
ending, so its answers run to the context's end) bounds a generate evaluation's answers
instead of failing its lines: `short-a` is promoted over `short-b` on its own answers,
the package saying each version's context and the answers it ended; a line's own
`max_tokens` is honoured; a prompt that alone does not fit is a 422 naming the line.

A judge (`gen-judge`, a third tiny Llama) grades the generate evaluation's answer pairs
under its verdict schema: its counts and win rate are in the package and the refusal
message; a judge that is not a stored generator, or one named for another task's
evaluation, is a 4xx that changes nothing.

Before: only the classify and embed runners had run end to end; `judge` was an unknown
field (400); every line of a generate evaluation sent max_tokens 256, so a 128-position
model answered each with a 400 and its promotion failed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.arch_models import CORPUS as SENTENCES

NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
SWAPPED = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
QUERIES = ["how do cats behave at home", "when did the market close", "who moved to Zurich"]
DOCUMENTS = ["cats sleep for most of the day", "the stock market closed higher on Friday", "a b c",
             "José Núñez moved from São Paulo", "hello world", "quarterly revenue grew"]
PROMPTS = ["the quick brown fox", "hello world", "invoices must be paid", "what is the capital of france?"]
#: Positions of the short-context generators: less than a prompt plus the default 256 tokens.
SHORT = 128


def build(root: Path) -> dict[str, tuple[Path, str]]:
    """store name -> (folder, task) of the tiny versions (module doc)."""
    from safetensors.torch import load_file, save_file

    from tests.arch_models import encoder
    from tests.gen_models import build_llama, never_ending

    out: dict[str, tuple[Path, str]] = {}
    ner = encoder("bert", "token", root / "ner-a", labels=NER_LABELS)
    swapped = encoder("bert", "token", root / "ner-swapped", labels=SWAPPED)
    out |= {"ner-a": (ner, "extract"), "ner-swapped": (swapped, "extract")}
    rr = encoder("bert", "seq", root / "rr-a", labels=["score"])
    flip = encoder("bert", "seq", root / "rr-flip", labels=["score"])
    weights = load_file(flip / "model.safetensors")
    for key in ("classifier.weight", "classifier.bias"):
        weights[key] = -weights[key]
    save_file(weights, flip / "model.safetensors", metadata={"format": "pt"})
    out |= {"rr-a": (rr, "rerank"), "rr-flip": (flip, "rerank")}
    # 512 positions: a prompt plus the evaluation's 256 generated tokens fit.
    out |= {"gen-a": (build_llama(root / "gen-a", seed=0, max_positions=512), "generate"),
            "gen-b": (build_llama(root / "gen-b", seed=1, max_positions=512), "generate"),
            "gen-judge": (build_llama(root / "gen-judge", seed=2, max_positions=2048), "generate"),
            "short-a": (never_ending(build_llama(root / "short-a", seed=0, max_positions=SHORT)), "generate"),
            "short-b": (build_llama(root / "short-b", seed=1, max_positions=SHORT), "generate")}
    return out


@pytest.fixture(scope="module")
def tasks_box(tone_box, tmp_path_factory: pytest.TempPathFactory):
    """The tone daemon with the versions of `build` pulled through its API."""
    for name, (folder, task) in build(tmp_path_factory.mktemp("promote-tasks")).items():
        r = httpx.post(tone_box.url + "/v1/store/pull", json={"source": f"path:{folder}", "name": name, "task": task},
                       headers=tone_box.admin, timeout=120)
        assert r.status_code == 200 and '"success"' in r.text.splitlines()[-1], r.text
    return tone_box


def set_alias(d, alias: str, version: str) -> None:
    r = httpx.put(f"{d.url}/v1/aliases/{alias}", json={"version": version}, headers=d.admin, timeout=120)
    assert r.status_code == 200, r.text


def promote(d, candidate: str, alias: str, text: str, **extra) -> httpx.Response:
    return httpx.post(d.url + "/v1/promotions", json={"candidate": candidate, "alias": alias, "eval": text, **extra},
                      headers=d.admin, timeout=300)


def version(d, alias: str) -> str:
    return httpx.get(f"{d.url}/v1/aliases/{alias}", timeout=30).json()["version"]


def better_then_refused(d, alias: str, good: str, bad: str, text: str, *refusal: str) -> dict:
    """The broken twin holds the alias; `good` is promoted over it; `bad` is then refused
    with each `refusal` fragment in the message and the alias stays on `good`. The promotion's package."""
    set_alias(d, alias, bad)
    r = promote(d, good, alias, text)
    assert r.status_code == 200, r.text
    package = r.json()
    assert package["kind"] == "promote" and package["rollback_target"] == bad and version(d, alias) == good
    r = promote(d, bad, alias, text)
    assert r.status_code == 409 and r.json()["error"]["code"] == "promotion_refused", r.text
    assert all(part in r.json()["error"]["message"] for part in refusal), r.text
    assert version(d, alias) == good
    return package


def test_extract_is_evaluated_by_span_f1(tasks_box) -> None:
    d = tasks_box
    r = httpx.post(d.url + "/v1/extract", json={"model": "ner-a", "inputs": SENTENCES}, timeout=60)
    assert r.status_code == 200, r.text
    rows = r.json()["results"]
    assert any(rows)  # the random tagger names spans: the file has something to miss
    text = "".join(json.dumps({"text": s, "entities": [{"start": e["start"], "end": e["end"], "label": e["entity"]}
                                                         for e in row]}) + "\n" for s, row in zip(SENTENCES, rows))
    ev = better_then_refused(d, "people", "ner-a", "ner-swapped", text, "span_f1 0.", "vs 1.0000")["evaluation"]
    assert ev["metrics"] == ["span_f1"] and ev["candidate"] == {"span_f1": 1.0}
    # Swapped names miss most spans (a span whose B- and I- tags disagree may still split alike).
    assert ev["current"]["span_f1"] < 0.5


def test_rerank_is_evaluated_by_ndcg_and_mrr(tasks_box) -> None:
    d = tasks_box
    lines = []
    for q in QUERIES:
        r = httpx.post(d.url + "/v1/rerank", json={"model": "rr-a", "query": q, "documents": DOCUMENTS}, timeout=60)
        assert r.status_code == 200, r.text
        lines.append(json.dumps({"query": q, "documents": DOCUMENTS, "relevant": [r.json()["results"][0]["index"]]}))
    package = better_then_refused(d, "ranker", "rr-a", "rr-flip", "\n".join(lines) + "\n", "ndcg@10 0.", "mrr 0.")
    ev = package["evaluation"]
    assert ev["metrics"] == ["ndcg@10", "mrr"] and ev["candidate"] == {"ndcg@10": 1.0, "mrr": 1.0}
    # Reversed (up to ties among saturated scores): the best documents rank lower.
    assert ev["current"]["mrr"] < 1.0 and ev["current"]["ndcg@10"] < 1.0


@pytest.fixture(scope="module")
def generate_eval(tasks_box) -> str:
    """PROMPTS with gen-a's own greedy answers as `expected`, at the evaluation's length."""
    from fleet.daemon.promotions import EVAL_MAX_TOKENS

    lines = []
    for p in PROMPTS:
        r = httpx.post(tasks_box.url + "/v1/generate", json={"model": "gen-a", "prompt": p, "temperature": 0.0,
                                                             "max_tokens": EVAL_MAX_TOKENS}, timeout=120)
        assert r.status_code == 200, r.text
        lines.append(json.dumps({"prompt": p, "expected": r.json()["text"]}))
    return "\n".join(lines) + "\n"


def test_generate_is_evaluated_by_exact_match(tasks_box, generate_eval) -> None:
    d = tasks_box
    package = better_then_refused(d, "writer", "gen-a", "gen-b", generate_eval, "exact_match 0.0000 vs 1.0000")
    ev = package["evaluation"]
    assert ev["metrics"] == ["exact_match", "schema_valid"] and ev["candidate"] == {"exact_match": 1.0}
    assert ev["current"] == {"exact_match": 0.0} and package["capacity"]["tokens"] > 0


def test_a_short_context_bounds_the_answers_instead_of_failing_every_line(tasks_box) -> None:
    from fleet.daemon.promotions import EVAL_MAX_TOKENS

    d = tasks_box

    def answer(prompt: str, **limit) -> str:
        r = httpx.post(d.url + "/v1/generate", json={"model": "short-a", "prompt": prompt, "temperature": 0.0,
                                                     **limit}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    # short-a's own answers as the references: open-ended (to its context's end); a line
    # with its own max_tokens of 8; and one of 126, which fits the context but not past
    # this prompt (asked, refused by the worker, asked again to the context's end).
    lines = [{"prompt": p, "expected": answer(p)} for p in PROMPTS]
    lines.append({"prompt": PROMPTS[0], "expected": answer(PROMPTS[0], max_tokens=8), "max_tokens": 8})
    lines.append({"prompt": PROMPTS[0], "expected": lines[0]["expected"], "max_tokens": SHORT - 2})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    set_alias(d, "short", "short-b")
    r = promote(d, "short-a", "short", text)
    assert r.status_code == 200, r.text
    ev = r.json()["evaluation"]
    assert ev["candidate"] == {"exact_match": 1.0} and ev["current"]["exact_match"] < 1.0
    limit = ev["generation"]
    assert limit["max_tokens"] == EVAL_MAX_TOKENS and limit["lines_with_max_tokens"] == 2
    assert limit["context"] == {"short-a": SHORT, "short-b": SHORT}
    # short-a never stops: its context ended every answer but the 8-token line's.
    assert limit["context_bound"]["short-a"] == len(PROMPTS) + 1
    assert 0 <= limit["context_bound"]["short-b"] <= len(PROMPTS) + 1
    from fleetctl.commands.promote import answer_limits  # what `fleetctl promote` prints of it

    assert answer_limits(limit).startswith(f"answers: up to {EVAL_MAX_TOKENS} tokens (2 lines their own max_tokens), "
                                           f"within each context: short-a {SHORT} tokens ({len(PROMPTS) + 1} answers "
                                           f"ended by it), short-b {SHORT} tokens (")
    assert version(d, "short") == "short-a"

    # A prompt that alone fills the context: a 422 naming the line, nothing switched.
    long = json.dumps({"prompt": " ".join(["zebra 7 quartz"] * 60), "expected": "x"})
    r = promote(d, "short-b", "short", text + long + "\n")
    assert r.status_code == 422 and r.json()["error"]["code"] == "input_too_long", r.text
    assert f"evaluation line {len(lines) + 1}: its prompt alone does not fit short-" in \
        r.json()["error"]["message"], r.text
    assert version(d, "short") == "short-a"


def test_a_judge_grades_each_pair_and_its_win_rate_is_in_the_package_and_the_refusal(tasks_box,
                                                                                    generate_eval) -> None:
    d = tasks_box
    set_alias(d, "judged", "gen-a")
    r = promote(d, "gen-b", "judged", generate_eval, judge="gen-judge")
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "exact_match 0.0000 vs 1.0000" in message and "judge gen-judge: the candidate won " in message
    package = httpx.get(d.url + "/v1/promotions/" + re.search(r"Package (prm_\S+)", message).group(1),
                        timeout=30).json()
    ev, judge = package["evaluation"], package["evaluation"]["judge"]
    # Every line has a reference and two different answers: the judge was asked four times,
    # and each verdict is one of its schema's.
    assert judge["model"] == "gen-judge" and judge["lines"] == len(PROMPTS) and judge["identical"] == 0
    assert judge["candidate_wins"] + judge["current_wins"] + judge["ties"] == len(PROMPTS)
    assert judge["win_rate"] == pytest.approx((judge["candidate_wins"] + judge["ties"] / 2) / len(PROMPTS))
    assert f"{judge['ties']} tied of {len(PROMPTS)} (win rate {judge['win_rate']:.4f})" in message
    assert ev["metrics"][-1] == "judge_win_rate" and ev["candidate"]["judge_win_rate"] == judge["win_rate"]
    assert ev["current"]["judge_win_rate"] == pytest.approx(1 - judge["win_rate"])
    assert version(d, "judged") == "gen-a"


@pytest.mark.parametrize("judge, status, words", [
    ("tone-v1", 400, "judge 'tone-v1' serves classify: a judge must be a generator"),
    ("no-such-judge", 404, "judge 'no-such-judge' is not in the store"),
])
def test_a_judge_that_is_not_a_stored_generator_is_refused(tasks_box, generate_eval, judge, status, words) -> None:
    d = tasks_box
    set_alias(d, "judged", "gen-a")
    r = promote(d, "gen-b", "judged", generate_eval, judge=judge)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert version(d, "judged") == "gen-a"


def test_a_judge_for_another_tasks_evaluation_is_a_400(tasks_box) -> None:
    d = tasks_box
    set_alias(d, "tone-judged", "tone-v1")
    r = promote(d, "tone-same", "tone-judged", '{"text": "fine", "label": "one-pos"}\n', judge="gen-judge")
    assert r.status_code == 400 and "a judge grades generated answers; this evaluation is classify's" in \
        r.json()["error"]["message"], r.text
    assert version(d, "tone-judged") == "tone-v1"


def test_the_tally_puts_the_candidate_first_on_even_lines_only() -> None:
    from fleet.judge import tally

    # A judge that always says "a": the candidate wins the even lines and loses the odd ones.
    r = tally("j", [0, 1, 2, 3], ["a", "a", "a", "a"])
    assert (r.candidate_wins, r.current_wins, r.ties, r.win_rate) == (2, 2, 0, 0.5)
    # Line 1's "b" is the candidate; an identical pair (None) is a tie no judge was asked about.
    r = tally("j", [0, 1, 4], ["tie", "b", None])
    assert (r.candidate_wins, r.current_wins, r.ties, r.identical) == (1, 0, 2, 1)
    assert r.win_rate == pytest.approx(2 / 3)
