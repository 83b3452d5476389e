"""`fleetctl mcp`: fleet's tools (fleet.mcp_tools) for a desktop agent, over MCP's
stdio transport. The agent starts this command from its config file; each tool call
becomes one request to the running daemon over HTTP, found and authorised as every
verb finds it (FLEET_URL, else FLEET_HOME's config or the running daemon's lock file;
FLEET_API_KEY or FLEET_API_KEY_FILE, else the operator's admin key when this user
has it). Stdout carries MCP's messages only; anything else goes to stderr.

Replies are asked for as JSON (embeddings as nested lists, as the structured content
carries them); a 429 or 503 is retried as `fleetctl.Client` retries it (Retry-After,
bounded), and any other refusal is the tool's error, in the daemon's own words.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import typer

from fleet.errors import FleetError

#: Seconds one call may wait for the daemon: past the longest `timeout_ms` it takes.
HTTP_TIMEOUT_S = 620.0
RETRIES, MAX_RETRY_WAIT_S = 3, 10.0


async def serve_stdio(url: str | None = None) -> None:
    import httpx

    from fleet.config import client_url
    from fleet.mcp_tools import ToolFailure, build_server, error_message
    from fleetctl.client import RETRY_STATUSES, env_api_key, operator_key, retry_after_s, unreachable

    try:
        from mcp.server.stdio import stdio_server
    except ModuleNotFoundError as exc:
        raise FleetError(f"fleetctl mcp needs the mcp package ({exc.name} is not installed): "
                         "pip install 'fleet-serve[mcp]'") from None
    base = (url or client_url()).rstrip("/")
    key = env_api_key() or operator_key(base)
    headers = {"Accept": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=HTTP_TIMEOUT_S) as http:
        async def call(method: str, path: str, body: dict[str, Any] | None, request: Any) -> dict[str, Any]:
            content = None if body is None else json.dumps(body).encode()
            sent = {"Content-Type": "application/json"} if content is not None else None
            for attempt in range(RETRIES + 1):
                try:
                    resp = await http.request(method, path, content=content, headers=sent)
                except httpx.TransportError as exc:
                    raise ToolFailure(unreachable(base, exc).message) from None
                if resp.status_code < 400:
                    data = resp.json()
                    return data if isinstance(data, dict) else {"result": data}
                if resp.status_code not in RETRY_STATUSES or attempt == RETRIES:
                    break
                hinted = retry_after_s(resp)
                await asyncio.sleep(min(MAX_RETRY_WAIT_S, hinted if hinted is not None else 0.5 * 2 ** attempt))
            raise ToolFailure(error_message(resp.status_code, resp.content))

        server = build_server(call)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


def register(app: typer.Typer) -> None:
    @app.command("mcp")
    def mcp() -> None:
        """Serve fleet's tools to a desktop agent over MCP (stdio).

        Put this command in the agent's MCP config; it talks to the running daemon
        (FLEET_URL, FLEET_API_KEY as every verb). Tools: embed, rerank, classify,
        extract, decide, generate, models.
        """
        asyncio.run(serve_stdio())
