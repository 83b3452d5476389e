"""Throughput of local_queue across real processes, and the cost of a return.

Pipeline: producer process(es) put_many -> consumer process(es) claim(batch) and
ack_many -> one collector process wait_results. Reports items/s from the first
put to the last result, then (in this process) the cost of return_items.

    flock /tmp/fleet-bench.lock python bench/queue_bench.py --items 300000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from local_queue import LocalQueue, QueueFull  # noqa: E402


def produce(name: str, lane_name: str, start: int, count: int, put_batch: int, payload_bytes: int,
            go, full_waits, cpu, slot) -> None:
    q = LocalQueue.attach(name)
    lane = q.lane_id(lane_name)
    payload = os.urandom(payload_bytes)
    go.wait()
    i, waits = start, 0
    while i < start + count:
        n = min(put_batch, start + count - i)
        try:
            q.put_many(lane, [payload] * n, tokens=[16] * n, request_ids=list(range(i, i + n)))
            i += n
        except QueueFull:
            # Bench-side backpressure; the daemon answers 429 instead.
            waits += 1
            time.sleep(0.0002)
    full_waits.value += waits
    cpu[slot] = time.process_time()
    q.close()


def consume(name: str, lane_name: str, batch: int, result_bytes: int, stop, cpu, slot) -> None:
    q = LocalQueue.attach(name)
    lane = q.lane_id(lane_name)
    wid = q.register_worker(os.getpid(), "cpu")
    result = b"r" * result_bytes
    while not stop.is_set():
        if not q.wait_for_work(0.1):
            continue
        claims = q.claim(lane, worker=wid, max_items=batch, max_tokens=1 << 40, lease_ms=10_000)
        if claims:
            q.ack_many([(c.item_id, result, 0) for c in claims])
            del claims
    cpu[slot] = time.process_time()
    q.unregister_worker(wid)
    q.close()


def collect(name: str, total: int, out, cpu) -> None:
    q = LocalQueue.attach(name)
    seen = 0
    got = bytearray(total)
    while seen < total:
        for d in q.wait_results(1.0):
            got[d.request_id] += 1
            seen += 1
    cpu[0] = time.process_time()
    out.put((time.monotonic(), got.count(1) == total))
    q.close()


def measure_return(q: LocalQueue, batch: int, rounds: int) -> tuple[float, float]:
    """Mean µs of return_items(batch ids) and of claim(batch), in this process."""
    lane = q.lane_id("return-bench")
    wid = q.register_worker(os.getpid(), "cpu")
    q.put_many(lane, [b"x" * 100] * batch, tokens=[16] * batch, request_ids=list(range(batch)))
    t_ret = t_claim = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        claims = q.claim(lane, worker=wid, max_items=batch, max_tokens=1 << 40, lease_ms=10_000)
        t1 = time.perf_counter()
        q.return_items([c.item_id for c in claims])
        t2 = time.perf_counter()
        t_claim, t_ret = t_claim + t1 - t0, t_ret + t2 - t1
        del claims
    return t_ret / rounds * 1e6, t_claim / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=300_000)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="claim max_items")
    ap.add_argument("--put-batch", type=int, default=64, help="items per put_many")
    ap.add_argument("--payload", type=int, default=100, help="payload bytes")
    ap.add_argument("--result", type=int, default=64, help="result bytes")
    ap.add_argument("--slots", type=int, default=65536)
    ap.add_argument("--slab-mb", type=int, default=64)
    ap.add_argument("--return-rounds", type=int, default=5000)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()

    ctx = mp.get_context("spawn")
    q = LocalQueue.create(slots=a.slots, slab_bytes=a.slab_mb << 20)
    try:
        go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        full_waits = ctx.Value("q", 0)
        cpu = ctx.Array("d", 1 + a.consumers + a.producers)  # CPU seconds: collector, consumers, producers
        per = a.items // a.producers
        total = per * a.producers
        procs = [ctx.Process(target=collect, args=(q.name, total, out, cpu))]
        procs += [ctx.Process(target=consume, args=(q.name, "bench", a.batch, a.result, stop, cpu, 1 + i))
                  for i in range(a.consumers)]
        procs += [ctx.Process(target=produce, args=(q.name, "bench", i * per, per, a.put_batch, a.payload,
                                                    go, full_waits, cpu, 1 + a.consumers + i))
                  for i in range(a.producers)]
        for p in procs:
            p.start()
        while len(q.workers()) < a.consumers:
            time.sleep(0.01)
        time.sleep(0.3)  # let every child finish importing
        t0 = time.monotonic()
        go.set()
        t_end, exact = out.get(timeout=600)
        stop.set()
        for p in procs:
            p.join(30)
        rate = total / (t_end - t0)
        ret_us, claim_us = measure_return(q, a.batch, a.return_rounds)
        q.check()
        res = {
            "items": total, "producers": a.producers, "consumers": a.consumers, "batch": a.batch,
            "put_batch": a.put_batch, "payload_bytes": a.payload, "result_bytes": a.result,
            "seconds": round(t_end - t0, 3), "items_per_s": round(rate), "each_done_once": exact,
            "queue_full_waits": full_waits.value,
            "return_us": round(ret_us, 1), "return_us_per_item": round(ret_us / a.batch, 2),
            "claim_us": round(claim_us, 1),
            "cpu_s": {"collector": round(cpu[0], 2), "consumers": [round(c, 2) for c in cpu[1:1 + a.consumers]],
                      "producers": [round(c, 2) for c in cpu[1 + a.consumers:]]},
        }
        if a.json:
            print(json.dumps(res))
        else:
            print(f"{total} items, {a.producers} producer(s) -> {a.consumers} consumer(s) (claim {a.batch}) "
                  f"-> 1 collector: {res['seconds']} s, {rate:,.0f} items/s, each done once: {exact}, "
                  f"queue-full waits: {res['queue_full_waits']}")
            print(f"return_items({a.batch}) {ret_us:.1f} µs ({ret_us / a.batch:.2f} µs/item); "
                  f"claim({a.batch}) {claim_us:.1f} µs")
            print(f"CPU seconds (incl. start-up imports): {res['cpu_s']}")
    finally:
        q.close()
        q.unlink()


if __name__ == "__main__":
    main()
