"""Seeded plans measured again and again in one process, each against the decode loop's own
fixed-K speed measured right after it::

    .venv/bin/python scripts/experiments/seeded_plan_cost.py --plans 6

``EngineAutoK.seeded_plan`` prices each K's cycle from rounds of timed cycles on its probe texts
and multiplies the drafting cycles by ``drafting_spread``. For each plan this prints the
spread, the priced ratio of a K=2 and a K=3 cycle to a plain one and the K the plan starts
seeded requests at, from the first ``TIMED_PROBE_ROUNDS`` rounds (as the engine measures) and
from three times as many; then the time per token of fixed K=2 over fixed K=0 (Qwen's sampler
seeded, three of the bench's prompts x 128 tokens): drafting pays where that is under 1, and
the plan's K=2 ratio is right where it equals the tokens a K=2 cycle emits (~2.42 on the demo)
times it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import engine.scheduling.autok as autok  # noqa: E402
from engine.api import GenerationRequest  # noqa: E402
from engine.bench.prompts import load_prompts  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    parser.add_argument("--plans", type=int, default=6)
    args = parser.parse_args()
    engine = Engine.load(args.model, draft_tokens=0)
    sampler = autok.representative_sampler(engine, SamplingParams(temperature=1.0, seed=0))
    sequences = autok.probe_sequences(engine, sampler)
    counts = autok.AcceptanceCounts()
    for _ in range(autok.ACCEPTANCE_PROBE_ROUNDS):
        acceptance = autok.probe_acceptance(engine, sampler, sequences=sequences, counts=counts)
    print("probe acceptance", [round(a, 3) for a in acceptance])
    bench_prompts = load_prompts(ROOT / "configs" / "bench_prompts.jsonl", engine.tokenizer, None)
    prompts = [prompt["ids"] for prompt in bench_prompts[::8]]  # three of the bench's kinds

    def time_per_token(k: int) -> float:
        started = time.perf_counter()
        for seed, ids in enumerate(prompts):
            request = GenerationRequest(
                ids, replace(sampler, seed=seed), 128, draft_tokens=k, ignore_eos=True
            )
            for _ in engine.generate(request):
                pass
        return (time.perf_counter() - started) / (128 * len(prompts))

    def priced(rounds: list[list[tuple[int, int, float]]]) -> str:
        plan = autok.SeededPlan.measured(acceptance, rounds)
        seconds = plan.cycle_seconds
        return (
            f"spread {autok.drafting_spread(rounds):.3f}, K=2 {seconds[2] / seconds[0]:.2f}x "
            f"plain, K=3 {seconds[3] / seconds[0]:.2f}x, plan K={plan.k}"
        )

    ratios = []
    for plan in range(args.plans):
        sequences = autok.probe_sequences(engine, sampler)  # fresh texts: no context runs out
        rounds = []
        for _ in range(3 * autok.TIMED_PROBE_ROUNDS):
            timed: list[tuple[int, int, float]] = []
            for k in autok.TIMED_PROBE_ORDER:
                autok.time_probe_cycles(engine, sampler, k, timed, sequences=sequences)
            rounds.append(timed)
        ratio = time_per_token(2) / time_per_token(0)
        ratios.append(ratio)
        print(
            f"plan {plan}: {autok.TIMED_PROBE_ROUNDS} rounds: "
            f"{priced(rounds[: autok.TIMED_PROBE_ROUNDS])}; {len(rounds)} rounds: "
            f"{priced(rounds)}; fixed K=2 over K=0 time a token {ratio:.3f}",
            flush=True,
        )
    print(f"fixed K=2 over K=0 time a token, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
