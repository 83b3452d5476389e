"""Where the llama.cpp runtime puts a model (runtimes/adapters/llamacpp_offload.py): the
decision as a table, no llama.cpp needed. A worker on `cuda:K` offloads every layer to
llama.cpp's CUDA{K} alone; a CPU worker offloads nothing even where the build could; a
`cuda:K` worker whose build cannot offload, or that llama.cpp does not see, refuses.
(tests/test_llamacpp.py runs the refusal through a real worker and the real build.)
"""

from __future__ import annotations

import pytest

from fleet.errors import ModelLoadFailed
from fleet.runtimes.adapters.llamacpp_offload import ALL_LAYERS, CPU_ONLY, SPLIT_NONE, Offload, offload_params


@pytest.mark.parametrize("device, supports, gpus, want", [
    # The CPU: nothing on a GPU, with a GPU build too (llama.cpp's default would offload all).
    ("cpu", False, [], CPU_ONLY),
    ("cpu", True, ["CUDA0"], CPU_ONLY),
    # One GPU per worker: all layers on CUDA{K}, split mode NONE.
    ("cuda:0", True, ["CUDA0"], Offload(ALL_LAYERS, 0, SPLIT_NONE, "CUDA0")),
    ("cuda", True, ["CUDA0", "CUDA1"], Offload(ALL_LAYERS, 0, SPLIT_NONE, "CUDA0")),
    ("cuda:1", True, ["CUDA0", "CUDA1"], Offload(ALL_LAYERS, 1, SPLIT_NONE, "CUDA1")),
    # main_gpu is CUDA{K}'s place among the GPUs llama.cpp sees, not K itself.
    ("cuda:1", True, ["Vulkan0", "CUDA0", "CUDA1"], Offload(ALL_LAYERS, 2, SPLIT_NONE, "CUDA1")),
])
def test_the_offload_a_worker_loads_with(device, supports, gpus, want) -> None:
    assert offload_params(device, supports, gpus) == want


def test_cpu_only_keeps_every_layer_off_the_gpus() -> None:
    assert (CPU_ONLY.gpu_layers, CPU_ONLY.main_gpu, CPU_ONLY.split_mode, CPU_ONLY.gpu) == (0, -1, SPLIT_NONE, None)


def test_a_gpu_worker_with_a_build_without_gpu_support_refuses() -> None:
    """Understood or refused: never the CPU while the worker says the GPU."""
    with pytest.raises(ModelLoadFailed) as caught:
        offload_params("cuda:0", False, [])
    text = str(caught.value)
    assert "cuda:0" in text and "built without GPU support" in text and "CMAKE_ARGS=-DGGML_CUDA=on" in text
    assert caught.value.code == "model_load_failed"


def test_a_gpu_llama_cpp_does_not_see_is_refused() -> None:
    with pytest.raises(ModelLoadFailed, match=r"sees no CUDA2 \(its GPUs: CUDA0, CUDA1\)"):
        offload_params("cuda:2", True, ["CUDA0", "CUDA1"])
