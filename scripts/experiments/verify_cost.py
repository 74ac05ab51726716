"""What a verify pass of T positions costs against a plain step, trunk and vocabulary apart.

For T = 1, 2, 3, 5 (a plain step, and the verify of K = 1, 2, 4 drafts): the capturing trunk
forward of one sequence (``trunk_hidden``, as a drafting cycle runs it, the rolled-back
positions committed as a cycle would) and the vocabulary projection of its T hidden states,
each evaluated on its own; median milliseconds over ``--reps`` passes after one warm-up pass,
in rounds that cycle through T. For old-against-new comparisons of the products' code on a
full-size shape::

    python scripts/make_shapes.py 0.8B
    python scripts/experiments/verify_cost.py --model runs/shapes/qwen3.5-0.8B
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.api import DEMO_MODEL
from engine.cycle.sequence import start_sequence
from engine.model.mtp import project_to_vocab
from engine.model.trunk import mx, trunk_hidden
from engine.runtime import Engine
from sampling.params import SamplingParams

POSITIONS = (1, 2, 3, 5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--label", default="")
    args = p.parse_args()
    engine = Engine.load(args.model, draft_tokens=0, dtype="float32")
    trunk = engine.trunk
    seq = start_sequence(
        trunk, None, list(range(100, 164)), SamplingParams(temperature=0.0), use_head=False
    )
    times: dict[int, dict[str, list[float]]] = {t: {"trunk": [], "vocab": []} for t in POSITIONS}
    for _ in range(args.rounds):
        for t in POSITIONS:
            for rep in range(args.reps + 1):
                ids = mx.array([[seq.tokens[-1]] * t])
                t0 = time.perf_counter()
                hidden = trunk_hidden(trunk, ids, seq.trunk_cache, capture=True)
                mx.eval(hidden)
                t1 = time.perf_counter()
                mx.eval(project_to_vocab(trunk, hidden))
                t2 = time.perf_counter()
                seq.trunk_cache.commit(1, t)
                mx.eval(seq.trunk_cache.arrays())
                if rep:  # the first pass of a round compiles and warms
                    times[t]["trunk"].append(t1 - t0)
                    times[t]["vocab"].append(t2 - t1)
    result = {"label": args.label}
    base = statistics.median(times[1]["trunk"]) + statistics.median(times[1]["vocab"])
    for t in POSITIONS:
        trunk_ms = statistics.median(times[t]["trunk"]) * 1e3
        vocab_ms = statistics.median(times[t]["vocab"]) * 1e3
        result[f"T={t}"] = {
            "trunk ms": round(trunk_ms, 1),
            "vocab ms": round(vocab_ms, 1),
            "vs T=1": round((trunk_ms + vocab_ms) / (base * 1e3), 2),
        }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
