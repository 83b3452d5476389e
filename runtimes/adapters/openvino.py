"""OpenVINO: the second runtime family for encoders on CPU (embed, rerank, classify).

An adapter keeps its tokenizing, batching, pooling and results; only its
forward (token tensors -> one tensor) runs here, as a graph converted from the
adapter's own torch forward with `openvino.convert_model` (fp32 weights, the
sequence dimensions dynamic) and compiled for the CPU in f32 or bf16 (an
inference precision: one graph serves both). `runtimes/adapters/engines.py` decides by
measurement whether it serves instead of torch.

The graph is a derived file of the model (`fleet/derived.py`): OpenVINO IR
(`model.xml` + `model.bin`, raw weights, no pickle), kept beside the model in
the store with its sha256 and the hashes of the model files it came from;
converted at the first load, re-hashed at every load, converted again when the
model's files or the converting libraries change.

Why OpenVINO and not ONNX Runtime (both measured in-process on MiniLM,
length-sorted batches of 32, AMD EPYC Zen 4 with avx512_bf16, 2 vCPUs; bench/README.md):
OpenVINO ran fp32 faster than ONNX Runtime and has a bf16 mode that ONNX
Runtime's CPU provider lacks; it converts straight from the torch module
(no ONNX exporter); the optimum exporters of both pin other torch and
transformers versions than fleet's.

Nothing here knows lanes, batches, memory budgets or leases (the worker's rooms).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fleet.derived import derived
from fleet.errors import ModelLoadFailed

log = logging.getLogger("fleet.worker")

#: The IR's file names inside its derived folder.
GRAPH_XML, GRAPH_BIN = "model.xml", "model.bin"
#: OpenVINO's inference precision per fleet dtype name.
PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}
INSTALL = "pip install openvino (the fleet-serve[openvino] extra)"


def available() -> bool:
    """Whether the openvino package is importable (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def dtypes(device: str) -> list[str]:
    """The fleet dtypes OpenVINO runs natively on `device`: f32 on any CPU, bf16
    where the CPU plugin says it has it (AVX-512 BF16, AMX); nothing off the CPU."""
    if not device.startswith("cpu") or not available():
        return []
    import openvino as ov

    caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return ["float32", *(["bfloat16"] if "BF16" in caps else [])]


def traced_module(forward: Callable[[dict[str, Any]], Any], keys: Sequence[str], fixed: dict[str, Any],
                  owner: Any) -> Any:
    """The torch module `convert_model` traces: positional token tensors in the
    order of `keys`, rebuilt into the features dict `forward` takes."""
    import torch

    class Traced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.owner = owner  # registered, so its parameters are the module's

        def forward(self, *tensors: Any) -> Any:
            return forward({**fixed, **dict(zip(keys, tensors))})

    return Traced().eval()


def graph_versions(what: str) -> dict[str, str]:
    """What a converted graph depends on besides the model's files."""
    import openvino as ov
    import torch
    import transformers

    return {"graph": what, "openvino": str(ov.__version__), "torch": str(torch.__version__),
            "transformers": str(transformers.__version__)}


def convert(folder: Path, forward: Callable[[dict[str, Any]], Any], example: dict[str, Any], owner: Any) -> None:
    """Convert `forward` (a features dict of int64 (rows, tokens) tensors -> one
    float tensor, `owner`'s parameters inside) into OpenVINO IR in `folder`:
    the token tensors' two dimensions dynamic, weights kept in fp32."""
    import openvino as ov
    import torch

    keys = [k for k, v in example.items() if hasattr(v, "shape")]
    fixed = {k: v for k, v in example.items() if not hasattr(v, "shape")}
    module = traced_module(forward, keys, fixed, owner)
    with torch.no_grad():
        graph = ov.convert_model(module, example_input=tuple(example[k] for k in keys),
                                 input=[ov.PartialShape([-1, -1])] * len(keys))
    for port, key in zip(graph.inputs, keys):
        port.get_tensor().set_names({key})
    # compress_to_fp16=False: the saved weights stay fp32 (the default halves them).
    ov.save_model(graph, str(folder / GRAPH_XML), compress_to_fp16=False)


class OpenVinoForward:
    """A compiled graph called like the torch forward it came from: features
    (int64 (rows, tokens) tensors, as the tokenizer gives them) -> a float32
    torch tensor. The tensor views the graph's output buffer: valid until the
    next call (adapters read or copy it before they run the next micro-batch)."""

    engine = "openvino"

    def __init__(self, folder: Path, dtype: str, threads: int) -> None:
        import openvino as ov

        self.folder = folder
        self.dtype = dtype
        core = ov.Core()
        graph = core.read_model(str(folder / GRAPH_XML))
        self.keys = [port.get_any_name() for port in graph.inputs]
        self._compiled = core.compile_model(graph, "CPU", {
            "INFERENCE_PRECISION_HINT": PRECISIONS[dtype],
            # One batch at a time: the worker batches; one stream keeps every thread on it.
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads,
            # No pinning of OpenVINO's threads to cores: they share the box with the
            # API process and the clients, and a pinned thread cannot move off a busy core.
            "ENABLE_CPU_PINNING": False,
        })
        self._request = self._compiled.create_infer_request()

    def __call__(self, features: dict[str, Any]) -> Any:
        import torch

        inputs = {k: features[k].numpy() for k in self.keys}
        # share_inputs: the arrays are read in place (no copy); share_outputs: the
        # result views the request's buffer (see the class note).
        out = self._request.infer(inputs, share_inputs=True, share_outputs=True)[0]
        return torch.from_numpy(out if out.dtype == np.float32 else out.astype(np.float32))

    def weight_bytes(self) -> int:
        """Bytes its weights hold: the fp32 file, halved when it computes in bf16
        (the CPU plugin repacks them; in f32 it maps the file)."""
        size = (self.folder / GRAPH_BIN).stat().st_size
        return size // 2 if self.dtype == "bfloat16" else size


def load_graph(model_dir: Path, name: str, what: str, forward: Callable[[dict[str, Any]], Any],
               example: dict[str, Any], owner: Any) -> Path:
    """The folder of `name`'s converted graph `what` (a derived file of the model:
    converted now unless the store holds a checked one)."""
    if not available():
        raise ModelLoadFailed(f"{name}: the openvino runtime is not installed ({INSTALL})")
    try:
        return derived(model_dir, f"openvino-{what}", graph_versions(what),
                       lambda folder: convert(folder, forward, example, owner))
    except ModelLoadFailed:
        raise
    except Exception as exc:  # the converter raises many types for what it cannot trace
        raise ModelLoadFailed(f"cannot convert {name!r} for openvino: {type(exc).__name__}: {exc}") from exc


# ---- stand-ins: a compiled graph called as the adapter calls its torch model -------

class TokenModule:
    """sentence-transformers' first module (`Transformer`): features -> the same
    features with `token_embeddings`; the modules after it (pooling, dense, ...)
    run in torch on them."""

    def __init__(self, forward: OpenVinoForward) -> None:
        self.forward = forward

    def __call__(self, features: dict[str, Any]) -> dict[str, Any]:
        features["token_embeddings"] = self.forward(features)
        return features


class LogitsModel:
    """A transformers `*ForSequenceClassification`: `model(**features).logits`."""

    def __init__(self, forward: OpenVinoForward) -> None:
        self.forward = forward

    def __call__(self, **features: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.forward(features))


class ScoresModel:
    """A sentence-transformers `CrossEncoder`: `model(features)["scores"]`; its
    tokenization (`preprocess`) is the torch model's."""

    def __init__(self, forward: OpenVinoForward, base: Any) -> None:
        self.forward = forward
        self.preprocess = base.preprocess

    def __call__(self, features: dict[str, Any]) -> dict[str, Any]:
        return {"scores": self.forward(features)}


def weight_bytes(serving: Any) -> int:
    """Bytes a stand-in's graph holds (0 for anything else: a torch model is counted as one)."""
    forward = getattr(serving, "forward", None)
    if isinstance(serving, list):
        forward = getattr(serving[0], "forward", None) if serving else None
    return forward.weight_bytes() if isinstance(forward, OpenVinoForward) else 0


class Graph:
    """One model's converted graph, made (or found in the store) on first use and
    compiled per dtype: the candidates of one load share it."""

    def __init__(self, model_dir: Path, name: str, what: str, forward: Callable[[dict[str, Any]], Any],
                 example: dict[str, Any], owner: Any) -> None:
        self._args = (model_dir, name, what, forward, example, owner)
        self._folder: Path | None = None

    def compiled(self, dtype: str, threads: int) -> OpenVinoForward:
        if self._folder is None:
            self._folder = load_graph(*self._args)
        try:
            return OpenVinoForward(self._folder, dtype, threads)
        except MemoryError:
            raise
        except Exception as exc:  # the CPU plugin raises RuntimeError for what it cannot compile
            raise ModelLoadFailed(f"cannot compile {self._args[1]!r} for openvino {dtype}: {exc}") from exc
