"""A batch line's body outlives the object store's TTL (issue 23): with `--nats`, a body
over `nats_large_payload_bytes` rides the object store `fleet_payloads`, whose objects
JetStream expires by age; a batch line may wait in JetStream longer than that (no box
up, or interactive work saturating every box), and before, it was answered "the request
body is gone" into the batch's error file. Its requester now puts the body again every
third of the TTL while it waits (`Payloads.keep`), and only then: a requester killed -9
leaves orphans that expire within one TTL.

Real parts: a real `nats-server -js`, two real `fleetctl serve --nats` boxes (one CPU
worker each). Box B alone stores the embedder the batch names; box A takes the batch
(real openai SDK) and sends every line body through the object store
(FLEET_NATS_LARGE_PAYLOAD_BYTES 256). B is paused whole (SIGSTOP, "no box up") before
the batch is created, for three TTLs, then resumed.

The TTL: the test creates the bucket first with a TTL of TTL_S seconds, so it waits
seconds, not half an hour. A box binds to an existing bucket as it is (the first box
to create it sets its config) and reads the TTL JetStream keeps for it at the join:
the shipped bucket (PAYLOAD_TTL_S, 900 s) goes through the same code, with a body
put again every 300 s. FLEET_NATS_HEARTBEAT_MS 4000 (shipped: 2000): A keeps B in
its view (3 periods) while B is paused long enough to create the batch, whose
validation needs a box that stores its model. The heartbeat is only that view: what
is tested, the requester putting bodies again (`Payloads.keep`, timed by the
bucket's TTL) and a puller's bounded read, never reads it, so at the shipped period
they behave the same; a slow CI box could only fail the scaffolding (B dropped from
A's view before the batch is created), not the property.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from fleet.daemon.cluster import PAYLOADS_BUCKET, STREAM, batch_consumer_name
from tests.conftest import default_model_dir, start_daemon, wait_until_ready
from tests.gen_models import pull
from tests.nats_fixture import NatsServer, drop_queue_of_killed, nats_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.nats, pytest.mark.slow]

#: The bucket's TTL here (the shipped one is 900 s): bodies are put again every TTL_S / 3.
TTL_S = 3.0
#: How long B stays paused once the lines are queued: three TTLs, so a body put only once is long gone.
PAUSED_S = 3 * TTL_S
MODEL = "minilm-b"
HEARTBEAT_MS = 4000
LINES = 6
TEXTS = [f"line text {i}: a long enough sentence about a fox number {i * 11} that jumps over the "
         f"lazy dog sleeping by the river bank number {i % 5}, near the old mill" for i in range(2 * LINES)]
FINAL = ("completed", "failed", "expired", "cancelled")


def lines() -> str:
    return "".join(json.dumps({"custom_id": f"n{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": MODEL, "input": TEXTS[2 * i:2 * i + 2],
                                        "encoding_format": "float"}}) + "\n" for i in range(LINES))


async def _with_js(url: str, fn):
    import nats

    nc = await nats.connect(url)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


def create_bucket(url: str) -> None:
    from nats.js.api import ObjectStoreConfig, StorageType

    asyncio.run(_with_js(url, lambda js: js.create_object_store(
        PAYLOADS_BUCKET, ObjectStoreConfig(ttl=TTL_S, storage=StorageType.FILE))))


def live_objects(url: str) -> int:
    async def count(js) -> int:
        from nats.js.errors import NotFoundError

        try:
            return len(await (await js.object_store(PAYLOADS_BUCKET)).list(ignore_deletes=True))
        except NotFoundError:  # nats.py's answer for an empty bucket
            return 0

    return asyncio.run(_with_js(url, count))


def queued_lines(url: str) -> int:
    """Lines of the batch in JetStream: not delivered yet, or delivered and not acked."""
    async def read(js) -> int:
        info = await js.consumer_info(STREAM, batch_consumer_name(MODEL))
        return info.num_pending + info.num_ack_pending

    return asyncio.run(_with_js(url, read))


def entry_of(url: str, box: str) -> dict:
    for entry in httpx.get(url + "/v1/cluster", timeout=10).json()["boxes"]:
        if entry["box"] == box:
            return entry
    return {}


def wait_for(cond, timeout_s: float, what: str, step_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(step_s)
    return got


def pause_b_and_queue(a_url: str, b_pid: int, c: openai.OpenAI, file_id: str, nats_url: str) -> tuple[str, float]:
    """Pause B while A's view of it is fresh, create the batch on A, wait until its lines
    are queued in JetStream; (batch id, when they were)."""
    # Its entry is read every heartbeat, at most a heartbeat old: within 3 (it expires) there is time.
    heartbeat_s = HEARTBEAT_MS / 1000
    wait_for(lambda: 0 <= entry_of(a_url, "box-b").get("age_s", -1) < heartbeat_s + 0.5, 3 * heartbeat_s + 10,
             "A has no fresh view of box B")
    os.killpg(b_pid, signal.SIGSTOP)
    batch_id = c.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h").id
    wait_for(lambda: c.batches.retrieve(batch_id).status != "validating", 20, "the batch never left validating")
    assert c.batches.retrieve(batch_id).status == "in_progress", c.batches.retrieve(batch_id)
    wait_for(lambda: queued_lines(nats_url) >= LINES, 30, "the lines were never queued in JetStream")
    return batch_id, time.monotonic()


def test_a_batch_line_body_outlives_the_object_store_ttl_and_an_orphan_does_not(
        nats_server: NatsServer, tmp_path: Path) -> None:  # noqa: F811
    create_bucket(nats_server.url)
    pull(tmp_path / "b", default_model_dir(), MODEL)  # only B stores the batch's model
    env = {"FLEET_NATS": nats_server.url, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1",
           "FLEET_NATS_HEARTBEAT_MS": str(HEARTBEAT_MS), "FLEET_PRELOAD": ""}
    a = start_daemon(tmp_path / "a", extra_env={**env, "FLEET_BOX": "box-a", "FLEET_NATS_LARGE_PAYLOAD_BYTES": "256"},
                     wait_ready=False)
    b = start_daemon(tmp_path / "b", extra_env={**env, "FLEET_BOX": "box-b"}, wait_ready=False)
    try:
        wait_until_ready(a)
        wait_until_ready(b)
        wait_for(lambda: MODEL in entry_of(a.url, "box-b").get("models", {}), 30, "A never saw box B's model")
        # The references, through the cluster (B runs them; the body rides the object store too).
        r = httpx.post(a.url + "/v1/embeddings", json={"model": MODEL, "input": TEXTS, "encoding_format": "float"},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-by"].startswith("box-b/")
        refs = np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)

        path = tmp_path / "in.jsonl"
        path.write_text(lines())
        c = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=2)
        file_id = c.files.create(file=path.open("rb"), purpose="batch").id

        # 1. No box can run the lines for three TTLs: their bodies are still there when B is back.
        batch_id, queued_at = pause_b_and_queue(a.url, b.proc.pid, c, file_id, nats_server.url)
        refreshed0 = entry_of(a.url, "box-a").get("bodies_refreshed", 0)
        time.sleep(max(0.0, queued_at + PAUSED_S - time.monotonic()))
        live_while_paused = live_objects(nats_server.url)
        os.killpg(b.proc.pid, signal.SIGCONT)
        bb = wait_for(lambda: (x := c.batches.retrieve(batch_id)).status in FINAL and x, 120,
                      "the batch did not end within 120 s of box B's resume", step_s=0.5)
        errors = c.files.content(bb.error_file_id).text.splitlines() if bb.error_file_id else []
        seen: Counter = Counter()
        wrong = []
        for raw in c.files.content(bb.output_file_id).text.splitlines() if bb.output_file_id else []:
            line = json.loads(raw)
            seen[line["custom_id"]] += 1
            i = int(line["custom_id"][1:])
            vecs = np.asarray([d["embedding"] for d in line["response"]["body"]["data"]], dtype=np.float32)
            ref = refs[2 * i:2 * i + 2]
            cos = np.sum(vecs * ref, axis=1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
            if cos.min() < 0.999:
                wrong.append(line["custom_id"])
        ended = time.time()  # A's entry from a heartbeat after the end counts every put
        entry = wait_for(lambda: (e := entry_of(a.url, "box-a")).get("at", 0) > ended and e, 3 * HEARTBEAT_MS / 1000,
                         "A's cluster entry was not renewed")
        refreshed = entry["bodies_refreshed"] - refreshed0
        # Answered: A deletes each body (in the background).
        live_after = wait_for(lambda: (n := live_objects(nats_server.url)) == 0 and [n], 10,
                              "bodies left in the object store after their lines were answered")

        # 2. A requester killed -9 puts nothing again: its bodies are gone within one TTL.
        batch2, _ = pause_b_and_queue(a.url, b.proc.pid, c, file_id, nats_server.url)
        time.sleep(TTL_S)  # each body was put again at least once
        orphans = live_objects(nats_server.url)
        os.killpg(a.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        a.proc.wait(timeout=30)
        wait_for(lambda: live_objects(nats_server.url) == 0, TTL_S + 5, "orphaned bodies outlived the TTL")
        orphan_gone_s = time.monotonic() - killed_at
        os.killpg(b.proc.pid, signal.SIGCONT)
    finally:
        for d in (a, b):
            with contextlib.suppress(ProcessLookupError):  # A is gone after step 2
                os.killpg(d.proc.pid, signal.SIGCONT)
            d.stop()
            if d.proc.returncode == -signal.SIGKILL:
                drop_queue_of_killed(d.proc.pid)
    print(f"{LINES} lines queued with no box up for {PAUSED_S:.0f} s (bucket TTL {TTL_S:.0f} s): "
          f"{live_while_paused} bodies live at the end of the pause; {bb.status} {bb.request_counts}; "
          f"bodies put again {refreshed}; orphans of a killed requester: {orphans}, gone {orphan_gone_s:.1f} s "
          f"after the kill")
    assert not errors, f"lines answered into the error file: {errors[:3]}"
    assert live_while_paused == LINES, "the bodies of the waiting lines expired"
    assert bb.status == "completed", (bb.status, bb.request_counts)
    assert (bb.request_counts.completed, bb.request_counts.failed) == (LINES, 0)
    assert sorted(seen.items()) == sorted((f"n{i}", 1) for i in range(LINES))
    assert not wrong, f"lines answered with another text's vectors: {wrong}"
    # Every third of the TTL while paused: each body at least twice (three TTLs; a put
    # late by the box's load still leaves more than two).
    assert refreshed >= 2 * LINES, refreshed
    assert live_after == [0]
    assert orphans == LINES and batch2
