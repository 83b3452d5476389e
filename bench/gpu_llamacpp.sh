#!/usr/bin/env bash
# The llama.cpp runtime on a lent GPU (issue 34): build llama-cpp-python with CUDA there,
# then `python -m fleet.bench gpu-llamacpp` (bench/gpu_llamacpp.py) with --device cuda:0
# and --device cpu: offload shown by /v1/ps, greedy text equal to llama.cpp's own `Llama`,
# output tokens/s at 1 and 16 streams. One call, from the repository root; bench/README.md
# ("llama.cpp on a GPU (prepared)") has the call.
#
#   bash bench/gpu_llamacpp.sh slim SDIST     here: SDIST (73 MiB, over a call's 64 MiB) less
#                                             what a CUDA build does not read, as
#                                             .llamacpp/llama_cpp_python-*.tar.gz (3.6 MB), with
#                                             the gguf and diskcache wheels beside it
#   bash bench/gpu_llamacpp.sh build          build the wheel only (into $LLAMACPP/wheel)
#   bash bench/gpu_llamacpp.sh bundle WHEEL   the installed package of a built wheel, each
#                                             library once, as .llamacpp-built/ (40 MB): a run
#                                             with LLAMACPP=.llamacpp-built skips the build
#   bash bench/gpu_llamacpp.sh                build (or unpack the bundle), install, check,
#                                             bench (the device call)
#
# Environment: OUT (results; required for a run), PY (python3), LLAMACPP (.llamacpp: the
# sdist and wheels), WHL (.whl: the server's wheels gpu-prepare carries, installed when the
# image lacks them), LLAMACPP_WHEEL (a built wheel: no build), DEVICES ("cuda:0 cpu"; "cpu"
# rehearses the rest of a run on a box without a GPU), SHAPE (smollm2), MAX_TOKENS
# (128), THREADS (8: the CPU side's worker threads), BENCH_S (180 per device), JOBS (nproc),
# NICE (0), EXTRA_CMAKE (more -D options), NVIDIA_PY (the Python whose nvidia wheels hold
# cuBLAS; $PY).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-python3} LLAMACPP=${LLAMACPP:-.llamacpp} WHL=${WHL:-.whl} SHAPE=${SHAPE:-smollm2}
DEVICES=${DEVICES:-cuda:0 cpu} MAX_TOKENS=${MAX_TOKENS:-128} THREADS=${THREADS:-8} BENCH_S=${BENCH_S:-180} JOBS=${JOBS:-$(nproc)} NICE=${NICE:-0}
ROOT=$(pwd)
VERSION=0.3.36
LIBS="" CUDA_EXTRA=""

slim() {
  # Keeps the Python package, the build files, llama.cpp's src/common/include/vendor and
  # ggml with its CPU and CUDA backends; drops docs, tests, tools, example models (the
  # vocabularies of models/ are 76 MB), the other backends and the sdist's .git (39 MB).
  local sdist=$1 tmp top v b
  tmp=$(mktemp -d)
  tar xzf "$sdist" -C "$tmp" || return 1
  top=$(ls "$tmp")
  v="$tmp/$top/vendor/llama.cpp"
  rm -rf "$tmp/$top"/{.git,.github,docs,examples,tests,docker,scripts} "$v"/{.git,.github,.devops} \
    "$v"/{models,docs,media,tools,examples,pocs,tests,benches,gguf-py,conversion,grammars,requirements,skills,ci,scripts,app}
  for b in "$v"/ggml/src/ggml-*/; do
    case $(basename "$b") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$b" ;; esac
  done
  mkdir -p "$LLAMACPP"
  tar czf "$LLAMACPP/$top.tar.gz" -C "$tmp" "$top" && rm -rf "$tmp"
  # What the run installs beside it and the image lacks: gguf (fleet's GGUF converter) and
  # diskcache (imported by llama_cpp).
  "$PY" -m pip download -q --no-deps --only-binary :all: -d "$LLAMACPP" gguf==0.19.0 diskcache==5.6.3 || return 1
  grep -qx '/.llamacpp/' .git/info/exclude 2>/dev/null || echo '/.llamacpp/' >> .git/info/exclude
  ls -l "$LLAMACPP"
}

cuda_flags() {
  # cuBLAS: the toolkit's own, else the nvidia wheels torch brings (nvidia/cu13: headers
  # and libraries) named to CMake; libcuda (CUDA VMM) where the driver's is found, else
  # the build goes without VMM. Sets CUDA_EXTRA (the -D options) and LIBS (the library folders).
  local nvcc root="/nonexistent" inc lib site drv
  CUDA_EXTRA=""
  nvcc=$(command -v nvcc) && root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  if [ -e "$root/include/cublas_v2.h" ]; then
    LIBS="$root/lib64:$root/lib"
  else
    for site in $("${NVIDIA_PY:-$PY}" -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
      inc=$(find "$site" -maxdepth 3 -name cublas_v2.h -printf '%h\n' 2>/dev/null | head -1)
      [ -n "$inc" ] && break
    done
    [ -n "${inc:-}" ] || { echo "no cublas_v2.h in $root/include nor in the nvidia wheels" >&2; return 1; }
    lib=$(dirname "$inc")/lib
    CUDA_EXTRA="-DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so* | head -1)"
    CUDA_EXTRA+=" -DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so* | head -1)"
    CUDA_EXTRA+=" -DCMAKE_CUDA_FLAGS=-I$inc -DCMAKE_CXX_FLAGS=-I$inc"
    LIBS="$lib:$root/lib64:$root/lib"
  fi
  drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
  if [ -n "$drv" ]; then CUDA_EXTRA+=" -DCUDA_cuda_driver_LIBRARY=$drv"; else CUDA_EXTRA+=" -DGGML_CUDA_NO_VMM=ON"; fi
}

build() {
  local sdist start
  sdist=$(ls "$LLAMACPP"/llama_cpp_python-$VERSION.tar.gz 2>/dev/null) \
    || { echo "no $LLAMACPP/llama_cpp_python-$VERSION.tar.gz: run '$0 slim SDIST' here first"; return 2; }
  command -v nvcc > /dev/null || { echo "no nvcc on the PATH"; return 2; }
  cuda_flags || return 2
  export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF $CUDA_EXTRA ${EXTRA_CMAKE:-}"
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  echo "CMAKE_ARGS=$CMAKE_ARGS"
  mkdir -p "$LLAMACPP/wheel"
  start=$(date +%s)
  nice -n "$NICE" "$PY" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$LLAMACPP/wheel" "$sdist" \
    > /tmp/llamacpp-build.log 2>&1
  local rc=$?
  echo "build: rc=$rc in $(( $(date +%s) - start )) s on $JOBS jobs (log: /tmp/llamacpp-build.log)"
  [ -n "${OUT:-}" ] && tail -n 200 /tmp/llamacpp-build.log > "$OUT/llamacpp-build-tail.log"
  [ $rc = 0 ] || { tail -n 40 /tmp/llamacpp-build.log; return 3; }
  ls -l "$LLAMACPP"/wheel/llama_cpp_python-*.whl
}

bundle() {
  # The wheel holds each library six times (lib/ and llama_cpp/lib/, each name a copy):
  # llama_cpp/ with one file per library and its names as links, xz (the CUDA library is
  # 57 MB, 38 of them device code), beside the run's two wheels.
  local wheel=$1 tmp real base
  tmp=$(mktemp -d)
  "$PY" -m pip install -q --no-deps --no-index --target "$tmp" "$wheel" || return 1
  (cd "$tmp/llama_cpp/lib" && for real in *.so.*.*.*; do
     base=${real%%.so.*}; rm -f "$base.so" "$base.so.0"; ln -s "$real" "$base.so.0"; ln -s "$base.so.0" "$base.so"
   done)
  find "$tmp/llama_cpp" -name __pycache__ -prune -exec rm -rf {} +
  mkdir -p .llamacpp-built
  tar cJf .llamacpp-built/llama_cpp-$VERSION.tar.xz -C "$tmp" llama_cpp && rm -rf "$tmp"
  cp "$LLAMACPP"/*.whl .llamacpp-built/ 2>/dev/null
  grep -qx '/.llamacpp-built/' .git/info/exclude 2>/dev/null || echo '/.llamacpp-built/' >> .git/info/exclude
  ls -l .llamacpp-built
}

case ${1:-run} in
  slim) slim "${2:?usage: $0 slim SDIST}"; exit $? ;;
  bundle) bundle "${2:?usage: $0 bundle WHEEL}"; exit $? ;;
  build) build; exit $? ;;
  run) ;;
  *) echo "usage: $0 [slim SDIST | build | bundle WHEEL | run]" >&2; exit 2 ;;
esac

OUT=${OUT:?OUT must name the results folder}
mkdir -p "$OUT"
{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  nvcc --version 2>/dev/null | tail -1
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  # 1. llama.cpp: a carried bundle or wheel, or built here (timed); installed apart from
  #    the image's packages.
  TARGET=$(mktemp -d /tmp/fleet-llamacpp.XXXXXX)
  SITE=$(mktemp -d /tmp/fleet-site.XXXXXX)
  bundled=$(ls "$LLAMACPP"/llama_cpp-$VERSION.tar.xz 2>/dev/null)
  wheel=${LLAMACPP_WHEEL:-}
  if [ -n "$bundled" ]; then
    cuda_flags || true  # LIBS: where its libraries find cuBLAS
    tar xJf "$bundled" -C "$TARGET" || { echo "the bundle did not unpack"; exit 4; }
  else
    if [ -z "$wheel" ]; then
      build || exit $?
      wheel=$(ls "$LLAMACPP"/wheel/llama_cpp_python-*.whl | head -1)
    else
      cuda_flags || true
    fi
    "$PY" -m pip install -q --no-index --no-deps --target "$TARGET" "$wheel" || { echo "the wheel did not install"; exit 4; }
  fi
  # 2. The server's wheels the image lacks, and gguf and diskcache.
  extra=$(ls "$LLAMACPP"/*.whl 2>/dev/null)
  "$PY" -c 'import msgspec, litestar' 2>/dev/null || extra="$extra $(ls "$WHL"/*.whl 2>/dev/null)"
  if [ -n "${extra// /}" ]; then
    # shellcheck disable=SC2086 # a list of paths without spaces
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" $extra || { echo "the wheels did not install"; exit 4; }
  fi
  export PYTHONPATH="$TARGET:$SITE:$ROOT" LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$TARGET"/llama_cpp/lib/libggml-cuda.so | grep -E "cublas|cudart|libcuda|not found"
  # 3. The build offloads and llama.cpp sees the GPU the worker will name.
  "$PY" -c '
import llama_cpp.llama_cpp as L
from fleet.runtimes.adapters.llamacpp_offload import llama_gpus
L.llama_backend_init()
ok = bool(L.llama_supports_gpu_offload())
print("llama.cpp offload:", ok, "GPUs:", llama_gpus())
raise SystemExit(0 if ok else 5)' || [ "${DEVICES#*cuda}" = "$DEVICES" ] || { echo "gpu_llamacpp: this build cannot offload"; exit 5; }
  # 4. The bench, GPU then CPU, each bounded.
  rc=0
  for device in $DEVICES; do
    timeout -k 15 "$BENCH_S" "$PY" -m fleet.bench gpu-llamacpp --device "$device" --shape "$SHAPE" \
      --max-tokens "$MAX_TOKENS" --streams 1,16 --threads "$THREADS" --out "$OUT/gpu-llamacpp-${device//:/}.json"
    r=$?
    echo "gpu-llamacpp $device rc=$r"
    [ $r = 0 ] || rc=$r
  done
  date -u
  exit $rc
} 2>&1 | tee "$OUT/gpu-llamacpp.log"
exit "${PIPESTATUS[0]}"
