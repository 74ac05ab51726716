"""Per-position acceptance of sampled speculation at K = 1..4, seeded and unseeded requests.

Every sampled row draws by rejection sampling with uniforms keyed by (seed, position,
purpose); an unseeded request's seed is random. Both should accept alike: this measures it on
the bench prompts with the checkpoint's own sampler (``preset:qwen``), one request per prompt,
a fixed K per run. a_i is P(draft i accepted | drafts 1..i-1 accepted), from the requests'
``accepted_per_position`` counts; "tokens/cycle" is what a K-cycle emitted on average.

``--coupled`` also prices, at every first draft of the same runs, the two rules' chance of
accepting it from its q and p: rejection sampling's sum_y min(p(y), q(y)), and a Gumbel
coupling's P(argmax q/E = argmax p/E) with one Exponential(1) noise E_y per token shared by
draft and target (the rule that makes a draw independent of K; estimated with 256 noise
draws per state).

``--draft-temperatures 0.3,1.3`` also runs K=1 (seeded) with the head's draft drawn at each
of those temperatures instead of the request's (the same top-k/top-p after it; the target p
keeps the request's): rejection sampling is exact for any q, so this asks whether a q other
than the request's own truncation of the head would be accepted more.

    PYTHONPATH=. .venv/bin/python scripts/experiments/sampled_acceptance.py --model models/qwen3.5-demo
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import GenerationRequest, GenerationStats  # (binds the fast BLAS first)
from engine.bench.prompts import load_prompts
from engine.bench.speed import parse_samplers
from engine.runtime import Engine


def per_position(stats: GenerationStats, k: int) -> list[float]:
    """a_1..a_K: accepted_per_position[i] counts cycles that accepted more than i drafts."""
    reached = [stats.proposed_per_position[0], *stats.accepted_per_position[: k - 1]]
    accepted = stats.accepted_per_position[:k]
    return [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]


def first_draft_acceptance(q: Any, p: Any, rng: np.random.Generator) -> tuple[float, float]:
    """Rejection sampling's and the Gumbel coupling's chance of accepting a first draft drawn
    from q (``Truncated`` rows) with target p."""
    q_ids = np.arange(q.probs.shape[-1]) if q.ids is None else np.array(q.ids[0])
    p_ids = np.arange(p.probs.shape[-1]) if p.ids is None else np.array(p.ids[0])
    tokens = np.union1d(q_ids, p_ids)
    qv = np.zeros(tokens.size)
    pv = np.zeros(tokens.size)
    qv[np.searchsorted(tokens, q_ids)] = np.array(q.probs[0])
    pv[np.searchsorted(tokens, p_ids)] = np.array(p.probs[0])
    noise = rng.exponential(size=(256, tokens.size))
    coupled = np.mean(np.argmax(qv / noise, axis=1) == np.argmax(pv / noise, axis=1))
    return float(np.minimum(qv, pv).sum()), float(coupled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--prompts", default="configs/bench_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=12, help="bench prompts used")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sampler", default="preset:qwen")
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--coupled", action="store_true", help="price the coupled rule too")
    parser.add_argument("--draft-temperatures", default="", help="K=1 with q at these")
    args = parser.parse_args()

    priced: list[tuple[float, float]] = []
    if args.coupled:
        from engine.cycle import speculative

        rule = speculative.accept_drafts_with
        rng = np.random.default_rng(0)

        def pricing(drafts: Any, q: Any, p: Any, *uniforms: Any) -> Any:
            priced.append(first_draft_acceptance(q, p, rng))
            return rule(drafts, q, p, *uniforms)

        speculative.accept_drafts_with = pricing

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
    if priced:
        rejection, coupled = np.mean(priced, axis=0)
        print(
            f"first drafts of these runs ({len(priced)}): expected acceptance "
            f"{rejection:.3f} by rejection sampling, {coupled:.3f} by Gumbel coupling"
        )
    for temperature in [float(t) for t in args.draft_temperatures.split(",") if t]:
        totals = GenerationStats()
        with drafting_at(temperature):
            for i, prompt in enumerate(prompts):
                params = replace(base, seed=1000 + i)
                request = GenerationRequest(
                    prompt["ids"], params, args.max_tokens, draft_tokens=1, ignore_eos=True
                )
                for event in engine.generate(request):
                    pass
                totals.add(event.stats)
        print(
            f"K=1, q at temperature {temperature} (p at {base.temperature}): "
            f"a_1 {per_position(totals, 1)[0]:.3f}",
            flush=True,
        )
    print(f"({time.perf_counter() - t0:.0f} s)")


@contextmanager
def drafting_at(temperature: float) -> Iterator[None]:
    """Every draft drawn from the head's logits at ``temperature`` (the request's other
    truncation settings unchanged); the target distributions keep the request's."""
    from engine.cycle import speculative

    draw = speculative._RowDrafts.draw

    def draw_at(row: Any, step_logits: Any, i: int) -> None:
        own = row.seq.params
        row.seq.params = replace(own, temperature=temperature)
        try:
            draw(row, step_logits, i)
        finally:
            row.seq.params = own

    speculative._RowDrafts.draw = draw_at
    try:
        yield
    finally:
        speculative._RowDrafts.draw = draw


if __name__ == "__main__":
    main()
