"""The Python client (`from fleetctl import Client, AsyncClient`) against real daemons
(real HTTP on 127.0.0.1, real workers, real weights), and its retry path against a
tiny real HTTP server that answers 429/503 with `Retry-After` before it answers 200.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from fleet.errors import BadRequest, ModelNotFound, Overloaded, Unavailable
from tests.conftest import DEFAULT_MODEL, default_model_dir, start_daemon
from tests.gen_models import build_llama, pull
from tests.test_embed_api import TEXTS, reference, served_dtype

MSGPACK = "application/msgpack"


def test_import_fleetctl_stays_light():
    """`import fleetctl` loads no client (httpx), numpy or torch; the names resolve on first use."""
    code = ("import sys, fleetctl; assert 'fleetctl.client' not in sys.modules and 'httpx' not in sys.modules; "
            "from fleetctl import Client, AsyncClient, FleetEmbeddings; import fleetctl.client as c; "
            "assert Client is c.Client and AsyncClient is c.AsyncClient; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- against the session daemon (all-MiniLM-L6-v2) ----------------------------------

def test_embed_returns_numpy_vectors_like_sentence_transformers(daemon, st_model):
    from fleetctl import Client

    with Client(daemon.url) as fleet:
        got = fleet.embed(DEFAULT_MODEL, TEXTS)
        raw = fleet.embed(DEFAULT_MODEL, TEXTS[:2], normalize=False)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (len(TEXTS), 384)
    want = reference(st_model, served_dtype(daemon.url), TEXTS)
    cos = np.sum(got * want, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > 0.999
    # all-MiniLM-L6-v2 ends in a Normalize module: normalize=False is its own output, unit
    # vectors, as sentence-transformers' encode(normalize_embeddings=False) gives them.
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    assert np.sum(raw * got[:2], axis=1).min() > 0.9999  # the vectors normalize=True gives (bf16 noise aside)


def test_embed_tokens_output_is_a_list_of_arrays(daemon, st_model):
    from fleetctl import Client

    with Client(daemon.url) as fleet:
        blocks = fleet.embed(DEFAULT_MODEL, TEXTS[:3], output="tokens")
    lengths = [len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS[:3]]
    assert [b.shape for b in blocks] == [(n, 384) for n in lengths]
    np.testing.assert_allclose(np.linalg.norm(blocks[0], axis=1), 1.0, atol=1e-5)


def test_models_and_ps(daemon):
    from fleetctl import Client

    with Client(daemon.url) as fleet:
        cards = fleet.models().data
        ps = fleet.ps()
    card = next(c for c in cards if c.id == DEFAULT_MODEL)
    assert card.task == "embed" and card.loaded
    assert ps["workers"] and any(DEFAULT_MODEL in w["models"] for w in ps["workers"])
    # Whether its CPU forward replays a traced graph, and why (runtimes/adapters/traced.py): a
    # verdict measured at load, so either way, but always said.
    forward = next(w["models"][DEFAULT_MODEL] for w in ps["workers"] if DEFAULT_MODEL in w["models"])["forward"]
    assert (forward["traced"] and forward["speedup"] > 1.0 and forward["up_to_tokens"] == 256) or \
        (not forward["traced"] and forward["why"]), forward


def test_errors_are_typed_from_their_codes(daemon):
    from fleetctl import Client

    with Client(daemon.url) as fleet:
        with pytest.raises(ModelNotFound, match="no-such-model"):
            fleet.embed("no-such-model", ["a"])
        with pytest.raises(BadRequest, match="empty"):
            fleet.embed(DEFAULT_MODEL, [])
        with pytest.raises(BadRequest, match="text only"):
            fleet.embed(DEFAULT_MODEL, [b"\x89PNG not really"])
        # Still usable after errors (the connection pool is not poisoned).
        assert fleet.embed(DEFAULT_MODEL, ["ok"]).shape == (1, 384)


def test_unreachable_daemon_is_unavailable():
    from fleetctl import Client
    from tests.conftest import free_port

    with Client(f"http://127.0.0.1:{free_port()}", retries=0) as fleet:
        with pytest.raises(Unavailable, match="cannot reach") as info:
            fleet.ps()
    assert "fleetctl serve" in info.value.hint


def test_async_client_matches_the_blocking_one(daemon):
    from fleetctl import AsyncClient, Client

    with Client(daemon.url) as fleet:
        want = fleet.embed(DEFAULT_MODEL, TEXTS)

    async def main():
        async with AsyncClient(daemon.url) as fleet:
            rows = await asyncio.gather(*(fleet.embed(DEFAULT_MODEL, [t]) for t in TEXTS))
            with pytest.raises(ModelNotFound):
                await fleet.embed("no-such-model", ["a"])
            return np.concatenate(rows), await fleet.ps()

    got, ps = asyncio.run(main())
    assert got.shape == want.shape
    assert np.min(np.sum(got * want, axis=1)) > 0.999
    assert ps["workers"]


def test_langchain_style_embeddings(daemon):
    from fleetctl import Client, FleetEmbeddings

    with Client(daemon.url) as fleet:
        want = fleet.embed(DEFAULT_MODEL, TEXTS)
        emb = FleetEmbeddings(DEFAULT_MODEL, client=fleet, batch_size=3)  # three requests for eight texts
        docs = emb.embed_documents(TEXTS)
        query = emb.embed_query(TEXTS[1])
    assert isinstance(docs, list) and len(docs) == len(TEXTS) and isinstance(docs[0][0], float)
    assert np.min(np.sum(np.asarray(docs) * want, axis=1)) > 0.999
    assert len(query) == 384 and float(np.dot(query, want[1])) > 0.999


# ---- every task endpoint, on a daemon with tiny models ----------------------------------

@pytest.fixture(scope="module")
def tasks_daemon(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertForTokenClassification

    root = tmp_path_factory.mktemp("client-models")
    home = root / "home"
    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def bert(cls, name: str, **kw) -> Path:
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, **kw)
        folder = root / name
        cls(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    labels = {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
              "label2id": {"negative": 0, "neutral": 1, "positive": 2}}
    tags = {"id2label": {0: "O", 1: "B-PER", 2: "I-PER"}, "label2id": {"O": 0, "B-PER": 1, "I-PER": 2}}
    pull(home, bert(BertForSequenceClassification, "reranker", num_labels=1), "tiny-reranker")
    pull(home, bert(BertForSequenceClassification, "classifier", num_labels=3, **labels), "tiny-classifier")
    pull(home, bert(BertForTokenClassification, "tagger", num_labels=3, **tags), "tiny-tagger")
    pull(home, build_llama(root / "llama"), "tiny-llama")
    d = start_daemon(home)
    yield d
    d.stop()


def json_post(d, path: str, body: dict) -> dict:
    resp = httpx.post(d.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_rerank_classify_extract_match_the_json_api(tasks_daemon):
    from fleetctl import Client

    docs = ["cats sleep a lot", "stocks fell", "kittens play", "a"]
    texts = ["I love it", "Angela Merkel met Emmanuel Macron in Berlin", "ok"]
    with Client(tasks_daemon.url) as fleet:
        hits = fleet.rerank("tiny-reranker", "how do cats behave", docs, top_n=3, return_documents=True)
        classes = fleet.classify("tiny-classifier", texts, top_k=2)
        spans = fleet.extract("tiny-tagger", texts)
        with pytest.raises(BadRequest, match="labels"):
            fleet.extract("tiny-tagger", texts, labels=["person"])
    want = json_post(tasks_daemon, "/v1/rerank", {"model": "tiny-reranker", "query": "how do cats behave",
                                                  "documents": docs, "top_n": 3, "return_documents": True})
    assert [(h.index, h.document.text) for h in hits] == [(r["index"], r["document"]["text"])
                                                          for r in want["results"]]
    np.testing.assert_allclose([h.score for h in hits], [r["score"] for r in want["results"]], rtol=1e-5)
    want = json_post(tasks_daemon, "/v1/classify", {"model": "tiny-classifier", "inputs": texts, "top_k": 2})
    assert [[ls.label for ls in row] for row in classes] == [[r["label"] for r in row] for row in want["results"]]
    assert all(len(row) == 2 for row in classes)
    want = json_post(tasks_daemon, "/v1/extract", {"model": "tiny-tagger", "inputs": texts})
    assert [[(e.entity, e.text, e.start, e.end) for e in row] for row in spans] == \
        [[(e["entity"], e["text"], e["start"], e["end"]) for e in row] for row in want["results"]]


def test_generate_whole_and_streamed_agree(tasks_daemon):
    from fleetctl import AsyncClient, Client

    opts = {"max_tokens": 12, "temperature": 0.0}
    with Client(tasks_daemon.url) as fleet:
        whole = fleet.generate("tiny-llama", "the quick brown", **opts)
        chunks = list(fleet.generate("tiny-llama", "the quick brown", stream=True, **opts))
        chat = fleet.generate("tiny-llama", messages=[{"role": "user", "content": "hello"}], **opts)
        with pytest.raises(BadRequest, match="max_tokens"):
            list(fleet.generate("tiny-llama", "x", stream=True, max_tokens=0))
    assert whole.text and whole.usage.output_tokens >= 1
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == whole.finish_reason and chunks[-1].usage == whole.usage
    assert len(chunks) >= 2  # text arrived in pieces before the final event
    assert chat.usage.input_tokens > 0

    async def main():
        async with AsyncClient(tasks_daemon.url) as fleet:
            stream = await fleet.generate("tiny-llama", "the quick brown", stream=True, **opts)
            return [c async for c in stream]

    assert "".join(c.text for c in asyncio.run(main())) == whole.text


# ---- retries, against a tiny real HTTP server ----------------------------------------------

class Script:
    """What the server answers, in order (the last answer repeats), and what it saw."""

    def __init__(self, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.answers = answers
        self.seen: list[tuple[float, int]] = []  # (monotonic time, client port) per request
        self.lock = threading.Lock()

    def next(self, port: int) -> tuple[int, dict[str, str], bytes]:
        with self.lock:
            self.seen.append((time.monotonic(), port))
            return self.answers[min(len(self.seen) - 1, len(self.answers) - 1)]


@pytest.fixture()
def scripted():
    servers = []

    def start(answers):
        script = Script(answers)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the client may reuse its connection

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, headers, body = script.next(self.client_address[1])
                self.send_response(status)
                self.send_header("Content-Type", MSGPACK)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", script

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def error(code: str, message: str) -> bytes:
    return msgspec.msgpack.encode({"error": {"code": code, "message": message}})


VECTORS = np.arange(6, dtype="<f4").reshape(2, 3)
OK = (200, {}, msgspec.msgpack.encode({"model": "m", "embeddings": VECTORS.tobytes(), "shape": [2, 3],
                                       "usage": {"input_tokens": 4}, "dtype": "float32"}))
BUSY = (429, {"Retry-After": "1"}, error("overloaded", "queue is full"))
STARTING = (503, {"Retry-After": "0"}, error("unavailable", "no worker yet"))


def test_retries_429_after_retry_after_then_succeeds_on_one_connection(scripted):
    from fleetctl import Client

    url, script = scripted([BUSY, STARTING, OK])
    t0 = time.monotonic()
    with Client(url) as fleet:
        got = fleet.embed("m", ["a", "b"])
    np.testing.assert_array_equal(got, VECTORS)
    assert len(script.seen) == 3
    # The 429 asked for 1 s, the 503 for 0 s: the client waited as told, no longer.
    assert script.seen[1][0] - script.seen[0][0] >= 0.95
    assert time.monotonic() - t0 < 5
    assert len({port for _, port in script.seen}) == 1  # one kept-alive connection for all three


def test_retries_are_bounded_and_end_in_the_typed_error(scripted):
    from fleetctl import Client

    url, script = scripted([(429, {"Retry-After": "30"}, error("overloaded", "queue is full"))])
    t0 = time.monotonic()
    with Client(url, retries=2, max_retry_wait_s=0.2) as fleet:
        with pytest.raises(Overloaded, match="queue is full") as info:
            fleet.embed("m", ["a"])
    assert len(script.seen) == 3  # one try + two retries
    assert time.monotonic() - t0 < 3  # the 30 s hint was capped at 0.2 s per wait
    assert info.value.retry_after_s == 30.0


def test_other_errors_are_not_retried(scripted):
    from fleetctl import Client

    url, script = scripted([(400, {}, error("bad_request", "`inputs` is empty")), OK])
    with Client(url) as fleet:
        with pytest.raises(BadRequest):
            fleet.embed("m", [])
    assert len(script.seen) == 1


def test_async_client_retries_too(scripted):
    from fleetctl import AsyncClient

    url, script = scripted([STARTING, STARTING, OK])

    async def main():
        async with AsyncClient(url) as fleet:
            return await fleet.embed("m", ["a", "b"])

    np.testing.assert_array_equal(asyncio.run(main()), VECTORS)
    assert len(script.seen) == 3
