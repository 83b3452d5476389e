"""Token numbers are the tokenizer's: `X-Batch-Tokens`, `fleet_batch_tokens`, `/v1/top`'s
tokens/s and batch means equal what all-MiniLM-L6-v2's own tokenizer (its tokenizer.json,
read here with the `tokenizers` library) counts for the same texts, and items are inputs
(`X-Batch-Items`, `fleet_batch_items`), on the session's real daemon and real weights.

Before, every one of them was the daemon's estimate (payload bytes / 4 + 2 a text,
"hello" 11 against 3 tokens) and items counted requests. What stays an estimate (a lane's
queued work, not tokenized yet) is named so in `/v1/ps`: `estimated_tokens`.
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir

#: Short (nothing truncated), of several scripts: the estimate misses each differently.
NATIVE = ["hello", "The quick brown fox jumps over the lazy dog.", "naïve café, Zürich — 東京 and Ελλάδα"]
OPENAI = ["invoices due in thirty days", "a"]


def tokenizer_count(texts: list[str]) -> int:
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_padding()  # the file pads every text to 128: count each text's own tokens
    return sum(len(e.ids) for e in tok.encode_batch(texts))


def batch_series(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(("fleet_batch_items", "fleet_batch_tokens")) and s.name.endswith(("_sum", "_count"))
            and s.labels.get("model") == DEFAULT_MODEL}


def top_row(url: str) -> dict:
    models = httpx.get(url + "/v1/top", timeout=10).json()["models"]
    return next((m for m in models if m["model"] == DEFAULT_MODEL), {"batches": 0})


def poll(check, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > end:
            assert got, what
            return got
        time.sleep(0.2)


def test_batch_numbers_are_the_tokenizers_and_items_are_inputs(daemon: DaemonProc) -> None:
    url = daemon.url
    assert httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["warm"]}, timeout=120).status_code == 200
    # /v1/top's window (10 s) holds this test's batches alone once the model has been quiet for it.
    poll(lambda: top_row(url)["batches"] == 0, 30, "the model's top window never went quiet")
    before = batch_series(url)

    # 1. Each lone request is its own batch: its headers name its inputs and tokens.
    native = httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": NATIVE}, timeout=60)
    openai = httpx.post(url + "/v1/embeddings", json={"model": DEFAULT_MODEL, "input": OPENAI}, timeout=60)
    assert native.status_code == 200 and openai.status_code == 200, (native.text, openai.text)
    want = {"native": tokenizer_count(NATIVE), "openai": tokenizer_count(OPENAI)}
    assert tokenizer_count(["hello"]) == 3  # [CLS] hello [SEP]
    assert native.json()["usage"]["input_tokens"] == want["native"]
    assert openai.json()["usage"]["prompt_tokens"] == want["openai"]
    for r, texts, key in ((native, NATIVE, "native"), (openai, OPENAI, "openai")):
        assert (int(r.headers["x-batch-items"]), int(r.headers["x-batch-tokens"])) == (len(texts), want[key]), \
            dict(r.headers)
    total, inputs = want["native"] + want["openai"], len(NATIVE) + len(OPENAI)

    # 2. /metrics: two batches more, of exactly those inputs and tokens.
    def moved() -> dict | None:
        now = batch_series(url)
        return now if now["fleet_batch_tokens_count"] - before.get("fleet_batch_tokens_count", 0) >= 2 else None

    after = poll(moved, 10, "the two batches never reached /metrics")
    assert {k: after[k] - before.get(k, 0) for k in after} == {
        "fleet_batch_items_count": 2, "fleet_batch_items_sum": inputs,
        "fleet_batch_tokens_count": 2, "fleet_batch_tokens_sum": total}

    # 3. /v1/top (`fleetctl top`): the same two batches, their mean inputs and tokens, and
    #    tokens/s over the window from the workers' token counters.
    row = poll(lambda: (m := top_row(url))["batches"] == 2 and m["tokens_per_s"] > 0 and m, 10,
               "the two batches never reached /v1/top")
    window_s = httpx.get(url + "/v1/top", timeout=10).json()["window_s"]
    assert (row["batch_items"], row["batch_tokens"]) == (round(inputs / 2, 1), round(total / 2, 1)), row
    assert row["tokens_per_s"] == round(total / window_s, 1), row

    # 4. What no tokenizer has read yet says so: a lane's queued work is an estimate.
    lanes = httpx.get(url + "/v1/ps", timeout=10).json()["lanes"]
    assert all("tokens" not in lane and "estimated_tokens" in lane for lane in lanes), lanes
