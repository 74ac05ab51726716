"""The trunk's activations, with the exponential mlx computes fastest on the device in use.

mlx's CPU backend evaluates ``exp`` (and with it ``sigmoid``, ``silu`` and the compiled blocks
that fuse them) one element at a time with out-of-line ``fmaf`` calls, about 3x the cost of
``power(e, x)`` (glibc's ``powf``; within 1 ulp, where mlx's ``exp`` is off by up to ~7), and a
decoder layer takes ~1,500 exponentials per position, so CPUs use ``power(e, x)``
(docs/CPU_CHOICES.md). On GPUs ``exp`` is one instruction:
``mx.exp`` there. Where the native kernel runs, the two largest users, an MLP's SwiGLU
(``swiglu``) and a GDN layer's conv (``gated_deltanet.causal_conv_silu``), are its own ops
with a 16-lane polynomial exp instead (~10x cheaper an element than powf).

The choice is made when a block is built (compiled blocks trace it once), from the default
device, and every path of one engine — prefill, plain and drafting cycles, batched rows —
runs the same formula, so greedy and sampled exactness between them is unchanged.
"""

from __future__ import annotations

import math

import mlx.core as mx

from engine.model import products


def exp(x: mx.array) -> mx.array:
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.power(math.e, x)
    return mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    return 1 / (1 + exp(-x))


def silu(x: mx.array) -> mx.array:
    return x / (1 + exp(-x))


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``, an MLP's activation: on a CPU with the native kernel one op
    (``SwiGlu``, its exp a 16-lane polynomial within ~2 ulp) where mlx's compiled kernel calls
    powf an element at a time (~10 ns each: 3,584 a 0.8B layer and position)."""
    if native := products.native_for(gate, up):
        return native.swiglu(gate, up)
    return silu(gate) * up
