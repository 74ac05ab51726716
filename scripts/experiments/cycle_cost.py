"""Milliseconds of the engine's main paths, for old-vs-new comparisons of one change.

* a 512-token prompt's prefill (the bench prompts joined; ``Engine.generate``, one token out);
* per generated token at K=0 and K=4 (greedy, 192 tokens, EOS ignored);
* an 8-row batched K=2 cycle (``launch_cycles`` + ``read_cycles`` + commit; median of 30,
  three fresh groups) — the cycle ``mtpserve bench-batch`` runs at 8 rows — and the ops its
  graph dispatches.

Best of three for each. On a noisy machine alternate two checkouts, e.g.::

    git archive OLD | tar -x -C /tmp/old
    for i in 1 2 3; do
      (cd /tmp/old && PYTHONPATH=/tmp/old python $OLDPWD/scripts/experiments/cycle_cost.py --label old)
      python scripts/experiments/cycle_cost.py --label new
    done
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# step_overhead imports engine first: its __init__ preloads the fast BLAS before mlx loads
from step_overhead import cycle_primitives

from engine.api import DEMO_MODEL, GenerationRequest
from engine.cycle.sequence import start_sequence
from engine.cycle.speculative import commit, launch_cycles, read_cycles
from engine.runtime import Engine
from sampling.params import SamplingParams

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
ROWS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "class Point:",
    "import os\nimport sys",
    "for i in range(10):",
    "Once upon a time",
    "x = [1, 2, 3]\nprint(",
    "def fib(n):",
]
GREEDY = SamplingParams(temperature=0.0)


def prefill_ms(engine: Engine, prompt: list[int]) -> float:
    best = float("inf")
    for _ in range(3):
        request = GenerationRequest(prompt, GREEDY, 1, draft_tokens=0, ignore_eos=True)
        t0 = time.perf_counter()
        for _event in engine.generate(request):
            pass
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def per_token_ms(engine: Engine, prompt: list[int], k: int) -> float:
    best = float("inf")
    for _ in range(3):
        request = GenerationRequest(prompt, GREEDY, 192, draft_tokens=k, ignore_eos=True)
        out: list[int] = []
        for event in engine.generate(request):
            out += event.token_ids
        best = min(best, event.stats.generation_seconds / len(out))
    return best * 1e3


def batched_cycle_ms(engine: Engine, k: int = 2) -> tuple[float, int]:
    """The median cycle's ms (best of three groups) and the ops the next cycle dispatches."""
    trunk, head = engine.trunk, engine.loaded.head
    best = float("inf")
    for _ in range(3):
        seqs = [
            start_sequence(trunk, head, engine.tokenizer.encode(p * 3), GREEDY, use_head=True)
            for p in ROWS
        ]
        times = []
        for _cycle in range(30):
            t0 = time.perf_counter()
            results = read_cycles(launch_cycles(trunk, head, seqs, k))
            for seq, result in zip(seqs, results, strict=True):
                commit(seq, result, len(result.emitted))
            times.append(time.perf_counter() - t0)
        best = min(best, sorted(times)[len(times) // 2])
    return best * 1e3, cycle_primitives(engine, seqs, k)["total"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--label", default="")
    args = p.parse_args()
    engine = Engine.load(args.model, draft_tokens=0, dtype="float32")
    prompts = Path(__file__).resolve().parents[1] / "configs" / "bench_prompts.jsonl"
    text = " ".join(json.loads(line)["prompt"] for line in prompts.read_text().splitlines())
    long_prompt = list(engine.tokenizer.encode(text * 4))[:512]
    prompt = list(engine.tokenizer.encode(PROMPT))
    result = {
        "label": args.label,
        "prefill 512 tokens ms": round(prefill_ms(engine, long_prompt), 1),
        "K=0 ms/token": round(per_token_ms(engine, prompt, 0), 3),
        "K=4 ms/token": round(per_token_ms(engine, prompt, 4), 3),
    }
    ms, ops = batched_cycle_ms(engine)
    result |= {"8-row K=2 cycle ms": round(ms, 2), "8-row K=2 cycle ops": ops}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # timed as the mtpserve command runs (MTPSERVE_MALLOC=system: glibc)
    raise SystemExit(main())
