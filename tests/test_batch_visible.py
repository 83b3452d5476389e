"""Replies name the batch they ran in (`X-Batch-Items`, `X-Batch-Tokens`), and `/v1/ps`
shows the last batch's adapters: on the hot route (`/v1/embed`, plain ASGI) and on a
Litestar route (`/v1/embeddings`), against the session's real daemon.

Concurrent requests that shared a batch (on /v1/embed, the same worker stamps in their
`X-Fleet-Timeline`: one batch, one set of stamps) report the same batch and at least as
many items as came back from it; a request run as pieces (`X-Fleet-Pieces`) names the
largest of its batches and is left out of that grouping. The LoRA side
(`X-Batch-Adapters`, generation's prompt and generated tokens in `last_batch`) is in
tests/test_lora_api.py, on its mixed-adapter daemon.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import defaultdict
from functools import partial

import httpx

from tests.conftest import DEFAULT_MODEL, DaemonProc

TEXTS = [f"request {i} asks about invoices and the weather in town number {i}" for i in range(24)]


def embed(url: str, text: str, route: str) -> httpx.Response:
    if route == "/v1/embed":
        body = {"model": DEFAULT_MODEL, "inputs": [text, text + " again"]}
    else:
        body = {"model": DEFAULT_MODEL, "input": [text, text + " again"]}
    return httpx.post(url + route, json=body, headers={"X-Fleet-Timeline": "1"}, timeout=60)


def batch_of(r: httpx.Response) -> str | None:
    """The worker's stamps of the batch a /v1/embed reply ran in (the same for all of it)."""
    stamps = dict(part.split("=") for part in r.headers.get("x-fleet-timeline", "").split(",") if "=" in part)
    return f"{r.headers['x-served-by']}:{stamps['ran']}" if "ran" in stamps else None


def test_concurrent_replies_name_their_shared_batch(daemon: DaemonProc) -> None:
    for route in ("/v1/embed", "/v1/embeddings"):
        with cf.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(partial(embed, daemon.url, route=route), TEXTS))
        assert all(r.status_code == 200 for r in got), [r.text for r in got if r.status_code != 200]
        batches: dict[str, list[httpx.Response]] = defaultdict(list)
        for r in got:
            items, tokens = int(r.headers["x-batch-items"]), int(r.headers["x-batch-tokens"])
            assert items >= 1 and tokens >= 2 * 2, (route, r.headers)  # two texts, two special tokens each at least
            assert "x-batch-adapters" not in r.headers  # the base model alone
            if "x-fleet-pieces" not in r.headers and (batch := batch_of(r)) is not None:
                batches[batch].append(r)
        for key, replies in batches.items():
            # One batch, one answer to "which batch": every reply of it says the same.
            assert len({(r.headers["x-batch-items"], r.headers["x-batch-tokens"]) for r in replies}) == 1, key
            assert int(replies[0].headers["x-batch-items"]) >= len(replies), key
        if route == "/v1/embed":
            assert batches  # the grouping above ran


def test_ps_last_batch_lists_its_adapters(daemon: DaemonProc) -> None:
    assert embed(daemon.url, "one more", "/v1/embed").status_code == 200
    ps = httpx.get(daemon.url + "/v1/ps", timeout=10).json()
    last = [w["last_batch"] for w in ps["workers"] if w["last_batch"].get("model") == DEFAULT_MODEL]
    assert last and all(b["loras"] == [] and b["items"] >= 1 and b["tokens"] > 0 for b in last), last
    assert all("generated_tokens" not in b for b in last)  # an encoder's batch: no generation counts
