"""A verify of T positions over a plain step, timed in one process with the row counts taking
turns (each iteration runs every T once), so that the VM's drifting memory speed hits them alike:
the trunk forward over T positions plus the vocabulary projection, every position kept (no
replay of the recurrent states); lowest and median milliseconds and their ratios to the first
T::

    python scripts/experiments/verify_ratio.py runs/shapes/qwen3.5-0.8B --positions 1,5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.model.mtp import project_to_vocab  # noqa: E402
from engine.model.trunk import trunk_hidden  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--positions", default="1,5")
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    positions = [int(n) for n in args.positions.split(",")]
    engine = Engine.load(args.model, draft_tokens=0)
    trunk = engine.trunk
    prompt = [(i * 7919) % 1000 for i in range(128)]
    seq = engine.new_sequence(prompt, SamplingParams(temperature=0.0), draft=True)

    def forward(n: int) -> float:
        start = time.perf_counter()
        ids = mx.array([seq.tokens[-1]] * n)[None]
        hidden = trunk_hidden(trunk, ids, seq.trunk_cache, capture=True)
        mx.eval(hidden, project_to_vocab(trunk, hidden), seq.trunk_cache.arrays())
        # every position kept: a verify that keeps fewer replays the recurrent states, lazily,
        # in whatever evaluates next (here the next row count's forward)
        seq.trunk_cache.commit(n, n)
        seq.tokens.extend([seq.tokens[-1]] * n)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {n: [] for n in positions}
    for iteration in range(args.iterations + 2):  # two warm-ups compile every shape
        for n in positions:
            seconds = forward(n)
            if iteration >= 2:
                times[n].append(seconds)
    first = times[positions[0]]
    for n in positions:
        low, mid = min(times[n]), statistics.median(times[n])
        print(
            f"T={n}: lowest {1e3 * low:.1f} ms, median {1e3 * mid:.1f} ms; over T={positions[0]}: "
            f"lowest {low / min(first):.2f}, median {mid / statistics.median(first):.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
