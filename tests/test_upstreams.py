"""Upstreams (daemon/upstreams.py, daemon/spill.py): box A sends a model's requests to
box B (a second real `fleetctl serve`, kind fleet) when A's lane would make them wait
past the entry's `spill_after_ms`, and a remote model's to an OpenAI-compatible
server (a small fake here: no real one runs offline), at the shipped settings.

- A flood that saturates A: some requests answered here, some by B; each once (A's
  local count plus its spilled count is the flood, B ran exactly the spilled ones);
  the flood's p95 under `spill_after_ms` plus the p95 of the answers B gave.
- Batch lines never spill (a batch that fills A's lane sends nothing to B); a remote
  model's line goes upstream.
- The OpenAI-compatible upstream gets the request's id, client, what is left of the
  deadline is the call's bound, its key from the environment, the model renamed;
  a native route it cannot take and an upstream that fails are refused clearly, and
  the failing one is marked down.
- A generator A does not store goes to B (missing here): native and OpenAI-shaped,
  its stream relayed as it comes, each answer B's own.
- B killed mid-flood: nothing lost; A marks B down and serves the rest itself.

The pure parts (the decision, the wait estimate, bodies, headers, config checks)
are tables at the end.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fleet.daemon.spill import expected_wait_ms, should_spill
from fleet.daemon.upstreams import Upstreams, reply_headers, upstream_body
from fleet.config import Settings, UpstreamConfig
from fleet.errors import BadRequest
from tests.conftest import DEFAULT_MODEL, free_port, start_daemon

SPILL_MS = 300
REMOTE = "remote-emb"
GEN = "tiny-gen"
FAKE_KEY = "fake-upstream-key-123"
WORDS = ("the invoice for the quarterly maintenance contract is overdue and the customer asked whether the "
         "late fee can be waived given the long relationship").split()
#: One request: 8 texts of 48 words, ~0.1-0.5 s of a 1-thread CPU worker's time.
TEXTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(48)) for i in range(8)]


class FakeOpenAI:
    """An OpenAI-compatible embeddings server (`POST /v1/embeddings`) in a thread: it records
    what it was sent; `status` other than 200 makes it answer that with an error."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if fake.status != 200:
                    out = json.dumps({"error": {"message": "fake is down", "type": "server_error"}}).encode()
                    self.send_response(fake.status)
                else:
                    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
                    out = json.dumps({"object": "list", "model": body["model"], "usage": {
                        "prompt_tokens": 3, "total_tokens": 3}, "data": [
                        {"object": "embedding", "index": i, "embedding": [0.5, 0.25, float(i)]}
                        for i in range(len(inputs))]}).encode()
                    self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory):
    """(A, B, fake): A routes the default model to B past SPILL_MS and REMOTE to the fake."""
    from fleet.pull import pull_model
    from fleet.store import Store
    from tests.gen_models import build_llama

    fake = FakeOpenAI()
    env = {"FLEET_CPU_THREADS": "1"}
    gen = build_llama(tmp_path_factory.mktemp("gen") / GEN)
    home_b = tmp_path_factory.mktemp("box-b")
    pull_model(Store(home_b / "models"), f"path:{gen}", name=GEN)  # B only: A spills it as missing
    b = start_daemon(home_b, extra_env={**env, "FLEET_BOX": "b"}, args=["--workers", "1"], wait_ready=False)
    home = tmp_path_factory.mktemp("box-a")
    (home / "config.toml").write_text(
        f'[[upstream]]\nname = "b"\nurl = "{b.url}"\nkind = "fleet"\n\n'
        f'[[upstream]]\nname = "fake"\nurl = "{fake.url}"\nkind = "openai"\nkey_env = "FAKE_KEY"\n')
    (home / "models.toml").write_text(
        f'[models."{DEFAULT_MODEL}"]\nroute = "spill"\nspill_after_ms = {SPILL_MS}\nupstream = "b"\n\n'
        f'[models."{REMOTE}"]\nsource = "path:/nonexistent"\ntask = "embed"\nruntime = "sentence-transformers"\n'
        f'route = "remote"\nupstream = "fake"\nupstream_model = "text-embedding-fake"\n\n'
        f'[models."{GEN}"]\nsource = "path:{gen}"\ntask = "generate"\nruntime = "transformers"\n'
        f'route = "spill"\nupstream = "b"\n')
    a = start_daemon(home, extra_env={**env, "FLEET_BOX": "a", "FAKE_KEY": FAKE_KEY}, args=["--workers", "1"],
                     wait_ready=False)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, fake
    finally:
        a.stop()
        b.stop()
        fake.stop()


def counter(url: str, family: str, **labels: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    if family not in families:
        return 0.0
    return sum(s.value for s in families[family].samples
               if s.name in (family, family + "_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def flood(url: str, n: int, concurrency: int, tag: str, on_answer=None) -> list[tuple[str, int, str, float]]:
    """`n` embed requests, `concurrency` at a time: (request id, status, X-Served-By, seconds) each."""
    def one(i: int) -> tuple[str, int, str, float]:
        rid = f"{tag}-{i}"
        t = time.perf_counter()
        r = client.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": TEXTS},
                        headers={"X-Request-Id": rid})
        out = (r.headers.get("x-request-id", ""), r.status_code, r.headers.get("x-served-by", ""),
               time.perf_counter() - t)
        if r.status_code == 200:
            assert r.json()["shape"] == [len(TEXTS), 384]
        if on_answer is not None:
            on_answer(out)
        return out

    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.95))]


@pytest.mark.slow
def test_a_flood_spills_past_the_bound_and_each_request_is_answered_once(boxes):
    a, b, _ = boxes
    flood(a.url, 4, 1, "warm")  # A learns how fast its lane goes
    a_ok = counter(a.url, "fleet_requests", model=DEFAULT_MODEL, status="ok")
    b_ok = counter(b.url, "fleet_requests", model=DEFAULT_MODEL, status="ok")
    spilled = counter(a.url, "fleet_spilled_requests", model=DEFAULT_MODEL, upstream="b")
    n = 96
    answers = flood(a.url, n, 16, "flood")
    # Every request answered, once, with its own id.
    assert [rid for rid, *_ in answers] == [f"flood-{i}" for i in range(n)]
    assert all(status == 200 for _, status, _, _ in answers), answers
    here = [s for _, _, by, s in answers if by.startswith("a/")]
    upstream = [s for _, _, by, s in answers if by == "upstream/b"]
    assert len(here) + len(upstream) == n and here and upstream, [by for _, _, by, _ in answers]
    # Answered once: A ran the ones it answered, B ran exactly the spilled ones.
    assert counter(a.url, "fleet_requests", model=DEFAULT_MODEL, status="ok") - a_ok == len(here)
    assert counter(a.url, "fleet_spilled_requests", model=DEFAULT_MODEL, upstream="b") - spilled == len(upstream)
    assert counter(b.url, "fleet_requests", model=DEFAULT_MODEL, status="ok") - b_ok == len(upstream)
    # The goal: the flood's p95 stays under the bound plus the upstream's own p95.
    assert p95(here + upstream) <= SPILL_MS / 1000 + p95(upstream), (p95(here), p95(upstream))
    top = httpx.get(a.url + "/v1/top", timeout=30).json()["upstreams"]
    assert {u["name"]: (u["up"], u["spilled"] >= len(upstream)) for u in top} == {"b": (True, True),
                                                                                   "fake": (True, False)}


@pytest.mark.slow
def test_batch_lines_never_spill_and_a_remote_models_line_goes_upstream(boxes, tmp_path):
    import openai

    a, b, fake = boxes
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
    b_ok = counter(b.url, "fleet_requests", model=DEFAULT_MODEL, status="ok")
    seen = len(fake.seen)
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": DEFAULT_MODEL, "input": TEXTS}} for i in range(40)]
    lines.append({"custom_id": "remote", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": REMOTE, "input": ["x"]}})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines), batch
    # 40 lines of 8 texts queue far past the bound on A's one worker, and none went to B.
    assert counter(b.url, "fleet_requests", model=DEFAULT_MODEL, status="ok") == b_ok
    assert [body["model"] for _, body in fake.seen[seen:]] == ["text-embedding-fake"]


@pytest.mark.slow
def test_an_openai_upstream_gets_the_requests_id_client_and_key(boxes):
    a, _, fake = boxes
    seen = len(fake.seen)
    r = httpx.post(a.url + "/v1/embeddings", json={"model": REMOTE, "input": ["hello", "world"]},
                   headers={"X-Request-Id": "rid-remote-1", "X-Fleet-Client": "tenant-7"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-served-by"] == "upstream/fake", r.text
    assert r.headers["x-request-id"] == "rid-remote-1"
    assert [d["embedding"] for d in r.json()["data"]] == [[0.5, 0.25, 0.0], [0.5, 0.25, 1.0]]
    headers, body = fake.seen[seen]
    assert headers["authorization"] == f"Bearer {FAKE_KEY}" and headers["x-request-id"] == "rid-remote-1"
    assert headers["x-fleet-client"] == "tenant-7" and body == {"model": "text-embedding-fake",
                                                                "input": ["hello", "world"]}
    # MessagePack asked for: the upstream's JSON comes back as MessagePack.
    r = httpx.post(a.url + "/v1/embeddings", json={"model": REMOTE, "input": "x"},
                   headers={"Accept": "application/msgpack"}, timeout=30)
    assert r.status_code == 200 and msgspec.msgpack.decode(r.content)["data"][0]["index"] == 0
    # A native route an OpenAI-compatible upstream cannot take: refused, naming why.
    r = httpx.post(a.url + "/v1/embed", json={"model": REMOTE, "inputs": ["x"]}, timeout=30)
    assert r.status_code == 503 and "OpenAI routes only" in r.json()["error"]["message"]
    # The upstream fails: a clear 503 for a remote model, and it is marked down (circuit).
    fake.status = 503
    try:
        r = httpx.post(a.url + "/v1/embeddings", json={"model": REMOTE, "input": "x"}, timeout=30)
        assert r.status_code == 503 and "fake" in r.json()["error"]["message"], r.text
        assert counter(a.url, "fleet_upstream_up", upstream="fake") == 0
        asked = len(fake.seen)
        r = httpx.post(a.url + "/v1/embeddings", json={"model": REMOTE, "input": "x"}, timeout=30)
        assert r.status_code == 503 and "marked down" in r.json()["error"]["message"]
        assert len(fake.seen) == asked  # not asked while down
    finally:
        fake.status = 200


@pytest.mark.slow
def test_a_generator_not_stored_here_spills_with_its_stream(boxes):
    """A does not store GEN: its requests go to B, native and OpenAI-shaped, streams relayed
    as they come; each answer is B's own (greedy: the same text as asking B directly)."""
    a, b, _ = boxes
    body = {"model": GEN, "prompt": "hello world", "max_tokens": 6, "temperature": 0}
    direct = httpx.post(b.url + "/v1/generate", json=body, timeout=60)
    via = httpx.post(a.url + "/v1/generate", json=body, timeout=60)
    assert via.status_code == 200 and via.headers["x-served-by"] == "upstream/b", via.text
    assert via.headers["x-upstream-served-by"].startswith("b/") and via.json()["text"] == direct.json()["text"]
    chat = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    whole = httpx.post(b.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"]
    with httpx.stream("POST", a.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-served-by"] == "upstream/b"
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])
    assert text == whole["content"]


@pytest.mark.slow
def test_the_upstream_killed_mid_flood_loses_nothing(boxes):
    """Runs last: it kills B."""
    a, b, _ = boxes
    answered: list[tuple[str, int, str, float]] = []
    killed = threading.Event()

    def on_answer(answer: tuple[str, int, str, float]) -> None:
        answered.append(answer)
        if answer[2] == "upstream/b" and not killed.is_set():
            killed.set()
            os.kill(b.proc.pid, signal.SIGKILL)

    errors = counter(a.url, "fleet_upstream_errors", upstream="b")
    n = 64
    answers = flood(a.url, n, 16, "kill", on_answer)
    assert killed.is_set(), "nothing was spilled before the kill"
    assert [rid for rid, *_ in answers] == [f"kill-{i}" for i in range(n)]
    assert all(status == 200 for _, status, _, _ in answers), [(s, by) for _, s, by, _ in answers if s != 200]
    assert counter(a.url, "fleet_upstream_errors", upstream="b") > errors
    assert counter(a.url, "fleet_upstream_up", upstream="b") == 0
    # B is down: the next requests stay here.
    after = flood(a.url, 4, 4, "after")
    assert all(s == 200 and by.startswith("a/") for _, s, by, _ in after), after
    top = {u["name"]: u for u in httpx.get(a.url + "/v1/top", timeout=30).json()["upstreams"]}
    assert top["b"]["up"] is False and top["b"]["errors"] >= 1


# ---- the pure parts ------------------------------------------------------------------

@pytest.mark.parametrize("mode, batch, missing, wait_ms, spills", [
    ("remote", False, False, 0, True), ("remote", True, False, 0, True),  # remote: always, batch lines too
    ("spill", False, False, 299, False), ("spill", False, False, 301, True),
    ("spill", False, True, 0, True),  # not stored here
    ("spill", True, True, 10_000, False),  # batch lines never spill
    ("local", False, True, 10_000, False),
])
def test_should_spill(mode, batch, missing, wait_ms, spills):
    assert should_spill(mode, batch=batch, missing=missing, wait_ms=wait_ms, bound_ms=300) is spills


@pytest.mark.parametrize("depth, tokens, claimed, item, age, rate, workers, want", [
    (0, 0, 0, 0.0, 0.0, 4.0, 1, 0.0),  # idle
    (2, 400, 0, 0.0, 50.0, 4.0, 1, 100.0),  # queued tokens at the rate
    (2, 400, 0, 0.0, 900.0, 4.0, 1, 900.0),  # the head waited longer already
    (0, 0, 4, 100.0, 0.0, 4.0, 1, 100.0),  # a running batch holds the next one back
    (2, 400, 4, 100.0, 0.0, 4.0, 2, 100.0),  # two workers read twice as fast
])
def test_expected_wait_ms(depth, tokens, claimed, item, age, rate, workers, want):
    assert expected_wait_ms(depth, tokens, claimed, item, age, rate, workers) == pytest.approx(want)


def test_upstream_bodies_and_headers():
    body = json.dumps({"model": "m", "inputs": ["x"], "timeout_ms": 30000}).encode()
    out, mp = upstream_body(body, msgpack=False, kind="fleet", native=True, left_ms=1234, rename=None)
    assert json.loads(out) == {"model": "m", "inputs": ["x"], "timeout_ms": 1234} and not mp
    packed = msgspec.msgpack.encode({"model": "m", "input": "x"})
    assert upstream_body(packed, msgpack=True, kind="fleet", native=False, left_ms=5, rename=None) == (packed, True)
    out, mp = upstream_body(packed, msgpack=True, kind="openai", native=False, left_ms=5, rename="there")
    assert json.loads(out) == {"model": "there", "input": "x"} and not mp
    raw = [(b"Content-Type", b"application/json"), (b"X-Served-By", b"b/0"), (b"X-Request-Id", b"r"),
           (b"Content-Length", b"9"), (b"X-Queue-Ms", b"1.0")]
    assert reply_headers(raw, "b") == [(b"content-type", b"application/json"), (b"x-queue-ms", b"1.0"),
                                       (b"x-upstream-served-by", b"b/0"), (b"x-served-by", b"upstream/b")]


@pytest.mark.parametrize("upstreams, models, words", [
    ([{"name": "B", "url": "http://x"}], "", "upstream name"),
    ([{"name": "b", "url": "ftp://x"}], "", "http:// or https://"),
    ([{"name": "b", "url": "http://x"}, {"name": "b", "url": "http://y"}], "", "defined twice"),
    ([{"name": "b", "url": "http://x", "key_env": "FLEET_TEST_NO_SUCH_VAR"}], "", "is not set"),
    ([{"name": "b", "url": "http://x", "key_file": "/nonexistent/key"}], "", "cannot read key_file"),
    ([{"name": "b", "url": "http://x", "key_file": "/k", "key_env": "K"}], "", "not both"),
    ([], '[models."all-minilm-l6-v2"]\nroute = "spill"\n', "defines no [[upstream]]"),
    ([{"name": "b", "url": "http://x"}], '[models."all-minilm-l6-v2"]\nroute = "remote"\nupstream = "c"\n',
     "names upstream 'c'"),
])
def test_a_config_that_does_not_check_out_is_refused(tmp_path, upstreams, models, words):
    (tmp_path / "models.toml").write_text(models)
    settings = Settings(home=str(tmp_path), upstream=[UpstreamConfig(**u) for u in upstreams])
    with pytest.raises(BadRequest) as info:
        Upstreams(settings, CollectorRegistry())
    assert words in info.value.message


def test_top_shows_a_line_of_upstreams():
    from fleetctl.commands.top import upstreams_line

    line = upstreams_line([{"name": "b", "kind": "fleet", "up": True, "down_s": 0, "spilled": 12, "errors": 0},
                           {"name": "c", "kind": "openai", "up": False, "down_s": 7.2, "spilled": 0, "errors": 3},
                           {"name": "d", "kind": "fleet", "up": False, "down_s": 0, "spilled": 1, "errors": 1}])
    assert line == ("upstreams: b (fleet) up, 12 spilled, 0 errors · c (openai) [red]down 7 s[/], 0 spilled, "
                    "3 errors · d (fleet) [red]retrying[/], 1 spilled, 1 errors")


def test_a_key_comes_from_its_file_and_is_read_again_on_reload(tmp_path):
    key = tmp_path / "b.key"
    key.write_text("first\n")
    settings = Settings(home=str(tmp_path), upstream=[UpstreamConfig(name="b", url="http://x", key_file=str(key))])
    ups = Upstreams(settings, CollectorRegistry())
    assert ups.by_name["b"].key == "first" and not ups.active
    key.write_text("second\n")
    ups.reload(settings)
    assert ups.by_name["b"].key == "second"
    Path(key).unlink()
    ups.reload(settings)  # unreadable: logged, the current key kept
    assert ups.by_name["b"].key == "second"
