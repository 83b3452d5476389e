"""Bounded work in the API process (issue 25, deliverable 3).

A real daemon at the shipped settings. What the API process does itself (TEI's
`/tokenize`, token-id inputs decoded back to text) is bounded before it starts
(`max_tokenize_bytes`, `max_token_ids`: 413 `payload_too_large` naming the
setting and its value) and runs off the event loop, so other requests are
answered meanwhile. Before: one 15 MB `/tokenize` took the API process from
81 MB to 2.8 GB; three at once to 7.4 GB.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest

from fleet.config import Settings
from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon

MIB = 1 << 20
#: The reproduction: 15 MB of text, under max_body_bytes (16 MiB).
BIG_TEXT = "word " * 3_000_000
#: Peak RSS of the API process while three such requests run (issue 25).
RSS_GOAL = 600 * MIB
DEFAULTS = Settings()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("fleet-bounds") / "home")
    yield d
    d.stop()


class PeakRss:
    """The API process's largest RSS while the block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def concurrently(url: str, path: str, bodies: list[dict], small: list[tuple[str, str, dict | None]]
                 ) -> tuple[list[httpx.Response], list[tuple[int, bool]]]:
    """Post `bodies` at once; while they run, send the `small` requests one after another.
    Returns the big answers and, per small request, (status, whether a big one was still running)."""
    big: list[httpx.Response | None] = [None] * len(bodies)

    def post(i: int) -> None:
        big[i] = httpx.post(url + path, json=bodies[i], timeout=300)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    seen: list[tuple[int, bool]] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for method, small_path, body in small:
            status = client.request(method, small_path, json=body).status_code
            seen.append((status, any(t.is_alive() for t in threads)))
    for t in threads:
        t.join()
    assert all(r is not None for r in big)
    return big, seen  # type: ignore[return-value]


SMALL = [("GET", "/healthz", None), ("POST", "/v1/embed", {"model": DEFAULT_MODEL, "inputs": ["a short text"]}),
         ("POST", "/tokenize", {"inputs": "a short text"})] * 3


def test_three_15_mb_tokenize_requests_are_refused_naming_the_limit(shipped: DaemonProc) -> None:
    with PeakRss(shipped.proc.pid) as rss:
        big, small = concurrently(shipped.url, "/tokenize", [{"inputs": BIG_TEXT}] * 3, SMALL)
    for r in big:
        assert r.status_code == 413, r.text[:300]
        err = r.json()  # TEI's error shape: {"error": message, "error_type": code}
        assert err["error_type"] == "payload_too_large"
        assert f"max_tokenize_bytes = {DEFAULTS.max_tokenize_bytes}" in err["error"]
        assert str(len(BIG_TEXT)) in err["error"]
    assert [status for status, _ in small] == [200] * len(SMALL)
    assert rss.peak <= RSS_GOAL, f"API RSS peaked at {rss.peak / MIB:.0f} MiB"


def test_tokenize_at_the_bound_runs_off_the_loop(shipped: DaemonProc) -> None:
    words = DEFAULTS.max_tokenize_bytes // len("word ")
    with PeakRss(shipped.proc.pid) as rss:
        big, small = concurrently(shipped.url, "/tokenize", [{"inputs": "word " * words}] * 3, SMALL)
    for r in big:
        assert r.status_code == 200, r.text[:300]
        tokens = r.json()[0]
        assert len(tokens) == words + 2  # [CLS] word ... [SEP]
        assert tokens[1] == {"id": tokens[1]["id"], "text": "word", "special": False, "start": 0, "stop": 4}
    assert [status for status, _ in small] == [200] * len(SMALL)
    # Other requests are answered while the big ones are still being tokenized.
    assert any(running for _, running in small), small
    assert rss.peak <= RSS_GOAL, f"API RSS peaked at {rss.peak / MIB:.0f} MiB"


@pytest.mark.parametrize(("path", "field"), [("/v1/embeddings", "input"), ("/embed", "inputs"), ("/decode", "ids")])
def test_token_ids_over_the_bound_are_refused_before_decoding(shipped: DaemonProc, path: str, field: str) -> None:
    half = DEFAULTS.max_token_ids // 2
    at_bound = httpx.post(shipped.url + path, json={field: [[2773] * half] * 2}, timeout=120)
    assert at_bound.status_code == 200, at_bound.text[:300]
    over = httpx.post(shipped.url + path, json={field: [[2773] * half] * 2 + [[2773]]}, timeout=120)
    assert over.status_code == 413, over.text[:300]
    err = over.json()["error"]
    if path != "/v1/embeddings":  # TEI's routes answer TEI's error shape
        err = {"code": over.json()["error_type"], "message": err}
    assert err["code"] == "payload_too_large"
    assert f"max_token_ids = {DEFAULTS.max_token_ids}" in err["message"]
    assert str(2 * half + 1) in err["message"]


def test_large_json_replies_are_built_off_the_loop_and_equal_the_msgpack_one(shipped: DaemonProc) -> None:
    """Over REPLY_INLINE_VALUES floats, each shape's JSON reply is built on the work pool."""
    import msgspec
    import numpy as np

    from fleet.daemon.offload import REPLY_INLINE_VALUES

    texts = [f"text number {i}" for i in range(REPLY_INLINE_VALUES // 384 + 8)]
    raw = httpx.post(shipped.url + "/v1/embed", content=msgspec.msgpack.encode({"inputs": texts}),
                     headers={"Content-Type": "application/msgpack"}, timeout=300)
    assert raw.status_code == 200, raw.content[:300]
    out = msgspec.msgpack.decode(raw.content)
    want = np.frombuffer(out["embeddings"], dtype="<f4").reshape(out["shape"])
    assert want.size > REPLY_INLINE_VALUES
    replies = {
        "/v1/embed": (lambda r: r["embeddings"], {"inputs": texts}),
        "/v1/embeddings": (lambda r: [d["embedding"] for d in r["data"]], {"input": texts}),
        "/embed": (lambda r: r, {"inputs": texts}),
        "/api/embed": (lambda r: r["embeddings"], {"model": DEFAULT_MODEL, "input": texts}),
    }
    for path, (rows, body) in replies.items():
        got = httpx.post(shipped.url + path, json=body, timeout=300)
        assert got.status_code == 200, (path, got.text[:300])
        assert np.allclose(np.array(rows(got.json()), dtype=np.float32), want, atol=1e-5), path


#: all-MiniLM-L6-v2's token vectors: 384 values each; at most 256 tokens an input.
WIDTH = 384


def post_msgpack(url: str, path: str, body: dict) -> httpx.Response:
    import msgspec

    return httpx.post(url + path, content=msgspec.msgpack.encode(body), timeout=300,
                      headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})


def token_refusal(r: httpx.Response) -> str:
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    if isinstance(err, str):  # TEI's route (/embed_all): {"error": message, "error_type": code}
        err = {"code": r.json()["error_type"], "message": err}
    assert err["code"] == "payload_too_large"
    assert f"max_token_vector_bytes = {DEFAULTS.max_token_vector_bytes}" in err["message"]
    return err["message"]


def test_token_vectors_over_the_bound_are_refused_before_the_work(shipped: DaemonProc) -> None:
    """100 inputs of ~250 tokens: ~25 000 token vectors, 202 MB as JSON text (21 bytes a
    value), 39 MB as MessagePack (4): over the 128 MiB bound as JSON only."""
    texts = ["word " * 200] * 100  # 1 000 characters: ~250 tokens + 2 each by the estimate
    tokens = 100 * (1000 // 4 + 2)
    for path, body in (("/v1/embed", {"inputs": texts, "output": "tokens"}), ("/embed_all", {"inputs": texts})):
        message = token_refusal(httpx.post(shipped.url + path, json=body, timeout=120))
        # "about": the estimate made before anything was queued, not the worker's count.
        assert f"about {tokens} tokens x {WIDTH} values x 21 bytes (JSON) = {tokens * WIDTH * 21} bytes" in message
        assert "MessagePack" in message
    import msgspec
    import numpy as np

    raw = post_msgpack(shipped.url, "/v1/embed", {"inputs": texts, "output": "tokens"})
    assert raw.status_code == 200, raw.content[:300]
    out = msgspec.msgpack.decode(raw.content)
    assert [tuple(s) for s in out["shapes"]] == [(202, WIDTH)] * 100  # [CLS] word x 200 [SEP]
    assert all(np.isfinite(np.frombuffer(b, dtype="<f4")).all() for b in out["embeddings"])


def test_token_vectors_over_the_bound_by_the_workers_count_are_refused_before_the_reply(shipped: DaemonProc) -> None:
    """"a a a ...": a token per 2 characters, twice the estimate. 140 inputs of 122 tokens
    pass the estimate (8 680 tokens) and come to 17 080: 138 MB as JSON, over the bound."""
    texts = ["a " * 120] * 140
    message = token_refusal(httpx.post(shipped.url + "/v1/embed", json={"inputs": texts, "output": "tokens"},
                                       timeout=300))
    assert f"come to {140 * 122} tokens x {WIDTH} values x 21 bytes (JSON)" in message


def test_large_token_vector_replies_are_built_off_the_loop_and_equal_the_msgpack_one(shipped: DaemonProc) -> None:
    """Over REPLY_INLINE_VALUES values, the JSON replies of `output: "tokens"` and TEI's
    /embed_all are built block by block on the work pool; their values are the raw ones."""
    import msgspec
    import numpy as np

    from fleet.daemon.offload import REPLY_INLINE_VALUES

    texts = [f"text number {i} " + "word " * (i % 40) for i in range(48)]
    want = {}
    for normalize in (True, False):
        raw = post_msgpack(shipped.url, "/v1/embed", {"inputs": texts, "output": "tokens", "normalize": normalize})
        assert raw.status_code == 200, raw.content[:300]
        out = msgspec.msgpack.decode(raw.content)
        want[normalize] = [np.frombuffer(b, dtype="<f4").reshape(s) for b, s in zip(out["embeddings"], out["shapes"])]
    assert sum(b.size for b in want[True]) > REPLY_INLINE_VALUES
    native = httpx.post(shipped.url + "/v1/embed", json={"inputs": texts, "output": "tokens"}, timeout=300)
    assert native.status_code == 200, native.text[:300]
    assert [tuple(s) for s in native.json()["shapes"]] == [b.shape for b in want[True]]
    tei = httpx.post(shipped.url + "/embed_all", json={"inputs": texts}, timeout=300)
    assert tei.status_code == 200, tei.text[:300]
    tei_lists = post_msgpack(shipped.url, "/embed_all", {"inputs": texts})
    assert tei_lists.status_code == 200, tei_lists.content[:300]
    for got, normalize in ((native.json()["embeddings"], True), (tei.json(), False),
                           (msgspec.msgpack.decode(tei_lists.content), False)):
        assert len(got) == len(texts)
        for block, ref in zip(got, want[normalize]):
            block = np.array(block, dtype=np.float32)
            assert block.shape == ref.shape
            # Each request is batched on its own (padding differs by ~1e-4); a block out of
            # place or a row of another token would be far off.
            cos = (block * ref).sum(1) / np.linalg.norm(block, axis=1) / np.linalg.norm(ref, axis=1)
            assert cos.min() > 0.9999, cos.min()
