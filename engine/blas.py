"""Make mlx's CPU matmuls use OpenBLAS instead of the reference BLAS the mlx-cpu wheel links.

The Linux mlx-cpu wheel bundles netlib's reference BLAS (a few GFLOP/s). Loading OpenBLAS with
RTLD_GLOBAL *before* mlx is imported puts its ``cblas_*`` symbols first in the global lookup
scope, so libmlx binds to them instead (measured in docs/BENCHMARKS.md: ~30x on fp32 matmul).
Nothing happens on macOS (Accelerate) or when OpenBLAS is absent; ``MTPSERVE_BLAS`` may name a
library explicitly, or be set to ``none`` to keep the bundled one (for before/after measurements).
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_loaded: str | None = None


def use_fast_blas() -> str | None:
    """Preload OpenBLAS if possible; return the library path in use (None: bundled BLAS)."""
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    choice = os.environ.get("MTPSERVE_BLAS", "")
    if choice.lower() == "none":
        return None
    if "mlx.core" in sys.modules:
        # Too late to interpose: libmlx already resolved its BLAS symbols.
        return None
    for path in (choice,) if choice else CANDIDATES:
        if path and os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded = path
            return path
    return None


def blas_in_use() -> str:
    return _loaded or "bundled reference BLAS"
