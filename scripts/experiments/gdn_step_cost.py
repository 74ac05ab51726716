"""What a Gated-DeltaNet layer's recurrence and conv cost a decode step: the trunk's plain step
and verify of T = 2..5 positions (``engine.scheduling.costs.estimate_costs``, wall clock) with

* ``mlx``: the recurrence in mlx ops (``delta_rule_step`` / ``delta_rule_chunk``) and mlx's
  ``nn.Conv1d``;
* ``native-conv1d``: the native kernel's recurrence (``delta_rule_native``), mlx's conv1d;
* ``native``: the kernel's recurrence and ``causal_conv`` (what the engine runs on CPUs).

The settings alternate in one process (``--rounds`` times, compiled blocks rebuilt at each
switch) and each keeps its lowest time, so the machine's drift hits all of them alike.
``--zeros`` also times each setting with every product replaced by zeros: the step outside the
products.

    python scripts/experiments/gdn_step_cost.py runs/shapes/qwen3.5-0.8B --rounds 4 --zeros
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.core as mx  # noqa: E402

import engine.model.delta_rule as delta_rule  # noqa: E402
import engine.model.gated_deltanet as gated_deltanet  # noqa: E402
import engine.model.products as products  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from engine.scheduling.costs import estimate_costs  # noqa: E402

SETTINGS = ("mlx", "native-conv1d", "native")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--zeros", action="store_true")
    args = parser.parse_args()

    engine = Engine.load(args.model, draft_tokens=0, dtype="auto")
    real = (
        products._on_kernel,
        products.multiply,
        gated_deltanet.causal_conv,
        products._on_kernel_together,
    )

    def zeros_of(module, x):  # a projection's output shape, no product
        return mx.zeros(x.shape[:-1] + (module.get("weight").shape[0],), dtype=x.dtype)

    def zeros_times(x, weight):
        return mx.zeros(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype)

    def zeros_together(modules, x, norm=None, residual=None, up=None):
        if residual is not None:  # x @ 0 + residual
            return [residual]
        return [zeros_of(module, x) for module in modules]

    def use(setting: str, zeros: bool) -> None:
        native = setting != "mlx"
        gated_deltanet.native_delta_rule = delta_rule.native_delta_rule = lambda: native
        gated_deltanet.causal_conv = (
            real[2] if setting == "native" else (lambda conv, window: conv(window))
        )
        products._on_kernel, products.multiply = (zeros_of, zeros_times) if zeros else real[:2]
        products._on_kernel_together = zeros_together if zeros else real[3]
        for _, module in engine.trunk.named_modules():
            module.__dict__.pop("_mtpserve_compiled", None)

    runs = [(s, False) for s in SETTINGS] + ([(s, True) for s in SETTINGS] if args.zeros else [])
    best: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for run in runs:
            use(*run)
            costs = estimate_costs(engine, reps=5, thorough=True, clock=time.perf_counter)
            old = best.get(run, [float("inf")] * len(costs.trunk))
            best[run] = [min(a, b) for a, b in zip(old, costs.trunk, strict=True)]
    use("native", False)
    print(f"{args.model}: lowest of {args.rounds} rounds, ms (verify / plain)")
    print("| setting | products | plain step | T=2 | T=3 | T=4 | T=5 |")
    print("|---|---|---|---|---|---|---|")
    for (setting, zeros), t in best.items():
        ratios = " | ".join(f"{1e3 * x:.1f} ({x / t[0]:.2f})" for x in t[1:])
        print(f"| {setting} | {'zeros' if zeros else 'kernel'} | {1e3 * t[0]:.1f} | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
