"""One big text must not tie up a worker (issue 16, deliverable 3).

A real daemon at the shipped settings (16 MiB body limit). A 15 MB text is cut to
a character bound from the model's max tokens before tokenizing, so: its answer is
the answer for a max-length text (truncation unchanged), an unrelated small request
sent while two of them run is answered, and the worker's RSS comes back near where
it was after a burst of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import psutil
import pytest

from fleet.runtimes.adapters.batching import char_bound
from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon
from tests.gen_models import build_llama, pull

MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
BIG_BYTES = 15_000_000
MIB = 1 << 20
#: all-MiniLM-L6-v2 reads 256 tokens.
MAX_TOKENS = 256
#: After a burst, the worker's RSS may stay this far above its level before it
#: (allocator pools); the landed code kept ~1.7 GB.
RSS_SLACK = 160 * MIB


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """The default model and a tiny generator, at the shipped settings."""
    root = tmp_path_factory.mktemp("fleet-big")
    pull(root / "home", build_llama(root / "llama"), "big-llama")
    d = start_daemon(root / "home")
    yield d
    d.stop()


def big_text() -> str:
    words = "invoices must be paid within thirty days of receipt "
    return (words * (BIG_BYTES // len(words) + 1))[:BIG_BYTES]


def embed(url: str, texts: list[str], timeout: float = 120, **extra) -> httpx.Response:
    body = msgspec.msgpack.encode({"model": DEFAULT_MODEL, "inputs": texts, **extra})
    return httpx.post(url + "/v1/embed", content=body, headers=MSGPACK, timeout=timeout)


def vectors(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.content[:300]
    out = msgspec.msgpack.decode(resp.content)
    return np.frombuffer(out["embeddings"], dtype="<f4").reshape(out["shape"])


def worker_rss(d: DaemonProc) -> int:
    pid = httpx.get(d.url + "/v1/ps", timeout=10).json()["workers"][0]["pid"]
    return psutil.Process(pid).memory_info().rss


def test_a_15_mb_text_is_answered_as_its_max_length_prefix(shipped):
    text = big_text()
    got = vectors(embed(shipped.url, [text]))
    prefix = vectors(embed(shipped.url, [text[:char_bound(MAX_TOKENS)]]))
    assert np.allclose(got, prefix, atol=1e-5)
    usage = msgspec.msgpack.decode(embed(shipped.url, [text]).content)["usage"]["input_tokens"]
    assert usage == MAX_TOKENS


def test_a_15_mb_text_without_truncation_is_refused_before_tokenizing(shipped):
    resp = embed(shipped.url, [big_text()], truncate=False)
    assert resp.status_code == 422
    err = msgspec.msgpack.decode(resp.content)["error"]
    assert err["code"] == "input_too_long" and "characters" in err["message"]


def test_a_15_mb_prompt_is_refused_before_tokenizing(shipped):
    for body in ({"prompt": big_text()}, {"messages": [{"role": "user", "content": big_text()}]}):
        resp = httpx.post(shipped.url + "/v1/generate", json={"model": "big-llama", "max_tokens": 4, **body},
                          timeout=120)
        assert resp.status_code == 422, resp.text[:300]
        err = resp.json()["error"]
        assert err["code"] == "input_too_long" and "characters" in err["message"]
    ok = httpx.post(shipped.url + "/v1/generate", json={"model": "big-llama", "prompt": "hello", "max_tokens": 4},
                    timeout=120)
    assert ok.status_code == 200, ok.text[:300]


def test_big_texts_do_not_starve_a_small_request_nor_keep_memory(shipped):
    embed(shipped.url, ["warm"])
    before = worker_rss(shipped)
    text = big_text()
    answers: list[int] = []
    big = [threading.Thread(target=lambda: answers.append(embed(shipped.url, [text]).status_code))
           for _ in range(2)]
    for t in big:
        t.start()
    # The unrelated 11-byte embed of the issue, at the default request timeout (30 s).
    small = embed(shipped.url, ["hello world"], timeout=60)
    for t in big:
        t.join(timeout=120)
    assert small.status_code == 200, small.content[:300]
    assert answers == [200, 200]
    for _ in range(3):  # a burst: more big ones, one after another
        assert embed(shipped.url, [text]).status_code == 200
    after = worker_rss(shipped)
    print(f"\nworker rss before {before / MIB:.0f} MiB, after 5 x 15 MB texts {after / MIB:.0f} MiB")
    assert after - before < RSS_SLACK, (before / MIB, after / MIB)
