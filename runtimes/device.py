"""Device facts a worker needs at load time (torch imported by callers only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def fast_dtypes(device: str) -> list[str]:
    """Reduced-precision dtypes worth trying on this device, fastest first.

    On CPU, bf16 only pays off with native bf16 instructions (AVX-512 BF16 or
    AMX); without them torch emulates it and it is slower than fp32.
    """
    if device.startswith("cuda"):
        import torch

        return (["bfloat16"] if torch.cuda.is_bf16_supported() else []) + ["float16"]
    return cpu_fast_dtypes(cpu_flags())


def causal_lm_dtype(adapter: Any) -> str:
    """The dtype a causal LM loads in (generators, LLM rerankers, decision models): its
    profile's, else bf16 (fp16 without it) on CUDA and float32 on the CPU, where fp32
    keeps greedy tokens and scores those of the reference library."""
    wanted = adapter.spec.profile.dtype
    if wanted != "auto":
        return wanted
    if adapter.device.startswith("cuda"):
        return "bfloat16" if adapter._torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def cpu_fast_dtypes(flags: set[str]) -> list[str]:
    """`fast_dtypes` of a CPU with these /proc/cpuinfo flags: bf16 with native bf16."""
    return ["bfloat16"] if {"avx512_bf16", "amx_bf16"} & flags else []


def device_class(device: str) -> str:
    """Key for tuned profiles, e.g. `cpu-avx512bf16`, `cuda-sm90`."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda-sm{major}{minor}"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "cpu-amx"
    if "avx512_bf16" in flags:
        return "cpu-avx512bf16"
    if "avx512f" in flags:
        return "cpu-avx512"
    if "avx2" in flags:
        return "cpu-avx2"
    return "cpu"
