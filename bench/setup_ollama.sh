#!/usr/bin/env bash
# Install Ollama's server for the `ollama` peer that `fleetctl bench --compare`
# starts on loopback (bench/peers.py).
#
# Ollama ships its Linux server as a release archive (a Go binary with its
# llama.cpp libraries); no PyPI, npm or Debian package carries it (the `ollama`
# packages on PyPI and npm are clients). This downloads that archive for this CPU
# (amd64 or arm64), unpacks it into bench/.ollama (bin/ollama and lib/ollama) and
# checks that it runs. It needs curl, tar and zstd, and installs nothing outside
# bench/.ollama: no service, no user. The bench runs it with a store of its own in a
# temporary folder and imports the model from fleet's folder (`ollama create`). With
# an `ollama` already on PATH the bench uses that one and this script is not needed.
#
# Usage: bench/setup_ollama.sh   (OLLAMA_VERSION pins a release, e.g. 0.13.0; default: the latest)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.ollama"
case "$(uname -m)" in
  x86_64) arch=amd64 ;;
  aarch64|arm64) arch=arm64 ;;
  *) echo "setup_ollama: no Ollama release for $(uname -m)" >&2; exit 1 ;;
esac
for tool in curl tar zstd; do
  if ! command -v "$tool" >/dev/null; then
    echo "setup_ollama: $tool is not installed (apt-get install $tool), then run this again" >&2
    exit 1
  fi
done
url="https://ollama.com/download/ollama-linux-$arch.tar.zst${OLLAMA_VERSION:+?version=$OLLAMA_VERSION}"
archive="$(mktemp)"
trap 'rm -f "$archive"' EXIT
echo "setup_ollama: downloading Ollama's Linux release ($arch) into $root" >&2
if ! curl -fsSL -o "$archive" "$url"; then
  echo "setup_ollama: the download failed: it needs to reach Ollama's release archive" >&2
  exit 1
fi
mkdir -p "$root"
zstd -dc "$archive" | tar x -C "$root"
"$root/bin/ollama" --version
echo "Ollama ready: $root/bin/ollama"
