#!/usr/bin/env bash
# llama.cpp's own server for the generation bench (bench/generate_engines.py): the
# `server` extra of the llama-cpp-python build in .venv/llamacpp (scripts/setup_llamacpp.sh),
# i.e. `python -m llama_cpp.server`. Its Python requirements come from PyPI into their own
# folder, .venv/llamacpp-server, beside the build and not in the venv: they pin a FastAPI
# stack that the daemon's own Litestar install must not share. The bench runs the server
# with PYTHONPATH=.venv/llamacpp-server:.venv/llamacpp and reports it skipped, with this
# script's name, when the folder is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d .venv/llamacpp/llama_cpp/server ]; then
  echo "llama.cpp server: build llama.cpp first (./scripts/setup_llamacpp.sh)" >&2
  exit 1
fi
# The requirements of llama-cpp-python 0.3.36's `server` extra, as its metadata lists them.
rm -rf .venv/llamacpp-server.tmp
.venv/bin/python -m pip install -q --target .venv/llamacpp-server.tmp \
  'uvicorn>=0.22.0' 'fastapi>=0.100.0' 'pydantic-settings>=2.0.1' 'sse-starlette>=1.6.1' \
  'starlette-context>=0.3.6,<0.4' 'PyYAML>=5.1'
rm -rf .venv/llamacpp-server
mv .venv/llamacpp-server.tmp .venv/llamacpp-server
