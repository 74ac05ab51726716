"""One trunk forward of N positions with every product replaced by zeros: what a decode step
(N = 1) or a verify (N = K + 1) costs outside its products, and what a verify that keeps fewer
positions than it ran adds (the Gated-DeltaNet states replayed to the kept position). The same
forward ``engine.scheduling.costs.estimate_costs`` times, with the vocabulary projection;
lowest, mean and median milliseconds over ``--iterations`` after three warm-ups. Several
position counts take turns, one forward each an iteration, so that the VM's drifting memory
speed hits them alike, and each is also given over the first (with ``--products``: a verify
over a plain step)::

    python scripts/experiments/step_outside_products.py runs/shapes/qwen3.5-0.8B --positions 5
    python scripts/experiments/step_outside_products.py runs/shapes/qwen3.5-0.8B --positions 5 --keep 1
    python scripts/experiments/step_outside_products.py runs/shapes/qwen3.5-0.8B \
        --positions 1,2,3,4,5 --products --iterations 20
    python scripts/experiments/step_outside_products.py runs/shapes/qwen3.5-0.8B-mlx-8bit \
        --positions 1,5 --products --iterations 10 --context 4000

``--context`` first fills the cache with that many positions (a prompt's chunks of 128); every
iteration then adds the positions it keeps. ``--isas`` takes turns between instruction sets of
the native kernel, each forward under each (``native.set_isa``), and gives each over the first:
two builds of the kernel's loops in one process, the second compiled into the ``avx512`` slot
(the VNNI kernel with the variant's macros defined), meet the machine's drift alike::

    MTPSERVE_AVX512_VARIANT=MY_VARIANT bash scripts/build_native.sh .venv/bin/python
    python scripts/experiments/step_outside_products.py runs/shapes/qwen3.5-0.8B-mlx-8bit \
        --positions 1,3,5 --products --iterations 20 --isas avx512-vnni,avx512
    bash scripts/build_native.sh .venv/bin/python   # the usual build again

Run it under ``perf record -g`` to see where those milliseconds go.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import engine.model.products as products  # noqa: E402
from engine.model.mtp import project_to_vocab  # noqa: E402
from engine.model.trunk import trunk_hidden  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--positions", default="1", help="one count, or several to take turns")
    parser.add_argument("--keep", type=int, help="positions each commit keeps (default: all)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--products", action="store_true", help="keep the real products")
    parser.add_argument(
        "--context", type=int, default=0, help="positions in the cache before the first step"
    )
    parser.add_argument("--isas", default="", help="instruction sets of the kernel to take turns")
    args = parser.parse_args()
    counts = [int(n) for n in args.positions.split(",")]
    isas = [name for name in args.isas.split(",") if name] or [""]

    engine = Engine.load(args.model, draft_tokens=0, dtype="auto")
    if not args.products:

        def zeros_of(module: nn.Module, x: mx.array) -> mx.array:
            return mx.zeros(x.shape[:-1] + (module.get("weight").shape[0],), dtype=x.dtype)

        def zeros_times(x: mx.array, weight: mx.array) -> mx.array:
            return mx.zeros(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype)

        def zeros_together(
            modules: list[nn.Module],
            x: mx.array,
            norm: nn.Module | None = None,
            residual=None,
            up=None,
            joined=None,
            gate=None,
        ) -> list[mx.array]:
            if residual is not None:  # x @ 0 + residual
                return [residual]
            return [zeros_of(module, x) for module in modules]

        products._on_kernel, products.multiply = zeros_of, zeros_times
        products._on_kernel_together = zeros_together
    ids = [(i * 7919) % (engine.vocab_size - 1) for i in range(max(counts + [args.context]))]
    seq = engine.new_sequence(ids[:1], SamplingParams(temperature=0.0), draft=True)
    for start in range(0, args.context, 128):  # the cache a long conversation has
        chunk = ids[start : min(args.context, start + 128)]
        hidden = trunk_hidden(engine.trunk, mx.array([chunk]), seq.trunk_cache, capture=True)
        mx.eval(hidden, seq.trunk_cache.arrays())
        seq.trunk_cache.commit(len(chunk), len(chunk))

    def forward(n: int) -> float:
        # a commit that keeps fewer positions replays the states lazily, inside the next forward
        start = time.perf_counter()
        hidden = trunk_hidden(engine.trunk, mx.array([ids[:n]]), seq.trunk_cache, capture=True)
        mx.eval(hidden, project_to_vocab(engine.trunk, hidden), seq.trunk_cache.arrays())
        seq.trunk_cache.commit(min(args.keep or n, n), n)
        return time.perf_counter() - start

    native = products.native()
    times: dict[tuple[int, str], list[float]] = {(n, isa): [] for n in counts for isa in isas}
    for iteration in range(args.iterations + 3):
        for n in counts:
            # the instruction sets in a turning order, so that none is always first
            for isa in isas[iteration % len(isas) :] + isas[: iteration % len(isas)]:
                if isa:
                    native.set_isa(isa)
                seconds = forward(n)
                if iteration >= 3:
                    times[n, isa].append(seconds)
    what = "with products" if args.products else "products as zeros"
    for isa in isas:
        first = times[counts[0], isa]
        for n in counts:
            own = times[n, isa]
            low, mean, mid = min(own), statistics.mean(own), statistics.median(own)
            over = (
                f"; over {counts[0]}: lowest {low / min(first):.2f}, median "
                f"{mid / statistics.median(first):.2f}"
                if len(counts) > 1
                else ""
            )
            if isa != isas[0]:
                base = times[n, isas[0]]
                ratios = [a / b for a, b in zip(own, base, strict=True)]
                over += (
                    f"; over {isas[0]}: lowest {low / min(base):.3f}, median of the turns' "
                    f"ratios {statistics.median(ratios):.3f}"
                )
            keep = min(args.keep or n, n)
            print(
                f"{isa + ': ' if isa else ''}{n} positions, keeping {keep}, {what}: lowest "
                f"{1e3 * low:.2f} ms, mean {1e3 * mean:.2f}, median {1e3 * mid:.2f}{over}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
