"""What a 0.8B decode step's two largest elementwise blocks cost: a Gated-DeltaNet layer's
conv + silu over [T + 3, 6144] and an MLP's SwiGLU over [T, 3584], mlx's compiled formulation
(``causal_conv`` then ``silu``, ``silu(gate) * up``: exp as powf, one element at a time)
against the native ops (``causal_conv_silu``, ``swiglu``). Microseconds an op, 18 (conv) or
24 (SwiGLU) evaluated together as in a step, lowest of ``--rounds`` alternations::

    python scripts/experiments/elementwise_cost.py
"""

from __future__ import annotations

import argparse
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.model.activations import silu, swiglu
from engine.model.gated_deltanet import causal_conv, causal_conv_silu


def main() -> int:
    import mlx.core as mx
    import mlx.nn as nn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    conv = nn.Conv1d(6144, 6144, 4, groups=6144, bias=False)
    conv.set_dtype(mx.bfloat16)
    mx.eval(conv.parameters())
    ways = {
        "conv mlx": (mx.compile(lambda w: silu(causal_conv(conv, w))), 18),
        "conv native": (lambda w: causal_conv_silu(conv, w), 18),
        "swiglu mlx": (mx.compile(lambda g: silu(g) * g), 24),
        "swiglu native": (lambda g: swiglu(g, g), 24),
    }
    for T in (1, 5):
        inputs = {"conv": mx.random.normal((1, T + 3, 6144)), "swiglu": mx.random.normal((T, 3584))}
        mx.eval(*inputs.values())
        best = dict.fromkeys(ways, 1e9)
        for _ in range(args.rounds):
            for name, (op, count) in ways.items():
                x = inputs[name.split()[0]]
                copies = [x + i for i in range(count)]
                mx.eval(copies)
                t = time.perf_counter()
                mx.eval([op(c) for c in copies])
                best[name] = min(best[name], (time.perf_counter() - t) / count)
        print(f"T={T}: " + ", ".join(f"{name} {1e6 * s:.1f} us" for name, s in best.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
