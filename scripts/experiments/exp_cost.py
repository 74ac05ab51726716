"""What mlx's exponential costs on this device, against ``power(e, x)`` (engine/model/activations).

Nanoseconds per element of the elementwise ops behind SwiGLU and the gates, on a ``[rows, 768]``
float32 input (the demo model's MLP width), each evaluated alone, best of ``--repeats``; then
the compiled SwiGLU (``silu(gate) * up``) both ways at 1, 3 and 24 rows (a plain cycle, a K=2
verify, an 8-row K=2 verify), and each formula's largest relative error against float64::

    python scripts/experiments/exp_cost.py
"""

from __future__ import annotations

import argparse
import math
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.model.activations import silu


def seconds(fn, repeats: int) -> float:
    import mlx.core as mx

    for _ in range(10):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    print(f"device: {mx.default_device()}, mlx {mx.__version__}")
    x = mx.random.normal((args.rows, 768)) * 4
    y = mx.random.normal((args.rows, 768))
    mx.eval(x, y)
    ops = {
        "exp": lambda: mx.exp(x),
        "sigmoid": lambda: mx.sigmoid(x),
        "softmax (rows)": lambda: mx.softmax(x, axis=-1),
        "power(e, x)": lambda: mx.power(math.e, x),
        "log": lambda: mx.log(mx.abs(x) + 1),
        "multiply": lambda: x * y,
    }
    print("| op | ns per element |\n|---|---|")
    for name, fn in ops.items():
        print(f"| {name} | {seconds(fn, args.repeats) * 1e9 / x.size:.1f} |")

    exp_swiglu = mx.compile(lambda g, u: nn.silu(g) * u)
    power_swiglu = mx.compile(lambda g, u: silu(g) * u)
    print("\n| rows | compiled SwiGLU with exp, us | with power(e, x), us |\n|---|---|---|")
    for rows in (1, 3, 24):
        g, u = x[:rows], y[:rows]
        mx.eval(g, u)
        a = seconds(lambda g=g, u=u: exp_swiglu(g, u), args.repeats)
        b = seconds(lambda g=g, u=u: power_swiglu(g, u), args.repeats)
        print(f"| {rows} | {a * 1e6:.1f} | {b * 1e6:.1f} |")

    ref = np.array(x, dtype=np.float64)
    ref = ref / (1 + np.exp(-ref))
    ones = mx.ones_like(x)
    for name, fn in (("exp", exp_swiglu), ("power(e, x)", power_swiglu)):
        got = np.array(fn(x, ones), dtype=np.float64)
        err = np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30))
        print(f"silu with {name}: largest relative error {err:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
