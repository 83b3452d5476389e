"""MCP (fleet/mcp_tools.py): the official `mcp` SDK's client lists fleet's tools and
calls each one, over both transports, against a real daemon serving tiny models:
streamable HTTP at the daemon's `/mcp` (daemon/mcp_http.py) and stdio through
`fleetctl mcp` spawned as an agent spawns it (fleetctl/commands/mcp.py).

Each tool's structured result is the route's own JSON answer (the embed tool's
vectors equal `/v1/embed`'s); a refusal is a tool error carrying the daemon's
message, and the daemon keeps serving. `/mcp` takes the API key and the browser
guard like every route.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from fleet.mcp_tools import TOOLS, TOOLS_BY_NAME
from tests.conftest import start_daemon

pytestmark = pytest.mark.slow

KEY = "mcp-test-key-" + "k" * 20
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["the invoice is overdue", "hello world"]
#: Store name -> (folder key, task).
MODELS = {"t-emb": ("embedder", "embed"), "t-rr": ("reranker", "rerank"), "t-cls": ("classifier", "classify"),
          "t-ner": ("tagger", "extract"), "t-gen": ("llama", "generate"), "t-dec": ("llama", "decide")}
#: tool -> (arguments, keys its structured result must hold).
CALLS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "embed": ({"model": "t-emb", "inputs": TEXTS}, ("embeddings", "shape")),
    "rerank": ({"model": "t-rr", "query": "unpaid invoice", "documents": TEXTS}, ("results",)),
    "classify": ({"model": "t-cls", "inputs": TEXTS}, ("results",)),
    "extract": ({"model": "t-ner", "inputs": TEXTS}, ("results",)),
    "decide": ({"model": "t-dec", "state": TEXTS[0],
                "questions": {"late": {"type": "noul", "instructions": "Is the payment late?"},
                              "team": {"type": "choice", "criteria": {"billing": None, "support": None}}}},
               ("answers",)),
    "generate": ({"model": "t-gen", "prompt": "hello", "max_tokens": 4, "temperature": 0}, ("text", "finish_reason")),
    "models": ({}, ("data",)),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    from fleet.pull import pull_model
    from fleet.store import Store
    from tests.gen_models import build_llama
    from tests.lora_models import build_bases

    root = tmp_path_factory.mktemp("mcp-models")
    folders = {**build_bases(root), "llama": build_llama(root / "llama")}
    home = tmp_path_factory.mktemp("mcp-home")
    store = Store(home / "models")
    for name, (key, task) in MODELS.items():
        pull_model(store, f"path:{folders[key]}", name=name, task=task)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_API_KEY": KEY, "FLEET_CPU_THREADS": "1"},
                     args=["--workers", "1"], wait_ready=False)
    deadline = time.time() + 180
    while True:  # readiness takes the key too
        try:
            if httpx.get(d.url + "/readyz", headers=AUTH, timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline and d.proc.poll() is None, d.tail()
        time.sleep(0.3)
    yield d
    d.stop()


async def over_http(url: str, calls: list[tuple[str, dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """(listed tools, results) through the SDK's streamable HTTP client at `url`/mcp."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers=AUTH, timeout=120) as http, \
            streamable_http_client(url + "/mcp", http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        listed = (await session.list_tools()).tools
        return listed, [await session.call_tool(name, args) for name, args in calls]


async def over_stdio(url: str, calls: list[tuple[str, dict[str, Any]]], home: Path) -> tuple[list[Any], list[Any]]:
    """The same through `fleetctl mcp`, spawned with the environment an agent's config gives it."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "fleetctl", "mcp"],
                                   env={"FLEET_URL": url, "FLEET_API_KEY": KEY, "FLEET_HOME": str(home)},
                                   cwd=str(Path(__file__).resolve().parent.parent))
    with open(os.devnull, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            listed = (await session.list_tools()).tools
            return listed, [await session.call_tool(name, args) for name, args in calls]


def check_every_tool(fleet, listed: list[Any], results: list[Any]) -> None:
    assert [t.name for t in listed] == [t.name for t in TOOLS]
    for tool in listed:
        assert tool.input_schema["type"] == "object" and tool.description
        assert tool.output_schema["type"] == "object"
    for (name, (_args, keys)), result in zip(CALLS.items(), results):
        assert not result.is_error, (name, result.content)
        data = result.structured_content
        assert set(keys) <= set(data), (name, data)
        assert json.loads(result.content[0].text) == data  # the same JSON, for text-only clients
    by_name = dict(zip(CALLS, results))
    # The route's own answer: the embed tool's vectors are /v1/embed's.
    direct = httpx.post(fleet.url + "/v1/embed", json=CALLS["embed"][0], headers=AUTH, timeout=60).json()
    assert by_name["embed"].structured_content["embeddings"] == direct["embeddings"]
    assert by_name["embed"].structured_content["shape"] == [2, 32]
    assert sorted(r["index"] for r in by_name["rerank"].structured_content["results"]) == [0, 1]
    assert set(by_name["decide"].structured_content["answers"]) == {"late", "team"}
    stored = {m["id"]: m for m in by_name["models"].structured_content["data"]}
    assert set(MODELS) <= set(stored) and stored["t-emb"]["loaded"] is True


def test_http_client_lists_and_calls_every_tool(fleet):
    listed, results = asyncio.run(over_http(fleet.url, [(n, a) for n, (a, _) in CALLS.items()]))
    check_every_tool(fleet, listed, results)


def test_stdio_client_lists_and_calls_every_tool(fleet, tmp_path):
    listed, results = asyncio.run(over_stdio(fleet.url, [(n, a) for n, (a, _) in CALLS.items()], tmp_path))
    check_every_tool(fleet, listed, results)


BAD = [
    ("embed", {"model": "t-emb", "inputs": ["x"], "bogus": 1}, "unknown field `bogus`"),
    ("embed", {"model": "no-such-model", "inputs": ["x"]}, "no-such-model"),
    ("generate", {"model": "t-emb", "prompt": "x"}, "t-emb"),
    ("decide", {"model": "t-dec", "state": "x", "questions": {}}, "questions"),
]


def test_refusals_are_tool_errors_with_the_daemons_message(fleet, tmp_path):
    for run in (lambda calls: over_http(fleet.url, calls), lambda calls: over_stdio(fleet.url, calls, tmp_path)):
        _, results = asyncio.run(run([(name, args) for name, args, _ in BAD]))
        for (name, _args, words), result in zip(BAD, results):
            assert result.is_error, (name, result)
            assert words in result.content[0].text, (name, result.content[0].text)
    # Nothing else changed: the daemon answers as before.
    ok = httpx.post(fleet.url + "/v1/embed", json=CALLS["embed"][0], headers=AUTH, timeout=60)
    assert ok.status_code == 200


def test_mcp_takes_the_key_and_the_browser_guard(fleet):
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    no_key = httpx.post(fleet.url + "/mcp", json=init, headers=accept, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "unauthorized"
    page = httpx.post(fleet.url + "/mcp", json=init, headers={**accept, **AUTH, "Origin": "https://evil.example"},
                      timeout=30)
    assert page.status_code == 403
    ok = httpx.post(fleet.url + "/mcp", json=init, headers={**accept, **AUTH}, timeout=30)
    assert ok.status_code == 200 and ok.json()["result"]["serverInfo"]["name"] == "fleet"


def test_every_schema_field_is_a_field_of_the_route():
    """A tool's arguments are its route's body: each property the schema offers is one
    the route's request takes (its Struct, or System One's fields), so no tool
    advertises an argument the daemon would refuse."""
    from fleet.daemon import systemone
    from fleet import protocol

    structs = {"embed": protocol.EmbedRequestJson, "rerank": protocol.RerankRequest,
               "classify": protocol.ClassifyRequest, "extract": protocol.ExtractRequest,
               "generate": protocol.GenerateRequest}
    for name, struct in structs.items():
        spec = TOOLS_BY_NAME[name]
        assert set(spec.properties) | set(spec.fixed) <= set(struct.__struct_fields__), name
        assert set(spec.required) <= set(spec.properties)
        msgspec.json.schema(struct)  # the Struct is what the route decodes with
    assert set(TOOLS_BY_NAME["decide"].properties) <= set(systemone.TOP_FIELDS)
    assert TOOLS_BY_NAME["models"].method == "GET"
