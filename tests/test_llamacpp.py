"""The llama.cpp runtime (runtimes/adapters/llamacpp.py) on the real SmolLM2-135M-Instruct Q4_1
GGUF, through a real daemon (one CPU worker) and real HTTP:

- greedy text equals llama.cpp's own `Llama` object on the same file and prompt;
- JSON-schema output always parses and matches the schema, greedy and sampled;
- two streams in flight at once interleave (one batch: continuous batching);
- `/v1/ps` shows the engine, the bytes held (weights + KV cache) and the threads chosen;
- a deadline ends a sequence where it is and frees its place in the batch.

These need the optional `llama_cpp` package (the fleet-serve[llamacpp] extra): the plain
install leaves it out (`scripts/setup.sh --test` builds it into `.venv/llamacpp`, as the
OpenVINO extra goes into `.venv/openvino`); CI runs this file again with it:
`PYTHONPATH=.venv/llamacpp .venv/bin/python -m pytest -q -ra tests/test_llamacpp.py`.
The model is loaded once for the module (one daemon, one reference `Llama`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from fleet.pull import pull_model
from fleet.store import Store
from fleet.runtimes.adapters import llamacpp
from tests.conftest import DaemonProc, start_daemon
from tests.test_gguf_store import smollm2_gguf

pytestmark = pytest.mark.skipif(not llamacpp.available(), reason=(
    "llama_cpp is not installed (the fleet-serve[llamacpp] extra: PyPI has no binary of it; "
    "FLEET_BUILD_LLAMACPP=1 ./scripts/setup_llamacpp.sh builds it into .venv/llamacpp, 22-28 min on 2 cores, "
    "then these run with PYTHONPATH=.venv/llamacpp)"))

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Here is a list of three fruits:\n1."]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, gguf: Path):
    home = tmp_path_factory.mktemp("llamacpp-home")
    pull_model(Store(home / "models"), f"path:{gguf}", name=MODEL)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": MODEL, "FLEET_CPU_THREADS": "2"}, args=["--workers", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(gguf: Path):
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the runtime runs it (runtimes/adapters/llamacpp.py)
    from llama_cpp import Llama

    # Flash attention as the runtime's context runs it (llama.cpp's "auto" turns it on
    # for this model on the CPU; the `Llama` object's default is off, which rounds the
    # attention differently and flips a near tie ~20 tokens in).
    return Llama(str(gguf), n_ctx=1024, n_threads=2, flash_attn=True, verbose=False)


def test_greedy_text_equals_llama_cpps_own(served: DaemonProc, reference) -> None:
    for prompt in PROMPTS:
        ours = httpx.post(f"{served.url}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout=120).json()
        theirs = reference.create_completion(prompt, max_tokens=24, temperature=0)
        assert ours["choices"][0]["text"] == theirs["choices"][0]["text"], prompt
        assert ours["usage"] == {k: theirs["usage"][k] for k in ours["usage"]}


def test_json_schema_output_always_parses(served: DaemonProc) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):  # greedy and sampled: the grammar holds for every pick
        r = httpx.post(f"{served.url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 60, "seed": seed, "temperature": 0 if seed == 0 else 1.0, "response_format": fmt},
            timeout=120).json()
        value = json.loads(r["choices"][0]["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 120
        assert r["choices"][0]["finish_reason"] == "stop"


def test_two_streams_interleave(served: DaemonProc) -> None:
    """Both streams are in flight at once: each one's chunks arrive while the other's
    do, and the worker reports batches of two sequences."""
    arrivals: dict[int, list[float]] = {0: [], 1: []}
    start = threading.Barrier(2)

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Count from {i + 1} to 60, one number a line:\n", "max_tokens": 64,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as client:
            start.wait()  # both sent together: a busy box may start one thread a second late
            with client.stream("POST", f"{served.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals[i].append(time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    a, b = arrivals[0], arrivals[1]
    assert len(a) >= 10 and len(b) >= 10
    # Interleaved: chunks of each stream arrive between the other's first and last.
    assert sum(a[0] < t < a[-1] for t in b) >= 5 and sum(b[0] < t < b[-1] for t in a) >= 5


def test_ps_shows_the_engine_and_the_bytes_held(served: DaemonProc) -> None:
    ps = httpx.get(f"{served.url}/v1/ps", timeout=30).json()
    held = [m for w in ps["workers"] for name, m in w["models"].items() if name == MODEL]
    assert held, ps
    engine = held[0]["engine"]
    assert engine["engine"] == "llama.cpp"
    assert held[0]["bytes"] == engine["weights_bytes"] + engine["kv_bytes"] > 96_000_000
    assert held[0]["dtype"] == "Q4_1"
    assert engine["threads"] in (1, 2) and set(engine["threads_ms"]) == {"1", "2"}


def test_a_deadline_ends_a_sequence_and_frees_its_place(served: DaemonProc) -> None:
    """A generation past its `timeout_ms` is answered `timeout` at the deadline, not when
    its 1 800 tokens would be done (~30 s here; a grammar holds it to them, so it cannot
    end early), and leaves the batch: the next request runs alone in it."""
    t0 = time.monotonic()
    r = httpx.post(f"{served.url}/v1/generate", json={
        "model": MODEL, "prompt": "Say a many times:", "regex": "(a ){900}", "max_tokens": 2000,
        "temperature": 0, "timeout_ms": 1500}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 10
    after = httpx.post(f"{served.url}/v1/generate", json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert after.status_code == 200
    last = [w["last_batch"] for w in httpx.get(f"{served.url}/v1/ps", timeout=30).json()["workers"]]
    assert any(b.get("model") == MODEL and b.get("items") == 1 for b in last), last


def test_a_gpu_worker_with_this_build_refuses_the_load(served: DaemonProc) -> None:
    """A worker on `cuda:0` with a llama.cpp built without GPU support (this one) answers
    its lane `model_load_failed`, saying how to build it with CUDA, instead of serving on
    the CPU while it reports the GPU (runtimes/adapters/llamacpp_offload.py). A real worker
    core, the real build and the real GGUF of the served store; no GPU is needed, nor
    faked beyond the device name: the refusal comes before anything would touch one."""
    import os

    import msgspec

    from fleet.local_queue import LocalQueue
    from fleet.messages import STATUS_ERROR, Envelope, WorkError
    from fleet.protocol import GenerateRequest
    from fleet.runtimes.base import ModelSpec
    from fleet.runtimes.worker import WorkerCore

    _, folder = Store(served.home / "models").open(MODEL)
    queue = LocalQueue.create(slots=16, slab_bytes=1 << 20)
    try:
        worker = queue.register_worker(os.getpid(), "cuda:0")
        core = WorkerCore(queue, worker, "cuda:0", lambda name: ModelSpec(name, folder, "generate", "llama.cpp"),
                          served_by="box/0")
        body = msgspec.msgpack.encode(GenerateRequest(model=MODEL, prompt="hello", max_tokens=2))
        queue.put(queue.lane_id(MODEL), body, tokens=2, request_id=1)
        core.step()
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = queue.wait_results(0.2)
        assert [d.request_id for d in got] == [1] and got[0].status == STATUS_ERROR
        error = msgspec.msgpack.decode(msgspec.msgpack.encode(
            msgspec.msgpack.decode(got[0].result, type=Envelope).body), type=WorkError)
        assert error.code == "model_load_failed", error
        assert "cuda:0" in error.message and "built without GPU support" in error.message
        assert "CMAKE_ARGS=-DGGML_CUDA=on" in error.message
        assert MODEL not in core.residency.models
    finally:
        queue.close()
        queue.unlink()


@pytest.mark.slow
def test_the_gpu_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_llamacpp.sh's bench, run here as the GPU session runs it but with
    `--device cpu` (no GPU here), so the prepared device check is known to work before a
    lent machine runs it: a random Llama pulled through fleet's converter, served, greedy
    text equal to llama.cpp's own `Llama`, tokens/s at 1 and 4 streams, not offloaded."""
    import subprocess
    import sys

    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "fleet.bench", "gpu-llamacpp", "--device", "cpu", "--rounds", "1",
                        "--max-tokens", "16", "--streams", "1,4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["parity"]["same"] == [True, True, True] and not doc["offloaded"]
    assert doc["ps"]["engine"] == "llama.cpp" and doc["ps"]["gpu"] is None and doc["ps"]["device"] == "cpu"
    assert set(doc["rates"]) == {"fleet_1", "fleet_4", "llama_cpp_1"}
    assert doc["rates"]["fleet_4"]["output_tokens"] == 4 * 16
    assert all(v["output_tokens_per_s"] > 0 for v in doc["rates"].values())


def test_a_gpu_worker_loads_every_layer_and_charges_the_gpu(served: DaemonProc, monkeypatch) -> None:
    """The GPU branch of the load, with the GPU faked where one must exist (this build
    cannot offload and this box has none): the build says it offloads and sees CUDA0, and
    CUDA's free memory drops by 1 GiB over the load. The model then loads with every layer
    asked for CUDA0 (llama.cpp here, without GPUs, keeps them on the CPU), skips the thread
    probe, shows the offload in its engine facts and charges the larger of weights + cache
    and what the GPU lost."""
    import llama_cpp.llama_cpp as L

    from fleet.runtimes.adapters import llamacpp_offload
    from fleet.runtimes.base import ModelSpec

    _, folder = Store(served.home / "models").open(MODEL)
    free = iter([80 << 30, (80 << 30) - (1 << 30)])
    monkeypatch.setattr(L, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(llamacpp, "llama_gpus", lambda: ["CUDA0"])
    monkeypatch.setattr(llamacpp, "device_free_bytes", lambda torch, device: next(free))
    asked, apply = [], llamacpp_offload.Offload.apply
    monkeypatch.setattr(llamacpp_offload.Offload, "apply", lambda self, params: (asked.append(self),
                                                                                 apply(self, params)))
    adapter = llamacpp.LlamaCppLM(ModelSpec(MODEL, folder, "generate", "llama.cpp"), "cuda:0")
    adapter.load()
    try:
        assert asked == [llamacpp_offload.Offload(llamacpp_offload.ALL_LAYERS, 0, llamacpp_offload.SPLIT_NONE,
                                                  "CUDA0")]
        facts = adapter.choice.info()
        assert facts["gpu"] == "CUDA0" and facts["gpu_layers"] == L.llama_model_n_layer(adapter.model) + 1
        assert facts["threads_ms"] == {} and facts["threads_probe"].startswith("skipped")
        assert facts["device_bytes"] == 1 << 30
        assert adapter.footprint_bytes() == max(facts["weights_bytes"] + facts["kv_bytes"], 1 << 30)
    finally:
        adapter.unload()
