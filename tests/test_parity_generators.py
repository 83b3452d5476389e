"""Every decoder architecture the catalog serves for generation, proven on a tiny instance.

Each case of `tests.arch_models.GENERATOR_CASES` is a tiny random causal LM of
one architecture with its family's tokenizer class and a chat template of its
family's shape, served by one daemon (catalog overlay, preloaded, float32).
The prompts are sent at once (the worker decodes what arrives together in one
left-padded batch), and each answer must be `model.generate(do_sample=False)` of its prompt
alone in-process: the same tokens, and per token the same log-probability as
the reference forward pass (the largest difference is printed with `-s`).
The prompts run past Gemma 3's sliding window (8 tokens here) and SmolLM3's
NoPE layer is one of its four.

The same daemon serves the catalog's decision models (`tests.arch_models.DECIDE_CASES`:
the generator architectures pulled as task `decide`): every answer of `/v1/systemone`
must equal each question's own full sequences run alone in-process (the prompt
runtimes/adapters/decide.py documents; tests/decide_plain.py) to 1e-5.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.arch_models import DECIDE_CASES, GENERATOR_CASES, build_cases
from tests.conftest import DaemonProc, start_daemon
from tests.decide_plain import PlainForward
from tests.gen_models import Reference

PROMPTS = [
    "the quick brown fox",
    "hello world, this is fleet serving small models from one box and",
    "José Núñez moved from São Paulo to",
    "a",
]
CHAT = [{"role": "user", "content": "what is the capital of france?"}]
MAX_TOKENS = 12
#: The largest difference to the reference, per case (printed at the end of the module).
LARGEST: dict[str, str] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_cases({**GENERATOR_CASES, **DECIDE_CASES}, tmp_path_factory.mktemp("arch-generators"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    home = tmp_path_factory.mktemp("fleet-arch-generators")
    lines = []
    for name, case in {**GENERATOR_CASES, **DECIDE_CASES}.items():
        lines += [f'[models."{name}"]', f'source = "path:{folders[name]}"', f'task = "{case.task}"',
                  f'runtime = "{case.runtime}"', f'[models."{name}".profile]', 'dtype = "float32"', ""]
    (home / "models.toml").write_text("\n".join(lines))
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join([*GENERATOR_CASES, *DECIDE_CASES]),
                                      "FLEET_CPU_THREADS": "1"})
    yield d
    d.stop()
    if LARGEST:
        print("\nlargest difference to the reference, per architecture:")
        for name, text in LARGEST.items():
            print(f"  {name:28} {text}")


def generate(d: DaemonProc, body: dict) -> dict:
    resp = httpx.post(d.url + "/v1/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def greedy_ids(ref: Reference, prompt_ids: list[int]) -> list[int]:
    """The tokens `model.generate(do_sample=False)` picks after the prompt alone (EOS left out)."""
    torch = ref.torch
    x = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = ref.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
    new = out[0, len(prompt_ids):].tolist()
    return new[:-1] if new and new[-1] == ref.tokenizer.eos_token_id else new


def reference_logprobs(ref: Reference, prompt_ids: list[int], new_ids: list[int]) -> np.ndarray:
    """Log-probability of each generated token under one forward pass of prompt + generated."""
    torch = ref.torch
    ids = torch.tensor([prompt_ids + new_ids])
    with torch.inference_mode():
        logits = ref.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(new_ids)), torch.tensor(new_ids)].numpy()


@pytest.mark.parametrize("name", list(GENERATOR_CASES))
def test_greedy_generation_matches_transformers(fleet, folders, name):
    ref = Reference(folders[name])
    bodies = [{"model": name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
              for p in PROMPTS] + [{"model": name, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                    "logprobs": True}]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: generate(fleet, b), bodies))
    largest, generated = 0.0, 0
    for body, reply in zip(bodies, replies):
        prompt_ids = ref.chat_prompt(CHAT) if "messages" in body else ref.tokenizer(body["prompt"])["input_ids"]
        new_ids = greedy_ids(ref, prompt_ids)
        assert reply["text"] == ref.tokenizer.decode(new_ids, skip_special_tokens=True), body
        assert reply["usage"] == {"input_tokens": len(prompt_ids), "output_tokens": len(new_ids)}
        got = np.array([t["logprob"] for t in reply["logprobs"]], dtype=np.float64)
        want = reference_logprobs(ref, prompt_ids, new_ids)
        assert len(got) == len(new_ids)
        largest = max(largest, float(np.abs(got - want).max(initial=0)))
        generated += len(new_ids)
    LARGEST[name] = f"same greedy tokens ({generated} over {len(bodies)} requests), max |logprob diff| {largest:.1e}"
    assert largest < 1e-4 and generated > len(bodies)


STATE = "the invoice was paid twice"
QUESTIONS = {
    "twice": {"type": "noul", "instructions": "Paid twice?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None}},
    "size": {"type": "score", "instructions": "How bad?", "criteria": ["fine", "bad", "awful"]},
}


@pytest.mark.parametrize("name", list(DECIDE_CASES))
def test_decisions_match_a_plain_forward(fleet, folders, name):
    resp = httpx.post(fleet.url + "/v1/systemone", json={"model": name, "state": STATE, "questions": QUESTIONS},
                      timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    got = resp.json()["answers"]
    ref = PlainForward(folders[name])
    want = {
        "twice": ref.answer(STATE, "Paid twice?", ["Yes", "No"], ["Yes", "No"])[:1],
        "team": ref.answer(STATE, "Which team?", ["billing: money", "tech"], ["billing", "tech"]),
        "size": ref.answer(STATE, "How bad?", ["fine", "bad", "awful"], ["fine", "bad", "awful"]),
    }
    largest = 0.0
    for qid, p in want.items():
        a = got[qid]
        have = np.array([a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values()))
        largest = max(largest, float(np.abs(have - p).max()))
    LARGEST[name] = f"decisions, max |probability diff| {largest:.1e}"
    assert largest <= 1e-5
