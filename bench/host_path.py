"""The host path: what the HOST spends per token when the forward is (nearly) free (issue 34).

The full serving path (HTTP, MessagePack, the API process, the shared-memory
queue, a worker, its tokenizer, results back) with a model whose forward costs
next to nothing: a random 1-layer BERT of hidden size 32 in sentence-transformers'
folder layout with all-MiniLM-L6-v2's real tokenizer (`bench.models.build_st_embedder`).
What the daemon's processes burn per token is then the host path's own cost.

In one run:
1. `--clients` closed-loop clients (`bench.loadgen`: its own process, one asyncio
   loop, prepared requests) send `/v1/embed` requests of `--texts` corpus texts,
   MessagePack both ways, for `--duration` seconds after a short warm-up step.
   Tokens are the model's tokenizer's counts of what was sent (`bench.tokens.TokenCounter`,
   special tokens included), over the requests answered 200; the replies'
   `usage.input_tokens` are summed beside them as a cross-check.
2. CPU of every daemon process (the API process and its descendants: the workers)
   and of each of their threads, from /proc/<pid>/stat and /proc/<pid>/task/<tid>/stat
   (utime + stime, clock ticks) read right before and right after the measured
   step, as microseconds of CPU per token. The clients' CPU is not the daemon's:
   only the daemon's PIDs are read.
3. The tokenizer's own cost: the same request windows, `--texts` texts a batch,
   encoded by the `tokenizers` Rust tokenizer in this process on one thread
   (TOKENIZERS_PARALLELISM=false), configured as the worker's copy is
   (truncation at the model's max_seq_length, padding to the batch's longest):
   `encode_batch` and, where it exists, `encode_batch_fast` (the call the worker
   makes), CPU-us per token by `time.thread_time_ns`.
4. Goals: the daemon's CPU per token <= 2x the tokenizer's own (`encode_batch_fast`
   where it exists), and the busiest daemon thread <= 1.0 CPU-us per token.
5. Where a micro-batch's host time goes: a separate `--timeline` seconds at the
   same load, every request with `X-Fleet-Timeline: 1` (blocking clients in this
   process, outside the CPU window): p50 per stage in ms and in us per token
   (request stages per the request's tokens, worker stages per its batch's tokens;
   requests that share the worker's `claimed` stamp ran in one batch).

Usage:
  flock /tmp/fleet-bench.lock python -m fleet.bench host-path [--clients 16] [--texts 32] [--duration 6]
      [--device cpu] [--workers 0] [--url URL --model NAME] [--out bench/results/<time>-host-path.json]
Without --url the bench builds the model, pulls it into a temporary FLEET_HOME
(`bench.models.make_home`), runs `fleetctl serve` on a free loopback port
(`bench.daemon.LocalDaemon`, shipped defaults besides the device and workers)
and stops it by PID at the end. With --url the daemon must run on this machine
(its processes are read through /proc).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from fleet.bench import corpus, loadgen, report, stand_in
from fleet.bench.daemon import LocalDaemon, admin_headers
from fleet.bench.models import build_st_embedder, make_home
from fleet.bench.spy import binary
from fleet.bench.httpclient import BlockingConn, Endpoint, build_request
from fleet.bench.knee import CLOSED
from fleet.bench.targets import request_windows
from fleet.bench.timeline import HEADER, parse_stamps
from fleet.bench.tokens import TokenCounter, package_model_dir
from fleet.bench.cli import CLIENTS, DEVICE, DURATION, OUT, URL, UsageError, bench, option

MODEL = "host-path-embed"
#: A forward that costs next to nothing beside the host's work (models.BERT_DEFAULTS otherwise).
MODEL_CONFIG = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 37,
                "max_position_embeddings": 512, "initializer_range": 0.02}
GOAL_RATIO = 2.0
GOAL_THREAD_US = 1.0
WARMUP_S = 1.0
MSGPACK = "application/msgpack"
TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Per request: (from stamp, to stamp, what happens), `sent`/`received` are the client's.
#: `put` is when the API learns its put is done: a worker may claim the item before
#: (tests/test_timeline.py), so the wait in the lane is measured from `checked`.
REQUEST_SPANS = (
    ("sent", "handler", "client send -> handler (HTTP parse, route)"),
    ("handler", "checked", "body read, decode, model check"),
    ("checked", "put", "queue put"),
    ("checked", "claimed", "queue put + wait in the lane until claimed"),
    ("ran", "collected", "result write, ack, loop wake-up + collect"),
    ("collected", "resumed", "future resolved, request resumes"),
    ("resumed", "encoded", "reply build + encode"),
    ("encoded", "received", "reply send, client read"),
)
#: Per batch (fleet.messages.WORKER_STAGES). The adapter stamps `tokenized` and `forward`
#: for the batch's last micro-batch, so with several micro-batches decoded -> tokenized
#: also holds the earlier ones' forwards (bench/saturation.py).
BATCH_SPANS = (
    ("woke", "claimed", "lane choice + claim"),
    ("claimed", "lingered", "linger for more"),
    ("lingered", "decoded", "return overpull, decode"),
    ("decoded", "tokenized", "tokenize (+ earlier micro-batches)"),
    ("tokenized", "forward", "forward + pool (last micro-batch)"),
    ("forward", "host", "normalise, vectors to host"),
    ("host", "ran", "split, result Structs"),
)


# ---- the daemon's processes and threads, from /proc ----------------------------------

def _ticks(stat: str) -> int:
    """utime + stime (clock ticks) of a /proc/.../stat line; comm may hold spaces and parens."""
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])  # fields 14 and 15; rest[0] is field 3


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None


@dataclass
class ProcCpu:
    """One read of a process: its own total (threads that exited included) and each live thread's."""

    ticks: int
    threads: dict[int, tuple[str, int]]  # tid -> (comm, ticks)


def read_cpu(pid: int) -> ProcCpu | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    threads = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return None
    for tid in tids:
        tstat, comm = _read(f"/proc/{pid}/task/{tid}/stat"), _read(f"/proc/{pid}/task/{tid}/comm")
        if tstat is not None and comm is not None:
            threads[tid] = (comm.strip(), _ticks(tstat))
    return ProcCpu(_ticks(stat), threads)


def python_thread_names(pid: int) -> dict[int, str]:
    """{tid: Python thread name} of `pid` from one `py-spy dump --json` where py-spy is
    installed (bench.spy.binary), else {}: /proc's comm says `python` for every thread Python starts."""
    spy = binary()
    if spy is None:
        return {}
    try:
        done = subprocess.run([spy, "dump", "--pid", str(pid), "--json"], check=False, capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
        return {int(t["os_thread_id"]): str(t["thread_name"]) for t in json.loads(done.stdout) if t.get("os_thread_id")}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return {}


def daemon_processes(url: str) -> tuple[dict[int, str], dict]:
    """({pid: role} of the API process and its descendants, the /v1/ps reply). Roles:
    `api`, `worker <id> (<device>)` for the workers /v1/ps lists, else `child: <command line's end>`."""
    ps = httpx.get(url + "/v1/ps", timeout=30).json()
    api = int(ps["pid"])
    if not os.path.exists(f"/proc/{api}"):
        raise RuntimeError(f"the daemon at {url} (pid {api}) is not on this machine: its CPU cannot be read")
    workers = {int(w["pid"]): f"worker {w['worker']} ({w['device']})" for w in ps.get("workers", []) if w.get("pid")}
    roles = {api: "api"}
    for child in psutil.Process(api).children(recursive=True):
        try:
            roles[child.pid] = workers.get(child.pid) or f"child: {_program(child.cmdline())}"
        except psutil.NoSuchProcess:
            continue
    return roles, ps


def _program(cmdline: list[str]) -> str:
    """What a child runs, shortly: a `-c` program's module (multiprocessing's helpers), else its last argument."""
    found = re.search(r"from (\S+) import", " ".join(cmdline))
    return found.group(1) if found else (cmdline[-1][-40:] if cmdline else "?")


def cpu_report(roles: dict[int, str], before: dict[int, ProcCpu | None], after: dict[int, ProcCpu | None],
               tokens: int, wall_s: float, names: dict[int, dict[int, str]] | None = None) -> dict:
    """CPU seconds and CPU-us per token of each process and each of its threads over the
    window; `names`: pid -> {tid: Python thread name} where known (python_thread_names)."""
    per_token = 1e6 / max(tokens, 1)
    procs = []
    for pid, role in roles.items():
        b, a = before.get(pid), after.get(pid)
        if b is None or a is None:
            procs.append({"pid": pid, "role": role, "gone": True})
            continue
        threads = []
        for tid, (comm, ticks) in a.threads.items():
            cpu_s = (ticks - b.threads.get(tid, (comm, 0))[1]) / CLK_TCK
            threads.append({"tid": tid, "comm": comm, "python_name": (names or {}).get(pid, {}).get(tid),
                            "main": tid == pid, "new": tid not in b.threads,
                            "cpu_s": cpu_s, "us_per_token": cpu_s * per_token})
        threads.sort(key=lambda t: -t["cpu_s"])
        cpu_s = (a.ticks - b.ticks) / CLK_TCK
        procs.append({"pid": pid, "role": role, "cpu_s": cpu_s, "cores": cpu_s / wall_s,
                      "us_per_token": cpu_s * per_token, "threads": threads})
    live = [p for p in procs if not p.get("gone")]
    total = sum(p["cpu_s"] for p in live)
    busiest = max(((p, t) for p in live for t in p["threads"]), key=lambda pt: pt[1]["cpu_s"], default=None)
    return {
        "window_s": wall_s, "clk_tck": CLK_TCK, "tokens": tokens, "processes": procs,
        "thread_names": "py-spy dump (Python threads), else /proc comm" if any((names or {}).values())
                        else "/proc comm (py-spy not on PATH: Python threads all read 'python')",
        "daemon_cpu_s": total, "daemon_us_per_token": total * per_token,
        "busiest_thread": None if busiest is None else {
            "pid": busiest[0]["pid"], "role": busiest[0]["role"], **busiest[1],
            "name": thread_name(busiest[0], busiest[1])},
    }


def thread_label(thread: dict) -> str:
    """`tid N <Python name>`, else `tid N '<comm>'` (main thread marked)."""
    name = thread.get("python_name")
    return f"tid {thread['tid']} " + (name if name else f"'{thread['comm']}'" + (" main" if thread["main"] else ""))


def thread_name(proc: dict, thread: dict) -> str:
    return f"{proc['role']} pid {proc['pid']} {thread_label(thread)}"


# ---- the tokenizer's own cost ----------------------------------------------------------

def tokenizer_cost(model_dir: Path, batches: list[list[str]], tokens: int, max_len: int | None,
                   passes: int = 5) -> dict:
    """CPU-us per token of encoding `batches` (`tokens` real tokens in all) on this thread,
    median of `passes` after one warm pass, per encode method the tokenizer has."""
    from tokenizers import Tokenizer

    was = os.environ.get("TOKENIZERS_PARALLELISM")
    # Read when the library first parallelises: one thread for these calls, restored after
    # so the daemon this process starts keeps its own setting.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        if max_len:
            tok.enable_truncation(max_len)
        pad = _pad_token(model_dir)
        tok.enable_padding(pad_id=tok.token_to_id(pad) or 0, pad_token=pad)
        out = {}
        for method in ("encode_batch", "encode_batch_fast"):
            encode = getattr(tok, method, None)
            if encode is None:
                continue
            runs = []
            for i in range(passes + 1):
                t0 = time.thread_time_ns()
                for batch in batches:
                    encode(batch)
                if i:
                    runs.append(time.thread_time_ns() - t0)
            ns = float(np.median(runs))
            out[method] = {"us_per_token": ns / 1e3 / tokens, "cpu_s_per_pass": ns / 1e9, "passes": passes}
        return {"batches": len(batches), "texts_per_batch": len(batches[0]) if batches else 0, "tokens": tokens,
                "max_length": max_len, "padding": "to the batch's longest", **out}
    finally:
        if was is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = was


def _pad_token(model_dir: Path) -> str:
    """The model's padding token (special_tokens_map.json), `[PAD]` (BERT's) where it names none."""
    path = model_dir / "special_tokens_map.json"
    pad = json.loads(path.read_text()).get("pad_token") if path.is_file() else None
    return (pad.get("content") if isinstance(pad, dict) else pad) or "[PAD]"


# ---- where a micro-batch's host time goes ----------------------------------------------

def timeline_phase(url: str, model: str, windows: list[tuple[list[str], int]], clients: int,
                   duration_s: float) -> tuple[list[dict], list[str]]:
    """Closed loop with `X-Fleet-Timeline: 1` on every request: (rows of stamps with the
    request's tokens and worker, errors)."""
    ep = Endpoint(url)
    prepared = [(build_request(ep, "/v1/embed", msgspec.msgpack.encode({"model": model, "inputs": texts}), MSGPACK,
                               MSGPACK).replace(b"\r\n\r\n", f"\r\n{HEADER}: 1\r\n\r\n".encode(), 1), tokens)
                for texts, tokens in windows]
    turn = itertools.count()
    rows: list[dict] = []
    errors: list[str] = []
    end = time.monotonic_ns() + int(duration_s * 1e9)

    def client() -> None:
        conn = BlockingConn(ep, timeout_s=TIMEOUT_S)
        try:
            while (sent := time.monotonic_ns()) < end:
                request, tokens = prepared[next(turn) % len(prepared)]
                status, headers, body = conn.exchange(request)
                received = time.monotonic_ns()
                if status != 200:
                    errors.append(f"HTTP {status}: {body[:200]!r}")
                    continue
                rows.append({"sent": sent, **parse_stamps(headers[HEADER.lower().encode()].decode()),
                             "received": received, "tokens": tokens,
                             "served_by": headers.get(b"x-served-by", b"").decode()})
        except Exception as exc:  # noqa: BLE001 (reported with the results)
            errors.append(repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, errors


def _p50(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def stage_table(rows: list[dict]) -> dict:
    """p50 ms and p50 us per token of each stage: request stages per request, worker
    stages per batch (rows grouped by worker and `claimed` stamp)."""
    batches: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if "claimed" in r:
            batches.setdefault((r["served_by"], r["claimed"]), []).append(r)
    stages = []
    for a, b, label in REQUEST_SPANS:
        ns = [(r[b] - r[a], r["tokens"]) for r in rows if a in r and b in r]
        extra = {}
        if b == "claimed":
            # `claimed` is the batch's first claim: a request put while its batch lingered
            # for company joined it after that stamp; it waited in the lane ~0.
            extra["joined_while_lingering"] = sum(d < 0 for d, _ in ns)
            ns = [(max(d, 0), t) for d, t in ns]
        stages.append({"from": a, "to": b, "stage": label, "per": "request", "n": len(ns),
                       "p50_ms": _p50([d / 1e6 for d, _ in ns]), "p50_us_per_token": _p50([d / 1e3 / t for d, t in ns]),
                       **extra})
    for a, b, label in BATCH_SPANS:
        ns = [(g[0][b] - g[0][a], sum(r["tokens"] for r in g)) for g in batches.values() if a in g[0] and b in g[0]]
        stages.append({"from": a, "to": b, "stage": label, "per": "batch", "n": len(ns),
                       "p50_ms": _p50([d / 1e6 for d, _ in ns]), "p50_us_per_token": _p50([d / 1e3 / t for d, t in ns])})
    sizes = [len(g) for g in batches.values()]
    return {"requests": len(rows), "batches": len(batches),
            "requests_per_batch": float(np.mean(sizes)) if sizes else None,
            "tokens_per_batch": float(np.mean([sum(r["tokens"] for r in g) for g in batches.values()])) if sizes else None,
            "round_trip_p50_ms": _p50([(r["received"] - r["sent"]) / 1e6 for r in rows]),
            "stages": stages}


# ---- the run ---------------------------------------------------------------------------------

def measure(url: str, model: str, *, model_dir: Path, clients: int = 16, texts: int = 32, duration_s: float = 6.0,
            timeline_s: float = 2.0, generators: int = 1, warmup_s: float = WARMUP_S) -> dict:
    """Load, CPU window, tokenizer's own cost and the timeline phase against a daemon on this box."""
    corpus_texts = corpus.load()
    counter = TokenCounter(model_dir)
    lengths = counter.count(corpus_texts)
    windows = request_windows(len(corpus_texts), texts)  # the first generator's windows (its seed)
    loaded = httpx.post(f"{url}/v1/models/{model}/load", headers=admin_headers(url), timeout=TIMEOUT_S)
    if loaded.status_code != 200:
        raise RuntimeError(f"{model} did not load: HTTP {loaded.status_code} {loaded.text[:500]}")
    roles, ps = daemon_processes(url)
    served = {str(w.get("pid")): {k: m.get(k) for k in ("dtype", "engine", "forward", "threads", "fixed_tokens")}
              for w in ps.get("workers", []) for name, m in w.get("models", {}).items() if name == model}
    setup = loadgen.Setup(kind="fleet", task="embed", url=url, model=model, texts=corpus_texts, lengths=lengths,
                          batch=texts)
    load_before = os.getloadavg()
    with loadgen.Generator(setup, processes=generators) as gen:
        gen.run(loadgen.StepPlan(index=0, mode=CLOSED, offered=clients, duration_s=warmup_s))
        before = {pid: read_cpu(pid) for pid in roles}
        t0 = time.monotonic()
        m = gen.run(loadgen.StepPlan(index=1, mode=CLOSED, offered=clients, duration_s=duration_s))
        wall = time.monotonic() - t0
        after = {pid: read_cpu(pid) for pid in roles}
    load_after = os.getloadavg()
    cpu = cpu_report(roles, before, after, m.tokens_ok, wall, {pid: python_thread_names(pid) for pid in roles})

    batches = [[corpus_texts[i] for i in w] for w in windows[:max(1, len(corpus_texts) // texts)]]
    tok = tokenizer_cost(model_dir, batches, sum(lengths[i] for w in windows[:len(batches)] for i in w),
                         counter.max_len)
    own = tok.get("encode_batch_fast", tok["encode_batch"])["us_per_token"]
    ratio = cpu["daemon_us_per_token"] / own
    busiest = cpu["busiest_thread"]["us_per_token"] if cpu["busiest_thread"] else None

    rows, tl_errors = timeline_phase(url, model, [([corpus_texts[i] for i in w], sum(lengths[i] for i in w))
                                                  for w in windows], clients, timeline_s)
    lat = m.latencies_ms
    return {
        "settings": {"url": url, "model": model, "clients": clients, "texts": texts, "duration_s": duration_s,
                     "warmup_s": warmup_s, "timeline_s": timeline_s, "generators": generators},
        "served": served, "load_before": load_before, "load_after": load_after,
        "load": {"sent": m.sent, "ok": m.ok, "errors": m.errors,
                 "error_codes": {str(k): v for k, v in m.error_codes.items()}, "error_sample": m.error_sample,
                 "tokens": m.tokens_ok, "server_tokens": m.server_tokens, "elapsed_s": m.elapsed_s,
                 "tokens_per_s": m.tokens_ok / m.elapsed_s, "requests_per_s": m.ok / m.elapsed_s,
                 "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
                 "p95_ms": float(np.percentile(lat, 95)) if lat.size else None,
                 "generator_cpu_s": m.cpu_s,
                 "tokens_counted_by": "TokenCounter (the model's tokenizer.json, special tokens included) over "
                                      "requests answered 200; server_tokens = the replies' usage.input_tokens"},
        "cpu": cpu,
        "tokenizer": tok,
        "ratio": ratio,
        "goals": {"ratio": {"goal": GOAL_RATIO, "value": ratio, "met": ratio <= GOAL_RATIO,
                            "against": "encode_batch_fast" if "encode_batch_fast" in tok else "encode_batch"},
                  "busiest_thread_us_per_token": {"goal": GOAL_THREAD_US, "value": busiest,
                                                  "met": busiest is not None and busiest <= GOAL_THREAD_US}},
        "timeline": {**stage_table(rows), "errors": len(tl_errors), "error_sample": tl_errors[:3]},
    }


def build_model(root: Path, minilm: Path) -> Path:
    """The tiny embedder (MODEL_CONFIG, all-MiniLM-L6-v2's tokenizer) in `root`/MODEL."""
    return build_st_embedder(root / MODEL, minilm, **MODEL_CONFIG)


def start_daemon(work: Path, device: str, workers: int, minilm: Path, forward: str | None = None) -> LocalDaemon:
    """The tiny embedder built into `work`, pulled into a FLEET_HOME there, served on
    `device`; with `forward` ("fixed_us,per_token_us") its forward is bench.stand_in's wait."""
    folder = build_model(work / "models", minilm)
    home = make_home(work / "home", {MODEL: folder}, {MODEL: (MODEL, "embed", "sentence-transformers", "")}, "auto")
    env = {"FLEET_PRELOAD": MODEL, "FLEET_DEVICE": device, "FLEET_WORKERS": str(workers)}
    if forward is None:
        return LocalDaemon(home, env=env, inherit_fleet=False)
    return LocalDaemon(home, env=env | {stand_in.ENV: forward}, inherit_fleet=False, module="fleet.bench.stand_in")


def summary(res: dict) -> str:
    """One line: what gpu_check's host-path check says."""
    load, cpu, tok = res["load"], res["cpu"], res["tokenizer"]
    b = cpu["busiest_thread"]
    own = tok.get("encode_batch_fast", tok["encode_batch"])["us_per_token"]
    return (f"{load['tokens_per_s']:,.0f} tokens/s, {load['ok']}/{load['sent']} answered; daemon "
            f"{cpu['daemon_us_per_token']:.2f} CPU-us/token = {res['ratio']:.1f}x the tokenizer's own {own:.3f} "
            f"(goal <= {GOAL_RATIO:g}x); busiest thread {b['us_per_token'] if b else float('nan'):.2f} us/token "
            f"(goal <= {GOAL_THREAD_US:g}): {b['name'] if b else '-'}")


def print_report(console: Console, res: dict) -> None:
    s, load, cpu, tok = res["settings"], res["load"], res["cpu"], res["tokenizer"]
    console.print(f"[bold]{s['clients']} clients x {s['texts']} texts, {s['duration_s']:g} s: "
                  f"{load['tokens_per_s']:,.0f} tokens/s[/], {load['requests_per_s']:.1f} requests/s; "
                  f"{load['ok']} answered, {load['errors']} errors; p50 {load['p50_ms'] or float('nan'):.1f} ms. "
                  f"Tokens: {load['tokens']:,} counted with the model's tokenizer (usage.input_tokens: "
                  f"{load['server_tokens']:,}). The clients' own CPU (not the daemon's): {load['generator_cpu_s']:.2f} s")
    for pid, m in res["served"].items():
        console.print(f"served by worker pid {pid}: " + ", ".join(f"{k} {v}" for k, v in m.items() if v is not None))
    t = Table(title=f"daemon CPU over the {cpu['window_s']:.1f} s window, per token", title_justify="left")
    for col in ("process", "pid", "CPU s", "cores", "CPU-us/token", "busiest thread", "its CPU-us/token"):
        t.add_column(col, justify="left" if col in ("process", "busiest thread") else "right")
    for p in cpu["processes"]:
        if p.get("gone"):
            t.add_row(p["role"], str(p["pid"]), "gone", "", "", "", "")
            continue
        top = p["threads"][0] if p["threads"] else None
        t.add_row(p["role"], str(p["pid"]), f"{p['cpu_s']:.2f}", f"{p['cores']:.2f}", f"{p['us_per_token']:.3f}",
                  thread_label(top) if top else "-",
                  f"{top['us_per_token']:.3f}" if top else "-")
    t.add_section()
    t.add_row("daemon, all processes", "", f"{cpu['daemon_cpu_s']:.2f}", f"{cpu['daemon_cpu_s'] / cpu['window_s']:.2f}",
              f"{cpu['daemon_us_per_token']:.3f}", "", "")
    for method in ("encode_batch", "encode_batch_fast"):
        if method in tok:
            t.add_row(f"tokenizer's own: {method}", "this", "", "", f"{tok[method]['us_per_token']:.3f}", "1 thread", "")
    console.print(t)
    threads = Table(title=f"busiest daemon threads (names: {cpu['thread_names']})", title_justify="left")
    for col in ("process", "tid", "thread", "CPU s", "CPU-us/token"):
        threads.add_column(col, justify="left" if col in ("process", "thread") else "right")
    ranked = sorted(((p, th) for p in cpu["processes"] if not p.get("gone") for th in p["threads"]),
                    key=lambda pt: -pt[1]["cpu_s"])
    for p, th in ranked[:10]:
        threads.add_row(p["role"], f"{th['tid']}" + (" (main)" if th["main"] else ""),
                        th["python_name"] or f"'{th['comm']}'",
                        f"{th['cpu_s']:.2f}", f"{th['us_per_token']:.3f}")
    console.print(threads)
    tl = res["timeline"]
    st = Table(title=f"where the host time goes: {tl['requests']} requests with {HEADER} "
                     f"({s['timeline_s']:g} s, {s['clients']} clients), {tl['batches']} batches, "
                     f"{tl['requests_per_batch'] or 0:.1f} requests / {tl['tokens_per_batch'] or 0:,.0f} tokens each",
               title_justify="left")
    for col in ("stage", "per", "p50 ms", "p50 us/token"):
        st.add_column(col, justify="left" if col in ("stage", "per") else "right")
    for row in tl["stages"]:
        st.add_row(row["stage"], row["per"], "-" if row["p50_ms"] is None else f"{row['p50_ms']:.3f}",
                   "-" if row["p50_us_per_token"] is None else f"{row['p50_us_per_token']:.3f}")
    st.add_section()
    st.add_row("round trip", "request", f"{tl['round_trip_p50_ms'] or float('nan'):.3f}", "")
    console.print(st)
    for key, label, unit in (("ratio", "daemon CPU per token / tokenizer's own", "x"),
                             ("busiest_thread_us_per_token", "busiest thread CPU-us per token", " us")):
        g = res["goals"][key]
        against = f" ({g['against']})" if key == "ratio" else ""
        value = "-" if g["value"] is None else f"{g['value']:.2f}{unit}"
        console.print(f"{label}{against}: {value} (goal <= {g['goal']:g}{unit}): "
                      + ("[green]met[/]" if g["met"] else "[red]not met[/]"))
    console.print(f"load average before {res['load_before'][0]:.2f} / {res['load_before'][1]:.2f} / "
                  f"{res['load_before'][2]:.2f}, after {res['load_after'][0]:.2f} / {res['load_after'][1]:.2f} / "
                  f"{res['load_after'][2]:.2f} ({os.cpu_count()} CPUs)")


@bench("host-path", CLIENTS.but(default=16), option("--texts", type=int, default=32, help="corpus texts per request"),
       DURATION.but(default=6.0, help="measured seconds (after a 1 s warm-up step)"),
       option("--timeline", type=float, default=2.0, help="seconds of timeline-stamped requests after it"),
       DEVICE.but(help="cpu | cuda:K (the daemon's FLEET_DEVICE)"),
       option("--workers", type=int, default=0, help="FLEET_WORKERS (0: the shipped default)"),
       option("--generators", type=int, default=1, help="load generator processes"),
       URL.but(help="a running daemon on this machine instead of one started here (needs --model)"),
       option("--model", help="the embedder to load with --url"),
       option("--model-dir", type=Path, help="its folder, for token counts (default: all-MiniLM-L6-v2's, "
              "the tokenizer the built model has)"),
       option("--forward", metavar="FIXED_US,PER_TOKEN_US",
              help="a stand-in forward (bench.stand_in): a GIL-free wait of FIXED_US per forward plus "
                   "PER_TOKEN_US per padded token, as an accelerator costs the host thread; default: the "
                   "tiny model's real forward, on this machine's cores"),
       OUT.but(help="JSON path (default bench/results/<time>-host-path.json)"))
def main(args: argparse.Namespace) -> int:
    if args.url and not args.model:
        raise UsageError("--url needs --model")
    console = Console(width=None if sys.stdout.isatty() else 150)
    minilm = package_model_dir()
    model_dir = args.model_dir or minilm
    with tempfile.TemporaryDirectory(prefix="fleet-host-path-") as tmp:
        daemon = None if args.url else start_daemon(Path(tmp), args.device, args.workers, minilm, args.forward)
        url = args.url.rstrip("/") if args.url else daemon.url
        try:
            res = measure(url, args.model or MODEL, model_dir=model_dir, clients=args.clients, texts=args.texts,
                          duration_s=args.duration, timeline_s=args.timeline, generators=args.generators)
        finally:
            if daemon:
                daemon.stop()
    print_report(console, res)
    doc = report.document("host-path", "fleet.bench", args.argv) | {"device": args.device, "forward": args.forward,
                                                                    "started_daemon": daemon is not None, **res}
    out = report.save(doc, args.out, "host-path")
    Console(stderr=True).print(f"results: {out}")
    return 0 if res["load"]["errors"] == 0 and res["timeline"]["errors"] == 0 else 1
