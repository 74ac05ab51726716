#!/usr/bin/env bash
# Linux: make sure a fast BLAS is present. The mlx-cpu wheel links netlib's reference BLAS;
# mtpserve preloads BLIS (or, failing that, OpenBLAS) in-process (engine/blas.py): fp32 matmuls
# ~20x faster, and BLIS beats OpenBLAS on the small products of decoding (docs/BENCHMARKS.md §1).
# Never fails the install: without either library mtpserve still runs, on the slow BLAS.
# macOS uses Accelerate through Metal builds: nothing to do.
set -uo pipefail
[ "$(uname -s)" = "Linux" ] || exit 0

# The patterns are globbed each time `found` runs, so a library apt has just installed is seen.
BLIS='/usr/lib/*-linux-gnu/blis-pthread/libblis.so.4'
OPENBLAS='/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/*-linux-gnu/libopenblas.so.0 /usr/lib64/libopenblas.so.0'
found() {
  local lib
  # shellcheck disable=SC2086  # word splitting and globbing of the patterns are the point
  for lib in $1; do [ -e "$lib" ] && { echo "$lib"; return 0; }; done
  return 1
}

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -qq "$1" >/dev/null 2>&1 ||
    { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq "$1" >/dev/null 2>&1; }
}

if lib=$(found "$BLIS"); then echo "BLIS found: $lib"; exit 0; fi
echo "Installing Debian's libblis4-pthread (fast BLAS for mlx on the CPU)"
if apt_install libblis4-pthread && lib=$(found "$BLIS"); then echo "BLIS installed: $lib"; exit 0; fi
if lib=$(found "$OPENBLAS"); then echo "BLIS unavailable; using OpenBLAS: $lib"; exit 0; fi
if apt_install libopenblas0-pthread && lib=$(found "$OPENBLAS"); then echo "OpenBLAS installed: $lib"; exit 0; fi
if command -v dnf >/dev/null 2>&1 && sudo dnf install -y openblas >/dev/null 2>&1; then exit 0; fi
echo "warning: no BLIS or OpenBLAS could be installed; mlx keeps its slow reference BLAS" >&2
exit 0
