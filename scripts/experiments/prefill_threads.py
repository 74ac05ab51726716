"""One prefill chunk's wall and process-CPU milliseconds with BLIS on one thread and on every
core, for chunks of several sizes (the evidence behind ``engine.model.trunk.
prefill_on_all_cores``; docs/BENCHMARKS.md, "Decode threads and the prefill chunk").

    python scripts/experiments/prefill_threads.py --model models/qwen3.5-demo --rows 3,16,64,128
    python scripts/experiments/prefill_threads.py --model runs/shapes/qwen3.5-0.8B --rows 3,16,64,96,128

Each size runs ``--repeats`` rounds, one thread then every core in each, on a fresh cache
(``trunk_hidden`` over the chunk, evaluated with the cache); the three figures are sorted.
"""

from __future__ import annotations

import argparse
import os
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
import engine.blas as blas  # isort: skip
import mlx.core as mx

from engine.model.trunk import new_trunk_cache, trunk_hidden
from engine.runtime import Engine


def chunk_ms(engine: Engine, rows: int, threads: int) -> tuple[float, float]:
    cache = new_trunk_cache(engine.trunk)
    chunk = mx.array([100 + i % 1000 for i in range(rows)])[None]
    blas._set_threads(threads)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        hidden = trunk_hidden(engine.trunk, chunk, cache, capture=False)
        mx.eval(hidden, cache.arrays())
        return 1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu)
    finally:
        blas._set_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--rows", default="3,16,64,128")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if blas._set_threads is None:
        raise SystemExit(f"needs BLIS (in use: {blas.blas_in_use()})")
    engine = Engine.load(args.model, draft_tokens=0)
    every = os.cpu_count() or 1
    print(f"{blas.blas_in_use()}, {every} cores, hidden {engine.trunk.args.hidden_size}")
    chunk_ms(engine, 4, 1)  # compile and warm up
    for rows in (int(r) for r in args.rows.split(",")):
        runs: dict[int, list[tuple[float, float]]] = {1: [], every: []}
        for _ in range(args.repeats):
            for threads in runs:
                runs[threads].append(chunk_ms(engine, rows, threads))
        for threads, times in runs.items():
            wall = sorted(round(w) for w, _ in times)
            cpu = sorted(round(c) for _, c in times)
            print(f"{rows:4d} rows, {threads} thread(s): wall ms {wall}, cpu ms {cpu}", flush=True)


if __name__ == "__main__":
    main()
