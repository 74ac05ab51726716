"""Give mlx's CPU matmuls a fast BLAS instead of the reference BLAS the mlx-cpu wheel links.

The Linux mlx-cpu wheel bundles netlib's reference BLAS (a few GFLOP/s). Loading another BLAS
with RTLD_GLOBAL *before* mlx is imported puts its ``cblas_*`` symbols first in the global
lookup scope, so libmlx binds to them instead.

Which one: BLIS (Debian ``libblis4-pthread``) first, OpenBLAS as the fallback. Decoding is a
chain of small products — T = 1..K+1 rows against each weight matrix — and there OpenBLAS's
sgemm pays for packing the whole weight matrix and for waking its threads on every call: a
[2, 256] x [256, 768] product costs ~38 us with OpenBLAS (2 threads) and ~25 us with BLIS on one
thread. Big products (prefill) want every core instead. BLIS takes its thread count at run time,
so decoding runs on one thread and ``all_cores()`` widens it around long prefill chunks
(docs/CPU_CHOICES.md).

Nothing happens on macOS (Accelerate). ``MTPSERVE_BLAS`` may name a library explicitly, or be
``none`` to keep the bundled one (for before/after measurements).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/aarch64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_loaded: str | None = None
#: BLIS's run-time thread setter, when the loaded library is BLIS.
_set_threads: ctypes._CFuncPtr | None = None


def use_fast_blas() -> str | None:
    """Preload the fast BLAS if possible; return the library path in use (None: bundled)."""
    global _loaded, _set_threads
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
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded = path
            setter = getattr(lib, "bli_thread_set_num_threads", None)
            if setter is not None:
                setter.argtypes, setter.restype = [ctypes.c_long], None
                _set_threads = setter
                setter(1)  # decoding: one thread (see the module docstring)
            return path
    return None


@contextmanager
def all_cores(enabled: bool = True) -> Iterator[None]:
    """Run the block's matmuls on every core (long prefill chunks of wide models:
    ``engine.model.mlx_products.prefill_on_all_cores``); back to one thread afterwards.

    The block must evaluate what it builds: mlx is lazy, and the setting applies when the
    products run. No effect unless the BLAS is BLIS (or when not ``enabled``).
    """
    if _set_threads is None or not enabled:
        yield
        return
    _set_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        _set_threads(1)


def blas_in_use() -> str:
    return _loaded or "bundled reference BLAS"
