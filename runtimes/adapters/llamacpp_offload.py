"""Where the llama.cpp runtime puts a model: all of it on the worker's GPU, or none of it.

A worker owns one device. On `cuda:K` every layer goes to that one GPU (llama.cpp's
split mode NONE, `main_gpu` = K's place among the GPUs llama.cpp sees); on the CPU none
does, even with a build that could offload (llama.cpp's own default is every layer on
every GPU it sees, which would put a CPU worker's model on a GPU its budget never
counted). A `cuda:K` worker with a build that cannot offload refuses the load: serving
on the CPU while `/v1/ps` says the GPU would be a different meaning under the same
answer (understood or refused).

`offload_params` is the decision, pure; `llama_gpus` reads what the installed build sees.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.errors import ModelLoadFailed

#: A layer count above any model's: llama.cpp then offloads every layer and the output.
ALL_LAYERS = 999
#: llama_split_mode: the whole model on `main_gpu`.
SPLIT_NONE = 0
#: ggml_backend_dev_type: a GPU with memory of its own.
DEVICE_GPU = 1
#: How the extra is rebuilt with CUDA (pip compiles llama.cpp from source, `nvcc` on the PATH;
#: without --no-cache-dir pip reuses the CPU build it cached).
CUDA_BUILD = "CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python"


@dataclass(frozen=True)
class Offload:
    """The llama_model_params a worker loads with (`gpu` names the GPU, None on the CPU)."""

    gpu_layers: int
    main_gpu: int
    split_mode: int = SPLIT_NONE
    gpu: str | None = None

    def apply(self, params: Any) -> None:
        params.n_gpu_layers, params.main_gpu, params.split_mode = self.gpu_layers, self.main_gpu, self.split_mode


#: Nothing on a GPU: with split mode NONE a negative `main_gpu` drops every GPU from the
#: model's devices (a build without GPUs has none to drop: the same load as the defaults).
CPU_ONLY = Offload(gpu_layers=0, main_gpu=-1)


def cuda_index(device: str) -> int | None:
    """K of `cuda:K` (`cuda` alone is 0); None for any other device."""
    kind, _, index = device.partition(":")
    return (int(index) if index else 0) if kind == "cuda" else None


def offload_params(device: str, supports_offload: bool, gpus: Sequence[str]) -> Offload:
    """The offload of a worker on `device` with a build that can offload or not, seeing
    `gpus` (llama.cpp's GPU names in its order, `llama_gpus`). CUDA numbers the GPUs of
    CUDA_VISIBLE_DEVICES in that order for torch and for llama.cpp alike, so the worker's
    `cuda:K` is llama.cpp's `CUDA{K}`. Raises ModelLoadFailed where it cannot be honoured."""
    k = cuda_index(device)
    if k is None:
        return CPU_ONLY
    if not supports_offload:
        raise ModelLoadFailed(
            f"this worker runs on {device}, but the installed llama.cpp cannot offload to a GPU: it was "
            f"built without GPU support (build it with CUDA: {CUDA_BUILD}), or its CUDA found no GPU "
            f"(the worker's log says which); or serve this model with --device cpu")
    name = f"CUDA{k}"
    if name not in gpus:
        raise ModelLoadFailed(f"this worker runs on {device}, but llama.cpp sees no {name} "
                              f"(its GPUs: {', '.join(gpus) or 'none'})")
    return Offload(gpu_layers=ALL_LAYERS, main_gpu=list(gpus).index(name), gpu=name)


def llama_gpus() -> list[str]:
    """The names of the GPUs (own memory) ggml's backends registered, in registry order,
    which is the order llama.cpp numbers `main_gpu` in (llama_cpp's bindings leave these
    functions out: bound here from its libggml)."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.ggml_backend_dev_name.argtypes, lib.ggml_backend_dev_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    devices = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [lib.ggml_backend_dev_name(d).decode() for d in devices if lib.ggml_backend_dev_type(d) == DEVICE_GPU]


def device_free_bytes(torch: Any, device: str) -> int | None:
    """Free bytes on a `cuda:K` device (CUDA's count: it sees llama.cpp's allocations,
    which torch's allocator does not); None on the CPU."""
    k = cuda_index(device)
    return None if k is None else int(torch.cuda.mem_get_info(k)[0])
