"""Per-position acceptance of sampled speculation at K = 1..4, seeded and unseeded requests.

Every sampled row draws by rejection sampling with uniforms keyed by (seed, position,
purpose); an unseeded request's seed is random. Both should accept alike: this measures it on
the bench prompts with the checkpoint's own sampler (``preset:qwen``), one request per prompt,
a fixed K per run. a_i is P(draft i accepted | drafts 1..i-1 accepted), from the requests'
``accepted_per_position`` counts; "tokens/cycle" is what a K-cycle emitted on average.

    PYTHONPATH=. .venv/bin/python scripts/sampled_acceptance.py --model models/qwen3.5-demo
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from engine.api import GenerationRequest, GenerationStats  # (binds the fast BLAS first)
from engine.bench.prompts import load_prompts
from engine.bench.speed import parse_samplers
from engine.runtime import Engine


def per_position(stats: GenerationStats, k: int) -> list[float]:
    """a_1..a_K: accepted_per_position[i] counts cycles that accepted more than i drafts."""
    reached = [stats.proposed_per_position[0], *stats.accepted_per_position[: k - 1]]
    accepted = stats.accepted_per_position[:k]
    return [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--prompts", default="configs/bench_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=12, help="bench prompts used")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sampler", default="preset:qwen")
    parser.add_argument("--max-k", type=int, default=4)
    args = parser.parse_args()

    engine = Engine.load(args.model, draft_tokens=0)
    prompts = load_prompts(Path(args.prompts), engine.tokenizer, args.limit)
    base = next(iter(parse_samplers(args.sampler, engine).values()))
    print(f"{args.model}, {args.sampler}, {len(prompts)} prompts x {args.max_tokens} tokens")
    print("| K | requests | acceptance | a_1 | a_2 | a_3 | a_4 | tokens/cycle |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for k in range(1, args.max_k + 1):
        for mode in ("seeded", "unseeded"):
            totals = GenerationStats()
            for i, prompt in enumerate(prompts):
                params = replace(base, seed=1000 * k + i if mode == "seeded" else None)
                request = GenerationRequest(
                    prompt["ids"], params, args.max_tokens, draft_tokens=k, ignore_eos=True
                )
                event = None
                for event in engine.generate(request):
                    pass
                totals.add(event.stats)
            a = per_position(totals, k)
            cells = [f"{x:.3f}" for x in a] + ["–"] * (4 - k)
            per_cycle = totals.completion_tokens / totals.cycles
            print(
                f"| {k} | {mode} | {totals.acceptance_rate:.3f} | {' | '.join(cells)} "
                f"| {per_cycle:.2f} |",
                flush=True,
            )
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
