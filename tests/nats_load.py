"""Load through one box of a NATS cluster while something breaks, and the count of what came back.

`Load` sends embed requests to one box, `concurrency` at a time, until told to stop;
every answer is checked against the reference vectors of its own texts, so an answer
given to the wrong request would count as wrong. `Tally` is what the fault tests
report: requests sent, answered 200, answered otherwise (by code), wrong answers, and
replies the requesters dropped as second answers (their `duplicates` counters).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np

from tests.conftest import DEFAULT_MODEL

TEXTS = [f"request {i}: the quick brown fox number {i * 7} jumps over lazy dog {i}" for i in range(24)]


def texts_of(i: int, n_texts: int) -> list[int]:
    """Request i's texts (indices into TEXTS): n_texts consecutive ones from i."""
    return [(i + k) % len(TEXTS) for k in range(n_texts)]


def references(url: str, headers: dict[str, str] | None = None) -> np.ndarray:
    """TEXTS embedded in one request: what every answer must match."""
    r = httpx.post(url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": TEXTS}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


@dataclass
class Reply:
    i: int
    status: int
    served_by: str
    code: str = ""
    right: bool = False
    at: float = 0.0


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    otherwise: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    #: Replies the requesting box dropped because the request was answered already.
    duplicates: int = 0

    def __str__(self) -> str:
        other = ", ".join(f"{n} x {code}" for code, n in sorted(self.otherwise.items())) or "none"
        return (f"sent {self.sent}, answered 200 {self.ok}, answered otherwise {other}, wrong answers "
                f"{self.wrong}, answered twice (dropped as duplicates) {self.duplicates}")


class Load:
    """Embed requests of `n_texts` texts through `url`, `concurrency` at a time, at the
    daemon's default timeout_ms unless `timeout_ms` is given."""

    def __init__(self, url: str, refs: np.ndarray, *, concurrency: int = 8, n_texts: int = 2,
                 timeout_ms: int | None = None, headers: dict[str, str] | None = None) -> None:
        self.url, self.refs = url, refs
        self.concurrency, self.n_texts, self.timeout_ms = concurrency, n_texts, timeout_ms
        self.headers = {"content-type": "application/msgpack", **(headers or {})}
        self.replies: list[Reply] = []
        #: The first error message of each code answered (what a failing test shows).
        self.first_error: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._next = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self, limit: int | None = None) -> list[Reply]:
        """Until `stop()` (or `limit` requests sent); returns every reply, in the order they came."""
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=self.concurrency)) as client:
            async def worker() -> None:
                while not self._stop.is_set() and (limit is None or self._next < limit):
                    i, self._next = self._next, self._next + 1
                    self.replies.append(await self._one(client, i))

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return self.replies

    async def _one(self, client: httpx.AsyncClient, i: int) -> Reply:
        body: dict = {"model": DEFAULT_MODEL, "inputs": [TEXTS[t] for t in texts_of(i, self.n_texts)]}
        if self.timeout_ms is not None:
            body["timeout_ms"] = self.timeout_ms
        try:
            r = await client.post(self.url + "/v1/embed", content=msgspec.msgpack.encode(body), headers=self.headers)
        except httpx.TransportError as exc:
            return Reply(i, 0, "", f"transport: {type(exc).__name__}", at=time.monotonic())
        answer = msgspec.msgpack.decode(r.content)
        reply = Reply(i, r.status_code, r.headers.get("x-served-by", ""), at=time.monotonic())
        if r.status_code != 200:
            reply.code = answer["error"]["code"]
            self.first_error.setdefault(reply.code, answer["error"]["message"])
            return reply
        vecs = np.frombuffer(answer["embeddings"], dtype="<f4").reshape(answer["shape"])
        ref = self.refs[texts_of(i, self.n_texts)]
        cos = np.sum(vecs * ref, axis=1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
        reply.right = bool(cos.min() > 0.999)
        return reply

    def tally(self, duplicates: int = 0) -> Tally:
        codes = collections.Counter(r.code for r in self.replies if r.status != 200)
        return Tally(len(self.replies), sum(r.status == 200 for r in self.replies), dict(codes),
                     sum(r.status == 200 and not r.right for r in self.replies), duplicates)

    def answered_once_each(self) -> bool:
        """Every request sent got exactly one reply (the client's side of "answered once")."""
        return sorted(r.i for r in self.replies) == list(range(len(self.replies)))


def cluster_view(url: str, headers: dict[str, str] | None = None, boxes: tuple[str, ...] = ("box-a", "box-b"),
                 timeout_s: float = 20.0) -> dict[str, dict]:
    """The entries of `boxes` in the cluster view of the box at `url`, each written after
    this call (a heartbeat later: what happened before the call is in them), by box name."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        view = httpx.get(url + "/v1/cluster", headers=headers, timeout=10).json()
        entries = {b["box"]: b for b in view["boxes"] if b["box"] in boxes}
        if all(b in entries and entries[b]["at"] > since for b in boxes):
            return entries
        if time.monotonic() > deadline:
            raise AssertionError(f"no fresh entry of {boxes} within {timeout_s:.0f} s: {view}")
        time.sleep(0.25)
