#!/usr/bin/env bash
# Linux: make sure a fast BLAS is present. The mlx-cpu wheel links netlib's reference BLAS;
# mtpserve preloads BLIS (or, failing that, OpenBLAS) in-process (engine/blas.py): fp32 matmuls
# ~20x faster, and BLIS beats OpenBLAS on the small products of decoding (docs/BENCHMARKS.md §1).
# macOS uses Accelerate through Metal builds: nothing to do.
set -euo pipefail
[ "$(uname -s)" = "Linux" ] || exit 0
for lib in /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4; do
  if [ -e "$lib" ]; then echo "BLIS found: $lib"; exit 0; fi
done
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "Installing Debian's libblis4-pthread (fast BLAS for mlx on the CPU)"
  $SUDO apt-get install -y -qq libblis4-pthread >/dev/null || {
    $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq libblis4-pthread >/dev/null; }
elif command -v dnf >/dev/null 2>&1; then
  sudo dnf install -y openblas
else
  echo "warning: install BLIS or OpenBLAS with your package manager; without one mlx uses the slow reference BLAS" >&2
fi
