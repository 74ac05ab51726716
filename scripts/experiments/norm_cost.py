"""What the RMS norms of one decode step cost: mlx's own CPU norm against the native kernel's
(engine/model/norms.py), at a Qwen3.5-0.8B step's shapes.

Per layer, as the trunk runs them: the input and post-attention norms over the hidden state
[T, 1024]; in the Gated-DeltaNet layers (three of four) the gated norm of the output heads
[T, 16, 128]; in the attention layers the q and k head norms [T, 8, 256] and [T, 2, 256]; each
layer an ``mx.compile``d block, 24 layers and the final norm a graph, evaluated together.
Milliseconds a step, lowest and median of ``--rounds`` alternations, at T = 1 and 5 (a plain
step, a K=4 verify), and each graph's primitives::

    python scripts/experiments/norm_cost.py
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import statistics
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.model import norms
from engine.model.activations import silu

LAYERS = 24
EPS = 1e-6


def mlx_norm(x, w):  # noqa: ANN001, ANN201
    import mlx.core as mx

    return mx.fast.rms_norm(x, w, EPS)


def mlx_gated(x, w, gate):  # noqa: ANN001, ANN201
    import mlx.core as mx

    return (silu(gate) * mx.fast.rms_norm(x, w, EPS)).astype(x.dtype)


def native_norm(x, w):  # noqa: ANN001, ANN201
    return norms.rms_norm(x, w, EPS)


def native_gated(x, w, gate):  # noqa: ANN001, ANN201
    class Norm:
        weight, eps = w, EPS

    return norms.gated_rms_norm(Norm, x, gate)


def step_graph(norm, gated, weights, T: int):  # noqa: ANN001, ANN201
    """The outputs of one step's norms, each layer a compiled block."""
    import mlx.core as mx

    hidden, head, gdn = weights

    def gdn_layer(x, y):  # noqa: ANN001, ANN202
        x = norm(norm(x, hidden), hidden)
        return x, gated(y, gdn, y)

    def attention_layer(x, q, k):  # noqa: ANN001, ANN202
        x = norm(norm(x, hidden), hidden)
        return x, norm(q, head), norm(k, head)

    gdn_block, attention_block = mx.compile(gdn_layer), mx.compile(attention_layer)
    x = mx.random.normal((T, 1024))
    y = mx.random.normal((T, 16, 128))
    q = mx.random.normal((T, 8, 256))
    k = mx.random.normal((T, 2, 256))
    mx.eval(x, y, q, k)

    def run() -> list:
        xs, outs = x, []
        for layer in range(LAYERS):
            if layer % 4 == 3:
                xs, qs, ks = attention_block(xs, q, k)
                outs += [qs, ks]
            else:
                xs, ys = gdn_block(xs, y)
                outs.append(ys)
        return [norm(xs, hidden), *outs]

    return run


def primitives(outputs: list) -> int:
    import mlx.core as mx

    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sum(collections.Counter(re.findall(r'label ="([A-Za-z]+)', dot.getvalue())).values())


def main() -> int:
    import mlx.core as mx

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="steps timed together a round")
    args = p.parse_args()
    weights = tuple(mx.random.normal((n,)).astype(mx.bfloat16) for n in (1024, 256, 128))
    ways = {"mlx": (mlx_norm, mlx_gated), "native": (native_norm, native_gated)}
    for T in (1, 5):
        runs = {name: step_graph(*fns, weights, T) for name, fns in ways.items()}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(2):  # compile
            for run in runs.values():
                mx.eval(run())
        for _ in range(args.rounds):
            for name, run in runs.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    mx.eval(run())
                times[name].append((time.perf_counter() - t) / args.steps * 1e3)
        for name, run in runs.items():
            print(
                f"T={T} {name:6s} {min(times[name]):.3f} ms lowest, "
                f"{statistics.median(times[name]):.3f} median, {primitives(run())} primitives"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
