"""Throughput of local_queue across real processes, and the cost of a return.

Pipeline: producer process(es) put_many -> consumer process(es) claim(batch) and
ack_many -> one collector process wait_results. items/s runs from the start
signal to the last result collected. Then, in this process, the cost of
return_items (and of the claim before it) on a batch.

On a shared machine other jobs take CPU from the pipeline: each run reports the
load average and `cpu_share`, the fraction of all cores the pipeline's
processes actually got; a low share means a starved run, not a slow queue.

The lone path (`--lone N`): one request at a time, as a lone client sends them.
In this process, the median and 10th-percentile µs of each call of put(1) ->
claim(1) -> ack(1) -> wait_results; across processes, a worker process making the queue calls of
a worker's step (lane_stats, claim, ack, wait_for_work) answers this process's
put + wait_results: round trip and each side's CPU µs per request.

Before/after (`--against DIR`): DIR holds another tree's `local_queue/` (e.g.
`git archive <commit> local_queue | tar -x -C DIR`); every shape runs against
this tree (A) and DIR (B) in turn, in fresh processes, A B / B A alternating
over `--rounds`, and the medians and A/B ratios are printed.

    flock /tmp/fleet-bench.lock python -m fleet.bench queue-bench --repeat 5
    flock /tmp/fleet-bench.lock python -m fleet.bench queue-bench --against /tmp/q-before --rounds 5 \
        --out bench/results/queue-bench-before-after.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

# Which tree's local_queue to import: this repository's, or (set by --against
# for its B runs, inherited by spawned children) another tree's.
_LIB = os.environ.get("QUEUE_BENCH_LIB") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _LIB)

from local_queue import LocalQueue, QueueFull  # noqa: E402

from fleet.bench.cli import JSON, OUT, ROUNDS, bench, option  # noqa: E402


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


def _load_local_queue(root: str) -> type:
    """LocalQueue of root/local_queue, imported beside the one this script uses (its
    modules live under no name in sys.modules), so that two trees run in one process."""
    def ours(module: str) -> bool:
        return module == "local_queue" or module.startswith("local_queue.")

    mine = {k: sys.modules.pop(k) for k in [k for k in sys.modules if ours(k)]}
    sys.path.insert(0, root)
    try:
        module = importlib.import_module("local_queue")
        if not os.path.realpath(module.__file__).startswith(os.path.realpath(root) + os.sep):
            raise RuntimeError(f"{root}: imported {module.__file__} instead")
        return module.LocalQueue
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(mine)


def _stats_us(samples: list[int]) -> tuple[float, float]:
    """(median, 10th percentile) of nanosecond samples, in µs. The 10th percentile is
    the call's own cost: on a shared box the median also carries the time slices of
    neighbours (cold caches after each switch)."""
    samples = sorted(samples)
    return round(samples[len(samples) // 2] / 1e3, 2), round(samples[len(samples) // 10] / 1e3, 2)


def measure_lone(sides: dict[str, type], rounds: int, payload_bytes: int, result_bytes: int,
                 chunk: int = 50) -> dict:
    """One request at a time, all in this process: median and 10th-percentile µs of
    put(1), claim(1), ack(1) and wait_results, and CPU µs of the whole cycle per request,
    per queue implementation; several run in turns of `chunk` requests (A B, B A, ...),
    so that whatever else the box does falls on all of them alike."""
    queues = {side: cls.create(slots=1024, slab_bytes=16 << 20) for side, cls in sides.items()}
    try:
        setup = {side: (q, q.lane_id("lone"), q.register_worker(os.getpid(), "cpu")) for side, q in queues.items()}
        payload, result = os.urandom(payload_bytes), b"r" * result_bytes
        clock = time.perf_counter_ns
        ops = {side: {"put": [], "claim": [], "ack": [], "collect": []} for side in queues}
        cpu = dict.fromkeys(queues, 0.0)
        order = list(queues)
        for first in range(0, rounds, chunk):
            for side in order if first // chunk % 2 == 0 else order[::-1]:
                q, lane, wid = setup[side]
                mine = ops[side]
                c0 = time.process_time()
                for i in range(first, min(rounds, first + chunk)):
                    t0 = clock()
                    q.put_many(lane, [payload], tokens=[16], request_ids=[i])
                    t1 = clock()
                    claims = q.claim(lane, worker=wid, max_items=1, max_tokens=1 << 40, lease_ms=10_000)
                    t2 = clock()
                    q.ack_many([(claims[0].item_id, result, 0)])
                    t3 = clock()
                    done = q.wait_results(1.0)
                    t4 = clock()
                    if len(done) != 1 or done[0].request_id != i:
                        raise RuntimeError(f"lone path: request {i} came back as {done!r}")
                    del claims
                    for k, dt in zip(mine, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        mine[k].append(dt)
                cpu[side] += time.process_time() - c0
        out = {}
        for side, q in queues.items():
            q.check()
            out[side] = {}
            for k, v in ops[side].items():
                out[side][f"{k}_us"], out[side][f"{k}_us_p10"] = _stats_us(v)
            out[side]["cycle_cpu_us"] = round(cpu[side] / rounds * 1e6, 2)
        return out
    finally:
        for q in queues.values():
            q.close()
            q.unlink()


def lone_worker(root: str | None, name: str, result_bytes: int, go, stop, cpu, slot: int) -> None:
    """The worker's side of the lone path, the queue calls of runtimes' WorkerCore.step:
    lane_stats; a lane with work: claim the head, then up to what was queued, ack;
    none: wait_for_work(since) for work put after the generation read before it."""
    q = (_load_local_queue(root) if root else LocalQueue).attach(name)
    lane = q.lane_id("lone")
    wid = q.register_worker(os.getpid(), "cpu")
    result = b"r" * result_bytes
    go.wait()
    c0 = time.process_time()
    while not stop.is_set():
        since = q.work_generation()
        queued = sum(s.depth for s in q.lane_stats() if s.lane == lane)
        if not queued:
            q.wait_for_work(0.1, since=since)
            continue
        claims = q.claim(lane, worker=wid, max_items=1, max_tokens=1 << 40, lease_ms=10_000)
        if claims and queued > 1:
            claims += q.claim(lane, worker=wid, max_items=queued - 1, max_tokens=1 << 40, lease_ms=10_000)
        if claims:
            q.ack_many([(c.item_id, result, 0) for c in claims])
            del claims
    cpu[slot] = time.process_time() - c0
    q.unregister_worker(wid)
    q.close()


def measure_lone_procs(roots: dict[str, str | None], rounds: int, payload_bytes: int, result_bytes: int) -> dict:
    """One request at a time across processes: this process puts one and waits for its
    result; a worker process answers. Per queue implementation (root None: this
    tree's), each with its own queue and worker, requests taking turns A B, B A, ...:
    round trip p50/p99 and CPU µs per request of each side."""
    ctx = mp.get_context("spawn")
    sides = list(roots)
    queues = {side: (_load_local_queue(root) if root else LocalQueue).create(slots=1024, slab_bytes=16 << 20)
              for side, root in roots.items()}
    workers = []
    try:
        lanes = {side: q.lane_id("lone") for side, q in queues.items()}
        go, stop, cpu = ctx.Event(), ctx.Event(), ctx.Array("d", len(sides))
        for j, side in enumerate(sides):
            workers.append(ctx.Process(target=lone_worker,
                                       args=(roots[side], queues[side].name, result_bytes, go, stop, cpu, j)))
            workers[-1].start()
        while not all(q.workers() for q in queues.values()):
            time.sleep(0.01)
        time.sleep(0.2)
        payload = os.urandom(payload_bytes)
        go.set()
        time.sleep(0.05)  # the workers reach wait_for_work
        trips = {side: [] for side in sides}
        here = dict.fromkeys(sides, 0.0)
        for i in range(rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                q = queues[side]
                c0, t0 = time.process_time(), time.perf_counter_ns()
                q.put_many(lanes[side], [payload], tokens=[16], request_ids=[i])
                done = []
                while not done:
                    done = q.wait_results(1.0)
                trips[side].append(time.perf_counter_ns() - t0)
                here[side] += time.process_time() - c0
                if len(done) != 1 or done[0].request_id != i:
                    raise RuntimeError(f"lone path: request {i} came back as {done!r}")
        stop.set()
        for w in workers:
            w.join(30)
        out = {}
        for j, side in enumerate(sides):
            queues[side].check()
            t = sorted(trips[side])
            out[side] = {"round_trip_p50_us": round(t[len(t) // 2] / 1e3, 1),
                         "round_trip_p99_us": round(t[len(t) * 99 // 100] / 1e3, 1),
                         "worker_cpu_us": round(cpu[j] / rounds * 1e6, 2),
                         "client_cpu_us": round(here[side] / rounds * 1e6, 2)}
        return out
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
        for q in queues.values():
            q.close()
            q.unlink()


# Shapes for --against: payload bytes : result bytes : batch (claim max_items and
# items per put_many) : items per run (large payloads run fewer).
SHAPES = "1024:1536:1:20000,1024:1536:32:200000,262144:1536:1:4000,262144:1536:32:8000,262144:262144:32:4000"


def run_child(lib: str | None, argv: list[str]) -> dict:
    """This bench in a fresh process, against this tree's local_queue (lib None) or lib's."""
    env = dict(os.environ)
    env.pop("QUEUE_BENCH_LIB", None)
    if lib:
        env["QUEUE_BENCH_LIB"] = lib
    out = subprocess.run([sys.executable, "-m", "fleet.bench", "queue-bench", "--json", *argv], env=env, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if os.path.realpath(r["lib"]) != os.path.realpath(os.path.join(lib or _LIB, "local_queue")):
        raise RuntimeError(f"the child imported {r['lib']}, not {lib or _LIB}")
    return r


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def compare(a: argparse.Namespace) -> dict:
    """Every shape against this tree (A) and a.against (B) in fresh processes, A B / B A
    alternating; the lone path with both trees loaded here, taking turns inside each
    measurement. Medians over the rounds, and A/B."""
    other = os.path.abspath(a.against)
    sides = {"A": None, "B": other}
    shapes = [tuple(int(x) for x in spec.split(":")) for spec in a.shapes.split(",")]
    common = ["--slots", str(a.slots), "--slab-mb", str(a.slab_mb), "--return-rounds", "0", "--lone", "0"]
    jobs = [(f"{p}B/{r}B claim {b}", ["--repeat", "1", "--payload", str(p), "--result", str(r),
                                       "--batch", str(b), "--put-batch", str(b), "--items", str(n)])
            for p, r, b, n in shapes]
    got: dict[str, dict[str, list]] = {name: {"A": [], "B": []} for name, _ in jobs}
    lone: dict[str, list] = {"A": [], "B": []}
    classes = {"A": LocalQueue, "B": _load_local_queue(other)}
    for rnd in range(a.rounds):
        order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
        for name, argv in jobs:
            for side in order:
                r = run_child(sides[side], argv + common)["runs"][0]
                got[name][side].append(r)
                print(f"round {rnd + 1} {side} {name}: {r['items_per_s']:,} items/s, CPU µs/item "
                      f"{r['cpu_us_per_item']}, load {r['load_avg_1m']}", flush=True)
        if a.lone:
            load = round(os.getloadavg()[0], 2)
            here = measure_lone({s: classes[s] for s in order}, a.lone, 1024, 1536)
            procs = measure_lone_procs({s: sides[s] for s in order}, a.lone, 1024, 1536)
            for side in order:
                lone[side].append({**here[side], **procs[side], "load_avg_1m": load})
                print(f"round {rnd + 1} {side} lone: {lone[side][-1]}", flush=True)
    med = statistics.median
    table = []
    for name, _ in jobs:
        ra, rb = got[name]["A"], got[name]["B"]
        va, vb = med(r["items_per_s"] for r in ra), med(r["items_per_s"] for r in rb)
        row = {"shape": name, "items_per_s": {"A": va, "B": vb, "A/B": _ratio(va, vb)},
               "load_avg_1m": [min(r["load_avg_1m"] for r in ra + rb), max(r["load_avg_1m"] for r in ra + rb)]}
        for role in ("consumers", "producers", "collector"):
            ca, cb = med(r["cpu_us_per_item"][role] for r in ra), med(r["cpu_us_per_item"][role] for r in rb)
            row[f"{role}_cpu_us_per_item"] = {"A": ca, "B": cb, "A/B": _ratio(ca, cb)}
        table.append(row)
    if a.lone:
        row = {"shape": "lone (1024B/1536B)", "load_avg_1m": [min(r["load_avg_1m"] for r in lone["A"]),
                                                              max(r["load_avg_1m"] for r in lone["A"])]}
        for key in lone["A"][0]:
            if key != "load_avg_1m":
                va, vb = med(r[key] for r in lone["A"]), med(r[key] for r in lone["B"])
                row[key] = {"A": va, "B": vb, "A/B": _ratio(va, vb)}
        table.append(row)
    return {"A": "this tree", "B": a.against, "rounds": a.rounds, "table": table, "raw": {**got, "lone": lone}}


@bench("queue-bench", option("--items", type=int, default=300_000), option("--producers", type=int, default=1),
       option("--consumers", type=int, default=1),
       option("--batch", type=int, default=32, help="claim max_items (and the return batch)"),
       option("--put-batch", type=int, default=64, help="items per put_many"),
       option("--payload", type=int, default=100, help="payload bytes"),
       option("--result", type=int, default=64, help="result bytes"), option("--slots", type=int, default=65536),
       option("--slab-mb", type=int, default=64),
       option("--repeat", type=int, default=3, help="pipeline runs; best and median are reported"),
       option("--return-rounds", type=int, default=5000),
       option("--lone", type=int, default=2000, help="rounds of the lone path (0: skip)"), JSON,
       option("--against", metavar="DIR", help="compare with DIR/local_queue (see above)"),
       ROUNDS.but(default=5, help="--against: rounds of A B (B A) per shape"),
       option("--shapes", default=SHAPES, help="--against: payload:result:batch:items,..."),
       OUT.but(type=str, help="--against: write the comparison JSON here"))
def main(a: argparse.Namespace) -> None:
    if a.against:
        summary = compare(a)
        for row in summary["table"]:
            print(json.dumps({k: v for k, v in row.items()}))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(summary, f, indent=1)
        return

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
    ret = measure_return(a.batch, a.return_rounds) if a.return_rounds else {}
    lone = measure_lone({"A": LocalQueue}, a.lone, a.payload, a.result)["A"] if a.lone else {}
    lone_procs = measure_lone_procs({"A": None}, a.lone, a.payload, a.result)["A"] if a.lone else {}
    summary = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "runs": runs,
               "lib": os.path.dirname(sys.modules[LocalQueue.__module__].__file__),
               "lone": lone, "lone_procs": lone_procs, **ret}
    if rates:
        summary.update(items_per_s_best=max(rates), items_per_s_median=round(statistics.median(rates)))
    if a.json:
        print(json.dumps(summary))
        return
    if rates:
        print(f"items/s best {max(rates):,}, median {summary['items_per_s_median']:,}")
    if ret:
        print(f"return_items({a.batch}) {ret['return_us_median']} µs ({ret['return_us_per_item']} µs/item), "
              f"claim({a.batch}) {ret['claim_us_median']} µs (medians over {a.return_rounds} rounds)")
    if lone:
        print(f"lone path ({a.lone} requests, {a.payload} B / {a.result} B), µs per call: {lone}")
        print(f"lone path across processes: {lone_procs}")
