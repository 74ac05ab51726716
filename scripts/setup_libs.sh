#!/usr/bin/env bash
# Linux: make sure a fast BLAS and jemalloc are present.
# The mlx-cpu wheel links netlib's reference BLAS; mtpserve preloads BLIS (or, failing that,
# OpenBLAS) in-process (engine/blas.py): fp32 matmuls ~20x faster, and BLIS beats OpenBLAS on
# the small products of decoding (docs/CPU_CHOICES.md).
# jemalloc: the `mtpserve` command re-executes itself under it (engine/allocator.py), which cuts
# the per-primitive cost of mlx's host bookkeeping (same heading).
# Never fails the install: without these libraries mtpserve still runs, on the slow BLAS and
# glibc's malloc.
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

JEMALLOC='/usr/lib/*-linux-gnu/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2'
if lib=$(found "$JEMALLOC"); then echo "jemalloc found: $lib"
else
  echo "Installing Debian's libjemalloc2 (the allocator mtpserve runs under)"
  if { apt_install libjemalloc2 || { command -v dnf >/dev/null 2>&1 && sudo dnf install -y jemalloc >/dev/null 2>&1; }; } &&
     lib=$(found "$JEMALLOC"); then echo "jemalloc installed: $lib"
  else echo "warning: jemalloc could not be installed; mtpserve keeps glibc's malloc" >&2; fi
fi

blas() {
  if lib=$(found "$BLIS"); then echo "BLIS found: $lib"; return 0; fi
  echo "Installing Debian's libblis4-pthread (fast BLAS for mlx on the CPU)"
  if apt_install libblis4-pthread && lib=$(found "$BLIS"); then echo "BLIS installed: $lib"; return 0; fi
  if lib=$(found "$OPENBLAS"); then echo "BLIS unavailable; using OpenBLAS: $lib"; return 0; fi
  if apt_install libopenblas0-pthread && lib=$(found "$OPENBLAS"); then echo "OpenBLAS installed: $lib"; return 0; fi
  if command -v dnf >/dev/null 2>&1 && sudo dnf install -y openblas >/dev/null 2>&1; then return 0; fi
  echo "warning: no BLIS or OpenBLAS could be installed; mlx keeps its slow reference BLAS" >&2
  return 0
}
blas
exit 0
