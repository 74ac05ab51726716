"""Milliseconds a decoded token at several context lengths, the KV caches written in place
(``engine.model.attention``, "Writes") against mlx's copying slice update, taking turns on
one sequence per length (each turn decodes ``--tokens`` more, so the context moves by a few
tokens between them)::

    python scripts/experiments/kv_write_cost.py models/qwen3.5-demo --contexts 30,1000,3000
    python scripts/experiments/kv_write_cost.py runs/shapes/qwen3.5-0.8B --contexts 64,2048 \
        --tokens 8 --rounds 3

Greedy plain decoding (K=0); the median of ``--rounds`` turns each.
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

from engine.api import GenerationRequest  # noqa: E402
from engine.model import attention  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

TEXT = "The history of the city goes back to a small fishing village on the river. "


IN_PLACE = attention.RowKVCache.write


def copying(cache: attention.RowKVCache, start: int, keys, values):  # noqa: ANN001, ANN201
    """The same write never owning its buffers: always mlx's copying slice update."""
    cache._owned = False
    return IN_PLACE(cache, start, keys, values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--contexts", default="30,1000,3000")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.load(args.model, draft_tokens=0)
    base = list(engine.tokenizer.encode(TEXT))
    greedy = SamplingParams(temperature=0.0)
    for length in (int(c) for c in args.contexts.split(",")):
        seq = engine.new_sequence((base * (length // len(base) + 1))[:length], greedy, draft=False)
        times: dict[str, list[float]] = {"in place": [], "copying": []}
        for _ in range(args.rounds + 1):  # the first turn prefills and warms up
            for name, write in (("in place", IN_PLACE), ("copying", copying)):
                attention.RowKVCache.write = write
                request = GenerationRequest(
                    seq.tokens, greedy, args.tokens, draft_tokens=0, ignore_eos=True
                )
                stamps = [time.perf_counter() for _ in engine.decode(seq, request)]
                times[name].append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
        attention.RowKVCache.write = IN_PLACE
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        print(
            f"context {length}: in place {medians['in place']:.2f} ms a token, copying "
            f"{medians['copying']:.2f} ({medians['copying'] / medians['in place']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
