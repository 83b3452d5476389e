"""Several boxes through one real nats-server: two daemons on this machine.

Box A and box B are real `fleetctl serve --nats` processes (own ports, FLEET_HOMEs,
FLEET_BOX names, one CPU worker each, real all-MiniLM-L6-v2) joined through a real
`nats-server -js` on 127.0.0.1. Requests go to A only; the scenarios check that
both boxes serve them, that large bodies go through the object store, and that
a NATS restart and a kill -9 of box B lose nothing. Run in file order: the last
scenario kills B.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon, wait_until_ready
from tests.nats_fixture import NatsServer, nats_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.nats, pytest.mark.slow]

TEXTS = [f"request {i}: the quick brown fox number {i * 7} jumps over lazy dog {i}" for i in range(24)]


class Boxes:
    def __init__(self, nats: NatsServer, a: DaemonProc, b: DaemonProc) -> None:
        self.nats, self.a, self.b = nats, a, b


def box_env(nats: NatsServer, box: str) -> dict[str, str]:
    return {
        "FLEET_NATS": nats.url, "FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1",
        # Short ack wait and heartbeat so redelivery and the cluster view react in seconds.
        "FLEET_NATS_ACK_WAIT_MS": "3000", "FLEET_NATS_HEARTBEAT_MS": "500",
        # A small per-box capacity, so a burst sent to A spills over to B.
        "FLEET_NATS_FETCH_PER_WORKER": "4",
        "FLEET_MAX_BODY_BYTES": str(8 << 20), "FLEET_TIMEOUT_MS": "60000",
    }


@pytest.fixture(scope="module")
def boxes(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    root = tmp_path_factory.mktemp("boxes")
    a = start_daemon(root / "a", extra_env=box_env(nats_server, "box-a"), wait_ready=False)
    b = start_daemon(root / "b", extra_env=box_env(nats_server, "box-b"), wait_ready=False)
    try:
        wait_until_ready(a)
        wait_until_ready(b)
        yield Boxes(nats_server, a, b)
    finally:
        for d in (a, b):
            d.stop()
            if d.proc.returncode == -signal.SIGKILL:
                drop_queue_of_killed(d.proc.pid)


def drop_queue_of_killed(pid: int) -> None:
    """A daemon killed with -9 could not unlink its shared-memory queue (named after its pid)."""
    from local_queue import LocalQueue

    try:
        q = LocalQueue.attach(f"fleet-{pid}")
    except FileNotFoundError:
        return
    q.unlink()
    q.close()


@pytest.fixture(scope="module")
def references(boxes: Boxes) -> np.ndarray:
    """TEXTS embedded in one request: what every single-text answer must match."""
    r = httpx.post(boxes.a.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": TEXTS}, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


async def embed_all(url: str, indices: list[int], *, concurrency: int, on_reply=None,
                    timeout_ms: int = 60_000) -> list[tuple[int, int, str, np.ndarray | None]]:
    """POST one text per request; (index, status, served-by, vector) per request, in order sent."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int):
            async with sem:
                r = await client.post(url + "/v1/embed", content=msgspec.msgpack.encode(
                    {"model": DEFAULT_MODEL, "inputs": [TEXTS[i % len(TEXTS)]], "timeout_ms": timeout_ms}),
                    headers={"content-type": "application/msgpack"})
            vec = None
            if r.status_code == 200:
                body = msgspec.msgpack.decode(r.content)
                vec = np.frombuffer(body["embeddings"], dtype="<f4").reshape(body["shape"])[0]
            out = (i, r.status_code, r.headers.get("x-served-by", ""), vec)
            if on_reply is not None:
                await on_reply(out)
            return out

        return await asyncio.gather(*(one(i) for i in indices))


def assert_all_correct(results, references: np.ndarray) -> None:
    bad = [(i, status) for i, status, _, _ in results if status != 200]
    assert not bad, f"requests that failed: {bad}"
    for i, _, served_by, vec in results:
        ref = references[i % len(TEXTS)]
        cos = float(vec @ ref / (np.linalg.norm(vec) * np.linalg.norm(ref)))
        assert cos > 0.999, f"request {i} (served by {served_by}) got another text's vector: cosine {cos:.4f}"


def boxes_of(results) -> set[str]:
    return {served_by.split("/")[0] for _, _, served_by, _ in results}


def test_requests_sent_to_a_are_served_by_both_boxes(boxes: Boxes, references: np.ndarray) -> None:
    results = asyncio.run(embed_all(boxes.a.url, list(range(48)), concurrency=12))
    assert_all_correct(results, references)
    assert boxes_of(results) == {"box-a", "box-b"}, f"served by {sorted(boxes_of(results))}"


def test_ps_cluster_lists_every_box_with_models_and_load(boxes: Boxes) -> None:
    env = {**os.environ, "FLEET_URL": boxes.a.url, "COLUMNS": "200"}
    deadline = time.monotonic() + 20
    while True:  # heartbeats are periodic: the counts may lag the last answers by a period or two
        out = subprocess.run([sys.executable, "-m", "fleetctl", "ps", "--cluster", "--json"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        by_name = {b["box"]: b for b in json.loads(out.stdout)["boxes"]}
        if (set(by_name) == {"box-a", "box-b"} and sum(b["served"] for b in by_name.values()) >= 48) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(by_name) == {"box-a", "box-b"}
    for b in by_name.values():
        assert b["models"].get(DEFAULT_MODEL) == "embed"
        assert DEFAULT_MODEL in b["loaded"]
        assert b["workers"] == 1 and b["capacity"] == 4
    assert by_name["box-a"]["served"] + by_name["box-b"]["served"] >= 48
    table = subprocess.run([sys.executable, "-m", "fleetctl", "ps", "--cluster"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "box-a" in table.stdout and "box-b" in table.stdout and DEFAULT_MODEL in table.stdout


async def _object_store_state(url: str) -> tuple[int, int]:
    """(last sequence of the payload bucket's stream, live objects in it)."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("OBJ_fleet_payloads")
        obj = await js.object_store("fleet_payloads")
        try:
            live = len(await obj.list(ignore_deletes=True))
        except Exception as exc:  # nats.py raises NotFoundError for an empty bucket
            from nats.js.errors import NotFoundError

            if not isinstance(exc, NotFoundError):
                raise
            live = 0
        return info.state.last_seq, live
    finally:
        await nc.close()


def test_a_3_mb_request_goes_through_the_object_store(boxes: Boxes) -> None:
    seq_before, _ = asyncio.run(_object_store_state(boxes.nats.url))
    big = "hello world " * ((1 << 20) // 12)  # ~1 MiB per text, 3 texts: ~3 MiB body
    r = httpx.post(boxes.a.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [big, big, big]},
                   timeout=120)
    assert r.status_code == 200, r.text
    vecs = np.asarray(r.json()["embeddings"], dtype=np.float32)
    assert vecs.shape == (3, 384)
    # Truncation keeps the first 256 tokens: the same vector as a short text with that prefix.
    small = httpx.post(boxes.a.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["hello world " * 300]},
                       timeout=60).json()["embeddings"][0]
    assert float(vecs[0] @ np.asarray(small, dtype=np.float32)) > 0.999
    seq_after, live = asyncio.run(_object_store_state(boxes.nats.url))
    assert seq_after > seq_before, "the body did not go through the object store"
    deadline = time.monotonic() + 10
    while live and time.monotonic() < deadline:  # deleted once answered (in the background)
        time.sleep(0.2)
        _, live = asyncio.run(_object_store_state(boxes.nats.url))
    assert live == 0, "the payload object was not deleted after the answer"


def test_unknown_model_and_deadline_answer_without_hanging(boxes: Boxes) -> None:
    r = httpx.post(boxes.a.url + "/v1/embed", json={"model": "no-such-model", "inputs": ["x"]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    t0 = time.monotonic()
    r = httpx.post(boxes.a.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["x"], "timeout_ms": 1},
                   timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 5


def _served_and_duplicates(url: str, wait_s: float = 1.5) -> tuple[int, int]:
    time.sleep(wait_s)  # at least three heartbeat periods: every box's entry is fresh
    view = httpx.get(url + "/v1/cluster", timeout=10).json()
    return sum(b["served"] for b in view["boxes"]), sum(b["duplicates"] for b in view["boxes"])


def test_slow_work_extends_its_ack_deadline_instead_of_being_redelivered(boxes: Boxes) -> None:
    served0, dup0 = _served_and_duplicates(boxes.a.url)
    long_text = " ".join(f"word{i}" for i in range(300))  # truncated to 256 tokens
    t0 = time.monotonic()
    r = httpx.post(boxes.a.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": [long_text] * 128},
                   timeout=120)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert elapsed > 3.5, f"the request took {elapsed:.1f} s: not longer than ack_wait (3 s), nothing shown"
    # A redelivered copy would start on the other box after ack_wait and take as long again.
    served1, dup1 = _served_and_duplicates(boxes.a.url, wait_s=elapsed + 4.0)
    # Held past ack_wait, yet run once: in_progress() kept JetStream from redelivering it.
    assert (served1 - served0, dup1 - dup0) == (1, 0)


def test_nats_restart_mid_run_loses_no_accepted_request(boxes: Boxes, references: np.ndarray) -> None:
    done = 0
    restarted = asyncio.Event()

    async def run():
        loop = asyncio.get_running_loop()

        async def on_reply(_):
            nonlocal done
            done += 1
            if done == 8 and not restarted.is_set():
                restarted.set()
                await loop.run_in_executor(None, boxes.nats.restart)

        return await embed_all(boxes.a.url, list(range(48)), concurrency=8, on_reply=on_reply)

    results = asyncio.run(run())
    assert restarted.is_set()
    assert_all_correct(results, references)
    # The heartbeat bucket lives on the restarted server: box A's entry is back at
    # its next heartbeat after the reconnect, so wait for it (bounded) before reading.
    deadline = time.monotonic() + 20.0
    me = None
    while me is None and time.monotonic() < deadline:
        view = httpx.get(boxes.a.url + "/v1/cluster", timeout=10).json()
        me = next((b for b in view["boxes"] if b["box"] == "box-a"), None)
        if me is None:
            time.sleep(0.5)
    assert me is not None, f"box-a never reappeared in the cluster view: {view}"
    assert me["reconnects"] >= 1


def test_kill_9_of_box_b_under_load_completes_every_request_once(boxes: Boxes, references: np.ndarray) -> None:
    killed = asyncio.Event()

    async def on_reply(result):
        if result[2].startswith("box-b/") and not killed.is_set():
            killed.set()
            os.killpg(boxes.b.proc.pid, signal.SIGKILL)  # B and its worker, mid-batch

    results = asyncio.run(embed_all(boxes.a.url, list(range(60)), concurrency=12, on_reply=on_reply))
    boxes.b.proc.wait(timeout=10)
    assert killed.is_set(), "box B served nothing before the kill"
    assert len(results) == 60 and sorted(r[0] for r in results) == list(range(60))
    assert_all_correct(results, references)
    # B leaves the cluster view once its heartbeat entry expires.
    deadline = time.monotonic() + 15
    names = {"box-b"}
    while "box-b" in names and time.monotonic() < deadline:
        time.sleep(0.5)
        names = {b["box"] for b in httpx.get(boxes.a.url + "/v1/cluster", timeout=10).json()["boxes"]}
    assert names == {"box-a"}


def test_sigterm_of_box_b_under_load_hands_its_work_back(boxes: Boxes, references: np.ndarray) -> None:
    # B again (the previous scenario killed it), same FLEET_HOME and box name.
    boxes.b = start_daemon(boxes.b.home, extra_env=box_env(boxes.nats, "box-b"))
    stopping = asyncio.Event()

    async def on_reply(result):
        if result[2].startswith("box-b/") and not stopping.is_set():
            stopping.set()
            boxes.b.proc.send_signal(signal.SIGTERM)  # graceful: stop pulling, answer or hand back

    results = asyncio.run(embed_all(boxes.a.url, list(range(60)), concurrency=12, on_reply=on_reply))
    assert stopping.is_set(), "box B served nothing before SIGTERM"
    # It exits on its own (how is the drain's business: 0, or the signal re-raised).
    assert boxes.b.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    assert_all_correct(results, references)
