#!/usr/bin/env bash
# llama.cpp for the `llama.cpp` runtime (the fleet-serve[llamacpp] extra, runtimes/adapters/llamacpp.py),
# beside the venv in .venv/llamacpp, not in it (as OpenVINO in .venv/openvino): its tests
# run with PYTHONPATH=.venv/llamacpp (tests/test_llamacpp.py, bench/generate_engines.py)
# while the rest of the suite runs as an install without the extra.
#
# PyPI has no Linux binary wheel of llama-cpp-python: pip builds llama.cpp from source
# (25-30 min on this project's 2-core box under load), for this CPU (-march=native, the
# library's default: AVX-512 where there is some; a portable build without it decodes
# about 10x slower). So the built wheel is kept in FLEET_BUILD_CACHE (default
# ~/.cache/fleet), keyed by the version and this CPU's flags, and built again only when
# either changes; the multimodal library, examples, tools and tests are not built.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
CACHE=${FLEET_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fleet}
KEY="$VERSION-$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12)"
WHEELS="$CACHE/llama-cpp-python-$KEY"
if [ "$(cat .venv/llamacpp/.key 2>/dev/null)" = "$KEY" ]; then
  exit 0
fi
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  # The build is 22-28 minutes on two cores: more than a CI run can carry beside the suite
  # (60 minutes). Without a kept wheel it runs only when asked; the llama.cpp tests then
  # skip, saying so (tests/test_llamacpp.py).
  if [ "${FLEET_BUILD_LLAMACPP:-0}" != 1 ]; then
    echo "llama.cpp: no built wheel in $WHEELS; FLEET_BUILD_LLAMACPP=1 ./scripts/setup_llamacpp.sh" \
         "builds it (22-28 min on 2 cores); its tests skip until then" >&2
    exit 0
  fi
  mkdir -p "$WHEELS"
  echo "building llama-cpp-python $VERSION from source for this CPU (once; 25-30 min on 2 cores)" >&2
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    .venv/bin/python -m pip wheel -q --no-deps -w "$WHEELS" "llama-cpp-python==$VERSION"
fi
rm -rf .venv/llamacpp
# Its other requirements (numpy, jinja2, typing-extensions) are the venv's.
.venv/bin/python -m pip install -q --no-deps --target .venv/llamacpp "$WHEELS"/llama_cpp_python-*.whl 'diskcache>=5.6'
echo "$KEY" > .venv/llamacpp/.key
