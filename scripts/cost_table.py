"""The cost table of a checkpoint on this machine, and what the cost model predicts from it.

    python scripts/cost_table.py runs/shapes/qwen3.5-0.8B [--dtype bfloat16]

Times (lowest of a few runs after a warm-up, ``engine.scheduling.costs.estimate_costs``): the
plain decode step (a one-token trunk forward with the vocabulary projection), the head's draft
step over the full vocabulary and over a draft vocabulary of ``--draft-vocab`` tokens, the
trunk's verify forward over K+1 tokens against one, and prefill throughput of a ``--prefill-
tokens`` prompt for each ``--chunks`` size (every core, as prefill runs). ``--threads`` also
times (wall clock) the plain step with BLIS on every core instead of one (decoding runs on one).
``--clock cpu`` (the default) times with the process's CPU time: on a machine shared with other
jobs wall time is mostly waiting for a core.

From the table: the cost model's speed-up of each K over plain decoding at the per-position
acceptance vLLM publishes for Qwen3.5's MTP heads (0.92, 0.84, 0.65, 0.54) — each as a constant
acceptance, and as each position's given the one before, with the tokens/s that predicts — and
the head step's share of a plain step at which each K stops paying: a K-cycle costs
verify(K+1) + K head steps and emits E(K) = 1 + a + ... + a^K tokens, so K pays while
head/plain < (E(K) - verify(K+1) / plain) / K. Prints a markdown table and, with ``--json``, the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ACCEPTANCE = (0.92, 0.84, 0.65, 0.54)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--chunks", default="512")
    parser.add_argument("--threads", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the process's CPU time (steady on a shared machine; prefill's counts every "
        "thread); wall: elapsed time",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    from engine import blas

    blas.use_fast_blas()
    import mlx.core as mx

    from engine.cycle import sequence
    from engine.model.mtp import project_to_vocab
    from engine.model.trunk import trunk_hidden
    from engine.runtime import Engine
    from engine.scheduling.costs import MAX_AUTO_K, estimate_costs, expected_tokens
    from sampling.params import SamplingParams

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    engine = Engine.load(args.model, draft_tokens=0, dtype=args.dtype)
    dtype = str(engine.trunk.model.embed_tokens.weight.dtype).removeprefix("mlx.core.")
    full = estimate_costs(engine, reps=args.reps, thorough=True, clock=clock)
    engine.set_draft_vocab(args.draft_vocab)
    draft = estimate_costs(engine, reps=args.reps, thorough=True, clock=clock)
    engine.set_draft_vocab(0)

    greedy = SamplingParams(temperature=0.0)
    prompt = [(i * 7919) % 1000 for i in range(args.prefill_tokens)]
    prefill: dict[int, float] = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        best = float("inf")
        for _ in range(2):
            t = clock()
            seq = sequence.new_sequence(engine.trunk, engine.head, prompt, greedy, use_head=True)
            sequence.prefill(engine.trunk, engine.head, seq, prompt[:-1], chunk_tokens=chunk)
            best = min(best, clock() - t)
        prefill[chunk] = (len(prompt) - 1) / best

    threads: dict[int, float] = {}
    if args.threads and blas._set_threads is not None:
        seq = engine.new_sequence(prompt[:128], greedy, draft=False)
        trunk = engine.trunk
        for n in sorted({1, os.cpu_count() or 1}):
            blas._set_threads(n)
            best = float("inf")
            for _ in range(args.reps + 1):
                t = time.perf_counter()  # wall: CPU time would count both threads
                hidden = trunk_hidden(trunk, mx.array([[5]]), seq.trunk_cache, capture=True)
                mx.eval(hidden, project_to_vocab(trunk, hidden), seq.trunk_cache.arrays())
                seq.trunk_cache.commit(1, 1)
                best = min(best, time.perf_counter() - t)
            threads[n] = best
        blas._set_threads(1)

    plain = full.trunk[0]
    rows = []
    for a in ACCEPTANCE:
        acceptance = [a] * MAX_AUTO_K
        row = {"acceptance": a, "speedup": {}, "speedup_draft_vocab": {}, "break_even_share": {}}
        for k in range(1, MAX_AUTO_K + 1):
            row["speedup"][k] = full.predicted_speedup(acceptance, k)
            row["speedup_draft_vocab"][k] = draft.predicted_speedup(acceptance, k)
            e = expected_tokens(acceptance, k)
            row["break_even_share"][k] = (e - full.trunk[k] / plain) / k
        rows.append(row)
    # the same numbers as each position's acceptance given the one before it (a_1..a_4), the
    # way vLLM publishes them: what a head with that profile would give, and its tokens/s
    chained = list(ACCEPTANCE)
    per_position = {}
    for k in range(1, MAX_AUTO_K + 1):
        with_draft_vocab = draft.predicted_speedup(chained, k)
        per_position[k] = {
            "speedup": full.predicted_speedup(chained, k),
            "speedup_draft_vocab": with_draft_vocab,
            "tokens_per_second_draft_vocab": with_draft_vocab / plain,
        }
    result = {
        "model": args.model,
        "dtype": dtype,
        "blas": blas.blas_in_use(),
        "plain_step_ms": 1e3 * full.cycle[0],
        "head_step_ms": 1e3 * full.head_step,
        "head_step_draft_vocab_ms": 1e3 * draft.head_step,
        "draft_vocab": args.draft_vocab,
        "clock": args.clock,
        "head_share": full.head_step / plain,
        "head_share_draft_vocab": draft.head_step / plain,
        "verify_ratio": {k + 1: t / plain for k, t in enumerate(full.trunk)},
        "prefill_tokens_per_second": prefill,
        "plain_step_ms_by_threads": {n: 1e3 * t for n, t in threads.items()},
        "predictions": rows,
        "per_position_acceptance": chained,
        "per_position_predictions": per_position,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(format_table(result))
    return 0


def format_table(r: dict) -> str:
    ks = sorted(r["predictions"][0]["speedup"])
    lines = [
        f"{r['model']} ({r['dtype']}, {Path(r['blas']).name}, {r['clock']} time)",
        f"plain step {r['plain_step_ms']:.1f} ms; head step {r['head_step_ms']:.1f} ms "
        f"({100 * r['head_share']:.0f}% of plain), {r['head_step_draft_vocab_ms']:.1f} ms over "
        f"{r['draft_vocab']} tokens ({100 * r['head_share_draft_vocab']:.0f}%)",
        "verify of T tokens / plain: "
        + ", ".join(f"T={t}: {v:.2f}" for t, v in r["verify_ratio"].items()),
        f"prefill tokens per {r['clock']} second by chunk: "
        + ", ".join(f"{c}: {v:.0f}" for c, v in r["prefill_tokens_per_second"].items()),
    ]
    if r["plain_step_ms_by_threads"]:
        lines.append(
            "plain step by BLAS threads: "
            + ", ".join(f"{n}: {v:.1f} ms" for n, v in r["plain_step_ms_by_threads"].items())
        )
    lines += [
        "",
        "| acceptance | "
        + " | ".join(f"K={k} (draft vocab)" for k in ks)
        + " | "
        + " | ".join(f"K={k} pays below head share" for k in ks)
        + " |",
        "|---" * (1 + 2 * len(ks)) + "|",
    ]
    for row in r["predictions"]:
        cells = [f"{row['speedup'][k]:.2f}x ({row['speedup_draft_vocab'][k]:.2f}x)" for k in ks]
        cells += [f"{100 * row['break_even_share'][k]:.0f}%" for k in ks]
        lines.append(f"| {row['acceptance']} | " + " | ".join(cells) + " |")
    chained = " / ".join(str(a) for a in r["per_position_acceptance"])
    lines += [
        "",
        f"each position's acceptance given the one before ({chained}): "
        + ", ".join(
            f"K={k} {p['speedup']:.2f}x ({p['speedup_draft_vocab']:.2f}x, "
            f"{p['tokens_per_second_draft_vocab']:.1f} tok/s)"
            for k, p in r["per_position_predictions"].items()
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
