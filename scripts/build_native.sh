#!/usr/bin/env bash
# Builds mtpserve's CPU product kernel (engine/model/native: an mlx custom primitive in C++)
# against the installed mlx wheel's headers and CMake files, into engine/model/native/.
# Never fails the install: without a compiler, or when the build fails, it prints one line and
# mtpserve runs mlx's own products (the server log says which products run).
# MTPSERVE_AVX512_VARIANT="MACRO;..." builds the `avx512` slot as the VNNI kernel with those
# macros defined, for A/B measurements in one process (CMakeLists.txt); unset, the usual build.
set -uo pipefail
PY=${1:-.venv/bin/python}
BIN=$(dirname "$PY")
SRC=engine/model/native
BUILD=build/native
LOG=build/native.log
mkdir -p build

fallback() {
  echo "warning: the native product kernel is not built ($1); mtpserve runs mlx's own products, slower on CPUs" >&2
  exit 0
}

if [ "$("$PY" -c 'import mlx.core as mx; print(mx.default_device().type == mx.DeviceType.cpu)' 2>/dev/null)" != "True" ]; then
  echo "native product kernel: not needed (mlx runs on a GPU here)"
  exit 0
fi
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || fallback "no C++ compiler found"
"$PY" -m pip install --quiet "cmake>=3.27" "nanobind==3.1.0" >"$LOG" 2>&1 || fallback "cmake or nanobind could not be installed: $LOG"
{ "$BIN/cmake" -S "$SRC" -B "$BUILD" -DPython_EXECUTABLE="$(cd "$BIN" && pwd)/$(basename "$PY")" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$(pwd)/$SRC" \
    -DMTPSERVE_AVX512_VARIANT="${MTPSERVE_AVX512_VARIANT:-}" &&
  "$BIN/cmake" --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)"; } >>"$LOG" 2>&1 ||
  fallback "the build failed: $LOG"
"$PY" -c 'from engine.model import products; print(products.description())' 2>>"$LOG" ||
  fallback "the built kernel does not load: $LOG"
if [ -n "${MTPSERVE_AVX512_VARIANT:-}" ]; then
  echo "native product kernel: the avx512 slot is a VNNI variant ($MTPSERVE_AVX512_VARIANT); rebuild without MTPSERVE_AVX512_VARIANT to serve"
fi
