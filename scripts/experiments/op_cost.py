"""What one more mlx op costs a demo decode step: ``--ops`` views (reshapes, which copy
nothing) or as many tiny computing ops (a multiply or add of the ``[1, 1, H]`` hidden state)
inserted before the vocabulary projection of every plain step, taking turns with the step as it
is in one process::

    python scripts/experiments/op_cost.py --model models/qwen3.5-demo --ops 30

Greedy plain decoding (``compare_llamacpp.mtpserve_plain_tps``); the median of ``--rounds``
turns each, and the added microseconds an op.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.core as mx  # noqa: E402
from compare_llamacpp import mtpserve_plain_tps  # noqa: E402

import engine.cycle.speculative as speculative  # noqa: E402
from engine.runtime import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--ops", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.load(args.model, draft_tokens=0)
    project = speculative.project_to_vocab
    extra = {"kind": "none"}

    def padded(trunk, hidden: mx.array) -> mx.array:  # noqa: ANN001
        shape = hidden.shape
        for i in range(args.ops if extra["kind"] != "none" else 0):
            if extra["kind"] == "views":
                hidden = hidden.reshape(-1) if i % 2 == 0 else hidden.reshape(shape)
            else:
                hidden = hidden * 1.0 if i % 2 == 0 else hidden + 0.0
        return project(trunk, hidden.reshape(shape))

    def ms_a_token() -> float:
        return 1e3 / mtpserve_plain_tps(engine, args.tokens)

    speculative.project_to_vocab = padded
    ms_a_token()  # warm up
    times: dict[str, list[float]] = {"none": [], "views": [], "computing": []}
    for _ in range(args.rounds):
        for kind in times:
            extra["kind"] = kind
            times[kind].append(ms_a_token())
    base = statistics.median(times["none"])
    print(f"the step as it is: {base:.3f} ms a token")
    for kind in ("views", "computing"):
        median = statistics.median(times[kind])
        added = (median - base) * 1e3 / args.ops
        print(f"{args.ops} more {kind} ops: {median:.3f} ms a token, {added:.1f} us an op")


if __name__ == "__main__":
    main()
