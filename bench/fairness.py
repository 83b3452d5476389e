"""Fair admission (issue 25): what a large request and a flooding client cost the others.

Scenarios against a fresh `fleetctl serve` at the shipped defaults (its own
FLEET_HOME, MiniLM from its package), one after the other:

`big` (deliverable 1): one request of `--texts` inputs of about `--tokens` tokens
each (the issue's reproduction: 2 048 x ~3 900 tokens, 16 MB of JSON; a text is
single letters and spaces, two characters a token) while a small client sends one
one-text request every `--every` s, from 5 s before the big one until its answer.
Reported: the big request's status and time, the small client's latencies while it
ran (worst, p95, p50, statuses), the worker's counters (tokens served, micro-batches,
items dropped between micro-batches) at the big answer and once the worker is idle.
`--texts 0` sends the largest request `max_request_tokens` admits for MiniLM
instead (every text cut at its 256 tokens).

`flood` (deliverable 2): a light client (`X-Fleet-Client: light`, one request of
`--light-texts` texts at a time) alone for `--seconds`, then again while a flooding
client (`X-Fleet-Client: flood`, `--flood` connections sending back to back,
`--flood-texts` texts each) floods the same model, for `--seconds` alone first and
then beside it. Reported: the light client's p50 / p95 / worst alone and flooded,
the ratio, the flood's requests/s alone and beside the light client. With
`--fifo` the light client sends as the flood (one client): the same load without
fair queueing between them, for comparison. Also reported: the workers' counters
over the flood's two phases (tokens a micro-batch: what the light request waits for).

`floods`: what sharing costs when nobody is light: one client of `--flood`
connections, then two clients of half as many each, the same texts, `--seconds`
each after 3 s of warm-up, `--rounds` times. Reported: requests/s of each client
and in all, tokens a micro-batch. Two clients must move what one moves: micro-batches
are cut short only beside a client of shorter requests (`policy.lighter_client`).

`burst`: a cold start under a burst (tests/test_shutdown.py's load): `--connections`
connections of one client (no X-Fleet-Client) each send one request of `--texts`
~65-token texts at a time from the daemon's start, for `--seconds`. Reported: when
the first request of each connection was answered (first, median, last; how many
within a second of the last: answered together), how many ran as pieces, and the
latencies of all.

    python -m fleet.bench fairness-big --out bench/results/fairness-big.json
    python -m fleet.bench fairness-big --texts 0 --out bench/results/fairness-big-max.json
    python -m fleet.bench fairness-flood --out bench/results/fairness-flood.json
    python -m fleet.bench fairness-floods --out bench/results/fairness-floods.json
    python -m fleet.bench fairness-burst --cpu-threads 1 --out bench/results/fairness-burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import httpx

from fleet.bench.daemon import LocalDaemon
from fleet.bench.report import document, write_json
from fleet.bench.cli import OUT, ROUNDS, URL, bench, option

MODEL = "all-minilm-l6-v2"
#: MiniLM reads at most this many tokens of a text (its max_seq_len).
MODEL_TOKENS = 256


def letters(tokens: int, seed: int = 0) -> str:
    """A text of about `tokens` tokens for a WordPiece vocabulary: single letters and
    spaces (two characters a token)."""
    abc = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(abc[(seed + i) % 26] for i in range(tokens))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95), "worst_ms": round(max(ms), 1) if ms else None}


def worker_counters(url: str) -> dict:
    ps = httpx.get(url + "/v1/ps", timeout=10).json()
    out = {"tokens": 0, "served": 0, "micro_batches": 0, "dropped": 0, "interjected": 0, "lanes": ps.get("lanes", [])}
    for w in ps.get("workers", []):
        m = w.get("models", {}).get(MODEL) or {}
        for key in ("tokens", "served", "micro_batches", "dropped", "interjected"):
            out[key] += m.get(key, 0)
    return out


def wait_idle(url: str, timeout_s: float = 600.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        lanes = [lane for lane in httpx.get(url + "/v1/ps", timeout=10).json().get("lanes", [])
                 if lane.get("model") == MODEL and (lane.get("depth") or lane.get("claimed"))]
        if not lanes:
            return
        time.sleep(0.2)


# ---- big: one large request, a small client every second --------------------------------------

async def big(url: str, texts: int, tokens: int, every_s: float, lead_s: float) -> dict:
    if texts == 0:  # the largest request the ceiling admits: every text at MiniLM's cut
        texts, tokens = 300_000 // MODEL_TOKENS, 3_900
    body = json.dumps({"model": MODEL, "inputs": [letters(tokens, i) for i in range(texts)]}).encode()
    small_ms: list[float] = []
    small_status: dict[int, int] = {}
    result: dict = {"texts": texts, "tokens_per_text": tokens, "body_bytes": len(body)}
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as big_client, httpx.AsyncClient(timeout=120) as small_client:
        async def small_loop() -> None:
            k = 0
            while not done.is_set():
                t0 = time.perf_counter()
                r = await small_client.post(url + "/v1/embed", json={"model": MODEL, "inputs": [f"small {k}"]})
                ms = (time.perf_counter() - t0) * 1e3
                if big_started.is_set():
                    small_ms.append(ms)
                    small_status[r.status_code] = small_status.get(r.status_code, 0) + 1
                k += 1
                await asyncio.sleep(max(0.0, every_s - ms / 1e3))

        big_started = asyncio.Event()
        smalls = asyncio.create_task(small_loop())
        await asyncio.sleep(lead_s)
        before = await asyncio.to_thread(worker_counters, url)
        big_started.set()
        t0 = time.perf_counter()
        r = await big_client.post(url + "/v1/embed", content=body, headers={"content-type": "application/json"})
        result["big"] = {"status": r.status_code, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                         "pieces": r.headers.get("x-fleet-pieces"),
                         "error": r.json().get("error") if r.status_code != 200 else None}
        at_answer = await asyncio.to_thread(worker_counters, url)
        done.set()
        await smalls
    await asyncio.to_thread(wait_idle, url)
    idle = await asyncio.to_thread(worker_counters, url)
    result["small"] = {**summary(small_ms), "every_s": every_s, "status": small_status}
    keys = ("tokens", "served", "micro_batches", "dropped")
    result["worker"] = {
        "during": {k: at_answer[k] - before[k] for k in keys},
        "after_answer": {k: idle[k] - at_answer[k] for k in keys},
    }
    return result


# ---- flood: a light client alone, then beside a flooding one --------------------------------------

async def light_client(url: str, texts: int, seconds: float, name: str) -> tuple[list[float], list[float], list[float]]:
    """The light client's latencies (ms), and the server's split of each: X-Queue-Ms, X-Inference-Ms."""
    inputs = [f"a light client's sentence number {i}, of about twenty tokens in all" for i in range(texts)]
    out: list[float] = []
    queue_ms: list[float] = []
    inference_ms: list[float] = []
    async with httpx.AsyncClient(timeout=120, headers={"x-fleet-client": name}) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/embed", json={"model": MODEL, "inputs": inputs})
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
            queue_ms.append(float(r.headers["x-queue-ms"]))
            inference_ms.append(float(r.headers["x-inference-ms"]))
    return out, queue_ms, inference_ms


async def flood_client(url: str, connections: int, texts: int, stop: asyncio.Event, name: str,
                       answered: list[int]) -> int:
    """Floods until `stop`; `answered[0]` counts its answers as they come."""
    inputs = [f"a flooding client's longer sentence number {i}, " + letters(40, i) for i in range(texts)]

    async def one() -> None:
        async with httpx.AsyncClient(timeout=120, headers={"x-fleet-client": name}) as c:
            while not stop.is_set():
                r = await c.post(url + "/v1/embed", json={"model": MODEL, "inputs": inputs})
                r.raise_for_status()
                answered[0] += 1

    await asyncio.gather(*(one() for _ in range(connections)))
    return answered[0]


async def flood(url: str, seconds: float, light_texts: int, connections: int, flood_texts: int, fifo: bool) -> dict:
    await light_client(url, light_texts, 3.0, "light")  # warm: the cost model is fitted
    alone, alone_q, alone_i = await light_client(url, light_texts, seconds, "light")
    stop, answered = asyncio.Event(), [0]
    flooding = asyncio.create_task(flood_client(url, connections, flood_texts, stop, "flood", answered))
    await asyncio.sleep(3.0)  # the flood's backlog builds up
    t0, n0, c0 = time.monotonic(), answered[0], await asyncio.to_thread(worker_counters, url)
    await asyncio.sleep(seconds)  # the flood alone with the model
    alone_rate = (answered[0] - n0) / (time.monotonic() - t0)
    t0, n0, c1 = time.monotonic(), answered[0], await asyncio.to_thread(worker_counters, url)
    flooded, flooded_q, flooded_i = await light_client(url, light_texts, seconds, "flood" if fifo else "light")
    shared_rate = (answered[0] - n0) / (time.monotonic() - t0)
    c2 = await asyncio.to_thread(worker_counters, url)
    stop.set()
    await flooding
    a, f = summary(alone), summary(flooded)
    a["server_queue"], a["server_inference"] = summary(alone_q), summary(alone_i)
    f["server_queue"], f["server_inference"] = summary(flooded_q), summary(flooded_i)
    return {"light_texts": light_texts, "flood_connections": connections, "flood_texts": flood_texts,
            "fifo": fifo, "alone": a, "flooded": f,
            "p95_ratio": round(f["p95_ms"] / a["p95_ms"], 2) if a["p95_ms"] and f["p95_ms"] else None,
            "flood_alone_requests_per_s": round(alone_rate, 1), "flood_requests_per_s": round(shared_rate, 1),
            # The workers' counters over each phase: tokens a micro-batch is how long the
            # light request waits for one; interjected, how often it ran between two.
            "worker": {"flood_alone": phase_counters(c0, c1), "flooded": phase_counters(c1, c2)}}


def phase_counters(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("tokens", "served", "micro_batches", "interjected")}
    out["tokens_per_micro_batch"] = round(out["tokens"] / out["micro_batches"], 1) if out["micro_batches"] else None
    return out


# ---- floods: one flooding client, then two of half the connections ----------------------------

async def floods_phase(url: str, groups: list[tuple[str, int]], texts: int, seconds: float) -> dict:
    stop, counts = asyncio.Event(), [[0] for _ in groups]
    tasks = [asyncio.create_task(flood_client(url, n, texts, stop, name, c)) for (name, n), c in zip(groups, counts)]
    await asyncio.sleep(3.0)  # backlogs build up; the workers see every client
    n0, c0, t0 = [c[0] for c in counts], await asyncio.to_thread(worker_counters, url), time.monotonic()
    await asyncio.sleep(seconds)
    n1, c1, dt = [c[0] for c in counts], await asyncio.to_thread(worker_counters, url), time.monotonic() - t0
    stop.set()
    await asyncio.gather(*tasks)
    rates = [round((b - a) / dt, 2) for a, b in zip(n0, n1)]
    return {"clients": [name for name, _ in groups], "requests_per_s": rates,
            "total_requests_per_s": round(sum(rates), 2), "worker": phase_counters(c0, c1)}


async def floods(url: str, seconds: float, connections: int, texts: int, rounds: int) -> dict:
    half = max(1, connections // 2)
    runs = []
    for _ in range(rounds):
        runs.append(await floods_phase(url, [("flood", connections)], texts, seconds))
        runs.append(await floods_phase(url, [("flood-a", half), ("flood-b", half)], texts, seconds))
    one = [r["total_requests_per_s"] for r in runs[0::2]]
    two = [r["total_requests_per_s"] for r in runs[1::2]]
    return {"connections": connections, "texts": texts, "runs": runs,
            "two_over_one": round(sum(two) / sum(one), 2) if sum(one) else None}


# ---- burst: connections of one client, one mid-size request each, from a cold start -------------

#: ~65 tokens: test_shutdown's clients' text.
BURST_TEXT = "the quick brown fox jumps over the lazy dog near the river bank " * 5


async def burst(url: str, connections: int, texts: int, seconds: float) -> dict:
    """`connections` connections without X-Fleet-Client (one client: every loopback
    caller is one) each send one request of `texts` texts at a time, from the
    daemon's start (the model not loaded, no answer seen) for `seconds`."""
    body = {"model": MODEL, "inputs": [f"{i} {BURST_TEXT}" for i in range(texts)]}
    t_start = time.monotonic()
    spans: list[tuple[float, float, bool]] = []  # (sent s, answered s, ran as pieces)

    async def one() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            while time.monotonic() - t_start < seconds:
                t0 = time.monotonic()
                r = await c.post(url + "/v1/embed", json=body)
                r.raise_for_status()
                spans.append((t0 - t_start, time.monotonic() - t_start, "x-fleet-pieces" in r.headers))

    await asyncio.gather(*(one() for _ in range(connections)))
    first = sorted(spans, key=lambda s: s[0])[:connections]  # each connection's first request
    ends = sorted(e for _, e, _ in first)
    return {"connections": connections, "texts": texts, "seconds": seconds,
            "first_wave": {"first_answer_s": round(ends[0], 2), "median_answer_s": round(ends[len(ends) // 2], 2),
                           "last_answer_s": round(ends[-1], 2),
                           "answered_within_1s_of_the_last": sum(e > ends[-1] - 1.0 for e in ends),
                           "as_pieces": sum(p for _, _, p in first)},
            "all": {**summary([(e - s) * 1e3 for s, e, _ in spans]), "requests": len(spans),
                    "as_pieces": sum(p for _, _, p in spans)}}


#: Every scenario's: the daemon, the result file.
COMMON = (URL.but(help="a running daemon (default: start one at the shipped defaults)"), OUT)
SECONDS = option("--seconds", type=float, default=15.0)
FLOOD_TEXTS = option("--flood-texts", type=int, default=16)


@bench("fairness-big", option("--texts", type=int, default=2048, help="0: the largest request max_request_tokens admits"),
       option("--tokens", type=int, default=3900),
       option("--every", type=float, default=1.0, help="seconds between the small client's requests"),
       option("--lead", type=float, default=5.0, help="seconds the small client runs before the big request"), COMMON,
       summary="Fair admission (issue 25): a small client's latency while one large request runs.")
@bench("fairness-flood", SECONDS.but(default=30.0), option("--light-texts", type=int, default=8),
       option("--flood", type=int, default=16, help="the flooding client's connections"), FLOOD_TEXTS,
       option("--fifo", action="store_true", help="the light client sends as the flood (no fair share)"), COMMON,
       summary="Fair admission (issue 25): a light client's latency alone and beside a flooding one.")
@bench("fairness-floods", SECONDS,
       option("--flood", type=int, default=16, help="connections of the one client; each of two gets half"),
       FLOOD_TEXTS, ROUNDS.but(default=2), COMMON,
       summary="Fair admission (issue 25): one flooding client against two of half the connections each.")
@bench("fairness-burst", option("--connections", type=int, default=12), option("--texts", type=int, default=32),
       SECONDS, option("--cpu-threads", type=int, help="FLEET_CPU_THREADS for the daemon (default: the shipped)"),
       COMMON, summary="Fair admission (issue 25): a cold start under a burst of connections.")
def main(a: argparse.Namespace) -> int:
    scenario = a.bench.removeprefix("fairness-")
    doc = document(f"fairness-{scenario}", "fleet.bench", a.argv)
    with tempfile.TemporaryDirectory(prefix="fleet-fair-") as home:
        threads = getattr(a, "cpu_threads", None)
        env = {"FLEET_CPU_THREADS": str(threads)} if threads else None
        daemon = None if a.url else LocalDaemon(home, env=env, inherit_fleet=False)
        url = a.url or daemon.url
        try:
            if scenario == "big":
                doc["result"] = asyncio.run(big(url, a.texts, a.tokens, a.every, a.lead))
            elif scenario == "burst":
                doc["result"] = asyncio.run(burst(url, a.connections, a.texts, a.seconds))
            elif scenario == "floods":
                doc["result"] = asyncio.run(floods(url, a.seconds, a.flood, a.flood_texts, a.rounds))
            else:
                doc["result"] = asyncio.run(flood(url, a.seconds, a.light_texts, a.flood, a.flood_texts, a.fifo))
        finally:
            if daemon is not None:
                daemon.stop()
    print(json.dumps(doc["result"], indent=1))
    if a.out:
        write_json(doc, a.out)
    return 0
