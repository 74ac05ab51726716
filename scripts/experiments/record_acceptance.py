"""Record how many of K drafts the model accepts at every position of the bench prompts.

Auto K's policy (engine/scheduling/autok.py) is judged by how close it comes to the best fixed
K. On a noisy 2-core machine a bench run measures that to +-5%, too coarse to tune a policy by; a
replay on recorded acceptance is exact. This records, per prompt and sampler, the accepted
count of a K-draft cycle run at *every* emitted position (each cycle keeps one token, so the
text is what plain decoding writes, and the head's cache is fed exactly as in steady drafting).
A replay then plays any policy against the record: a K'-cycle at position t accepts
``min(K', accepted[t])`` and moves on by that plus one (tests/unit/test_autok_replay.py).

    .venv/bin/python scripts/experiments/record_acceptance.py --model models/qwen3.5-demo \
        --out tests/data/acceptance_demo.json

Sampled rows draw with the same seeds as the bench. With a cost table (``--costs``, a bench
``results.json``), the record carries the table the replay prices cycles with.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.api import GenerationRequest  # (the engine package binds the fast BLAS first)
from engine.bench.prompts import load_prompts
from engine.bench.speed import parse_samplers, with_seed
from engine.cycle.speculative import commit, run_cycle
from engine.runtime import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--prompts", default="configs/bench_prompts.jsonl")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--costs", help="a bench results.json whose start-up tables to keep")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    engine = Engine.load(args.model, draft_tokens=args.draft_tokens)
    prompts = load_prompts(Path(args.prompts), engine.tokenizer, None)
    record: dict[str, object] = {
        "model": str(engine.loaded.model_dir),
        "draft_tokens": args.draft_tokens,
        "max_tokens": args.max_tokens,
        "samplers": {},
    }
    t0 = time.perf_counter()
    for name, base in parse_samplers("greedy,preset:qwen", engine).items():
        rows = []
        for i, prompt in enumerate(prompts):
            params = base if base.greedy else with_seed(base, i)
            request = GenerationRequest(prompt["ids"], params, args.max_tokens)
            seq = engine.new_sequence(request.prompt_ids, params, draft=args.draft_tokens > 0)
            accepted = []
            for _ in range(args.max_tokens):
                result = run_cycle(engine.trunk, engine.loaded.head, seq, args.draft_tokens)
                commit(seq, result, 1)
                accepted.append(result.n_accepted)
            rows.append({"id": prompt["id"], "accepted": accepted})
        record["samplers"][name] = rows
        print(f"{name}: {len(rows)} prompts, {time.perf_counter() - t0:.0f}s", flush=True)
    if args.costs:
        record["costs"] = json.loads(Path(args.costs).read_text())["costs"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
