"""Milliseconds per generated token of sampled decoding with the sampler's native ops
(``top_k_truncate``, ``accept_candidates``: engine/model/native/sampler.cpp) against mlx's
formulations of the same rules, alternating in one process round by round (the VM's speed
drifts by a third over minutes); and the argmax of vocabulary rows, native against
``mx.argmax``::

    python scripts/experiments/sampler_cost.py --model models/qwen3.5-demo --rounds 7

Each round decodes ``--tokens`` tokens of one prompt with Qwen's sampler (seeded) at K=0 and
K=3, and greedy at K=0 for reference; lowest and median over the rounds.
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

import sampling.acceptance as acceptance  # noqa: E402
import sampling.distribution as distribution  # noqa: E402
from engine.api import GenerationRequest  # noqa: E402
from engine.model import products  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

PROMPT = "The history of the city goes back to a small fishing village on the river."


def per_token_ms(engine: Engine, params: SamplingParams, k: int, tokens: int) -> float:
    ids = list(engine.tokenizer.encode(PROMPT))
    seq = engine.new_sequence(ids, params, draft=k > 0)
    request = GenerationRequest(seq.tokens, params, tokens, draft_tokens=k, ignore_eos=True)
    start = time.perf_counter()
    for _ in engine.decode(seq, request):
        pass
    return (time.perf_counter() - start) / tokens * 1e3


def argmax_us(width: int, rows: int, native: bool, repeats: int = 50) -> float:
    x = mx.random.normal((rows, width))
    mx.eval(x)
    op = products.native().argmax if native else (lambda a: mx.argmax(a, axis=-1))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(op(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    if not products.on_native():
        raise SystemExit("the native kernel is not built here")
    engine = Engine.load(args.model, draft_tokens=0)
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1)
    greedy = SamplingParams(temperature=0.0)
    native_truncation, native_rule = distribution._native_truncation, acceptance._native_rule
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        results.setdefault("greedy K=0", []).append(per_token_ms(engine, greedy, 0, args.tokens))
        for sampler in ("native", "mlx"):
            if sampler == "mlx":
                distribution._native_truncation = lambda logits, params: None
                acceptance._native_rule = lambda draft_ids: None
            for k in (0, 3):
                results.setdefault(f"sampled K={k}, {sampler} sampler", []).append(
                    per_token_ms(engine, sampled, k, args.tokens)
                )
            distribution._native_truncation, acceptance._native_rule = (
                native_truncation,
                native_rule,
            )
    for name, times in results.items():
        print(f"{name}: lowest {min(times):.3f} ms a token, median {statistics.median(times):.3f}")
    for rows in (1, 5):
        print(
            f"argmax of {rows} x 248,320: native {argmax_us(248_320, rows, True):.0f} us, "
            f"mx.argmax {argmax_us(248_320, rows, False):.0f} us (medians, each eval included)"
        )


if __name__ == "__main__":
    main()
