#!/usr/bin/env bash
# Add the decision-checkpoint references that tests/test_decide_heads.py compares
# fleet's own heads against, the `laya` package (runtime `laya`) and the
# `bev-decider` package (runtime `bev`), to the isolated reference venv of
# scripts/setup_gliner_ref.sh (built first when missing). They share it because
# everything they require is there already (torch pinned to the project's, a
# transformers both accept, older than fleet's, so the comparison does not rest on
# fleet's own release): two small wheels, where a venv of their own would be another
# 1.2 GB and a minute and a half of CI. Never fleet's venv.
#
# Usage: scripts/setup_decide_ref.sh [VENV_DIR]   (default: bench/.venv-gliner)
# Idempotent: a venv where both packages import is left as it is.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/bench/.venv-gliner}"

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import laya.agent, bev_decider" 2>/dev/null; then
  echo "decision references ready: $venv/bin/python"
  exit 0
fi
[[ -x "$venv/bin/python" ]] || "$root/scripts/setup_gliner_ref.sh" "$venv"
"$venv/bin/python" -m pip install -q "laya==0.4.15" "bev-decider==0.2.1"
"$venv/bin/python" -c "import laya.agent, bev_decider"
echo "decision references ready: $venv/bin/python"
