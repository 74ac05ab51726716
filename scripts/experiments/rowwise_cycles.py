"""Whole decode cycles with products of a few rows row by row against one product each.

Loads the model twice in one process: once with row by row wherever ``ROWWISE_LIMITS`` lets
it run (as if it paid at every trial), once with one product everywhere (as if it never paid),
and times the same cycles on both, interleaved cycle by cycle so that the machine's drift
falls on both alike: ``rows`` greedy sequences (1, 2, 4, 8) at K = 0, 2, 3, each a
``launch_cycles`` + ``read_cycles`` + commit, median of 60 over three fresh groups.
``engine.model.mlx_products.rowwise_rows`` makes this choice per weight shape at load; this script
shows what the choice is worth on the whole cycle (docs/CPU_CHOICES.md)::

    python scripts/experiments/rowwise_cycles.py
"""

from __future__ import annotations

import argparse
import statistics
import time

# the same eight prompts and sampler as the 8-row cycle of scripts/experiments/cycle_cost.py, which
# imports engine first (its __init__ preloads the fast BLAS before anything imports mlx)
from cycle_cost import GREEDY, ROWS

from engine.api import DEMO_MODEL
from engine.cycle.sequence import Sequence, start_sequence
from engine.cycle.speculative import commit, launch_cycles, read_cycles
from engine.model import mlx_products
from engine.runtime import Engine


def load(model: str, rowwise: bool) -> Engine:
    """The model with row by row taken to pay at every trial row count, or at none."""
    saved = mlx_products.last_paying_rows, mlx_products._rowwise_rows
    mlx_products._rowwise_rows = {}
    mlx_products.last_paying_rows = lambda trials, seconds: trials[-1] if rowwise else 1
    try:
        return Engine.load(model, draft_tokens=0, dtype="float32")
    finally:
        mlx_products.last_paying_rows, mlx_products._rowwise_rows = saved


def group(engine: Engine, rows: int, k: int) -> list[Sequence]:
    trunk_, head = engine.trunk, engine.loaded.head
    return [
        start_sequence(trunk_, head, engine.tokenizer.encode(p * 3), GREEDY, use_head=k > 0)
        for p in ROWS[:rows]
    ]


def cycle_seconds(engine: Engine, seqs: list[Sequence], k: int) -> float:
    start = time.perf_counter()
    results = read_cycles(launch_cycles(engine.trunk, engine.loaded.head, seqs, k))
    for seq, result in zip(seqs, results, strict=True):
        commit(seq, result, len(result.emitted))
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL))
    args = p.parse_args()
    engines = {"row by row": load(args.model, True), "one product": load(args.model, False)}
    print("| rows | K | row by row ms | one product ms | one product / row by row |")
    print("|---|---|---|---|---|")
    for rows in (1, 2, 4, 8):
        for k in (0, 2, 3):
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(3):
                groups = {name: group(e, rows, k) for name, e in engines.items()}
                for _ in range(20):
                    for name, e in engines.items():
                        times[name].append(cycle_seconds(e, groups[name], k))
            a, b = (1e3 * statistics.median(times[n]) for n in engines)
            print(f"| {rows} | {k} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
