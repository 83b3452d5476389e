"""`fleetctl tune`'s measuring: a daemon per candidate (`DaemonMeasurer`).

Each candidate runs in its own `fleetctl serve` on a free loopback port with a temp
FLEET_HOME whose `models.toml` (the user's overlay plus the candidate, written as the
profile of this device class) holds it and whose `models` is the user's store (a
symlink; nothing is copied) or, for a catalog model not pulled yet, a temp store the
daemon pulls into; the bench's runner ramps it on the model's own task and `bench.knee`
finds the knee. The daemon's `/v1/ps` must report the candidate's device-class profile
in use before it is measured.

dtype: the daemon's own load-time check (`runtimes.adapters.hf_common.choose_dtype`, the check
set against fp32: cosine >= 0.9999 for embedders, ...) decides which reduced dtype is
allowed: the first candidate runs with `dtype = "auto"`, and the dtype it served (and
the check's log line, `dtype_checks`) fixes the dtype ladder to {that dtype, float32}.
A dtype the check refused is never tried.

engine: the same first load also chose the engine (torch, OpenVINO:
`runtimes.adapters.engines.choose` timed them on the model's own batch shapes, or a kept
verdict, or the only one offered); `/v1/ps` publishes it (`served_engine`). The search
holds that engine fixed: every candidate names it with its dtype (`engine =
"openvino"`, `dtype = "bfloat16"`: a fully forced choice, served unchecked), so each
measured daemon serves exactly that engine (the measurer refuses a candidate served
otherwise, `not_as_named`), its float32 rung is that engine's f32, and `--write` stores
a profile that is read against the engine it was measured on. Engines are not re-timed
here: the load-time check did that on the model's own shapes; its verdict (how chosen,
speed, and each engine's timings from the log, `engine_tables`) goes into the `tuned`
table.

A module of its own because it is the only part of the tune that starts processes and
speaks HTTP; the search (`bench.tune_search`) stays pure.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleet.bench.daemon import LocalDaemon
from fleet.bench.tune_search import Candidate, Measurement
from fleet.catalog import Profile, TunedInfo, write_tuned_profile


_DTYPE_LINE = re.compile(r"dtype check (\S+) (\S+): (.*) -> (keep|fp32)")


def dtype_checks(log_text: str, model: str) -> list[str]:
    """The load-time dtype check's lines for `model` in a daemon log ("bfloat16: min cosine ... -> keep")."""
    return [f"{m.group(2)}: {m.group(3)} -> {m.group(4)}" for m in _DTYPE_LINE.finditer(log_text)
            if m.group(1) == model]


def served_engine(rec: dict) -> dict:
    """What a model's `/v1/ps` record says serves it: engine, dtype, how the engine
    was chosen and its load-time tokens/s (`runtimes.adapters.engines.Choice.info`). A record
    without an engine (no engines weighed: a GPU, a CPU without OpenVINO) is torch."""
    e = rec.get("engine") or {}
    return {"engine": str(e.get("engine") or "torch"), "dtype": str(rec.get("dtype", "")),
            "by": str(e.get("by", "")), "tokens_per_s": float(e.get("tokens_per_s") or 0.0)}


def not_as_named(c: Candidate, served: dict) -> str:
    """Why the daemon does not serve what `c` names (its engine and dtype; an "auto"
    engine names nothing), "" when it does: a candidate is measured on exactly that."""
    if c.engine == "auto" or (served["engine"], served["dtype"]) == (c.engine, c.dtype):
        return ""
    return f"daemon serves {served['engine']} {served['dtype']}, not {c.runs_on}"


#: `runtimes.adapters.engines.choose`'s verdict line: "engine NAME: ENGINE DTYPE, fastest that
#: agrees ({label: timings or why refused})" or "... (kept verdict: {...})".
_ENGINE_LINE = re.compile(r"^engine (\S+): (\S+ \S+)(?:, fastest that agrees \(| \(kept verdict: )(\{.*\})\)$")


def engine_tables(log_text: str, model: str) -> dict[str, str]:
    """The engine verdict's table for `model` in a daemon log (JSON lines or plain):
    each candidate's load-time ms per workload, or why it was refused; {} when the
    load weighed no engines. The last verdict wins."""
    table: dict[str, str] = {}
    for line in log_text.splitlines():
        if "engine " not in line:
            continue
        try:
            msg = json.loads(line).get("msg", "") if line.startswith("{") else line.split("] ", 1)[-1]
        except (ValueError, AttributeError):
            continue
        m = _ENGINE_LINE.match(msg or "")
        if m and m.group(1) == model:
            try:
                got = ast.literal_eval(m.group(3))
            except (ValueError, SyntaxError):
                continue
            if isinstance(got, dict):
                table = {str(k): str(v) for k, v in got.items()}
    return table


@dataclass
class BenchKnobs:
    """How hard each candidate is benched: short steps, few of them (a noisy box
    gives noisy knees either way; many short candidates beat few long ones)."""

    batch: int = 32
    duration_s: float = 4.0
    min_requests: int = 12
    max_steps: int = 6
    warmup_s: float = 2.0
    grace_s: float = 5.0
    resolution: float = 0.08


#: A DaemonMeasurer's knobs when none are given (read, never changed: one serves all).
DEFAULT_KNOBS = BenchKnobs()


class DaemonMeasurer:
    """Measures a candidate by starting a daemon with it and benching its knee."""

    def __init__(self, *, model: str, task: str, device: str, cores: int, user_home: Path,
                 texts: list[str], lengths: list[int], knobs: BenchKnobs = DEFAULT_KNOBS,
                 device_class: str, new_entry: dict | None = None, start_timeout_s: float = 240.0,
                 note: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.task, self.device, self.cores = model, task, device, cores
        self.user_home, self.texts, self.lengths, self.knobs = Path(user_home), texts, lengths, knobs
        self.device_class, self.new_entry, self.start_timeout_s, self.note = device_class, new_entry, start_timeout_s, note
        self.work = Path(tempfile.mkdtemp(prefix="fleet-tune-"))
        self.home = self.work / "home"
        self.home.mkdir()
        user_store = self.user_home / "models"
        if (user_store / model / "manifest.json").is_file():
            # Shared read-only use of the user's store: the daemon re-hashes, never writes.
            (self.home / "models").symlink_to(user_store.resolve(), target_is_directory=True)
        self.dtype_log: list[str] = []
        #: The engine verdict's table of the last load that weighed engines (the default's).
        self.engine_table: dict[str, str] = {}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def _write_overlay(self, c: Candidate) -> None:
        overlay = self.home / "models.toml"
        user = self.user_home / "models.toml"
        overlay.write_text(user.read_text() if user.is_file() else "")
        write_tuned_profile(self.home, self.model, self.device_class, Profile(**c.profile()),
                            TunedInfo(tuned_at="candidate", knee_tokens_per_s=0.0, knee_p95_ms=0.0),
                            new_entry=self.new_entry)

    def _start(self, c: Candidate) -> LocalDaemon:
        """A daemon for this candidate (the user's FLEET_* settings do not leak in), not waited for."""
        threads = max(1, self.cores // c.workers) if not self.device.startswith("cuda") else 0
        env = {"FLEET_HOST": "127.0.0.1", "FLEET_PRELOAD": self.model, "FLEET_WORKERS": str(c.workers),
               "FLEET_DEVICE": self.device, "FLEET_CPU_THREADS": str(threads), "FLEET_LOG_LEVEL": "info"}
        return LocalDaemon(self.home, env=env, wait=False, inherit_fleet=False,
                           log=self.work / f"daemon-{time.monotonic_ns()}.log")

    def _wait_loaded(self, proc: subprocess.Popen, url: str, log_path: Path) -> dict:
        """Until the model is resident: its /v1/ps record (dtype, profile)."""
        import httpx

        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
            try:
                ps = httpx.get(url + "/v1/ps", timeout=2).json()
                if any(w.get("restarts", 0) for w in ps.get("workers", [])) or any(
                        s.get("restarts", 0) for s in ps.get("slots", [])):
                    # A worker died (bad candidate, broken install): do not wait out the timeout.
                    raise RuntimeError(f"a worker restarted while loading: {log_path.read_text()[-1500:]}")
                for w in ps.get("workers", []):
                    rec = w.get("models", {}).get(self.model)
                    if rec:
                        return rec
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.model} not loaded after {self.start_timeout_s:.0f} s")

    def __call__(self, c: Candidate) -> Measurement:
        from fleet.bench.knee import OPEN, Criteria
        from fleet.bench.runner import Plan, TargetSpec, bench

        t0 = time.time()
        self._write_overlay(c)
        daemon = self._start(c)
        proc, url, log_path = daemon.proc, daemon.url, daemon.log_path
        try:
            rec = self._wait_loaded(proc, url, log_path)
            if rec.get("profile") != self.device_class:
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0,
                                   note=f"daemon serves profile {rec.get('profile')!r}, not {self.device_class!r}")
            log_text = log_path.read_text(errors="replace")
            self.dtype_log += dtype_checks(log_text, self.model)
            self.engine_table = engine_tables(log_text, self.model) or self.engine_table
            s = served_engine(rec)
            on = {"dtype": s["dtype"], "engine": s["engine"], "engine_by": s["by"],
                  "engine_tokens_per_s": s["tokens_per_s"]}
            if why := not_as_named(c, s):
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note=why, **on)
            k = self.knobs
            plan = Plan(model=self.model, task=self.task, batch=k.batch, duration_s=k.duration_s,
                        min_requests=k.min_requests, max_step_s=2 * k.duration_s, mode=OPEN,
                        resolution=k.resolution, max_steps=k.max_steps, criteria=Criteria(),
                        grace_s=k.grace_s, warmup_s=k.warmup_s, device=self.device)
            runs = bench([TargetSpec(name="fleet", kind="fleet", url=url, pids=[proc.pid])], plan,
                         self.texts, self.lengths)
            knee = runs[0].knee(plan.criteria)
            if knee.knee is None:
                return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note="no healthy step", **on)
            return Measurement(knee.knee.tokens_per_s, knee.knee.p95_ms, knee.knee.throughput_rps, **on,
                               seconds=time.time() - t0, note=f"{len(runs[0].steps)} steps")
        except RuntimeError as exc:
            return Measurement(0.0, math.inf, ok=False, seconds=time.time() - t0, note=str(exc)[:300])
        finally:
            daemon.stop()
