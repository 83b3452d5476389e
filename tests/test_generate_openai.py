"""OpenAI generation features end to end, through the official `openai` client
against a real `fleetctl serve` (one CPU worker) and a tiny random Llama:
structured output (`response_format` json_object / json_schema, grammar-
constrained decoding: the output parses and matches the schema even from
random weights), `logprobs`/`top_logprobs` in OpenAI's shapes,
`stream_options.include_usage`, 400 `unsupported` for what fleet does not do,
the same knobs on the native `/v1/generate`, and a client that disconnects
mid-stream freeing its sequence at once.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import DaemonProc, start_daemon
from tests.gen_models import Reference, build_llama, never_ending, pull

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
LONG = "tiny-llama-long"  # 4096 positions: a sequence that runs long enough to be cut short
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "describe a customer as JSON"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("gen-openai-models")
    home = tmp_path_factory.mktemp("gen-openai-home")
    folder = build_llama(root / MODEL)
    long_folder = never_ending(build_llama(root / LONG, max_positions=4096))
    pull(home, folder, MODEL)
    pull(home, long_folder, LONG)
    return home, folder, long_folder


@pytest.fixture(scope="module")
def gen_daemon(tiny):
    d = start_daemon(tiny[0], extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(gen_daemon: DaemonProc):
    import openai

    return openai.OpenAI(base_url=gen_daemon.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ref(tiny) -> Reference:
    return Reference(tiny[1])


def matches_person(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == set(PERSON["required"])
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and type(value["member"]) is bool and value["tier"] in ("gold", "silver"))


def joined(content) -> str:
    """The text of a list of token logprobs, from their exact bytes."""
    return b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_output_matches_the_schema_even_from_random_weights(client) -> None:
    for seed in range(4):  # sampled as well as greedy: the grammar holds for every pick
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=seed,
                                              temperature=0 if seed == 0 else 1.0, response_format=person_format())
        value = json.loads(chat.choices[0].message.content)
        assert matches_person(value), value
        assert chat.choices[0].finish_reason == "stop"


def test_json_object_output_parses(client) -> None:
    comp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                          response_format={"type": "json_object"})
    assert comp.choices[0].finish_reason == "stop", comp.choices[0].message.content
    assert isinstance(json.loads(comp.choices[0].message.content), dict)


def test_structured_output_streamed_equals_not_streamed(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                           response_format=person_format()).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format=person_format(), stream=True))
    assert streamed == whole and matches_person(json.loads(streamed))
    # The legacy completions route takes it too.
    comp = client.completions.create(model=MODEL, prompt="a customer:", max_tokens=80, temperature=0,
                                     extra_body={"response_format": person_format()})
    assert matches_person(json.loads(comp.choices[0].text))


def test_chat_logprobs_are_consistent_under_greedy(client, ref: Reference) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                          logprobs=True, top_logprobs=5)
    choice = chat.choices[0]
    content = choice.logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # A token may hold part of a character: its `token` shows U+FFFD, its bytes are exact.
    assert joined(content) == choice.message.content == ref.greedy(ref.chat_prompt(MESSAGES), 20)[0]
    for t in content:
        assert len(t.top_logprobs) == 5 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # Without logprobs, none come back.
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          temperature=0).choices[0].logprobs is None


def test_logprobs_under_a_grammar_are_those_of_the_masked_distribution(client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                          response_format=person_format(), logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert joined(content) == chat.choices[0].message.content
    for t in content:  # the chosen token is the best allowed one; disallowed tokens are never listed
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert all(x.logprob > float("-inf") for x in t.top_logprobs)
    assert content[0].token == "{" and content[0].logprob == pytest.approx(0.0)  # the only allowed start


def test_completion_logprobs_in_the_legacy_shape(gen_daemon: DaemonProc, client, ref: Reference) -> None:
    prompt = "hello world"
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text == ref.greedy(prompt, 10)[0]
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == comp.usage.completion_tokens
    # The same tokens as the native route's (which carries each token's exact bytes).
    native = httpx.post(gen_daemon.url + "/v1/generate", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": True,
        "top_logprobs": 3}).json()["logprobs"]
    assert lp.tokens == [bytes(t["bytes"]).decode("utf-8", "replace") for t in native]
    assert lp.token_logprobs == pytest.approx([t["logprob"] for t in native])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # Greedy: the chosen token is the most likely one. (Two tokens that each hold part of
    # a character both read U+FFFD, and share one key of the legacy {token: logprob}.)
    for chosen, top, t in zip(lp.token_logprobs, lp.top_logprobs, native):
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(chosen)
        assert max(top.values()) <= chosen + 1e-6


def test_streamed_logprobs_equal_the_whole_ones(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=25, temperature=0,
                                           logprobs=True, top_logprobs=2).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=25, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


def test_logprobs_stop_where_a_stop_string_cuts_the_text(gen_daemon: DaemonProc, ref: Reference) -> None:
    full = ref.greedy("hello world", 30)[0]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    text = full[:full.find(stop)]
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 30, "temperature": 0, "stop": stop,
                "logprobs": True, "stream": stream}
        if stream:
            with httpx.stream("POST", gen_daemon.url + "/v1/generate", json=body, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            got_text = "".join(e["text"] for e in events)
            logprobs = [t for e in events for t in e.get("logprobs") or []]
        else:
            reply = httpx.post(gen_daemon.url + "/v1/generate", json=body, timeout=60).json()
            got_text, logprobs = reply["text"], reply["logprobs"]
        assert got_text == text
        # The tokens that begin before the cut: they spell the text, the last one
        # reaching into the stop string at most.
        spelled = b"".join(bytes(t["bytes"]) for t in logprobs).decode("utf-8", "replace")
        before = b"".join(bytes(t["bytes"]) for t in logprobs[:-1]).decode("utf-8", "replace")
        assert spelled.startswith(text) and len(before) < len(text), (spelled, text)


def test_include_usage_sends_the_usage_event_last(client) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    comp = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"n": 2, "stream": True}, "n"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_unsupported_chat_fields_are_refused_by_name(gen_daemon: DaemonProc, extra: dict, param: str) -> None:
    r = httpx.post(gen_daemon.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported" and param in error["message"]


@pytest.mark.parametrize("extra, param", [({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                                          ({"suffix": "x"}, "suffix"), ({"n": 3}, "n")])
def test_unsupported_completion_fields_are_refused_by_name(gen_daemon: DaemonProc, extra: dict, param: str) -> None:
    r = httpx.post(gen_daemon.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported" and param in r.text


def test_unsupported_through_the_client_is_a_400(client) -> None:
    import openai

    # tests.gen_models' chat template renders no tools: a request with tools is refused, saying so.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert err.value.status_code == 400 and "cannot express tools" in str(err.value)


@pytest.mark.parametrize("body, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "bad_request"),
    ({"response_format": {"type": "xml"}}, "bad_request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "bad_request"),
    ({"logprobs": True, "top_logprobs": 21}, "bad_request"),
    ({"top_logprobs": 2}, "bad_request"),  # without logprobs: true
])
def test_bad_structured_output_and_logprobs_requests_get_the_contract_error(gen_daemon: DaemonProc, body: dict,
                                                                            code: str) -> None:
    r = httpx.post(gen_daemon.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_native_generate_takes_format_and_logprobs(gen_daemon: DaemonProc) -> None:
    r = httpx.post(gen_daemon.url + "/v1/generate", timeout=60, json={
        "model": MODEL, "prompt": "a customer:", "max_tokens": 80, "temperature": 0, "format": PERSON,
        "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert matches_person(json.loads(body["text"]))
    assert b"".join(bytes(t["bytes"]) for t in body["logprobs"]).decode() == body["text"]
    assert all(len(t["top_logprobs"]) <= 2 for t in body["logprobs"])
    r = httpx.post(gen_daemon.url + "/v1/generate", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 150, "temperature": 0, "format": "json"})
    assert r.json()["finish_reason"] == "stop" and isinstance(json.loads(r.json()["text"]), dict)
    r = httpx.post(gen_daemon.url + "/v1/generate", timeout=60, json={
        "model": MODEL, "prompt": "hi", "format": "xml"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_at_a_tight_budget_generations_wait_for_cache_room_and_all_answer(gen_daemon: DaemonProc, tiny,
                                                                         tmp_path: Path, ref: Reference) -> None:
    # What the worker holds with MODEL resident and idle (weights + activation
    # allowance), read from the running daemon (its worker holds MODEL alone here).
    httpx.post(gen_daemon.url + "/v1/generate", json={"model": MODEL, "prompt": "a", "max_tokens": 1}, timeout=60)
    idle = httpx.get(gen_daemon.url + "/v1/ps", timeout=10).json()["workers"][0]["used_bytes"]
    # Cache bytes per token of tests.gen_models' Llama (fp32): 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes.
    per_token = 2 * 2 * 2 * 16 * 4
    prompt, max_tokens = "hello world", 100
    one = per_token * (len(ref.tokenizer(prompt)["input_ids"]) + max_tokens)
    budget = idle + one + one // 2  # room for one sequence's cache, not two
    home = tmp_path / "home"
    pull(home, tiny[1], MODEL)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1",
                                      "FLEET_CPU_BUDGET_BYTES": str(budget)}, args=["--workers", "1"])
    try:
        import concurrent.futures as cf

        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with cf.ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(httpx.post, d.url + "/v1/generate", json=body, timeout=120) for _ in range(4)]
            used = []
            while not all(a.done() for a in answers):
                used += [w["used_bytes"] for w in httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"]]
                time.sleep(0.02)
        want = ref.greedy(prompt, max_tokens)[0]
        assert [a.result().status_code for a in answers] == [200] * 4  # they waited; none failed
        assert [a.result().json()["text"] for a in answers] == [want] * 4
        assert max(used) <= budget and max(used) > idle, (idle, budget, max(used))
        # One whose cache could never fit is refused clearly, and alone.
        r = httpx.post(d.url + "/v1/generate", json={**body, "max_tokens": 240}, timeout=60)
        assert r.status_code == 507 and r.json()["error"]["code"] == "model_too_large"
        assert "max_tokens" in r.json()["error"]["message"]
    finally:
        d.stop()


def worker_claims(d: DaemonProc) -> int:
    return sum(w["claimed"] for w in httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"])


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(gen_daemon: DaemonProc, tiny) -> None:
    long_ref = Reference(tiny[2])
    # Left alone, this stream decodes 4000 tokens (the model never ends by itself),
    # re-decoding its growing text at every step: far longer than the wait below.
    prompt = "hello world"
    body = {"model": LONG, "prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", gen_daemon.url + "/v1/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert worker_claims(gen_daemon) == 1
        # Counted in the device memory while it runs: the cache reserve of 2000+ tokens.
        used = httpx.get(gen_daemon.url + "/v1/ps", timeout=10).json()["workers"][0]["used_bytes"]
    closed = time.monotonic()
    while worker_claims(gen_daemon) and time.monotonic() - closed < 10:
        time.sleep(0.05)
    freed_s = time.monotonic() - closed
    assert worker_claims(gen_daemon) == 0, "the sequence still runs after its client left"
    # The reserve went with it.
    assert httpx.get(gen_daemon.url + "/v1/ps", timeout=10).json()["workers"][0]["used_bytes"] < used
    print(f"disconnect -> sequence dropped in {freed_s * 1e3:.0f} ms")
    # The worker serves on.
    r = httpx.post(gen_daemon.url + "/v1/generate", json={"model": LONG, "prompt": prompt, "max_tokens": 5,
                                                          "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["text"] == long_ref.greedy(prompt, 5)[0]


# ---- a client's grammar fails its own request only --------------------------------------
# Grammars past the grammar engine's limits (llguidance's lexer): compiling them is cheap,
# but the lexer they need is built as tokens are matched, and blows its limit there.
#: 13 characters whose first token already needs more lexer than the engine builds.
REPEAT_BOMB = "a{1000000000}"
#: Ambiguous repetitions: the lexer passes the first token and fails on the second.
AMBIGUOUS = "(" + "(a|aa)*" * 500 + ")b"
#: The same, after eight forced `z` tokens: the engine fails mid-generation, past any
#: check made before the request runs.
LATE_BOMB = "z" * 8 + AMBIGUOUS
#: A JSON Schema's `pattern` is searched for in the string: anchored, it is the whole string.
BOMB_SCHEMA = {"type": "string", "pattern": f"^{REPEAT_BOMB}$"}


def plain_stream(d: DaemonProc, started) -> dict:
    """A plain generation of another client, streamed from LONG (it never ends by
    itself): `started` is set at its first piece; returns its last event."""
    body = {"model": LONG, "prompt": "hello world", "max_tokens": 300, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", d.url + "/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    return events[-1]


def error_of(r: httpx.Response) -> tuple[str | None, str]:
    """(code, message) of an error reply in the route's shape: the contract's
    `{error: {code, message}}`, TGI's `{error, error_type}`, Ollama's `{error}`."""
    body = r.json()
    if isinstance(body["error"], dict):
        return body["error"]["code"], body["error"]["message"]
    return body.get("error_type"), body["error"]


def assert_grammar_refused(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    code, message = error_of(r)
    assert code in ("bad_request", None) and "grammar engine" in message, r.text
    assert "lexer" in message  # the limit it hit, in the engine's words


@pytest.mark.parametrize("grammar", [REPEAT_BOMB, LATE_BOMB], ids=["refused-at-admission", "fails-mid-generation"])
def test_a_grammar_past_the_engines_limits_fails_only_its_own_request(gen_daemon: DaemonProc, grammar: str) -> None:
    # Four other clients' plain generations are decoding in the worker's batch
    # (each streamed its first piece) when the grammar arrives for the same model.
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(len(started)) as pool:
        victims = [pool.submit(plain_stream, gen_daemon, ev) for ev in started]
        assert all(ev.wait(60) for ev in started)
        r = httpx.post(gen_daemon.url + "/generate", timeout=120, json={
            "model": LONG, "inputs": "hello", "parameters": {"max_new_tokens": 20,
                                                             "grammar": {"type": "regex", "value": grammar}}})
        last = [v.result() for v in victims]
    assert_grammar_refused(r)
    assert all(e.get("finish_reason") == "length" and e["usage"]["output_tokens"] == 300 for e in last), last


def test_eos_never_ends_a_grammar_before_it_accepts(gen_daemon: DaemonProc) -> None:
    # The engine failing on the second token once left EOS as the only token allowed:
    # a 200 with "a" and finish_reason eos_token, text the grammar does not match.
    for grammar in (AMBIGUOUS, LATE_BOMB):
        r = httpx.post(gen_daemon.url + "/generate", timeout=120, json={
            "model": MODEL, "inputs": "hello", "parameters": {"max_new_tokens": 20,
                                                              "grammar": {"type": "regex", "value": grammar}}})
        assert_grammar_refused(r)
    # Streamed: the failure comes after `z`s were sent, as the stream's error event. Greedy,
    # as TGI's route above: sampled, a `b` right after the `z`s ends the regex before the
    # engine meets the ambiguous part (a 200 "stop", 2 runs in 6).
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 20, "regex": LATE_BOMB, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", gen_daemon.url + "/v1/generate", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e.get("text", "") for e in events[:-1]).startswith("zzz")
    assert events[-1]["error"]["code"] == "bad_request", events


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BOMB_SCHEMA}}}),
    ("/v1/generate", {"prompt": "hello", "max_tokens": 20, "format": BOMB_SCHEMA}),
    ("/v1/generate", {"prompt": "hello", "max_tokens": 20, "regex": AMBIGUOUS}),
    ("/api/generate", {"prompt": "hello", "stream": False, "options": {"num_predict": 20}, "format": BOMB_SCHEMA}),
], ids=["openai-json-schema", "native-format", "native-regex", "ollama-format"])
def test_every_route_refuses_a_grammar_past_the_limits_with_a_400(gen_daemon: DaemonProc, route: str,
                                                                  body: dict) -> None:
    assert_grammar_refused(httpx.post(gen_daemon.url + route, timeout=120, json={"model": MODEL, **body}))
