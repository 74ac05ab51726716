"""What a batched cycle costs as the batch runs it, and automatic K against the fixed K's.

For ``--rows`` rows of the bench prompts (greedy, 64 tokens each, EOS ignored) it runs batched
K=0, auto, K=2 and K=3 in turns for ``--rounds`` rounds (the first a warm-up) and prints each
one's median aggregate tokens/s and auto over the best fixed K; with ``--split``, for the
largest row count, the medians of a cycle's three parts at K=0 (launched ahead) and K=2: the
launch (building its graph, and waiting on the cycle before it where mlx's queue is full),
the read-back wait, and the host's work between one read-back and the next launch — what
``BatchK``'s period (read-back to read-back) holds and launch to read-back did not::

    python scripts/experiments/batch_periods.py --rows 8,4 --rounds 6 --split

Compare two checkouts by running it in each, in turns, in fresh processes.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import engine.scheduling.batching as batching  # noqa: E402
from engine.api import DEMO_MODEL  # noqa: E402
from engine.bench.batch import _requests, run_batched  # noqa: E402
from engine.bench.prompts import DEFAULT_PROMPTS, load_prompts  # noqa: E402
from engine.runtime import Engine  # noqa: E402

CONFIGS = (0, None, 2, 3)  # None: automatic K


def split(engine: Engine, prompts: list, rows: int) -> dict[str, float]:
    """Medians (ms) of the launch, the read-back wait and the host's work before the next
    launch, for cycles of all ``rows`` rows at K=0 and K=2."""
    parts: dict[str, list[float]] = collections.defaultdict(list)
    clock: dict[str, float] = {}
    launch, read = batching.launch_cycles, batching.read_cycles

    def timed_launch(trunk, head, seqs, k, profile=False, ks=None):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        if "read" in clock and len(seqs) == rows:
            parts[f"K={k} between"].append(start - clock["read"])
        out = launch(trunk, head, seqs, k, profile, ks)
        clock["launched"], clock["k"], clock["rows"] = time.perf_counter(), k, len(seqs)
        if len(seqs) == rows:
            parts[f"K={k} launch"].append(clock["launched"] - start)
        return out

    def timed_read(cycles):  # noqa: ANN001, ANN202
        out = read(cycles)
        clock["read"] = time.perf_counter()
        if clock.get("rows") == rows:
            parts[f"K={clock['k']} read"].append(clock["read"] - clock["launched"])
        return out

    batching.launch_cycles, batching.read_cycles = timed_launch, timed_read
    try:
        for k in (0, 2, 0, 2):
            run_batched(engine, _requests(engine, prompts, rows, k, 64))
    finally:
        batching.launch_cycles, batching.read_cycles = launch, read
    return {name: round(statistics.median(v) * 1e3, 3) for name, v in sorted(parts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--rows", default="8,4")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--split", action="store_true")
    args = parser.parse_args()
    engine = Engine.load(args.model)
    counts = [int(c) for c in args.rows.split(",")]
    prompts = load_prompts(Path(DEFAULT_PROMPTS), engine.tokenizer, max(counts))
    tps: dict[tuple[int, int | None], list[float]] = collections.defaultdict(list)
    for round_ in range(args.rounds):
        for rows in counts:
            for k in CONFIGS:
                got = run_batched(engine, _requests(engine, prompts, rows, k, 64))
                if round_:
                    tps[(rows, k)].append(got["aggregate_tps"])
    for rows in counts:
        medians = {k: statistics.median(tps[(rows, k)]) for k in CONFIGS}
        best = max(v for k, v in medians.items() if k is not None)
        cells = " ".join(f"{'auto' if k is None else f'K={k}'} {v:.0f}" for k, v in medians.items())
        print(f"{rows} rows, tok/s: {cells}; auto / best fixed {medians[None] / best:.3f}")
    if args.split:
        print(f"{max(counts)} rows, ms a cycle:", split(engine, prompts, max(counts)))


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()
    main()
