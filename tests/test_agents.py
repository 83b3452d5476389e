"""Agents on a local box, end to end against one real `fleetctl serve` (one CPU worker):
answers run until the model stops or its context is full when the client sends no
limit (OpenAI chat, Responses, Ollama chat), and say which server limit ended them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import httpx
import pytest

from tests.conftest import DaemonProc, start_daemon
from tests.gen_models import GEMMA3_TEMPLATE, SMOLLM3_TEMPLATE, build_llama, build_tool_caller, never_ending, pull

pytestmark = pytest.mark.slow

ENDLESS = "tiny-endless"  # 256 positions, greedy output never stops: it runs to the context's end
CALLER = "tiny-qwen-tools"  # Qwen2.5-Instruct's chat template; calls a tool as soon as it may
PLAIN = "tiny-llama"  # a chat template with no tools
GEMMA = "tiny-gemma3-tools"  # the same caller with Gemma 3's chat template: Python calls in ```tool_code blocks
SMOL = "tiny-smollm3-tools"  # a SmolLM3 caller with its real chat template: tools as `xml_tools`, Hermes calls
CONTEXT = 256
ASK = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("agents-models")
    home = tmp_path_factory.mktemp("agents-home")
    pull(home, never_ending(build_llama(root / ENDLESS)), ENDLESS)
    pull(home, build_tool_caller(root / CALLER), CALLER)
    pull(home, build_llama(root / PLAIN), PLAIN)
    pull(home, build_tool_caller(root / GEMMA, template=GEMMA3_TEMPLATE), GEMMA)
    pull(home, build_tool_caller(root / SMOL, template=SMOLLM3_TEMPLATE, model_type="smollm3"), SMOL)
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


# ---- tool calls -----------------------------------------------------------------------------

SWITCH = {"type": "object", "properties": {"mode": {"enum": ["on", "off"]}, "loud": {"type": "boolean"}},
          "required": ["mode", "loud"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_mode", "description": "Switch the device.",
                                           "parameters": SWITCH}},
         {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                           "parameters": WEATHER}}]
TURN_ON = [{"role": "user", "content": "turn it on"}]


def fits(name: str, arguments: str) -> bool:
    """Does a call parse and fit its tool's schema?"""
    args = json.loads(arguments)
    if name == "set_mode":
        return set(args) == {"mode", "loud"} and args["mode"] in ("on", "off") and type(args["loud"]) is bool
    return name == "get_weather" and set(args) == {"city", "days"} and isinstance(args["city"], str) \
        and type(args["days"]) is int


@pytest.mark.parametrize("choice", ["required", "auto", None, {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_tool_calls_parse_and_fit_their_schema(openai_client, choice) -> None:
    kw = {"tool_choice": choice} if choice is not None else {}
    for seed in range(3):  # sampled too: the grammar holds every pick
        chat = openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, seed=seed, **kw)
        choice0 = chat.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        calls = choice0.message.tool_calls
        assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
        assert all(fits(c.function.name, c.function.arguments) for c in calls), calls
        if isinstance(choice, dict):
            assert {c.function.name for c in calls} == {"get_weather"}


def test_chat_tool_calls_stream_as_deltas_and_history_renders(openai_client) -> None:
    chunks = list(openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, stream=True,
                                                        parallel_tool_calls=False, tool_choice="required"))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # As OpenAI streams a call: the first delta gives its id, type and name, the next ones
    # its arguments as they are written.
    first = deltas[0]
    assert first.index == 0 and first.type == "function" and first.id.startswith("call_") and first.function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments for d in deltas)
    assert len(deltas) > 3 and fits(first.function.name, arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result as history: the template renders them, the model answers.
    history = [*TURN_ON, {"role": "assistant", "content": None, "tool_calls": [
        {"id": first.id, "type": "function", "function": {"name": first.function.name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": first.id, "content": "switched on"}]
    chat = openai_client.chat.completions.create(model=CALLER, messages=history, tools=TOOLS, tool_choice="none",
                                                 max_tokens=4)
    assert chat.choices[0].message.tool_calls is None and chat.usage.prompt_tokens > 0


def test_chat_call_arguments_stream_as_they_are_written(served: DaemonProc, openai_client) -> None:
    # The openai client's stream helper adds up the argument deltas into the call.
    with openai_client.chat.completions.stream(model=CALLER, messages=TURN_ON, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    call = final.choices[0].message.tool_calls[0]
    assert len(pieces) > 3 and "".join(pieces) == done[0].arguments == call.function.arguments
    assert fits(call.function.name, call.function.arguments)
    # Read raw: the pieces leave the server one event each, several per call, before the finish.
    body = {"model": CALLER, "messages": TURN_ON, "tools": TOOLS, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": deltas[0]["function"]["arguments"]}
    assert sum(bool(d["function"].get("arguments")) for d in deltas) > 3
    assert fits("get_weather", "".join(d["function"]["arguments"] for d in deltas))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_fields_beside_tools_are_understood_or_refused_by_name(served: DaemonProc, openai_client) -> None:
    import openai

    # n > 1: n choices, each a call.
    chat = openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, n=2,
                                                 tool_choice="required")
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(fits(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
               for c in chat.choices)
    # stop applies to text, never inside a call: a stop string the call's JSON holds.
    chat = openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, stop=['"'],
                                                 tool_choice="required")
    assert chat.choices[0].finish_reason == "tool_calls"
    # Refused with the field named: logprobs with tools, a choice that names no tool,
    # streamed n > 1; a template that cannot express tools says so. The daemon serves on.
    for kw, param in (({"logprobs": True}, "logprobs"), ({"n": 2, "stream": True}, "n"),
                      ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, **kw)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=PLAIN, messages=TURN_ON, tools=TOOLS)
    assert "the chat template of tiny-llama cannot express tools" in err.value.body["message"]
    assert openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS).choices[0].message


def test_gemma3_calls_tools_as_python_in_its_own_blocks(openai_client) -> None:
    # Its template has no place for tools: they go in its system turn, its calls are read
    # from ```tool_code blocks; to clients, the same calls.
    chat = openai_client.chat.completions.create(model=GEMMA, messages=TURN_ON, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert len(choice.message.tool_calls) == 1 and fits(call.function.name, call.function.arguments)
    chunks = list(openai_client.chat.completions.create(model=GEMMA, messages=TURN_ON, tools=TOOLS, stream=True,
                                                        tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and fits("get_weather", deltas[0].function.arguments)
    # The call and its result as history (its template alone refuses a tool turn), with
    # and without tools to render.
    history = [*TURN_ON, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "switched on"}]
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        assert openai_client.chat.completions.create(model=GEMMA, messages=history, max_tokens=4, **kw).usage
    caps = {m.id: m.model_extra["capabilities"] for m in openai_client.models.list()}
    assert caps[GEMMA] == ["completion", "chat", "tools"]


def test_smollm3_calls_tools_through_its_real_template(openai_client) -> None:
    # A SmolLM3 in its hub layout, with the chat template it was released with
    # (tests/data/smollm3-3b.jinja; test_tool_formats says where it comes from).
    chat = openai_client.chat.completions.create(model=SMOL, messages=TURN_ON, tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "set_mode"}})
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["set_mode"]
    assert fits(call.function.name, call.function.arguments)
    chunks = list(openai_client.chat.completions.create(model=SMOL, messages=TURN_ON, tools=TOOLS, stream=True,
                                                        tool_choice="required", parallel_tool_calls=False))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len({d.index for d in deltas}) == 1 and deltas[0].function.name in ("set_mode", "get_weather")
    assert fits(deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas))
    # The call and its result as history: its template writes an assistant turn's content
    # only, so without fleet's blocks the call vanished and the prompt was the one of an
    # empty assistant turn followed by the user saying the result.
    history = [*TURN_ON, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "switched on"}]
    bare = [*TURN_ON, {"role": "assistant", "content": ""}, {"role": "user", "content": "switched on"}]
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}, {}):
        with_call, without = (openai_client.chat.completions.create(model=SMOL, messages=m, max_tokens=1, **kw)
                              for m in (history, bare))
        assert with_call.usage.prompt_tokens > without.usage.prompt_tokens + 10, kw
    caps = {m.id: m.model_extra["capabilities"] for m in openai_client.models.list()}
    assert caps[SMOL] == ["completion", "chat", "tools"]


def test_responses_function_calls_and_their_outputs(openai_client) -> None:
    import openai

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = openai_client.responses.create(model=CALLER, input="turn it on", tools=tools, tool_choice="required")
    assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"] * len(resp.output)
    call = resp.output[0]
    assert call.call_id.startswith("call_") and fits(call.name, call.arguments)
    with openai_client.responses.stream(model=CALLER, input="turn it on", tools=tools,
                                        parallel_tool_calls=False) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"] and fits(final.output[0].name, final.output[0].arguments)
    history = [{"role": "user", "content": "turn it on"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "switched on"}]
    after = openai_client.responses.create(model=CALLER, input=history, tools=tools, tool_choice="none",
                                           max_output_tokens=4)
    assert [o.type for o in after.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as err:  # a hosted tool: this server runs none
        openai_client.responses.create(model=CALLER, input="hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0]"


def test_a_call_cut_by_max_tokens_answers_length(served: DaemonProc, openai_client) -> None:
    # As OpenAI answers a call its budget cut: finish_reason "length" with the call as
    # written so far (its arguments do not parse), never its markup as content.
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, tool_choice=named,
                                                  temperature=0)
    args = whole.choices[0].message.tool_calls[0].function.arguments
    budget = whole.usage.completion_tokens - 6  # inside the arguments (~15 tokens from their end)
    cut = openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, tool_choice=named,
                                                temperature=0, max_tokens=budget)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and args.startswith(call.function.arguments) and call.function.arguments != args
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    chunks = list(openai_client.chat.completions.create(model=CALLER, messages=TURN_ON, tools=TOOLS, tool_choice=named,
                                                        temperature=0, max_tokens=budget, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    # Responses: the response and its call "incomplete"; Ollama's calls carry arguments as
    # objects: the cut one is left out, done_reason "length".
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = openai_client.responses.create(model=CALLER, input="turn it on", tools=tools, temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=budget)
    assert resp.status == "incomplete" and [(o.type, o.status) for o in resp.output] == [("function_call", "incomplete")]
    assert resp.output[0].arguments == call.function.arguments
    r = httpx.post(served.url + "/api/chat", json={"model": CALLER, "messages": TURN_ON, "stream": False,
                                                   "tools": TOOLS[1:], "options": {"temperature": 0,
                                                                               "num_predict": budget}}, timeout=120)
    assert r.status_code == 200 and r.json()["done_reason"] == "length", r.text
    assert not r.json()["message"].get("tool_calls") and "<tool_call>" not in r.json()["message"]["content"]


def test_ollama_client_tool_calls(served: DaemonProc) -> None:
    import ollama

    def set_mode(mode: str, loud: bool) -> str:
        """Switch the device.

        Args:
          mode: on or off
          loud: whether to be loud
        """
        return f"switched {mode}"

    client = ollama.Client(host=served.url, timeout=120)
    # Ollama has no tool_choice: this model calls as soon as it may ("auto").
    reply = client.chat(model=CALLER, messages=TURN_ON, tools=[set_mode])
    calls = reply.message.tool_calls
    assert reply.done_reason == "stop" and calls and calls[0].function.name == "set_mode"
    assert set(calls[0].function.arguments) == {"mode", "loud"}
    streamed = [c for part in client.chat(model=CALLER, messages=TURN_ON, tools=[set_mode], stream=True)
                for c in part.message.tool_calls or []]
    assert [c.function.name for c in streamed] == ["set_mode"]
    history = [*TURN_ON, reply.message, {"role": "tool", "content": "switched on", "tool_name": "set_mode"}]
    assert client.chat(model=CALLER, messages=history, options={"num_predict": 4}).message is not None
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=PLAIN, messages=TURN_ON, tools=[set_mode])
    assert err.value.status_code == 400 and "cannot express tools" in err.value.error


def test_models_and_show_say_what_each_model_can_do(served: DaemonProc, openai_client) -> None:
    import ollama

    caps = {m.id: m.model_extra["capabilities"] for m in openai_client.models.list()}
    assert caps[CALLER] == ["completion", "chat", "tools"] and caps[PLAIN] == ["completion", "chat"]
    client = ollama.Client(host=served.url, timeout=60)
    assert client.show(CALLER).capabilities == ["completion", "tools"]
    assert client.show(PLAIN).capabilities == ["completion"]


# ---- agent libraries, unchanged ----------------------------------------------------------------

def test_pydantic_ai_structured_output_through_its_output_tool(served: DaemonProc) -> None:
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Switch(BaseModel):
        mode: Literal["on", "off"]
        loud: bool

    model = OpenAIChatModel(CALLER, provider=OpenAIProvider(base_url=served.url + "/v1", api_key="unused"))
    out = Agent(model, output_type=Switch).run_sync("turn it on").output
    assert isinstance(out, Switch)


def test_openai_agents_run_a_tool_on_responses_and_chat(served: DaemonProc) -> None:
    import asyncio
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def set_mode(mode: Literal["on", "off"], loud: bool) -> str:
        """Switch the device."""
        calls.append(mode)
        return f"switched {mode}"

    async def run() -> list[str]:
        client = AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        outs = []
        for model in (OpenAIResponsesModel(CALLER, client), OpenAIChatCompletionsModel(CALLER, client)):
            agent = Agent(name="switch", instructions="Use the tools.", tools=[set_mode], model=model,
                          tool_use_behavior="stop_on_first_tool")
            outs.append((await Runner.run(agent, "turn it on")).final_output)
        return outs

    outs = asyncio.run(run())
    assert len(calls) == 2 and outs == [f"switched {m}" for m in calls]


def test_langchain_bind_tools(served: DaemonProc) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def set_mode(mode: Literal["on", "off"], loud: bool) -> str:
        """Switch the device."""
        return mode

    llm = ChatOpenAI(model=CALLER, base_url=served.url + "/v1", api_key="unused", max_retries=0)
    bound = llm.bind_tools([set_mode], tool_choice="set_mode")
    calls = bound.invoke("turn it on").tool_calls
    assert [c["name"] for c in calls] == ["set_mode"] and set(calls[0]["args"]) == {"mode", "loud"}
    merged = None
    for chunk in bound.stream("turn it on"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["set_mode"]


def test_smolagents_tool_calling_agent_calls_its_tool(served: DaemonProc) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def set_mode(mode: str, loud: bool) -> str:
        """Switch the device.

        Args:
            mode: on or off
            loud: whether to be loud
        """
        return f"switched {mode!r}"

    model = OpenAIServerModel(model_id=CALLER, api_base=served.url + "/v1", api_key="unused")
    agent = ToolCallingAgent(tools=[set_mode], model=model, max_steps=1, verbosity_level=0)
    agent.run("turn it on")
    step = next(s for s in agent.memory.steps if getattr(s, "tool_calls", None))
    assert step.tool_calls[0].name in ("set_mode", "final_answer")
    assert step.tool_calls[0].name != "set_mode" or "switched" in step.observations


#: Where `node` finds the Vercel AI SDK (a folder holding node_modules/ai):
#: FLEET_AI_SDK_DIR, else the folder scripts/setup_js_clients.sh installs into.
AI_SDK_DIR = Path(os.environ.get("FLEET_AI_SDK_DIR") or Path(__file__).parents[1] / ".venv" / "node")
AI_SDK = """
import { generateText, streamText, tool, jsonSchema } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
const base = process.argv[1];  // node -e SCRIPT URL
const model = createOpenAICompatible({ name: "fleet", baseURL: `${base}/v1`, apiKey: "unused" }).chatModel("%(model)s");
const ran = [];
const tools = { set_mode: tool({ description: "Switch the device.", inputSchema: jsonSchema(%(schema)s),
                                 execute: async ({ mode }) => { ran.push(mode); return `switched ${mode}`; } }) };
const out = {};
try {
  const gen = await generateText({ model, tools, toolChoice: "required", prompt: "turn it on" });
  out.generated = { calls: gen.toolCalls.map((c) => [c.toolName, c.input]), results: gen.toolResults.map((r) => r.output),
                    finish: gen.finishReason };
  // The call and its result as history, in the SDK's own messages: the model answers.
  const after = await generateText({ model, tools, toolChoice: "none", maxOutputTokens: 4,
                                     messages: [{ role: "user", content: "turn it on" }, ...gen.response.messages] });
  out.after = { calls: after.toolCalls.length, inputTokens: after.usage.inputTokens };
  const st = streamText({ model, tools, toolChoice: "required", prompt: "turn it on" });
  out.parts = [];
  for await (const p of st.fullStream) out.parts.push(p.type === "tool-input-delta" ? [p.type, p.delta] : [p.type]);
  out.streamed = { calls: (await st.toolCalls).map((c) => [c.toolName, c.input]),
                   results: (await st.toolResults).map((r) => r.output) };
  out.ran = ran;
} catch (e) { out.failed = String(e); }
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(not (AI_SDK_DIR / "node_modules" / "ai").is_dir() or shutil.which("node") is None,
                    reason="the Vercel AI SDK runs where scripts/setup_js_clients.sh installed it (or "
                           "FLEET_AI_SDK_DIR names a folder with `ai` and `@ai-sdk/openai-compatible`) "
                           "and node is on PATH")
def test_vercel_ai_sdk_runs_a_tool_through_generate_and_stream(served: DaemonProc) -> None:
    script = AI_SDK % {"model": CALLER, "schema": json.dumps(SWITCH)}
    run = subprocess.run(["node", "--input-type=module", "-e", script, served.url], cwd=AI_SDK_DIR,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "failed" not in out, out
    # Each call parsed by the SDK against the tool's schema and run by it; its result went back.
    gen, streamed = out["generated"], out["streamed"]
    assert gen["finish"] == "tool-calls" and [n for n, _ in gen["calls"]] == ["set_mode"]
    assert all(fits(n, json.dumps(a)) for n, a in gen["calls"] + streamed["calls"])
    assert out["ran"] == [a["mode"] for _, a in gen["calls"] + streamed["calls"]]
    assert gen["results"] + streamed["results"] == [f"switched {m}" for m in out["ran"]]
    assert out["after"]["calls"] == 0 and out["after"]["inputTokens"] > 0
    # Streamed: the call's arguments arrive as input deltas, then the whole call.
    kinds = [p[0] for p in out["parts"]]
    assert kinds.index("tool-input-start") < kinds.index("tool-input-delta") < kinds.index("tool-call")
    assert kinds.count("tool-input-delta") > 3  # as they are written
    assert kinds[-1] == "finish"


# ---- generation metrics ------------------------------------------------------------------------

def test_time_to_first_token_and_generated_tokens_per_model(served: DaemonProc, openai_client) -> None:
    before = metric(served, "fleet_generated_tokens_total", ENDLESS)
    chat = openai_client.chat.completions.create(model=ENDLESS, messages=ASK, temperature=0, max_tokens=40)
    list(openai_client.chat.completions.create(model=ENDLESS, messages=ASK, temperature=0, max_tokens=40,
                                               stream=True))
    assert metric(served, "fleet_generated_tokens_total", ENDLESS) - before == 2 * chat.usage.completion_tokens
    assert metric(served, "fleet_time_to_first_token_seconds_count", ENDLESS) >= 2
    row = next(m for m in httpx.get(served.url + "/v1/top", timeout=30).json()["models"] if m["model"] == ENDLESS)
    assert row["ttft_p50_ms"] > 0 and row["generated_tokens_per_s"] > 0


def metric(d: DaemonProc, name: str, model: str) -> float:
    """A series of `/metrics` for one model (0 when it has none yet)."""
    prefix = f'{name}{{model="{model}"}} '
    lines = httpx.get(d.url + "/metrics", timeout=30).text.splitlines()
    return next((float(line[len(prefix):]) for line in lines if line.startswith(prefix)), 0.0)


def instructor_module():
    """instructor, unchanged, from `.venv/instructor` (scripts/setup.sh --test): its newest
    release pins `jiter<0.15` and `rich<15`, which would take openai back from 3.63 to 3.3
    in the venv, so it is installed beside the venv with --no-deps (as the OpenVINO extra)."""
    import importlib
    import sys

    folder = Path(os.environ.get("FLEET_INSTRUCTOR_DIR", Path(__file__).resolve().parents[1] / ".venv" / "instructor"))
    if not (folder / "instructor").is_dir():
        pytest.skip(f"instructor is not installed in {folder} (scripts/setup.sh --test installs it)")
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # after the venv: nothing of the venv's is shadowed
    try:
        return importlib.import_module("instructor")
    except ImportError as exc:  # one of its requirements is missing from the venv
        pytest.skip(f"instructor from {folder} does not import here: {exc}")


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_typed_object(served: DaemonProc, mode: str) -> None:
    import openai
    from pydantic import BaseModel

    instructor = instructor_module()

    class Switch(BaseModel):
        mode: Literal["on", "off"]
        loud: bool

    client = instructor.from_openai(openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                                  timeout=120), mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(model=CALLER, response_model=Switch, max_tokens=64,
                                         messages=[{"role": "user", "content": "turn it on"}])
    assert isinstance(out, Switch)
