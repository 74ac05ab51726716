"""A prefill's Gated-DeltaNet recurrence on CPUs: mlx-lm's step-by-step rule against
``engine.model.delta_rule.delta_rule_prefill``'s closed-form blocks, for several block sizes.

One GDN layer of the demo model's shape (4 value heads, 2 key heads repeated, 64 x 64 state)
over a 512-token chunk: milliseconds (best of ``--repeats``) and the largest error of the
outputs and the final state against the rule in float64, for random keys and for one key
repeated with little decay (where the squaring series of a verify pass overflows float32)::

    python scripts/experiments/prefill_gdn_cost.py
"""

from __future__ import annotations

import argparse
import json
import time

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
import engine.model.delta_rule as delta_rule  # isort: skip
import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_update


def inputs(tokens: int, keys: str) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    heads, dim = 4, 64
    q = rng.standard_normal((1, tokens, heads, dim)) / dim
    k = rng.standard_normal((1, tokens, heads, dim))
    if keys == "repeated":
        k[:] = k[:, :1]
        log_g, beta = np.full((1, tokens, heads), -1e-4), np.full((1, tokens, heads), 0.99)
    else:
        log_g = -(rng.uniform(0, 1, (1, tokens, heads)) ** 3)
        beta = rng.uniform(0, 1, (1, tokens, heads))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, tokens, heads, dim))
    state = 0.1 * rng.standard_normal((1, heads, dim, dim))
    return q, k, v, log_g, beta, state


def reference(q, k, v, log_g, beta, state) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    s, y = state.copy(), np.zeros_like(v)
    for t in range(q.shape[1]):
        s = s * np.exp(log_g[:, t])[..., None, None]
        u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhvk,bhk->bhv", s, k[:, t]))
        s = s + np.einsum("bhv,bhk->bhvk", u, k[:, t])
        y[:, t] = np.einsum("bhvk,bhk->bhv", s, q[:, t])
    return y, s


def best_ms(run, repeats: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(keys: str, tokens: int, block_sizes: list[int], repeats: int) -> None:
    arrays = inputs(tokens, keys)
    y_ref, s_ref = reference(*arrays)
    q, k, v, log_g, beta, state = (mx.array(a.astype(np.float32)) for a in arrays)

    def errors(y: mx.array, s: mx.array) -> dict[str, float]:
        return {
            "y error": float(np.abs(np.array(y) - y_ref).max()),
            "state error": float(np.abs(np.array(s) - s_ref).max()),
        }

    # mlx-lm's rule takes the gate's inputs: a = softplus^-1(-log_g) with A_log = dt = 0
    a = mx.log(mx.expm1(-log_g))
    b = mx.log(beta / (1 - beta))
    zero = mx.zeros((q.shape[2],))

    def stepwise() -> tuple[mx.array, mx.array]:
        return gated_delta_update(q, k, v, a, b, zero, zero, state, None, use_kernel=False)

    row = {"keys": keys, "rule": "mlx-lm step by step", "ms": best_ms(stepwise, repeats)}
    print(json.dumps({**row, **errors(*stepwise())}), flush=True)
    for block in block_sizes:
        delta_rule.PREFILL_GDN_BLOCK = block

        def blocks() -> tuple[mx.array, mx.array]:
            return delta_rule.delta_rule_prefill(q, k, v, log_g, beta, state, 0)

        row = {"keys": keys, "rule": f"blocks of {block}", "ms": best_ms(blocks, repeats)}
        print(json.dumps({**row, **errors(*blocks())}), flush=True)

    def squaring(block: int = 64) -> tuple[mx.array, mx.array]:
        """Blocks of 64 inverted by the verify pass's squaring series instead."""
        ys, s = [], state
        for t in range(0, q.shape[1], block):
            part = (x[:, t : t + block] for x in (q, k, v, log_g, beta))
            y, capture = delta_rule.delta_rule_chunk(*part, s)
            s = capture.state_after(y.shape[1])
            ys.append(y)
        return mx.concatenate(ys, axis=1), s

    row = {"keys": keys, "rule": "blocks of 64, squaring series", "ms": None}
    print(json.dumps({**row, **errors(*squaring())}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--blocks", default="16,32,64,128")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for keys in ("random", "repeated"):
        measure(keys, args.tokens, [int(b) for b in args.blocks.split(",")], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
