"""LoRA adapters end to end: peft adapters of a tiny Llama pulled with `--base`,
served by a real daemon over real HTTP, compared with peft run directly.

Requests to several adapters of one base (and to the base itself) run in the
same batches; each must get exactly what its adapter gives alone. Adapters
cost their own weights only (one base in memory), a new adapter pulled while
the daemon runs is served without a restart, and wrong adapters get clear
errors.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from tests.conftest import DaemonProc, start_daemon
from tests.gen_models import Reference, build_llama, build_lora, pull

pytestmark = pytest.mark.slow

BASE, OTHER = "tiny-base", "tiny-other"
LORAS = ["lora-a", "lora-b", "lora-c"]
PROMPTS = ["hello world", "the quick brown fox", "invoices must be paid", "a b c d", "fleet serving"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora-models")
    home = tmp_path_factory.mktemp("lora-home")
    base = build_llama(root / BASE, seed=0)
    other = build_llama(root / OTHER, seed=1)
    folders = {name: build_lora(base, root / name, seed=10 + i) for i, name in enumerate(LORAS)}
    folders["lora-late"] = build_lora(base, root / "lora-late", seed=20)
    folders["lora-other"] = build_lora(other, root / "lora-other", seed=30)
    pull(home, base, BASE)
    pull(home, other, OTHER)
    for name in LORAS:
        pull(home, folders[name], name, "--base", BASE)
    pull(home, folders["lora-other"], "lora-other", "--base", OTHER)
    return {"home": home, "base": base, "folders": folders}


@pytest.fixture(scope="module")
def lora_daemon(models: dict):
    d = start_daemon(models["home"], extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1"},
                     args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ref(models: dict) -> Reference:
    return Reference(models["base"])


def generate(d: DaemonProc, model: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(d.url + "/v1/generate", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def adapter_bytes(folder: Path) -> int:
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return sum(t.numel() * t.element_size() for t in map(f.get_tensor, f.keys()))


def model_bytes(d: DaemonProc, name: str) -> int:
    ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
    return next(w["models"][name]["bytes"] for w in ps["workers"] if name in w["models"])


def test_mixed_adapter_batches_equal_each_adapter_alone(lora_daemon: DaemonProc, models: dict,
                                                        ref: Reference) -> None:
    # Warm the base alone first, to measure what the adapters add.
    assert generate(lora_daemon, BASE, "hi", 2).status_code == 200
    base_bytes = model_bytes(lora_daemon, BASE)
    jobs = [(name, prompt, 10 + 3 * i) for i, prompt in enumerate(PROMPTS) for name in [*LORAS, BASE]]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: generate(lora_daemon, j[0], j[1], j[2]), jobs))
    assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
    texts = {}
    for (name, prompt, n), r in zip(jobs, got):
        lora = models["folders"].get(name)
        assert r.json()["text"] == ref.greedy(prompt, n, lora)[0], (name, prompt)
        texts.setdefault(prompt, set()).add(r.json()["text"])
    assert all(len(v) == 4 for v in texts.values())  # the adapters really differ from each other and the base
    # One base in memory: the adapters add their own weights, nothing more.
    added = model_bytes(lora_daemon, BASE) - base_bytes
    expected = sum(adapter_bytes(models["folders"][n]) for n in LORAS)
    assert abs(added - expected) <= 0.05 * expected, (added, expected)
    assert added < 0.2 * base_bytes
    # /v1/ps lists them on the base; /v1/models marks them loaded.
    ps = httpx.get(lora_daemon.url + "/v1/ps", timeout=10).json()
    assert sorted(next(w["models"][BASE]["loras"] for w in ps["workers"] if BASE in w["models"])) == LORAS
    cards = {m["id"]: m for m in httpx.get(lora_daemon.url + "/v1/models", timeout=10).json()["data"]}
    assert all(cards[n]["loaded"] for n in [BASE, *LORAS]) and not cards["lora-other"].get("loaded")


def test_base_plus_adapter_field(lora_daemon: DaemonProc, models: dict, ref: Reference) -> None:
    r = generate(lora_daemon, BASE, PROMPTS[0], 12, adapter="lora-b")
    assert r.status_code == 200, r.text
    assert r.json()["text"] == ref.greedy(PROMPTS[0], 12, models["folders"]["lora-b"])[0]
    assert r.json()["model"] == BASE


def test_openai_chat_with_an_adapter_as_the_model(lora_daemon: DaemonProc, models: dict, ref: Reference) -> None:
    import openai

    client = openai.OpenAI(base_url=lora_daemon.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="lora-c", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == ref.greedy(ref.chat_prompt(messages), 10,
                                                         models["folders"]["lora-c"])[0]


def test_adapter_pulled_while_the_daemon_runs_is_served(lora_daemon: DaemonProc, models: dict,
                                                        ref: Reference) -> None:
    r = generate(lora_daemon, "lora-late", PROMPTS[1], 8)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    pull(models["home"], models["folders"]["lora-late"], "lora-late", "--base", BASE)
    r = generate(lora_daemon, "lora-late", PROMPTS[1], 8)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == ref.greedy(PROMPTS[1], 8, models["folders"]["lora-late"])[0]


def test_adapter_of_another_base_runs_on_its_own_base(lora_daemon: DaemonProc, models: dict) -> None:
    other = Reference(models["base"].parent / OTHER)
    r = generate(lora_daemon, "lora-other", PROMPTS[2], 8)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == other.greedy(PROMPTS[2], 8, models["folders"]["lora-other"])[0]


@pytest.mark.parametrize("model, adapter, status, code", [
    (BASE, "no-such-adapter", 400, "bad_request"),  # named, with the base's adapters listed
    (BASE, "lora-other", 400, "bad_request"),  # an adapter of another base
    (BASE, OTHER, 400, "bad_request"),  # not an adapter at all
    ("no-such-model", None, 404, "model_not_found"),
])
def test_wrong_adapters_get_clear_errors(lora_daemon: DaemonProc, model: str, adapter: str | None, status: int,
                                         code: str) -> None:
    extra = {"adapter": adapter} if adapter else {}
    r = generate(lora_daemon, model, "hello", 4, **extra)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    if adapter:
        assert adapter in r.json()["error"]["message"]


def test_replies_and_ps_name_the_batch_and_its_adapters(lora_daemon: DaemonProc) -> None:
    # Concurrent requests of three adapters and the base, several decode steps each:
    # each reply names the step that finished it (its sequences, their prompt and
    # generated tokens, the adapters among them), and ps the last step. 32 tokens each:
    # with 8 a loaded box sent them far enough apart that none shared a step.
    jobs = [(name, prompt, 32) for prompt in PROMPTS[:2] for name in [*LORAS, BASE]]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: generate(lora_daemon, *j), jobs))
    assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
    for (name, _, _), r in zip(jobs, got):
        usage = r.json()["usage"]
        adapters = r.headers.get("x-batch-adapters", "").split(",") if "x-batch-adapters" in r.headers else []
        assert set(adapters) <= set(LORAS) and (name == BASE or name in adapters), (name, r.headers)
        # Its own tokens are part of its batch's.
        assert int(r.headers["x-batch-tokens"]) >= usage["input_tokens"] + usage["output_tokens"]
        assert int(r.headers["x-batch-items"]) >= 1
    assert max(len(r.headers.get("x-batch-adapters", "").split(",")) for r in got) >= 2  # they shared steps
    ps = httpx.get(lora_daemon.url + "/v1/ps", timeout=10).json()
    last = next(w["last_batch"] for w in ps["workers"] if w["last_batch"].get("model") == BASE)
    assert last["prompt_tokens"] > 0 and last["generated_tokens"] > 0
    assert last["tokens"] == last["prompt_tokens"] + last["generated_tokens"]
    assert set(last["loras"]) <= set(LORAS)
