"""What a grammar costs a decode: milliseconds per generated token with and without a JSON
schema's grammar, at several K, greedy, on one engine (docs/BENCHMARKS.md, "What a grammar
costs a decode").

    python scripts/experiments/constraint_cost.py --model models/qwen3.5-demo --rounds 3

Each round runs every configuration once, in turn (free and constrained alternate, so the
machine's drift touches both alike); the figure is the median over rounds of generation
seconds per completion token (prefill excluded). The schema is an array of integers, so the
constrained reply keeps going until ``--tokens``; the free reply ignores EOS.
"""

from __future__ import annotations

import argparse
import statistics

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.api import GenerationRequest  # isort: skip
from engine.runtime import Engine, chat_prompt_ids
from sampling.constraint import json_schema_grammar
from sampling.params import SamplingParams

SCHEMA = {"type": "array", "items": {"type": "integer"}}


def ms_per_token(engine: Engine, prompt: list[int], k: int | None, grammar: str | None, n: int):
    request = GenerationRequest(
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        max_tokens=n,
        stop_token_ids=engine.eos_token_ids,
        ignore_eos=grammar is None,
        draft_tokens=k,
        grammar=grammar,
    )
    for event in engine.generate(request):
        pass
    stats = event.stats
    return 1e3 * stats.generation_seconds / stats.completion_tokens, stats.acceptance_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine.load(args.model)
    messages = [{"role": "user", "content": "List some numbers as a JSON array."}]
    prompt = chat_prompt_ids(engine.tokenizer, messages, enable_thinking=False)
    grammar = json_schema_grammar(SCHEMA)
    configs = [(k, g) for k in (0, 3, None) for g in (None, grammar)]
    runs: dict[tuple, list[tuple[float, float]]] = {c: [] for c in configs}
    for config in configs:  # warm-up: compiles, the grammar tokenizer, auto K's first costs
        ms_per_token(engine, prompt, *config, 16)
    for _ in range(args.rounds):
        for config in configs:
            runs[config].append(ms_per_token(engine, prompt, *config, args.tokens))
    print("| K | free ms/token | constrained ms/token | constrained / free | acceptance |")
    print("|---|---|---|---|---|")
    for k in (0, 3, None):
        free = statistics.median(ms for ms, _ in runs[(k, None)])
        held = statistics.median(ms for ms, _ in runs[(k, grammar)])
        acc_free = statistics.median(a for _, a in runs[(k, None)])
        acc_held = statistics.median(a for _, a in runs[(k, grammar)])
        name = "auto" if k is None else k
        print(
            f"| {name} | {free:.2f} | {held:.2f} | {held / free:.2f}x | "
            f"{acc_free:.2f} free, {acc_held:.2f} constrained |"
        )


if __name__ == "__main__":
    main()
