"""RMS norms: on the native kernel where products run on it, else ``mx.fast.rms_norm``.

mlx's CPU backend has no kernel of its own for ``mx.fast.rms_norm``: it evaluates the norm as
three primitives (square, sum, the rest fused; the gated norm of a Gated-DeltaNet layer's
output four), each a task on its one stream thread, and a decode step has two or three norms a
layer (27 of a demo model's 428 primitives a plain step, 79 at the 0.8B shape). The native
``RMSNorm`` primitive does each in one pass. Each row is normalised on its own with its sum of
squares in an order fixed by its length, so row t of a T-row norm is the one-row norm of that
row, and every path of an engine (prefill, plain and drafting cycles, batched rows) runs the
same op: exactness between them is unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.model import products
from engine.model.activations import silu


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``."""
    if native := products.native_for(x):
        return native.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def gated_rms_norm(norm: nn.Module, x: mx.array, gate: mx.array) -> mx.array:
    """mlx-lm's ``Qwen3NextRMSNormGated``: the RMS norm of x times silu(gate), in float32, in the
    gate's shape (``x [..., H, D]`` with a gate ``[..., H * D]`` as its projection emits it:
    the heads come out joined, as the output projection takes them)."""
    if native := products.native_for(x):
        return native.gated_rms_norm(x, norm.weight, gate, norm.eps)
    normed = mx.fast.rms_norm(x, norm.weight, norm.eps).astype(mx.float32)
    gated = silu(gate.astype(mx.float32).reshape(x.shape)) * normed
    return gated.astype(x.dtype).reshape(gate.shape)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through ``rms_norm``: what ``prepare`` makes of the model's norms."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


def prepare(model: nn.Module) -> None:
    """Route every ``nn.RMSNorm`` under ``model`` through ``rms_norm`` (its parameters kept:
    only the instance's class changes)."""
    for _, module in model.named_modules():
        if type(module) is nn.RMSNorm:
            module.__class__ = RMSNorm
