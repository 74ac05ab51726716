"""A compiled block run as one op on a CPU with the native kernel (the native module's ``Tape``).

A small model's decode step on a CPU is bound by per-op costs, not arithmetic: mlx evaluates
each op on the calling thread (allocating its outputs, ordering it, queueing its task under a
lock) and runs each as a task of its own on the stream's one thread, between which the product
pool's workers go to sleep, and the calling thread's share took the core those workers need.
``Taped(block)`` traces the block's ops once per shape and type of its arguments (that first
call runs the block itself) and runs each later call as one op whose nodes are the traced ops
(engine/model/native/tape.cpp): the kernel's work handed to the stream as one task; and for a
block of only the kernel's ops and mlx's views of their outputs (the trunk's decode blocks of
a dense Qwen3.5), from its second call on, the work its second call recorded run again over
the new arguments and outputs, with no op evaluated on the calling thread (the values between
its ops kept from call to call: at most 1 MiB a block, 64 MiB in all). As with ``mx.compile``, what
the block reads that is not an argument is a constant of it. Every output is bit for bit the
block's own (``tests/unit/test_tape.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine.model import products


class Taped:
    """``block`` (a function of arrays returning an array or a tuple of them, e.g. an
    ``mx.compile``-d layer) run as a tape on the native kernel, as itself elsewhere."""

    def __init__(self, block: Callable[..., Any]) -> None:
        self.block = block
        #: per argument shapes and types: the traced graph (None: the block cannot be one) and
        #: whether the block returns a tuple
        self.graphs: dict[tuple[tuple[Any, ...], ...], tuple[Any, bool]] = {}

    def __call__(self, *args: mx.array) -> Any:
        if not products.on_native():
            return self.block(*args)
        native = products.native()
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        traced = self.graphs.get(key)
        if traced is None:
            out = self.block(*args)
            many = isinstance(out, tuple | list)
            graph = native.trace_tape(list(args), list(out) if many else [out])
            self.graphs[key] = (graph, many)
            return out
        graph, many = traced
        if graph is None:
            return self.block(*args)
        outs = native.run_tape(graph, list(args))
        return tuple(outs) if many else outs[0]
