"""Tokens per second of a prompt's prefill, head included, as a request's start runs it
(``Engine.new_sequence``: chunks of ``PREFILL_CHUNK``, the products on the kernel or BLAS by
their row count, each GDN layer's recurrence): the bench prompts joined, cut to ``--tokens``;
median of ``--repeats``. For old-against-new comparisons run it in each checkout, in turns::

    git archive OLD | tar -x -C /tmp/old
    for i in 1 2; do
      (cd /tmp/old && PYTHONPATH=/tmp/old python $OLDPWD/scripts/experiments/prefill_speed.py \\
          $OLDPWD/runs/shapes/qwen3.5-0.8B)
      python scripts/experiments/prefill_speed.py runs/shapes/qwen3.5-0.8B
    done

(``mtpserve convert --model runs/shapes/qwen3.5-0.8B --out /tmp/q4 --bits 4`` gives its 4-bit
form.) ``--apart`` times, in one process and in turns, the prefill with its parts swapped: the
products of more than 64 rows on BLAS or all on the kernel, each GDN layer on the native
recurrence or ``delta_rule_prefill``'s closed-form blocks, and chunks of 64 and 256.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
import engine.model.gated_deltanet as gated_deltanet
import engine.model.products as products
from engine.bench.prompts import DEFAULT_PROMPTS
from engine.cycle.sequence import new_sequence, prefill
from engine.runtime import Engine
from sampling.params import SamplingParams

#: name -> (chunk tokens, products' row limit for the kernel, native recurrence)
PARTS = {
    "BLIS past 64 rows, closed-form GDN": (128, 64, False),
    "kernel, closed-form GDN": (128, 128, False),
    "BLIS past 64 rows, native GDN": (128, 64, True),
    "kernel, native GDN (as it runs)": (128, 128, True),
    "chunks of 64, kernel, native GDN": (64, 64, True),
    "chunks of 256, kernel, native GDN": (256, 256, True),
}


@contextmanager
def swapped(max_rows: int, native_gdn: bool) -> Any:
    rows, native = products.NATIVE_MAX_ROWS, gated_deltanet.native_delta_rule
    products.NATIVE_MAX_ROWS = max_rows
    if not native_gdn:
        gated_deltanet.native_delta_rule = lambda: False
    try:
        yield
    finally:
        products.NATIVE_MAX_ROWS, gated_deltanet.native_delta_rule = rows, native


def timed(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--apart", action="store_true")
    args = parser.parse_args()
    engine = Engine.load(args.model, draft_tokens=0)
    lines = Path(DEFAULT_PROMPTS).read_text().splitlines()
    text = " ".join(json.loads(line)["prompt"] for line in lines if line.strip())
    ids = list(engine.tokenizer.encode(text * 4))[: args.tokens]
    greedy = SamplingParams(temperature=0.0)
    if not args.apart:
        seconds = timed(
            lambda: engine.new_sequence(ids, greedy, draft=engine.has_head), args.repeats
        )
        print(
            f"{Path(args.model).name}: {len(ids)} tokens in {seconds * 1e3:.0f} ms "
            f"({len(ids) / seconds:.0f} tokens/s), median of {args.repeats}"
        )
        return
    results: dict[str, list[float]] = {name: [] for name in PARTS}
    for _ in range(args.repeats):
        for name, (chunk, max_rows, native_gdn) in PARTS.items():

            def run(chunk: int = chunk) -> None:
                seq = new_sequence(engine.trunk, engine.head, ids, greedy, engine.has_head)
                prefill(engine.trunk, engine.head, seq, ids[:-1], chunk_tokens=chunk)

            with swapped(max_rows, native_gdn):
                results[name].append(timed(run, 1))
    for name, times in results.items():
        seconds = statistics.median(times)
        print(f"{name}: {len(ids) / seconds:.0f} tokens/s (median of {args.repeats})")


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()
    main()
