"""Large products whole against split across CPU streams (``engine.model.mlx_products.product``).

Loads the checkpoint twice in one process, once with every weight whole and once as the engine
loads it (weights of ``SPLIT_WEIGHT_PARAMS`` or more in one column part per core), and times a
trunk forward over T = 1 (a plain step) and T = 5 (a K=4 verify) with the vocabulary
projection, the two engines alternating round by round (lowest of 2 per round; medians and
per-round ratios)::

    python scripts/make_shapes.py 0.8B
    python scripts/experiments/split_products.py runs/shapes/qwen3.5-0.8B
"""

from __future__ import annotations

import argparse
import statistics
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
import engine.model.loader as loader  # isort: skip
import mlx.core as mx

from engine.api import GenerationRequest
from engine.model.mtp import project_to_vocab
from engine.model.trunk import trunk_hidden
from engine.runtime import Engine
from sampling.params import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    parts = loader.product_parts()
    engines, seqs = {}, {}
    for n in (1, parts):
        loader.product_parts = lambda n=n: n
        engine = Engine.load(args.model, draft_tokens=0, dtype="float32")
        request = GenerationRequest(list(range(100, 164)), SamplingParams(temperature=0.0), 1)
        engines[n], seqs[n] = (
            engine,
            engine.new_sequence(request.prompt_ids, request.sampling, False),
        )

    def forward(n: int, length: int) -> float:
        engine, seq = engines[n], seqs[n]
        t = time.perf_counter()
        hidden = trunk_hidden(engine.trunk, mx.array([[5] * length]), seq.trunk_cache, True)
        mx.eval(hidden, project_to_vocab(engine.trunk, hidden), seq.trunk_cache.arrays())
        seq.trunk_cache.commit(1, length)
        return time.perf_counter() - t

    times: dict[tuple[int, int], list[float]] = {(n, t): [] for n in engines for t in (1, 5)}
    for n, length in times:
        forward(n, length)  # compile
    for r in range(args.rounds):
        for n in sorted(engines, reverse=bool(r % 2)):
            for length in (1, 5):
                times[(n, length)].append(min(forward(n, length) for _ in range(2)))
    for length in (1, 5):
        whole, split = times[(1, length)], times[(parts, length)]
        ratios = [round(b / a, 2) for a, b in zip(whole, split, strict=True)]
        print(
            f"T={length}: whole {1e3 * statistics.median(whole):.1f} ms, {parts} parts "
            f"{1e3 * statistics.median(split):.1f} ms "
            f"({statistics.median(split) / statistics.median(whole):.2f}x); per round {ratios}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
