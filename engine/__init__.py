"""The model, its MTP head, caches and the speculative loop.

Importing ``engine`` first preloads a fast BLAS (BLIS or OpenBLAS) on Linux (see
``engine.blas``) so that every mlx import that follows binds to it.
"""

from engine.blas import use_fast_blas

use_fast_blas()
