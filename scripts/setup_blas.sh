#!/usr/bin/env bash
# Linux: make sure OpenBLAS is present. The mlx-cpu wheel links netlib's reference BLAS; mtpserve
# preloads OpenBLAS in-process (engine/blas.py), which makes fp32 matmuls ~30x faster
# (docs/BENCHMARKS.md). macOS uses Accelerate through Metal builds: nothing to do.
set -euo pipefail
[ "$(uname -s)" = "Linux" ] || exit 0
for lib in /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/*-linux-gnu/libopenblas.so.0 /usr/lib64/libopenblas.so.0; do
  if [ -e "$lib" ]; then echo "OpenBLAS found: $lib"; exit 0; fi
done
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "Installing Debian's libopenblas0-pthread (fast BLAS for mlx on the CPU)"
  $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null || {
    $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null; }
elif command -v dnf >/dev/null 2>&1; then
  sudo dnf install -y openblas
else
  echo "warning: install OpenBLAS with your package manager; without it mlx uses the slow reference BLAS" >&2
fi
