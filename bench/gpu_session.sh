#!/usr/bin/env bash
# The lent GPU machine's one call, prepared here by `python -m fleet.bench gpu-prepare`
# (bench/gpu_prepare.py, which prints the exact `run` call: this script, its carry and
# timeout). It runs from the repository root of the copy that travelled:
#
#   1. the carried wheels (.whl: the server's packages the machine's image lacks) into a
#      site folder of their own, the image's packages left as they are;
#   2. an import of everything a daemon and its workers load, so a package that is
#      missing or too old there stops the call in seconds, saying which (exit 5);
#   3. `python -m fleet.bench gpu-check` on the device, all-MiniLM-L6-v2 from the carried
#      folder (fp16, or its shapes alone), nvidia-smi dmon and vmstat beside it, py-spy
#      (carried) for its profile; everything lands in $OUT.
#
# The same script rehearses here with no GPU (`gpu-prepare --rehearse PYTHON`: DEVICE=cpu,
# a venv holding the image's versions), so the first minutes of a lent machine are not
# spent finding that a wheel is missing.
#
# Environment: OUT (required: where the results go), DEVICE (cuda:0), PY (python3),
# WHL (.whl), GPU (.gpu: the fp16 MiniLM and COMMIT), CHECK_S (gpu-check's limit, 400 s).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:?OUT must name the results folder}
DEVICE=${DEVICE:-cuda:0} PY=${PY:-python3} WHL=${WHL:-.whl} GPU=${GPU:-.gpu} CHECK_S=${CHECK_S:-400}
ROOT=$(pwd)
mkdir -p "$OUT"
{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
  SITE=$(mktemp -d /tmp/fleet-site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
    || { echo "gpu_session: the carried wheels did not install"; exit 3; }
  export PYTHONPATH="$SITE:$ROOT" PATH="$SITE/bin:$PATH" FLEET_COMMIT="$(head -1 "$GPU/COMMIT" 2>/dev/null || echo unknown)"
  # What a daemon and its workers import: the API, the CLI, every adapter module.
  "$PY" - <<'PY' || { echo "gpu_session: an import failed (above): carry that package as a wheel"; exit 5; }
import importlib, pkgutil
import fleet.daemon.server, fleetctl.app, fleet.runtimes.worker, fleet.runtimes.adapters as adapters
skip = {"openvino", "llamacpp"}  # optional extras, not carried
for m in pkgutil.iter_modules(adapters.__path__):
    if m.name not in skip:
        importlib.import_module(f"fleet.runtimes.adapters.{m.name}")
import transformers, sentence_transformers, peft, tokenizers, llguidance
print("imports: ok", "transformers", transformers.__version__, "sentence-transformers",
      sentence_transformers.__version__, "peft", peft.__version__)
PY
  pids=()
  if command -v nvidia-smi >/dev/null; then nvidia-smi dmon -s u -d 2 > "$OUT/dmon.log" 2>&1 & pids+=($!); fi
  if command -v vmstat >/dev/null; then vmstat -t 2 > "$OUT/vmstat.log" 2>&1 & pids+=($!); fi
  tag=${DEVICE//:/}
  timeout -k 15 "$CHECK_S" "$PY" -m fleet.bench gpu-check --device "$DEVICE" --minilm-dir "$GPU/minilm" \
    --out "$OUT/gpu-check-$tag.json"
  rc=$?
  echo "gpu_check rc=$rc"
  [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
  date -u
  exit $rc
} 2>&1 | tee "$OUT/gpu-session.log"
