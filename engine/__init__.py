"""The model, its MTP head, caches and the speculative loop.

Importing ``engine`` first preloads OpenBLAS on Linux (see ``engine.blas``) so that every mlx
import that follows binds to the fast BLAS.
"""

from engine.blas import use_fast_blas

use_fast_blas()
