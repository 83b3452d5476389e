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

Targets (`local_target` turns a `--targets` name into one):
  st-fp32, st-bf16  `SentenceTransformer.encode` in that dtype;
  st-best           the faster dtype on this CPU: bf16 with native bf16
                    (avx512_bf16 or amx_bf16, runtimes.device.fast_dtypes), else fp32;
  ov-fp32, ov-bf16, ov-best
                    OpenVINO in-process through fleet's own dense adapter with its
                    engine forced (runtimes/adapters/openvino.py; the graph converted at
                    first load, kept under the temp directory for a package's
                    model): the adapter's `run_batch`, no worker, no queue, no HTTP.
                    Skipped, with a line saying so, when openvino is not installed;
  sorted-<one of the above>
                    the offline limit: the same texts, sorted by token count and
                    cut into batches of `--batch`, encoded back to back (a batch
                    job that holds all its texts up front pads least);
  sorted            sorted batches on the best engine: OpenVINO in the best dtype
                    when installed, else torch in the best dtype.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import msgspec
import numpy as np

from fleet.bench.loadgen import Merged, StepPlan, StepRaw, merge
from fleet.bench.targets import request_windows

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
    #: "torch": `SentenceTransformer.encode`; "openvino": fleet's adapter, engine forced.
    engine: str = "torch"
    #: Length-sorted batches of the texts instead of the request windows.
    sorted: bool = False
    #: The model's name (the adapter's requests carry it).
    model: str = "model"


#: dtype names of the targets -> fleet's (runtimes/base.Profile.dtype).
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
INSTALL_OPENVINO = "pip install 'fleet-serve[openvino]'"


class LocalTarget(msgspec.Struct, frozen=True):
    name: str
    engine: str
    dtype: str
    sorted: bool = False
    #: Why the name resolved as it did ("" when it names itself).
    note: str = ""


def best_dtype(flags: set[str]) -> str:
    """bf16 on a CPU with native bf16 (runtimes.device.cpu_fast_dtypes), else fp32."""
    from fleet.runtimes.device import cpu_fast_dtypes

    return "bf16" if cpu_fast_dtypes(flags) else "fp32"


def local_target(name: str, *, flags: set[str] | None = None, openvino: bool | None = None) -> LocalTarget | str | None:
    """The in-process target `name` means on this machine; a str: why it is skipped
    (the line to print); None: not an in-process target's name."""
    from fleet.runtimes.adapters import openvino as ov
    from fleet.runtimes.device import cpu_flags

    flags = cpu_flags() if flags is None else flags
    have_ov = ov.available() if openvino is None else openvino
    best = best_dtype(flags)
    why = f"{'native bf16' if best == 'bf16' else 'no native bf16'} on this CPU"
    sorted_ = name == "sorted" or name.startswith("sorted-")
    inner = name[len("sorted-"):] if name.startswith("sorted-") else name
    if name == "sorted":
        inner = "ov-best" if have_ov else "st-best"
        why = "the best engine: " + ("OpenVINO, installed" if have_ov else f"torch (openvino is not installed), {why}")
    prefix, _, dtype = inner.partition("-")
    if prefix not in ("st", "ov") or dtype not in ("fp32", "bf16", "best"):
        return None
    engine = "openvino" if prefix == "ov" else "torch"
    if engine == "openvino" and not have_ov:
        return f"{name}: skipped: openvino is not installed ({INSTALL_OPENVINO})"
    if dtype == "best":
        dtype = best
    concrete = ("sorted-" if sorted_ else "") + f"{prefix}-{dtype}"
    return LocalTarget(concrete, engine, dtype, sorted_, "" if concrete == name else f"{name} is {concrete} ({why})")


def local_batches(setup: STSetup) -> tuple[list[list[str]], list[int]]:
    """(texts per call, tokens per call): the request windows every target sends, or with
    `sorted` the texts ordered by token count (stably) and cut into batches of `batch`."""
    if setup.sorted:
        order = sorted(range(len(setup.texts)), key=setup.lengths.__getitem__)
        windows = [order[i:i + setup.batch] for i in range(0, len(order), setup.batch)]
    else:
        windows = request_windows(len(setup.texts), setup.batch, seed=setup.seed)
    return [[setup.texts[i] for i in w] for w in windows], [sum(setup.lengths[i] for i in w) for w in windows]


def _openvino_encoder(setup: STSetup):
    """fleet's dense adapter with OpenVINO forced in `setup.dtype`: (encode, info)."""
    from fleet.protocol import EmbedRequest
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.runtimes.adapters.sentence_transformer import SentenceTransformerEmbedder

    spec = ModelSpec(setup.model, Path(setup.model_dir), "embed", "sentence-transformers",
                     profile=Profile(engine="openvino", dtype=DTYPES[setup.dtype]))
    adapter = SentenceTransformerEmbedder(spec, setup.device)
    adapter.load()

    def encode(texts: list[str]) -> None:
        result = adapter.run_batch([EmbedRequest(model=setup.model, inputs=texts)])[0]
        if not hasattr(result, "data"):  # a WorkError: fail the step, never count it
            raise RuntimeError(f"OpenVINO in-process: {result!r}")

    import openvino

    return encode, {"openvino": str(openvino.__version__), "choice": adapter.choice.info() if adapter.choice else None}


def _child_main(pipe) -> None:
    setup = msgspec.msgpack.decode(pipe.recv_bytes(), type=STSetup)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads
    import torch
    from sentence_transformers import SentenceTransformer

    if setup.threads:
        torch.set_num_threads(setup.threads)
    info: dict = {}
    if setup.engine == "openvino":
        encode, info = _openvino_encoder(setup)
    else:
        model = SentenceTransformer(setup.model_dir, device=setup.device, local_files_only=True)
        model.eval()
        if setup.dtype == "bf16":
            model = model.to(torch.bfloat16)
        encode = model.encode
    batches, tokens = local_batches(setup)
    for b in batches[:2]:
        encode(b)  # first calls build kernels and caches
    pipe.send_bytes(_enc.encode({"ready": True, "torch": str(torch.__version__), "threads": torch.get_num_threads(),
                                 "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "engine": setup.engine,
                                 "batches": "length-sorted" if setup.sorted else "request windows", **info}))
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
            encode(batches[k])
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
        what = f"{'OpenVINO' if setup.engine == 'openvino' else 'sentence-transformers'} ({setup.dtype})"
        self.proc = ctx.Process(target=_child_main, args=(child,), name=f"fleet-bench-st-{setup.dtype}", daemon=True)
        self.proc.start()
        child.close()
        self.pipe.send_bytes(_enc.encode(setup))
        if not self.pipe.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"{what} did not load within {start_timeout_s:g} s")
        try:
            self.info = msgspec.msgpack.decode(self.pipe.recv_bytes())
        except EOFError as exc:
            raise RuntimeError(f"{what} process exited while loading "
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
