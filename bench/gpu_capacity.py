"""The GPU acceptance run's capacity: what the device holds and how fast it serves.

vram-budget (a budget of 2 of 3 models, one pinned: the pin stays, at most 2
resident, nothing lost), knee/<model> (tokens/s and p95 at the knee, MFU against the
device's peak, the GPU's busy share read by NVML during each step), profile/<model>
(py-spy on the daemon's processes during one more step at the knee), host-path
(bench.host_path's CPU per token with a nearly free forward) and nvml-budget (NVML's
memory view against torch's and the worker's budget).

A module of its own: these checks load the device and read its memory, where
bench.gpu_parity judges answers; bench.gpu_check runs them in order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from fleet.bench import corpus, host_path, loadgen, spy
from fleet.bench.acceptance import BATCH, TEXTS, TIMEOUT_MS, Check, Sizes, post, ps, resident, serve
from fleet.bench.daemon import admin_headers
from fleet.bench.knee import CLOSED, StepResult, find_knee
from fleet.bench.models import make_home
from fleet.bench.tokens import TokenCounter
from fleet.nvml import handle as nvml_handle

#: Dense bf16/fp16 tensor-core peak, TFLOP/s, by a substring of the NVML device name
#: (first match wins: more specific names first). Spec-sheet numbers, without sparsity.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0),
    ("RTX PRO 6000", 504.0), ("RTX 6000 Ada", 364.0), ("RTX A6000", 155.0), ("RTX 5090", 210.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("T4", 65.0),
]


# ---- VRAM budget holding 2 of 3 ----------------------------------------------------

def nvml_device(device: str) -> tuple[str, int] | None:
    """(name, total bytes) of a CUDA device from NVML (no CUDA context in this process)."""
    if not device.startswith("cuda"):
        return None
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = nvml_handle(pynvml, device)
        name = pynvml.nvmlDeviceGetName(handle)
        return (name.decode() if isinstance(name, bytes) else name), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    finally:
        pynvml.nvmlShutdown()


def vram_budget_check(work: Path, folders: dict[str, Path], device: str) -> Check:
    from fleet.runtimes.footprint import estimate_footprint

    names = ("budget-a", "budget-b", "budget-c")
    # One catalog source per name: each gets its own folder (hard links: no bytes copied).
    copies = {n: Path(shutil.copytree(folders["budget-model"], work / "models" / n, copy_function=os.link,
                                      dirs_exist_ok=True)) for n in names}
    home = make_home(work / "home-budget", copies,
                     {n: (n, "embed", "sentence-transformers", "") for n in names}, "float32")
    fp = estimate_footprint(home / "models" / names[0], "sentence-transformers", dtype="float32", max_seq_len=256)
    budget = fp.activation_bytes + int(2.5 * fp.weights_bytes)
    info = nvml_device(device)
    # CUDA: the worker's budget is the device's total minus the reserve, so the reserve sets it.
    env = ({"FLEET_GPU_RESERVE_BYTES": str(info[1] - budget)} if info else {"FLEET_CPU_BUDGET_BYTES": str(budget)})
    d = serve(home, device, 1, env)
    try:
        if httpx.post(f"{d.url}/v1/models/{names[0]}/pin", headers=d.admin,
                      timeout=TIMEOUT_MS / 1000).status_code != 200:
            return Check("vram-budget", False, f"pin {names[0]} failed:\n{d.tail()}")
        statuses: list[int] = []
        worst: list[str] = []
        for _ in range(3):
            for name in names:
                resp = post(d.url, "/v1/embed", {"model": name, "inputs": TEXTS})
                statuses.append(resp.status_code)
                now = resident(d.url)
                if names[0] not in now or not now[names[0]]["pinned"] or len(now) > 2:
                    worst.append(f"after {name}: {sorted(now)}")
        lost = [s for s in statuses if s != 200]
        ok = not lost and not worst
        oom = "out of memory" in d.log().lower()
        return Check("vram-budget", ok and not oom,
                     f"budget {budget >> 20} MiB = 2.5 x {fp.weights_bytes >> 20} MiB + activations; "
                     f"{statuses.count(200)}/{len(statuses)} answered, pin kept and <= 2 resident: {not worst}, "
                     f"OOM in log: {oom}", {"budget_bytes": budget, "weights_bytes": fp.weights_bytes,
                                            "non_200": lost, "violations": worst})
    finally:
        d.stop()


# ---- the GPU's busy share -----------------------------------------------------------

#: Seconds between NVML utilisation reads (the driver itself averages over 1/6 s to 1 s,
#: by product): a 4 s knee step gets ~20 samples.
BUSY_PERIOD_S = 0.2


class BusySampler:
    """The GPU's busy share while a block runs: `with BusySampler("cuda:0") as b: ...`,
    then `b.mean_pct` (None with `b.reason` on the CPU, without NVML, or where the
    device does not report it, e.g. a MIG slice) and `b.samples`.

    One daemon thread reads nvmlDeviceGetUtilizationRates(h).gpu every `period_s`:
    the percent of the driver's last sample window in which one or more kernels ran
    on the device: the `sm` column of nvidia-smi dmon and what issue 34 calls "SM
    busy". It says the device was never idle, not how many of its SMs were: a
    single small kernel at a time reads 100 %. MFU (knee_check) is the figure for
    how much of the device the work filled. Reads NVML only: no CUDA context here."""

    def __init__(self, device: str, period_s: float = BUSY_PERIOD_S) -> None:
        self.device, self.period_s = device, period_s
        self.values: list[int] = []
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None

    def start(self) -> BusySampler:
        if not self.device.startswith("cuda"):
            self.reason = f"not read on {self.device} (NVML reads CUDA devices)"
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 (no module, no driver: both mean no reading)
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return self
        try:
            handle = nvml_handle(pynvml, self.device)
            pynvml.nvmlDeviceGetUtilizationRates(handle)  # unsupported (MIG) fails here, not in the thread
        except Exception as exc:  # noqa: BLE001
            pynvml.nvmlShutdown()
            self.reason = f"NVML utilisation of {self.device} unreadable: {type(exc).__name__}: {exc}"
            return self
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, args=(handle,), name="nvml-busy", daemon=True)
        self._thread.start()
        return self

    def _run(self, handle: Any) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.values.append(int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            except Exception as exc:  # noqa: BLE001 (a read that fails ends the sampling, with its reason)
                self.reason = f"NVML read failed after {len(self.values)} samples: {type(exc).__name__}: {exc}"
                return

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._nvml.nvmlShutdown()
        if self._nvml is not None and not self.values and self.reason is None:
            self.reason = f"no sample: the block ran under {self.period_s:g} s"

    @property
    def samples(self) -> int:
        return len(self.values)

    @property
    def mean_pct(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None

    def __enter__(self) -> BusySampler:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# ---- tokens/s at the knee ---------------------------------------------------------

def flops_per_token(cfg: dict, tokens_per_text: float) -> float:
    """Forward FLOPs per token of a BERT encoder: 2 x the layers' matmul weights,
    plus attention scores and mixing (QK^T and AV: 4 x hidden x sequence per layer)."""
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    return layers * (2 * (4 * h * h + 2 * h * inter) + 4 * h * tokens_per_text)


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in device_name.lower()), None)


def knee_check(url: str, model: str, cfg: dict, sizes: Sizes, device: str, device_name: str | None,
               minilm: Path) -> Check:
    """Closed-loop steps up to the knee; the GPU's busy share (BusySampler) is read
    during each step and the knee step's mean is `sm_busy_pct` (issue 34's goal)."""
    if httpx.post(f"{url}/v1/models/{model}/load", headers=admin_headers(url),
                  timeout=TIMEOUT_MS / 1000).status_code != 200:
        return Check(f"knee/{model}", False, "load failed")
    dtype = resident(url)[model].get("dtype", "?")
    setup = embed_load(url, model, minilm)
    steps: list[StepResult] = []
    busy: list[BusySampler] = []
    with loadgen.Generator(setup, processes=sizes.generators) as gen:
        gen.run(loadgen.StepPlan(index=0, mode=CLOSED, offered=sizes.generators, duration_s=sizes.step_s / 2))
        for i, clients in enumerate(sizes.clients, start=1):
            with BusySampler(device) as sampler:
                m = gen.run(loadgen.StepPlan(index=i, mode=CLOSED, offered=clients, duration_s=sizes.step_s))
            busy.append(sampler)
            tokens = m.server_tokens if m.server_tokens >= 0 else m.tokens_ok
            p50, p95, p99 = np.percentile(m.latencies_ms, [50, 95, 99]).tolist() if m.ok else [float("nan")] * 3
            steps.append(StepResult(offered=clients, throughput_rps=m.ok / m.elapsed_s,
                                    tokens_per_s=tokens / m.elapsed_s, p50_ms=p50, p95_ms=p95, p99_ms=p99,
                                    sent=m.sent, ok=m.ok, errors=m.errors, mode=CLOSED))
            if find_knee(steps).saturated:
                break
    # How many workers hold the model after the steps: a second copy on the one device is
    # the rent-or-buy rule's answer to a holder that stays behind (runtimes.placement).
    holders = [w.get("worker") for w in ps(url)["workers"] if model in w.get("models", {})]
    knee = find_knee(steps)
    at = knee.knee or max(steps, key=lambda s: s.tokens_per_s)
    at_busy = busy[next(i for i, s in enumerate(steps) if s is at)]  # by identity: equal steps may differ in busy
    tokens_per_text = at.tokens_per_s / max(at.throughput_rps * BATCH, 1e-9)
    flops = flops_per_token(cfg, tokens_per_text) * at.tokens_per_s
    peak = peak_tflops(device_name)
    mfu = flops / (peak * 1e12) if peak else None
    data = {"dtype": dtype, "knee_clients": at.offered, "tokens_per_s": at.tokens_per_s, "rps": at.throughput_rps,
            "p50_ms": at.p50_ms, "p95_ms": at.p95_ms, "errors": sum(s.errors for s in steps),
            "saturated": knee.saturated, "tokens_per_text": tokens_per_text, "achieved_tflops": flops / 1e12,
            "peak_tflops": peak, "mfu": mfu, "sm_busy_pct": at_busy.mean_pct, "sm_busy_samples": at_busy.samples,
            "sm_busy_reason": at_busy.reason, "holders": holders, "steps": [asdict(s) for s in steps],
            "steps_sm_busy": [{"offered": s.offered, "mean_pct": b.mean_pct, "samples": b.samples}
                              for s, b in zip(steps, busy, strict=True)],
            "verdicts": [[v.step.offered, list(v.reasons)] for v in knee.verdicts]}
    errors = data["errors"]
    return Check(f"knee/{model}", errors == 0 and knee.knee is not None,
                 f"{at.tokens_per_s:,.0f} tokens/s, p95 {at.p95_ms:.1f} ms at {at.offered:g} clients x {BATCH} texts "
                 f"({dtype}, {'knee' if knee.saturated else 'not saturated: highest step'}); "
                 f"{flops / 1e12:.2f} TFLOP/s, MFU " + (f"{mfu:.1%} of {peak:g}" if mfu is not None else "n/a (no peak "
                 "for this device)") + (f", SM busy {at_busy.mean_pct:.0f} % ({at_busy.samples} samples)"
                                        if at_busy.mean_pct is not None else "")
                 + f"; held by {len(holders)} worker(s); errors {errors}", data)


def embed_load(url: str, model: str, minilm: Path) -> loadgen.Setup:
    """32-text embed requests of the corpus, tokens counted with MiniLM's tokenizer."""
    texts = corpus.load()
    return loadgen.Setup(kind="fleet", task="embed", url=url, model=model, texts=texts,
                         lengths=TokenCounter(minilm).count(texts), batch=BATCH)


def profile_check(url: str, model: str, knee: Check | None, sizes: Sizes, minilm: Path, out_dir: Path,
                  stem: str) -> Check:
    """One more closed-loop step at the knee's clients with py-spy on the API process and
    every worker (bench.spy): each thread's busy share and the frames it spent most on,
    the raw stacks beside the run's JSON. Where the host time of a micro-batch goes on
    the device (the H200 runs measured that one worker's loop was the limit, not why)."""
    name = f"profile/{model}"
    why = spy.available()
    if why:
        return Check(name, None, why)
    clients = int((knee.data or {}).get("knee_clients") or sizes.clients[-1]) if knee else sizes.clients[-1]
    info = ps(url)
    pids = {info["pid"]: "api", **{w["pid"]: f"worker{k}" for k, w in enumerate(info["workers"]) if w.get("pid")}}
    with loadgen.Generator(embed_load(url, model, minilm), processes=sizes.generators) as gen:
        gen.run(loadgen.StepPlan(index=0, mode=CLOSED, offered=clients, duration_s=1.0))
        running = spy.start(pids, sizes.step_s, out_dir, stem)
        m = gen.run(loadgen.StepPlan(index=1, mode=CLOSED, offered=clients, duration_s=sizes.step_s))
        procs = spy.finish(running, sizes.step_s)
    lines = []
    for key, summary in procs.items():
        if "error" in summary:
            lines.append(f"{key}: {summary['error'][:120]}")
            continue
        threads = summary["threads"]
        top = next(iter(threads.items()), None)
        lines.append(f"{key}: {len(threads)} threads ran" + (
            f", busiest {top[0]} {top[1]['busy']:.0%} (most in {top[1]['self'][0][0]})" if top else ""))
    # The load is the product's (an error fails the check); a recorder that could not
    # attach (no ptrace here) leaves the profile unread, not the daemon wrong.
    unread = [k for k, v in procs.items() if "error" in v]
    ok = False if m.errors else (None if unread else True)
    return Check(name, ok, f"{clients} clients, {m.ok} answered, {m.errors} errors; " + "; ".join(lines),
                 {"clients": clients, "seconds": sizes.step_s, "ok": m.ok, "errors": m.errors, "processes": procs})


def host_path_check(url: str, sizes: Sizes, minilm: Path) -> Check:
    """bench.host_path against the device daemon: its CPU per token with a nearly free forward."""
    res = host_path.measure(url, host_path.MODEL, model_dir=minilm, clients=sizes.host_clients, duration_s=sizes.host_s,
                            timeline_s=sizes.host_timeline_s, generators=min(sizes.generators, sizes.host_clients),
                            warmup_s=min(host_path.WARMUP_S, sizes.host_s / 2))
    load, cpu = res["load"], res["cpu"]
    roles = [p["role"] for p in cpu["processes"] if not p.get("gone")]
    read = "api" in roles and any(r.startswith("worker") for r in roles)
    ok = load["errors"] == 0 and load["ok"] > 0 and res["timeline"]["errors"] == 0 and read
    return Check("host-path", ok, host_path.summary(res) + ("" if read else "; API or worker CPU not read"), res)


# ---- NVML vs torch -----------------------------------------------------------------

#: NVML and CUDA's views of one GPU may differ by this much (driver reserve, a CUDA context).
VIEW_GAP = 1 << 30


#: Free-memory reads timed by nvml_check.
FREE_READS = 200
#: A process that times NVML's init and shutdown, 20 times (microseconds each, on stdout).
INIT_TIMER = ("import time, pynvml\nt = time.perf_counter()\nfor _ in range(20):\n    pynvml.nvmlInit()\n"
              "    pynvml.nvmlShutdown()\nprint((time.perf_counter() - t) / 20 * 1e6)")


def nvml_check(device: str) -> Check:
    if not device.startswith("cuda"):
        return Check("nvml-budget", None, "no CUDA device: the CPU budget is RAM (psutil), checked by vram-budget")
    import torch

    from fleet.runtimes.device_memory import cuda_index, device_budget, nvml_memory

    index = cuda_index(device)
    torch.cuda.init()
    nv_total, nv_free = nvml_memory(index)
    t_free, t_total = torch.cuda.mem_get_info(index)
    budget = device_budget(device)
    want = min(nv_total, t_total) - (512 << 20)  # the shipped gpu_reserve_bytes
    # The worker's budget is taken from the smaller view, which is what is checked.
    # The views differ by what one counts and the other not: on the H200 of
    # 20261204-gpu-check-h200-*.json NVML's total was 616 MiB over CUDA's (memory the
    # driver keeps) and its free 523 MiB over (this process's CUDA context); a gap of
    # gigabytes would mean another process or a wrong CUDA_VISIBLE_DEVICES mapping.
    ok = abs(nv_free - t_free) <= VIEW_GAP and abs(nv_total - t_total) <= VIEW_GAP and budget.budget_bytes == want
    # What one load decision's free-memory read costs (a worker leaving a lane to its
    # holders decides every IDLE_NAP_S): NVML opened once per process (fleet.nvml).
    t0 = time.perf_counter()
    for _ in range(FREE_READS):
        budget.free_now()
    free_read_us = (time.perf_counter() - t0) / FREE_READS * 1e6
    # What each read paid before fleet.nvml kept NVML open: an init and a shutdown, timed in
    # a process of its own (in this one NVML is open, and an init would only count up).
    cold = subprocess.run([sys.executable, "-c", INIT_TIMER], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    init_us = float(cold.stdout.strip()) if cold.returncode == 0 and cold.stdout.strip() else None
    return Check("nvml-budget", ok, f"total NVML {nv_total >> 20} / torch {t_total >> 20} MiB, free NVML "
                 f"{nv_free >> 20} / torch {t_free >> 20} MiB, budget {budget.budget_bytes >> 20} MiB "
                 f"(want {want >> 20}); a free-memory read {free_read_us:.0f} us"
                 + (f", an NVML init and shutdown {init_us:.0f} us" if init_us is not None else ""),
                 {"nvml_total": nv_total, "torch_total": t_total, "nvml_free": nv_free, "torch_free": t_free,
                  "budget_bytes": budget.budget_bytes, "free_read_us": free_read_us, "nvml_init_us": init_us})
