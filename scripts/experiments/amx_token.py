"""Every projection of a Qwen3.5-0.8B-shaped decoding step (scripts/bench_kernel.py's "token")
on two instruction sets of the native kernel, taking turns in one process, best of each:

    python scripts/experiments/amx_token.py --dtypes q8,q4 --rows 1,5,24 --rounds 3

(the AMX kernel against the AVX-512 VNNI one; `--isas` picks others).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kernel as bk  # noqa: E402

from engine.model import products  # noqa: E402


def best_ms(
    dtype: str, rows: list[int], isas: list[str], rounds: int
) -> dict[tuple[str, int], float]:
    """Lowest ms per token of each (instruction set, row count), taking turns round by round."""
    native = products.native()
    weights = bk.make_weights(dtype)
    xs = {t: bk.inputs(t, dtype) for t in rows}
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for isa in isas:
            native.set_isa(isa)
            for t in rows:
                ms = bk.seconds(lambda x=xs[t]: bk.native_token(weights, x, dtype), 2) * 1e3
                best[isa, t] = min(best.get((isa, t), float("inf")), ms)
    native.set_isa("")
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtypes", default="q8,q4")
    p.add_argument("--rows", default="1,5,24")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--isas", default="avx512-amx,avx512-vnni")
    args = p.parse_args()
    if products.native() is None:
        print(products.description())
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    isas = args.isas.split(",")
    for dtype in args.dtypes.split(","):
        best = best_ms(dtype, rows, isas, args.rounds)
        for isa in isas:
            one = best[isa, rows[0]]
            cells = " ".join(
                f"T={t} {best[isa, t]:.1f} ms ({best[isa, t] / one:.2f}x)" for t in rows
            )
            print(f"{dtype} {isa}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
