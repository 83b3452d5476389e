#!/usr/bin/env bash
# Build the isolated virtual environment of the GLiNER reference that
# tests/test_gliner.py compares fleet's own GLiNER span model against. It lives
# apart from the project's venv because the `gliner` package pins
# transformers<5.17 while fleet runs a newer transformers; torch is pinned to the
# project's version (from the local wheel when the machine has one) so both sides
# run the same kernels. Minimal: gliner and what it requires, no extras.
#
# Usage: scripts/setup_gliner_ref.sh [VENV_DIR]   (default: bench/.venv-gliner)
# Idempotent: a venv whose gliner imports is left as it is.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/bench/.venv-gliner}"
python="${PYTHON:-python3}"

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import importlib.metadata as m; m.version('gliner')" 2>/dev/null; then
  echo "gliner reference ready: $venv/bin/python"
  exit 0
fi
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0" "gliner==0.2.29"
"$venv/bin/python" -c "import gliner"
echo "gliner reference ready: $venv/bin/python"
