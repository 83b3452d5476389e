"""In-process sentence-transformers: the compute limit the servers are compared against.

`LocalST` runs `SentenceTransformer.encode` in its own spawned process (torch is
imported there, never in the bench's parent or generator processes), on the
same request windows the HTTP targets send (`bench.targets.request_windows`).
A step is closed loop with one caller: encode a request's inputs, record the
latency, take the next, for the step's duration. There is no HTTP, no queue,
no serialisation: what it reaches is what the model itself can do on this box
with that dtype. `encode` runs with its default settings (batch_size 32,
no normalisation) so it is "sentence-transformers as people use it"; torch's
OpenMP threads sleep when idle as in fleet's workers (OMP_WAIT_POLICY=PASSIVE
unless the environment sets it; runtimes/process.py): with OpenMP's default
spin the child's threads and the bench's own processes fought over a 2-core box
and this target measured 3-40 requests/s in one run, the scheduler, not the model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgspec
import numpy as np

from bench.loadgen import Merged, StepPlan, StepRaw, merge
from bench.targets import request_windows

_enc = msgspec.msgpack.Encoder()


class STSetup(msgspec.Struct, frozen=True):
    model_dir: str
    dtype: str  # "fp32" | "bf16"
    device: str
    texts: list[str]
    lengths: list[int]
    batch: int
    seed: int = 7
    threads: int = 0


def _child_main(pipe) -> None:
    setup = msgspec.msgpack.decode(pipe.recv_bytes(), type=STSetup)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads
    import torch
    from sentence_transformers import SentenceTransformer

    if setup.threads:
        torch.set_num_threads(setup.threads)
    model = SentenceTransformer(setup.model_dir, device=setup.device, local_files_only=True)
    model.eval()
    if setup.dtype == "bf16":
        model = model.to(torch.bfloat16)
    windows = request_windows(len(setup.texts), setup.batch, seed=setup.seed)
    batches = [[setup.texts[i] for i in w] for w in windows]
    tokens = [sum(setup.lengths[i] for i in w) for w in windows]
    model.encode(batches[0])  # first call builds kernels and caches
    pipe.send_bytes(_enc.encode({"ready": True, "torch": str(torch.__version__), "threads": torch.get_num_threads(),
                                 "omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}))
    j = 0
    while True:
        msg = pipe.recv_bytes()
        if not msg:
            return
        plan = msgspec.msgpack.decode(msg, type=StepPlan)
        lat: list[float] = []
        tok = 0
        cpu0 = time.process_time()
        started = time.time()
        t0 = time.perf_counter()
        end = t0 + plan.duration_s
        now = t0
        while now < end:
            k = j % len(batches)
            t = time.perf_counter()
            model.encode(batches[k])
            now = time.perf_counter()
            lat.append((now - t) * 1000.0)
            tok += tokens[k]
            j += 1
        raw = StepRaw(
            index=plan.index, sent=len(lat), ok=len(lat), errors=0, error_codes={}, error_sample="",
            latencies_ms=np.asarray(lat, dtype=np.float32).tobytes(), server_queue_ms=b"", server_inference_ms=b"",
            tokens_ok=tok, server_tokens=-1,
            elapsed_s=now - t0, lag_p99_ms=0.0, cpu_s=time.process_time() - cpu0, started_unix=started,
        )
        pipe.send_bytes(_enc.encode(raw))


class LocalST:
    """Parent-side handle; same `run(plan) -> Merged` shape as `bench.loadgen.Generator`."""

    def __init__(self, setup: STSetup, start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child,), name=f"fleet-bench-st-{setup.dtype}", daemon=True)
        self.proc.start()
        child.close()
        self.pipe.send_bytes(_enc.encode(setup))
        if not self.pipe.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"sentence-transformers ({setup.dtype}) did not load within {start_timeout_s:g} s")
        try:
            self.info = msgspec.msgpack.decode(self.pipe.recv_bytes())
        except EOFError as exc:
            raise RuntimeError(f"sentence-transformers ({setup.dtype}) process exited while loading "
                               f"(exit {self.proc.exitcode})") from exc

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def run(self, plan: StepPlan, on_progress=None) -> Merged:
        if plan.mode != "closed" or round(plan.offered) != 1:
            raise ValueError("the in-process target runs closed loop with one caller")
        self.pipe.send_bytes(_enc.encode(plan))
        while not self.pipe.poll(0.25):
            if not self.proc.is_alive():
                raise RuntimeError(f"sentence-transformers process {self.proc.pid} died (exit {self.proc.exitcode})")
        return merge([msgspec.msgpack.decode(self.pipe.recv_bytes(), type=StepRaw)])

    def close(self) -> None:
        try:
            self.pipe.send_bytes(b"")
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
