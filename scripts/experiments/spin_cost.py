"""Milliseconds per generated token with the product pool's workers spinning for each of several
times before they sleep (``MTPSERVE_SPIN_US``), alternating in one process round by round (the
pool is rebuilt with each spin between rounds)::

    python scripts/experiments/spin_cost.py --model models/qwen3.5-demo --spins 5,10,20,50
    python scripts/experiments/spin_cost.py --model runs/shapes/qwen3.5-0.8B --tokens 32 --ks 0

Greedy decoding of one prompt at each K of ``--ks``; lowest and median over ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

from engine.api import GenerationRequest  # noqa: E402
from engine.model import products  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

PROMPT = "The history of the city goes back to a small fishing village on the river."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--spins", default="5,10,20,50", help="microseconds, comma-separated")
    parser.add_argument("--ks", default="0,3")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    native = products.native()
    if native is None or not products.on_native():
        raise SystemExit("the native kernel is not built here")
    engine = Engine.load(args.model, draft_tokens=0)
    ids = list(engine.tokenizer.encode(PROMPT))
    greedy = SamplingParams(temperature=0.0)

    def per_token_ms(k: int) -> float:
        seq = engine.new_sequence(ids, greedy, draft=k > 0)
        request = GenerationRequest(
            seq.tokens, greedy, args.tokens, draft_tokens=k, ignore_eos=True
        )
        start = time.perf_counter()
        for _ in engine.decode(seq, request):
            pass
        return (time.perf_counter() - start) / args.tokens * 1e3

    threads = native.threads()
    results: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for spin in (int(s) for s in args.spins.split(",")):
            os.environ["MTPSERVE_SPIN_US"] = str(spin)
            native.set_threads(threads)  # a new pool, spinning as the variable says
            for k in (int(k) for k in args.ks.split(",")):
                results.setdefault((spin, k), []).append(per_token_ms(k))
    for (spin, k), times in sorted(results.items()):
        print(
            f"spin {spin} us, K={k}: lowest {min(times):.3f}, median {statistics.median(times):.3f} ms a token"
        )


if __name__ == "__main__":
    main()
