#!/usr/bin/env bash
# Build text-embeddings-inference's router (TEI) for the `tei` peer that
# `fleetctl bench --compare` starts on loopback (bench/peers.py).
#
# TEI ships as container images and as Rust source: no PyPI, npm or Debian package
# carries the router. So this builds it from source with cargo, as TEI's own
# "local CPU" install does: cargo fetches the source at the pinned tag (git) and its
# crates (crates.io), compiles the router with Intel MKL on x86-64 (on other CPUs
# with candle's own kernels), or with --gpu for NVIDIA GPUs (candle-cuda; it
# needs the CUDA toolkit), and installs it as bench/.tei/bin/text-embeddings-router.
# It needs cargo (rustup), gcc, pkg-config and OpenSSL's headers (libssl-dev), and
# takes 10-40 minutes. Nothing is installed outside bench/.tei. With a router already
# on PATH the bench uses that one and this script is not needed.
#
# Usage: bench/setup_tei.sh [--gpu]   (TEI_VERSION picks the tag; default below)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.tei"
version="${TEI_VERSION:-v1.9.4}"
repo="https://github.com/huggingface/text-embeddings-inference"

if ! command -v cargo >/dev/null; then
  echo "setup_tei: cargo is not installed: install Rust (rustup), then run this again" >&2
  exit 1
fi
features=(-F http)
if [[ "${1:-}" == "--gpu" ]]; then
  features=(--no-default-features -F http -F candle-cuda)
elif [[ "$(uname -m)" == "x86_64" ]]; then
  features=(-F mkl)
fi
echo "setup_tei: building text-embeddings-router $version (${features[*]}) into $root; this takes a while" >&2
if ! cargo install --locked --git "$repo" --tag "$version" --root "$root" "${features[@]}" text-embeddings-router; then
  echo "setup_tei: the build failed (above): it needs to reach the source (git) and crates.io" >&2
  exit 1
fi
"$root/bin/text-embeddings-router" --version
echo "TEI ready: $root/bin/text-embeddings-router"
