"""What a product of a few rows costs as one matrix-matrix product and row by row.

For weights of several sizes ([out, in] float32, and bfloat16 at two sizes) and 1 to 32 rows,
the best of three chains of products (evaluated together) per way:

* ``x @ weight.T`` — one BLAS matrix-matrix product (what mlx does for any ``x``);
* ``weight[None] @ x[:, :, None]`` — one batched op of one matrix-vector product per row
  (``engine.model.mlx_products._times``), whose rows equal the one-row product bit for bit.

Prints microseconds per product and the ratio row by row / one product (below 1: row by row
is faster), the table behind ``engine.model.mlx_products.ROWWISE_LIMITS`` (docs/CPU_CHOICES.md);
``--blocks``: weights too large for the cache, row by row in row blocks of 4, 8 and 16 MiB
(``ROWWISE_BLOCK_BYTES``)::

    python scripts/experiments/rowwise_products.py
    python scripts/experiments/rowwise_products.py --blocks --rows 1,2,5,9
"""

from __future__ import annotations

import argparse
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.model import mlx_products

mx = mlx_products.mx

SHAPES = [(768, 256), (8192, 256), (3584, 1024), (8192, 1024), (16384, 1024), (65536, 1024)]
HALF_SHAPES = [(768, 256), (3584, 1024)]


def per_product_us(product, x: mx.array, count: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval([product(x) for _ in range(count)])
        best = min(best, (time.perf_counter() - t0) / count)
    return best * 1e6


def row(out_dim: int, in_dim: int, dtype: mx.Dtype, rows: list[int]) -> str:
    weight = mx.random.normal((out_dim, in_dim)).astype(dtype)
    view, stacked = weight.T, weight[None]
    mx.eval(weight, view, stacked)
    count = max(3, int(4e7 / (out_dim * in_dim)))
    cells = []
    for m in rows:
        x = mx.random.normal((m, in_dim)).astype(dtype)
        mx.eval(x)
        whole = per_product_us(lambda x: x @ view, x, count)
        by_row = per_product_us(lambda x: stacked @ x.reshape(*x.shape, 1), x, count)
        cells.append(f"{whole:,.0f} / {by_row:,.0f} ({by_row / whole:.2f})")
    mib = weight.nbytes / 2**20
    name = "fp32" if dtype == mx.float32 else "bf16"
    return f"| {out_dim} x {in_dim} {name} ({mib:.1f} MiB) | " + " | ".join(cells) + " |"


#: weights too large for the cache: one column part of the 0.8B shape's vocabulary, and an MLP
#: projection of a 4B-class model (hidden 2,560)
BLOCKED_SHAPES = [(124160, 1024), (9728, 2560)]


def blocked(rows_list: list[int]) -> None:
    """For each of ``BLOCKED_SHAPES``: one product against row by row in row blocks of 4, 8 and
    16 MiB (milliseconds)."""
    for out_dim, in_dim in BLOCKED_SHAPES:
        blocked_table(out_dim, in_dim, rows_list)


def blocked_table(out_dim: int, in_dim: int, rows_list: list[int]) -> None:
    weight = mx.random.normal((out_dim, in_dim))
    view = weight.T
    mx.eval(weight, view)
    print(f"\n{out_dim} x {in_dim} fp32 ({weight.nbytes / 2**20:.0f} MiB)\n")
    print("| rows | one product | " + " | ".join(f"in {m} MiB blocks" for m in (4, 8, 16)) + " |")
    print("|---" * 5 + "|")
    for m in rows_list:
        x = mx.random.normal((m, in_dim))
        mx.eval(x)
        cells = [per_product_us(lambda x: x @ view, x, 3) / 1e3]
        for mib in (4, 8, 16):
            step = (mib << 20) // (in_dim * 4)
            parts = [weight[i : i + step] for i in range(0, weight.shape[0], step)]
            stacked = [mx.broadcast_to(part[None], (m, *part.shape)) for part in parts]
            mx.eval(*stacked)

            def product(x: mx.array, stacked: list[mx.array] = stacked) -> mx.array:
                columns = x.reshape(*x.shape, 1)
                return mx.concatenate([block @ columns for block in stacked], axis=1)

            cells.append(per_product_us(product, x, 3) / 1e3)
        print(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,3,5,9,16,24,32")
    p.add_argument(
        "--blocks", action="store_true", help="the 0.8B vocabulary part in row blocks instead"
    )
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.blocks:
        blocked([r for r in rows if r <= 9] or rows)
        return 0
    print("| weight | " + " | ".join(f"{m} rows: µs one / row by row (ratio)" for m in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for out_dim, in_dim in SHAPES:
        print(row(out_dim, in_dim, mx.float32, rows), flush=True)
    for out_dim, in_dim in HALF_SHAPES:
        print(row(out_dim, in_dim, mx.bfloat16, rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
