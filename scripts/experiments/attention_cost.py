"""One decode-time attention call, before and after ``engine/model/attention.py``.

Before: mlx-lm's ``KVCache.update_and_fetch`` and mlx's ``scaled_dot_product_attention`` over
the cache; after: ``attend_row`` (the write, and the attention over the cache padded to
``KV_BLOCK`` positions). A cache of L random positions, T new ones per call (then trimmed
again), best of five rounds of ``--calls`` calls each with the two ways alternating,
microseconds, for the demo model's heads
and the 0.8B shape's (``--caches 16``: each call the next of 16 caches, read from memory)::

    python scripts/experiments/attention_cost.py
    python scripts/experiments/attention_cost.py --lengths 2000,6000 --new 1,5 --caches 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.model import attention

mx = attention.mx
KVCache = attention.KVCache

HEADS = {"demo": (4, 2, 64), "0.8B": (8, 2, 256)}


def _cache(cls: type, kv_heads: int, dim: int, length: int) -> Any:
    cache = cls()
    cache.update_and_fetch(
        mx.random.normal((1, kv_heads, length, dim)), mx.random.normal((1, kv_heads, length, dim))
    )
    mx.eval(cache.keys, cache.values)
    return cache


def _best_of_both(ways: list[Callable[[], Any]], calls: int) -> list[float]:
    """Microseconds per call of each way: best of five rounds, the ways alternating in each
    round (this machine's speed drifts within seconds)."""
    for way in ways:
        for _ in range(10):
            mx.eval(way())
    best = [float("inf")] * len(ways)
    for _ in range(5):
        for i, way in enumerate(ways):
            start = time.perf_counter()
            for _ in range(calls):
                mx.eval(way())
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return [round(b * 1e6, 1) for b in best]


def compare(
    heads: tuple[int, int, int], length: int, t: int, calls: int, caches: int = 1
) -> tuple[float, float]:
    """Microseconds per call, (before, after); with several caches a call takes the next in
    turn, so that a cache larger than the machine's caches is read from memory, as a decode
    step reads each layer's after the weights have streamed through them."""
    q_heads, kv_heads, dim = heads
    q = mx.random.normal((1, q_heads, t, dim)) * dim**-0.5
    k = mx.random.normal((1, kv_heads, t, dim))
    v = mx.random.normal((1, kv_heads, t, dim))
    mx.eval(q, k, v)
    befores = itertools.cycle([_cache(KVCache, kv_heads, dim, length) for _ in range(caches)])
    afters = itertools.cycle(
        [_cache(attention.RowKVCache, kv_heads, dim, length) for _ in range(caches)]
    )

    def old() -> Any:
        before = next(befores)
        keys, values = before.update_and_fetch(k, v)
        mask = "causal" if t > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        before.trim(t)
        return out

    def new() -> Any:
        after = next(afters)
        out = attention.attend_row(q, k, v, after)
        after.trim(t)
        return out

    before_us, after_us = _best_of_both([old, new], calls)
    return before_us, after_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="300,2000,8000")
    p.add_argument("--new", default="1,4", help="positions per call (T)")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--caches", type=int, default=1, help="caches taken in turn (16: out of cache)")
    args = p.parse_args()
    for name, heads in HEADS.items():
        for length in map(int, args.lengths.split(",")):
            for t in map(int, args.new.split(",")):
                before, after = compare(heads, length, t, args.calls, args.caches)
                row = {"heads": name, "L": length, "T": t, "before_us": before, "after_us": after}
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
