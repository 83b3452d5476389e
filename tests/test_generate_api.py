"""Generation end to end: a real `fleetctl serve` (one CPU worker), a tiny Llama
built from a config and pulled through the store (`path:`), real HTTP; answers
compared with the same model run directly through transformers `generate`.

Covers the native `/v1/generate` (JSON and MessagePack, streaming over SSE),
OpenAI `/v1/completions` and `/v1/chat/completions` through the official
`openai` client (streaming included), continuous batching under concurrent
requests (same greedy tokens as each request alone), seeded sampling, stop
strings, and the contract's errors for bad input.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.conftest import DaemonProc, default_model_dir, start_daemon
from tests.gen_models import Reference, build_llama, pull

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
EMBEDDER = "minilm"
PROMPTS = [
    "hello world",
    "the quick brown fox jumps over",
    "a",
    "invoices must be paid within thirty days of receipt unless",
    "z y x w",
    "fleet serving small models",
    "user: what is the capital",
    "0 1 2 3 4 5 6 7 8 9",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gen-models")
    home = tmp_path_factory.mktemp("gen-home")
    folder = build_llama(root / MODEL)
    pull(home, folder, MODEL)
    pull(home, default_model_dir(), EMBEDDER)
    return home, folder


@pytest.fixture(scope="module")
def gen_daemon(tiny: tuple[Path, Path]):
    home, _ = tiny
    # A starvation bound longer than any test: lanes must take turns by themselves.
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1",
                                      "FLEET_LANE_MAX_WAIT_MS": "60000"}, args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ref(tiny: tuple[Path, Path]) -> Reference:
    return Reference(tiny[1])


def generate(d: DaemonProc, **body) -> httpx.Response:
    return httpx.post(d.url + "/v1/generate", json={"model": MODEL, **body}, timeout=120)


def sse_events(d: DaemonProc, path: str, body: dict) -> list[bytes]:
    """The `data:` payloads of a server-sent event stream, in order."""
    out = []
    with httpx.stream("POST", d.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:].encode())
    return out


def test_greedy_matches_transformers_generate(gen_daemon: DaemonProc, ref: Reference) -> None:
    r = generate(gen_daemon, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    text, n = ref.greedy(PROMPTS[0], 24)
    assert body["text"] == text
    assert body["usage"] == {"input_tokens": len(ref.tokenizer(PROMPTS[0])["input_ids"]), "output_tokens": n}
    assert body["finish_reason"] == ("length" if n == 24 else "stop")
    assert body["model"] == MODEL
    assert r.headers["x-served-by"].endswith("/0") and float(r.headers["x-inference-ms"]) > 0


def test_msgpack_in_and_out(gen_daemon: DaemonProc, ref: Reference) -> None:
    body = msgspec.msgpack.encode({"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0.0})
    r = httpx.post(gen_daemon.url + "/v1/generate", content=body,
                   headers={"content-type": "application/msgpack"}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["text"] == ref.greedy(PROMPTS[1], 10)[0]


def test_concurrent_requests_decode_together_with_the_same_greedy_tokens(gen_daemon: DaemonProc,
                                                                          ref: Reference) -> None:
    # Different prompt lengths and output lengths: sequences join and leave the
    # running batch at different steps (continuous batching).
    jobs = [(p, 8 + 5 * i) for i, p in enumerate(PROMPTS)] * 3
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: generate(gen_daemon, prompt=j[0], max_tokens=j[1], temperature=0), jobs))
    assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
    for (prompt, n), r in zip(jobs, got):
        assert r.json()["text"] == ref.greedy(prompt, n)[0], prompt
    ps = httpx.get(gen_daemon.url + "/v1/ps", timeout=10).json()
    served = [w["models"][MODEL]["served"] for w in ps["workers"] if MODEL in w["models"]]
    assert served and served[0] >= len(jobs)


def test_seeded_sampling_is_reproducible(gen_daemon: DaemonProc) -> None:
    def sample(seed: int) -> str:
        r = generate(gen_daemon, prompt="hello", max_tokens=16, temperature=1.5, top_p=0.95, seed=seed)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    first = sample(1234)
    # Alone and next to other requests: the row's own generator decides.
    with cf.ThreadPoolExecutor(4) as pool:
        again = list(pool.map(sample, [1234, 99, 1234, 7]))
    assert again[0] == first and again[2] == first
    assert len({first, again[1], again[3]}) > 1  # different seeds sample differently


def test_top_p_near_zero_is_greedy(gen_daemon: DaemonProc, ref: Reference) -> None:
    r = generate(gen_daemon, prompt=PROMPTS[4], max_tokens=12, temperature=1.0, top_p=1e-6, seed=5)
    assert r.json()["text"] == ref.greedy(PROMPTS[4], 12)[0]


def test_stop_strings_cut_the_text(gen_daemon: DaemonProc, ref: Reference) -> None:
    full, _ = ref.greedy(PROMPTS[3], 30)
    stop = full[6:9]
    cut = full.find(stop)
    r = generate(gen_daemon, prompt=PROMPTS[3], max_tokens=30, temperature=0, stop=[stop, "never-there"])
    body = r.json()
    assert body["text"] == full[:cut] and body["finish_reason"] == "stop"
    assert body["usage"]["output_tokens"] < 30


def test_native_stream_yields_the_same_text_token_by_token(gen_daemon: DaemonProc, ref: Reference) -> None:
    events = sse_events(gen_daemon, "/v1/generate",
                        {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 20, "temperature": 0, "stream": True})
    assert events[-1] == b"[DONE]"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    text = "".join(c["text"] for c in chunks)
    whole = generate(gen_daemon, prompt=PROMPTS[5], max_tokens=20, temperature=0).json()
    assert text == whole["text"] == ref.greedy(PROMPTS[5], 20)[0]
    assert len([c for c in chunks if c["text"]]) > 3  # pieces, not one blob at the end
    assert chunks[-1]["finish_reason"] == whole["finish_reason"] and chunks[-1]["usage"] == whole["usage"]


def test_stream_with_stop_string_never_sends_the_stop(gen_daemon: DaemonProc, ref: Reference) -> None:
    full, _ = ref.greedy(PROMPTS[3], 30)
    stop = full[8:11]
    events = sse_events(gen_daemon, "/v1/generate", {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 30,
                                                     "temperature": 0, "stream": True, "stop": stop})
    text = "".join(msgspec.json.decode(e)["text"] for e in events[:-1])
    assert text == full[:full.find(stop)]


def test_openai_client_completions_and_chat(gen_daemon: DaemonProc, ref: Reference) -> None:
    import openai

    client = openai.OpenAI(base_url=gen_daemon.url + "/v1", api_key="unused")
    comp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    text, n = ref.greedy(PROMPTS[2], 12)
    assert comp.choices[0].text == text and comp.usage.completion_tokens == n
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0)
    chat_text, chat_n = ref.greedy(ref.chat_prompt(messages), 15)
    assert chat.choices[0].message.content == chat_text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ref.chat_prompt(messages)) and chat.usage.completion_tokens == chat_n
    # Streaming through the official client: chunks in OpenAI's format, same text.
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0,
                                                stream=True):
        assert chunk.object == "chat.completion.chunk"
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == chat_text
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True))
    assert streamed == text


def test_completions_with_several_prompts(gen_daemon: DaemonProc, ref: Reference) -> None:
    r = httpx.post(gen_daemon.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": PROMPTS[:3], "max_tokens": 6, "temperature": 0})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [ref.greedy(p, 6)[0] for p in PROMPTS[:3]]


@pytest.mark.parametrize("body, status, code", [
    ({"prompt": "hi", "max_tokens": 0}, 400, "bad_request"),
    ({"prompt": "hi", "max_tokens": 100_000}, 400, "bad_request"),  # over the model's 256 positions
    ({"prompt": "hi", "max_tokens": 255}, 400, "bad_request"),  # prompt + max_tokens over the context
    ({"prompt": ""}, 400, "bad_request"),
    ({"messages": []}, 400, "bad_request"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "bad_request"),
    ({}, 400, "bad_request"),
    ({"prompt": "hi", "temperature": 3}, 400, "bad_request"),
    ({"prompt": "hi", "top_p": 0}, 400, "bad_request"),
    ({"prompt": "hi", "stop": [""]}, 400, "bad_request"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model_not_found"),
    ({"prompt": "hi", "adapter": "no-such-adapter"}, 400, "bad_request"),  # named, with the model's adapters
    ({"prompt": "hi " * 300, "max_tokens": 1}, 422, "input_too_long"),
])
def test_bad_input_gets_the_contract_error(gen_daemon: DaemonProc, body: dict, status: int, code: str) -> None:
    r = generate(gen_daemon, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    # Streaming requests fail the same way, before any event.
    r = generate(gen_daemon, **body, stream=True)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_bad_input_changes_nothing(gen_daemon: DaemonProc, ref: Reference) -> None:
    generate(gen_daemon, prompt="hi", max_tokens=0)
    generate(gen_daemon, prompt="hi " * 300, max_tokens=1)
    assert generate(gen_daemon, prompt=PROMPTS[0], max_tokens=8, temperature=0).json()["text"] == \
        ref.greedy(PROMPTS[0], 8)[0]
    lanes = httpx.get(gen_daemon.url + "/v1/ps", timeout=10).json().get("lanes", [])
    assert all(lane["depth"] == 0 and lane["claimed"] == 0 for lane in lanes)


def test_other_models_of_the_worker_are_served_between_decode_steps(gen_daemon: DaemonProc, ref: Reference,
                                                                    st_model) -> None:
    import time

    import numpy as np

    # One client, connected by the first call: a new httpx client costs tens of ms
    # (its SSL context) in this process, the GIL shared with the generate threads; the
    # suite once read that as the embed answered after a 0.3 s generation.
    embedder = httpx.Client(base_url=gen_daemon.url, timeout=120)

    def embed() -> tuple[httpx.Response, float]:
        r = embedder.post("/v1/embed", json={"model": EMBEDDER, "inputs": ["hello world"]})
        return r, time.monotonic()

    # A prompt whose greedy continuation runs to max_tokens (no early EOS).
    prompt = next(p for p in PROMPTS if ref.greedy(p, 200)[1] == 200)
    assert embed()[0].status_code == 200  # loaded next to the generator
    with cf.ThreadPoolExecutor(9) as pool:
        t0 = time.monotonic()
        gens = [pool.submit(lambda: (generate(gen_daemon, prompt=prompt, max_tokens=200, temperature=0),
                                     time.monotonic())) for _ in range(8)]
        time.sleep(0.1)
        r, embedded_at = embed()
        first_done = min(g.result()[1] for g in gens)
    embedder.close()
    assert r.status_code == 200
    # Answered while the generations were still decoding (not after them).
    assert embedded_at < first_done, (embedded_at - t0, first_done - t0)
    want = st_model.encode(["hello world"], normalize_embeddings=True)
    got = np.asarray(r.json()["embeddings"])
    assert float(got[0] @ want[0]) > 0.999  # the embedder's own dtype check allows bf16 on this CPU
    assert all(g.result()[0].json()["text"] == ref.greedy(prompt, 200)[0] for g in gens)


def test_stream_events_arrive_while_generating(gen_daemon: DaemonProc, ref: Reference) -> None:
    import time

    prompt = next(p for p in PROMPTS if ref.greedy(p, 200)[1] == 200)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    arrivals = []
    t0 = time.monotonic()
    with httpx.stream("POST", gen_daemon.url + "/v1/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - t0)
    # Token by token, not buffered to the end: the first text long before the last.
    assert len(arrivals) > 20
    assert arrivals[0] < 0.5 * arrivals[-1], (arrivals[0], arrivals[-1])
