"""Tool-call formats in the worker (runtimes.adapters.tools), in-process on a tiny model: each
family's format is recognised from its chat template's text, rendered, held to the
tools' schemas while decoding, and parsed back; text beside calls and calls that do
not parse are kept apart."""

from __future__ import annotations

import json

import pytest

from fleet.protocol import (
    ChatMessage, FunctionCall, FunctionDef, FunctionName, GenerateRequest, NamedToolChoice, ToolCall, ToolDef,
)
from fleet.tools import HERMES, LLAMA_JSON, PHI4_MINI, TOOL_CODE, tool_format
from fleet.runtimes.base import ModelSpec, Profile
from fleet.runtimes.adapters.generate import CausalLM
from fleet.runtimes.adapters.tools import Caller
from tests.gen_models import CHAT_TEMPLATE, GEMMA3_TEMPLATE, QWEN25_TEMPLATE, SMOLLM3_TEMPLATE, build_tool_caller

#: Phi-4-mini-instruct's chat template as the model ships it: tools as JSON text in the system turn.
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
#: A template in Llama 3.x's tool format (its instruction line and its `ipython` turns).
LLAMA_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}"
    "<|end_header_id|>\n\n{% if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SWITCH = ToolDef(FunctionDef("set_mode", "Switch the device.", {
    "type": "object", "properties": {"mode": {"enum": ["on", "off"]}, "loud": {"type": "boolean"}},
    "required": ["mode", "loud"], "additionalProperties": False}))
WEATHER = ToolDef(FunctionDef("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}))
ASK = [ChatMessage("user", "turn it on")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    adapter = CausalLM(ModelSpec("caller", build_tool_caller(tmp_path_factory.mktemp("formats") / "caller"),
                                 "generate", "transformers", Profile()), "cpu")
    adapter.load()
    return adapter


def test_the_format_is_read_from_the_template() -> None:
    assert tool_format(QWEN25_TEMPLATE.read_text()) == HERMES
    assert tool_format(SMOLLM3_TEMPLATE.read_text()) == HERMES
    assert tool_format(LLAMA_TEMPLATE) == LLAMA_JSON
    assert tool_format(PHI4_TEMPLATE) == PHI4_MINI
    assert tool_format(GEMMA3_TEMPLATE.read_text()) == TOOL_CODE
    assert tool_format(CHAT_TEMPLATE) is None and tool_format(None) is None


def run(model: CausalLM, template: str, max_tokens: int = 300, **kw) -> tuple:
    """A streamed request's result, and the call pieces its stream sent."""
    model.tokenizer.chat_template = template
    req = GenerateRequest(model="caller", messages=ASK, temperature=0.0, max_tokens=max_tokens, tools=[SWITCH, WEATHER],
                          stream=True, **kw)
    assert model.admit(0, req) is None
    results, pieces = {}, []
    while model.has_active():
        partials, done = model.step()
        assert not any(chunk.text for _, chunk in partials)  # never a call's markup as text
        pieces += [c for _, chunk in partials for c in chunk.calls]
        results.update(done)
    return results[0], pieces


def assembled(pieces: list) -> list[tuple[str, str]]:
    """The calls a stream's pieces add up to, each piece checked to continue its call."""
    written: dict[int, tuple[str, str]] = {}
    for p in pieces:
        name, args = written.get(p.index, (p.name, ""))
        assert p.start == len(args) and p.name == name and p.index <= len(written), (p, written)
        written[p.index] = (name, args + p.arguments)
    return [written[i] for i in range(len(written))]


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE.read_text(), SMOLLM3_TEMPLATE.read_text(), LLAMA_TEMPLATE,
                                      PHI4_TEMPLATE, GEMMA3_TEMPLATE.read_text()],
                         ids=[HERMES, "smollm3", LLAMA_JSON, PHI4_MINI, TOOL_CODE])
def test_each_format_decodes_calls_that_fit_their_schema(model: CausalLM, template: str) -> None:
    try:
        for choice in ("required", NamedToolChoice(FunctionName("get_weather"))):
            res, pieces = run(model, template, tool_choice=choice, parallel_tool_calls=False)
            assert res.finish_reason == "tool_calls" and len(res.tool_calls) == 1 and res.text == "", res
            call = res.tool_calls[0]
            # Streamed, the arguments came as the model wrote them: piece by piece, the call in the end
            # (a Python call is not its JSON arguments: it comes whole once written).
            assert assembled(pieces) == [(call.name, call.arguments)]
            assert len(pieces) == 1 if tool_format(template) == TOOL_CODE else len(pieces) > 3
            args = json.loads(call.arguments)
            if call.name == "set_mode":
                assert args["mode"] in ("on", "off") and type(args["loud"]) is bool
            else:
                assert call.name == "get_weather" and isinstance(args["city"], str) and type(args["days"]) is int
            assert not isinstance(choice, NamedToolChoice) or call.name == "get_weather"
    finally:
        model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE.read_text(), SMOLLM3_TEMPLATE.read_text(), LLAMA_TEMPLATE,
                                      PHI4_TEMPLATE, GEMMA3_TEMPLATE.read_text()],
                         ids=[HERMES, "smollm3", LLAMA_JSON, PHI4_MINI, TOOL_CODE])
def test_history_calls_are_rendered_in_the_format(model: CausalLM, template: str) -> None:
    model.tokenizer.chat_template = template
    try:
        call = ToolCall(FunctionCall("set_mode", '{"mode": "on", "loud": false}'), id="call_1")
        history = [*ASK, ChatMessage("assistant", None, [call]), ChatMessage("tool", "switched on", tool_call_id="call_1",
                                                                              name="set_mode")]
        caller = Caller("caller", model.tokenizer, [SWITCH], "auto", True, model._engine_token)
        text = model.tokenizer.decode(model.prompt_ids(GenerateRequest(model="caller", messages=history,
                                                                       tools=[SWITCH]), caller))
        assert "switched on" in text and "Switch the device." in text
        if tool_format(template) != TOOL_CODE:
            assert '"mode": "on"' in text
            return
        # Gemma 3's: the tools as Python signatures, the call as Python, its result in a user
        # turn (the template refuses a tool turn); without tools to render, the same history.
        assert 'def set_mode(mode: Literal["on", "off"], loud: bool):' in text
        assert '<start_of_turn>model\n```tool_code\nset_mode(mode="on", loud=False)\n```<end_of_turn>' in text
        assert "<start_of_turn>user\n```tool_output\nswitched on\n```<end_of_turn>" in text
        plain = model.tokenizer.decode(model.prompt_ids(GenerateRequest(model="caller", messages=history)))
        assert "def set_mode" not in plain and "```tool_output\nswitched on" in plain
    finally:
        model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


def test_sampled_calls_hold_only_the_properties_their_schema_declares(model: CausalLM) -> None:
    # No `additionalProperties` in the schema (LangChain's and Ollama's clients send none):
    # an undeclared key would fit JSON Schema and fail the function it calls.
    open_switch = ToolDef(FunctionDef("set_mode", None, {
        "type": "object", "properties": {"mode": {"enum": ["on", "off"]}, "loud": {"type": "boolean"}},
        "required": ["mode", "loud"]}))
    keys = set()
    for seed in range(32):
        req = GenerateRequest(model="caller", messages=ASK, temperature=1.0, seed=seed, max_tokens=300,
                              tools=[open_switch], tool_choice=NamedToolChoice(FunctionName("set_mode")))
        assert model.admit(seed, req) is None
    results = {}
    while model.has_active():
        results.update(model.step()[1])
    for res in results.values():
        keys |= {frozenset(json.loads(c.arguments)) for c in res.tool_calls}
    assert keys == {frozenset({"mode", "loud"})}


def test_split_keeps_text_beside_calls_and_calls_that_do_not_parse(model: CausalLM) -> None:
    caller = Caller("caller", model.tokenizer, [SWITCH], "auto", True, model._engine_token)
    text = ('Sure. <tool_call>\n{"name": "set_mode", "arguments": {"mode": "on", "loud": true}}\n</tool_call>\n'
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    rest, calls = caller.split(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("set_mode", {"mode": "on", "loud": True})]
    assert rest.startswith("Sure. ") and '"nope"' in rest  # a call of no tool stays text
    assert caller.call_start("Sure. <tool_") == len("Sure. ")  # a marker's beginning is held back
    assert caller.split("no call here") == ("no call here", [])


def test_call_pieces_follow_a_growing_text(model: CausalLM) -> None:
    # Two calls in each format's blocks, the text growing a character at a time; a
    # character still partial (decoded as U+FFFD) is held back until it is whole.
    weather = '{"name": "get_weather", "arguments": {"city": "Orl\u00e9ans", "days": 2}}'
    switch = '{"name": "set_mode", "arguments": {"mode": "on", "loud": true}}'
    texts = {QWEN25_TEMPLATE.read_text(): f"<tool_call>\n{weather}\n</tool_call>\n<tool_call>\n{switch}\n</tool_call>",
             PHI4_TEMPLATE: f"<|tool_call|>[{weather}, {switch}]<|/tool_call|>"}
    for template, text in texts.items():
        model.tokenizer.chat_template = template
        try:
            caller = Caller("caller", model.tokenizer, [SWITCH, WEATHER], "required", True, model._engine_token)
            sent, pieces = [], []
            for end in range(1, len(text) + 1):
                grown = text[:end - 1] + "\ufffd" if text[end - 1] == "\u00e9" else text[:end]
                pieces += caller.call_pieces(grown, sent)
            pieces += caller.call_pieces(text, sent)
            _, calls = caller.split(text)
            assert assembled(pieces) == [(c.name, c.arguments) for c in calls]
            assert [c.arguments for c in calls] == ['{"city": "Orl\u00e9ans", "days": 2}', '{"mode": "on", "loud": true}']
            assert all("\ufffd" not in p.arguments for p in pieces)
        finally:
            model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


def test_gemma3_calls_python_functions_in_tool_code_blocks(model: CausalLM) -> None:
    # "auto" (text or calls, several a block): each call fits its schema.
    for choice, parallel in (("required", False), ("auto", True)):
        res, pieces = run(model, GEMMA3_TEMPLATE.read_text(), tool_choice=choice, parallel_tool_calls=parallel)
        assert res.finish_reason in ("tool_calls", "stop"), res
        assert all(fits(c.name, c.arguments) for c in res.tool_calls) and (res.tool_calls or choice == "auto")
        assert assembled(pieces) == [(c.name, c.arguments) for c in res.tool_calls]
    model.tokenizer.chat_template = GEMMA3_TEMPLATE.read_text()
    try:
        caller = Caller("caller", model.tokenizer, [SWITCH, WEATHER], "auto", True, model._engine_token)
        text = ('Sure.\n```tool_code\nset_mode(mode="on", loud=True)\nget_weather(city="Orl\u00e9ans", '
                'days=2, extra={"a": [true, null]})\n```')
        rest, calls = caller.split(text)
        assert rest == "Sure.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("set_mode", {"mode": "on", "loud": True}),
            ("get_weather", {"city": "Orl\u00e9ans", "days": 2, "extra": {"a": [True, None]}})]
        # Parsed, never run: anything but calls of known tools with literal keywords stays text.
        for body in ('__import__("os").system("x")', "set_mode(*a)", "set_mode(**a)", "set_mode(mode=x)",
                     'nope(mode="on")', "set_mode(mode={1, 2})", "set_mode(mode=1j)", "set_mode("):
            assert caller.split(f"```tool_code\n{body}\n```")[1] == [], body
        # A tool a Python call cannot spell is refused, saying which name.
        odd = ToolDef(FunctionDef("set-mode", None, {"type": "object", "properties": {}}))
        err = model.admit(0, GenerateRequest(model="caller", messages=ASK, tools=[odd]))
        assert err.code == "bad_request" and "'set-mode'" in err.message and not model.has_active()
    finally:
        model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


def fits(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "set_mode":
        return set(args) == {"mode", "loud"} and args["mode"] in ("on", "off") and type(args["loud"]) is bool
    return name == "get_weather" and set(args) == {"city", "days"} and isinstance(args["city"], str) \
        and type(args["days"]) is int


def test_a_template_with_no_tools_is_refused_saying_so(model: CausalLM) -> None:
    model.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        err = model.admit(0, GenerateRequest(model="caller", messages=ASK, tools=[SWITCH]))
        assert err.code == "bad_request" and "cannot express tools" in err.message
        assert not model.has_active()
    finally:
        model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


def test_smollm3_template_renders_tools_calls_results_and_its_flags(model: CausalLM) -> None:
    """SmolLM3's real chat template, recognised from its text (this model is a Qwen2 named
    "caller"). tests/data/smollm3-3b.jinja is, byte for byte (sha256 3982464e...), the
    chat template HuggingFaceTB/SmolLM3-3B was released with on 8 July 2025; found in the
    public GitHub repository EricLBuehler/mistral.rs at chat_templates/smollm3.jinja
    (commit 85dcfbef, "Add the SmolLM3 model!", unchanged since). Later hub revisions
    also take `tools` as `xml_tools`.

    The template reads the tools from `xml_tools` and writes each as Python writes a dict;
    it writes an assistant turn's content only and a tool turn as a user turn: without
    fleet's blocks, a history call vanished (an empty assistant turn) and its result read
    as the user's words."""
    model.tokenizer.chat_template = SMOLLM3_TEMPLATE.read_text()
    try:
        call = ToolCall(FunctionCall("set_mode", '{"mode": "on", "loud": false}'), id="call_1")
        history = [*ASK, ChatMessage("assistant", None, [call]),
                   ChatMessage("tool", "switched on", tool_call_id="call_1", name="set_mode")]
        caller = Caller("caller", model.tokenizer, [SWITCH, WEATHER], "auto", True, model._engine_token)
        text = model.tokenizer.decode(model.prompt_ids(GenerateRequest(model="caller", messages=history,
                                                                       tools=[SWITCH, WEATHER]), caller))
        functions = [{"name": t.function.name, "description": t.function.description or "",
                      "parameters": t.function.parameters} for t in (SWITCH, WEATHER)]
        assert f"<tools>\n{functions[0]}\n{functions[1]}\n</tools>" in text and "'type': 'function'" not in text
        assert "Reasoning Mode: /think" in text
        block = '<tool_call>\n{"name": "set_mode", "arguments": {"mode": "on", "loud": false}}\n</tool_call>'
        result = "<|im_start|>user\n<tool_response>\nswitched on\n</tool_response><|im_end|>"
        assert f"<|im_start|>assistant\n{block}<|im_end|>\n{result}" in text
        # Without tools to render (or tool_choice "none"), the same history.
        plain = model.tokenizer.decode(model.prompt_ids(GenerateRequest(model="caller", messages=history)))
        assert "### Tools" not in plain and f"<|im_start|>assistant\n{block}<|im_end|>\n{result}" in plain
        # Its /no_think flag: an empty thought before each assistant turn, the call after it.
        quiet = [ChatMessage("system", "Be brief. /no_think"), *history]
        text = model.tokenizer.decode(model.prompt_ids(GenerateRequest(model="caller", messages=quiet,
                                                                       tools=[SWITCH]), caller))
        assert "Reasoning Mode: /no_think" in text and "Be brief." in text
        assert f"<|im_start|>assistant\n<think>\n\n</think>\n{block}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
        req = GenerateRequest(model="caller", messages=quiet, temperature=0.0, max_tokens=300, tools=[SWITCH, WEATHER],
                              tool_choice=NamedToolChoice(FunctionName("set_mode")))
        assert model.admit(0, req) is None
        results = {}
        while model.has_active():
            results.update(model.step()[1])
        res = results[0]
        assert res.finish_reason == "tool_calls" and [c.name for c in res.tool_calls] == ["set_mode"], res
        assert fits("set_mode", res.tool_calls[0].arguments)
    finally:
        model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE.read_text(), LLAMA_TEMPLATE, PHI4_TEMPLATE],
                         ids=[HERMES, LLAMA_JSON, PHI4_MINI])
def test_a_call_cut_by_max_tokens_is_a_call_with_length(model: CausalLM, template: str) -> None:
    # As OpenAI answers it: finish_reason "length" and the call as written so far (its
    # arguments do not parse), never its markup as text; streamed, the same call.
    named = NamedToolChoice(FunctionName("get_weather"))
    whole, _ = run(model, template, tool_choice=named)
    (call,) = whole.tool_calls
    n = whole.output_tokens
    budgets = range(n - 5, n - 25, -6)  # cuts in the closing markup, the arguments, the name
    for budget in budgets:  # one batch: greedy and held by the grammar, each row decodes alone
        req = GenerateRequest(model="caller", messages=ASK, temperature=0.0, max_tokens=budget,
                              tools=[SWITCH, WEATHER], tool_choice=named, stream=True)
        assert model.admit(budget, req) is None
    results, pieces = {}, {b: [] for b in budgets}
    while model.has_active():
        partials, done = model.step()
        for key, chunk in partials:
            assert not chunk.text
            pieces[key] += chunk.calls
        results.update(done)
    unparsed = 0
    for budget in budgets:
        res = results[budget]
        assert res.finish_reason == "length" and res.text == "" and res.output_tokens == budget, res
        if not res.tool_calls:  # cut before its name was written: nothing to call, no markup as text
            assert not pieces[budget]
            continue
        assert len(res.tool_calls) == 1 and res.tool_calls[0].name == "get_weather", res
        assert call.arguments.startswith(res.tool_calls[0].arguments)
        # What the stream sent is the call's beginning (the daemon sends the rest from the result).
        streamed = assembled(pieces[budget])
        assert len(streamed) <= 1 and all(name == "get_weather" and res.tool_calls[0].arguments.startswith(sent)
                                          for name, sent in streamed)
        unparsed += res.tool_calls[0].arguments != call.arguments
    assert unparsed >= 2
    model.tokenizer.chat_template = QWEN25_TEMPLATE.read_text()
