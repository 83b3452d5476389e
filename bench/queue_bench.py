"""Throughput of local_queue across real processes, and the cost of a return.

Pipeline: producer process(es) put_many -> consumer process(es) claim(batch) and
ack_many -> one collector process wait_results. items/s runs from the start
signal to the last result collected. Then, in this process, the cost of
return_items (and of the claim before it) on a batch.

On a shared machine other jobs take CPU from the pipeline: each run reports the
load average and `cpu_share`, the fraction of all cores the pipeline's
processes actually got; a low share means a starved run, not a slow queue.

    flock /tmp/fleet-bench.lock python bench/queue_bench.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from local_queue import LocalQueue, QueueFull  # noqa: E402


def produce(name: str, lane_name: str, start: int, count: int, put_batch: int, payload_bytes: int,
            go, full_waits, cpu, slot: int) -> None:
    q = LocalQueue.attach(name)
    lane = q.lane_id(lane_name)
    payload = os.urandom(payload_bytes)
    go.wait()
    c0 = time.process_time()
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
    cpu[slot] = time.process_time() - c0
    full_waits.value += waits
    q.close()


def consume(name: str, lane_name: str, batch: int, result_bytes: int, go, stop, cpu, slot: int) -> None:
    q = LocalQueue.attach(name)
    lane = q.lane_id(lane_name)
    wid = q.register_worker(os.getpid(), "cpu")
    result = b"r" * result_bytes
    go.wait()
    c0 = time.process_time()
    while not stop.is_set():
        if not q.wait_for_work(0.1):
            continue
        claims = q.claim(lane, worker=wid, max_items=batch, max_tokens=1 << 40, lease_ms=10_000)
        if claims:
            q.ack_many([(c.item_id, result, 0) for c in claims])
            del claims
    cpu[slot] = time.process_time() - c0
    q.unregister_worker(wid)
    q.close()


def collect(name: str, total: int, go, out, cpu) -> None:
    q = LocalQueue.attach(name)
    got = bytearray(total)
    go.wait()
    c0 = time.process_time()
    seen = 0
    while seen < total:
        for d in q.wait_results(1.0):
            got[d.request_id] += 1
            seen += 1
    t_end = time.monotonic()
    cpu[0] = time.process_time() - c0
    out.put((t_end, got.count(1) == total))
    q.close()


def run_pipeline(a: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = LocalQueue.create(slots=a.slots, slab_bytes=a.slab_mb << 20)
    procs = []
    try:
        go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        full_waits = ctx.Value("q", 0)
        cpu = ctx.Array("d", 1 + a.consumers + a.producers)  # CPU seconds: collector, consumers, producers
        per = a.items // a.producers
        total = per * a.producers
        procs = [ctx.Process(target=collect, args=(q.name, total, go, out, cpu))]
        procs += [ctx.Process(target=consume, args=(q.name, "bench", a.batch, a.result, go, stop, cpu, 1 + i))
                  for i in range(a.consumers)]
        procs += [ctx.Process(target=produce, args=(q.name, "bench", i * per, per, a.put_batch, a.payload,
                                                    go, full_waits, cpu, 1 + a.consumers + i))
                  for i in range(a.producers)]
        for p in procs:
            p.start()
        while len(q.workers()) < a.consumers:
            time.sleep(0.01)
        time.sleep(0.5)  # let every child finish importing and reach go.wait()
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        go.set()
        t_end, exact = out.get(timeout=600)
        stop.set()
        for p in procs:
            p.join(30)
        q.check()
        wall = t_end - t0
        return {
            "items": total, "seconds": round(wall, 3), "items_per_s": round(total / wall),
            "each_done_once": exact, "queue_full_waits": full_waits.value, "load_avg_1m": round(load, 2),
            "cpu_share": round(sum(cpu) / (wall * os.cpu_count()), 2),
            "cpu_us_per_item": {"collector": round(cpu[0] / total * 1e6, 2),
                                "consumers": round(sum(cpu[1:1 + a.consumers]) / total * 1e6, 2),
                                "producers": round(sum(cpu[1 + a.consumers:]) / total * 1e6, 2)},
        }
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        q.close()
        q.unlink()


def measure_return(batch: int, rounds: int) -> dict:
    """µs of return_items(batch claim ids) and of the claim(batch) before it, in this process."""
    q = LocalQueue.create(slots=4 * batch, slab_bytes=1 << 20)
    try:
        lane = q.lane_id("return-bench")
        wid = q.register_worker(os.getpid(), "cpu")
        q.put_many(lane, [b"x" * 100] * batch, tokens=[16] * batch, request_ids=list(range(batch)))
        rets, claims_us = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            claims = q.claim(lane, worker=wid, max_items=batch, max_tokens=1 << 40, lease_ms=10_000)
            t1 = time.perf_counter()
            q.return_items([c.item_id for c in claims])
            t2 = time.perf_counter()
            claims_us.append((t1 - t0) * 1e6)
            rets.append((t2 - t1) * 1e6)
            del claims
        q.check()
        return {"return_us_median": round(statistics.median(rets), 1),
                "return_us_per_item": round(statistics.median(rets) / batch, 2),
                "claim_us_median": round(statistics.median(claims_us), 1)}
    finally:
        q.close()
        q.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=300_000)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="claim max_items (and the return batch)")
    ap.add_argument("--put-batch", type=int, default=64, help="items per put_many")
    ap.add_argument("--payload", type=int, default=100, help="payload bytes")
    ap.add_argument("--result", type=int, default=64, help="result bytes")
    ap.add_argument("--slots", type=int, default=65536)
    ap.add_argument("--slab-mb", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="pipeline runs; best and median are reported")
    ap.add_argument("--return-rounds", type=int, default=5000)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()

    runs = []
    for _ in range(a.repeat):
        r = run_pipeline(a)
        runs.append(r)
        if not a.json:
            print(f"{r['items']} items, {a.producers} producer(s) -> {a.consumers} consumer(s) (claim {a.batch}) "
                  f"-> 1 collector: {r['seconds']} s, {r['items_per_s']:,} items/s, each done once: "
                  f"{r['each_done_once']}, cpu share {r['cpu_share']}, load {r['load_avg_1m']}, "
                  f"CPU µs/item {r['cpu_us_per_item']}", flush=True)
    rates = [r["items_per_s"] for r in runs]
    ret = measure_return(a.batch, a.return_rounds)
    summary = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "runs": runs,
               "items_per_s_best": max(rates), "items_per_s_median": round(statistics.median(rates)), **ret}
    if a.json:
        print(json.dumps(summary))
    else:
        print(f"items/s best {max(rates):,}, median {summary['items_per_s_median']:,}")
        print(f"return_items({a.batch}) {ret['return_us_median']} µs ({ret['return_us_per_item']} µs/item), "
              f"claim({a.batch}) {ret['claim_us_median']} µs (medians over {a.return_rounds} rounds)")


if __name__ == "__main__":
    main()
