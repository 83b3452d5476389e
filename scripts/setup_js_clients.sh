#!/usr/bin/env bash
# Install the JS client libraries the tests drive unchanged (the Vercel AI SDK of
# tests/test_agents.py) into .venv/node, at the versions tests/js/package-lock.json
# pins. Without npm it says so and leaves them out: those tests then skip, saying why.
# About 6 s and 29 MB the first time.
#
# Usage: scripts/setup_js_clients.sh [DIR]   (default: .venv/node)
# Idempotent: a folder installed from the same lockfile is left as it is.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.venv/node}"

if ! command -v npm >/dev/null; then
  echo "npm not found: the JS client tests will skip (install Node.js 18+ and rerun $0)" >&2
  exit 0
fi
if cmp -s "$root/tests/js/package-lock.json" "$dir/package-lock.json" && [[ -d "$dir/node_modules/ai" ]]; then
  echo "JS clients ready: $dir"
  exit 0
fi
mkdir -p "$dir"
cp "$root/tests/js/package.json" "$root/tests/js/package-lock.json" "$dir/"
npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
echo "JS clients ready: $dir"
