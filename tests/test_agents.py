"""Agents on a local box, end to end against one real `fleetctl serve` (one CPU worker):
answers run until the model stops or its context is full when the client sends no
limit (OpenAI chat, Responses, Ollama chat), and say which server limit ended them.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import DaemonProc, start_daemon
from tests.gen_models import build_llama, never_ending, pull

pytestmark = pytest.mark.slow

ENDLESS = "tiny-endless"  # 256 positions, greedy output never stops: it runs to the context's end
CONTEXT = 256
ASK = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("agents-models")
    home = tmp_path_factory.mktemp("agents-home")
    pull(home, never_ending(build_llama(root / ENDLESS)), ENDLESS)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def openai_client(served: DaemonProc):
    import openai

    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- answers in full ----------------------------------------------------------------------

def test_chat_with_no_limit_answers_to_the_end_of_the_context(served: DaemonProc, openai_client) -> None:
    raw = openai_client.chat.completions.with_raw_response.create(model=ENDLESS, messages=ASK, temperature=0)
    chat = raw.parse()
    usage = chat.usage
    assert usage.completion_tokens > 128 and usage.prompt_tokens + usage.completion_tokens == CONTEXT
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and choice.model_extra["length_limit"] == "context"
    assert raw.headers["x-fleet-length-limit"] == f"context; tokens={CONTEXT}"
    # Streamed: the same, the limit on the finishing event.
    chunks = list(openai_client.chat.completions.create(model=ENDLESS, messages=ASK, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].model_extra["length_limit"] == "context"
    # The client's own limit is not a server limit: no field, no header.
    raw = openai_client.chat.completions.with_raw_response.create(model=ENDLESS, messages=ASK, max_tokens=5)
    assert "length_limit" not in raw.parse().choices[0].model_extra and "x-fleet-length-limit" not in raw.headers


def test_responses_with_no_limit_answers_to_the_end_of_the_context(openai_client) -> None:
    resp = openai_client.responses.create(model=ENDLESS, input="hello world", temperature=0)
    assert resp.usage.output_tokens > 128 and resp.usage.input_tokens + resp.usage.output_tokens == CONTEXT
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.incomplete_details.model_extra["length_limit"] == "context"


def test_ollama_chat_with_no_limit_answers_to_the_end_of_the_context(served: DaemonProc) -> None:
    import ollama

    client = ollama.Client(host=served.url, timeout=120)
    done = client.chat(model=ENDLESS, messages=ASK, options={"temperature": 0})
    assert done.eval_count > 128 and done.prompt_eval_count + done.eval_count == CONTEXT
    assert done.done_reason == "length"
    # The limit, in fleet's field (the ollama client's types keep Ollama's own only) and header.
    body = {"model": ENDLESS, "messages": ASK, "options": {"temperature": 0}}
    r = httpx.post(served.url + "/api/chat", json={**body, "stream": False}, timeout=120)
    assert r.json()["length_limit"] == "context" and r.headers["x-fleet-length-limit"] == f"context; tokens={CONTEXT}"
    with httpx.stream("POST", served.url + "/api/chat", json=body, timeout=120) as r:
        last = json.loads(list(r.iter_lines())[-1])
    assert last["done_reason"] == "length" and last["length_limit"] == "context"
