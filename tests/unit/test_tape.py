"""A compiled block run as one op (engine/model/tape.py, engine/model/native/tape.cpp): every
output bit for bit the block's own — laid out, with mlx's ops (views, a fused elementwise
kernel) between the kernel's, and run again from its recorded work — over arguments that
change from call to call, strided ones among them; the trunk's decode forwards (one row and
batched, verifies rolled back in between) the same bits with tapes as with the compiled blocks
alone; one op in the graph."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model import products
from engine.model import trunk as trunk_module
from engine.model.tape import Taped
from engine.model.trunk import new_trunk_cache, trunk_hidden, trunk_hidden_rows
from tests.graphs import primitive_names

native = products.native()
pytestmark = pytest.mark.skipif(native is None, reason="the native kernel is not built")


def _weights(*shapes: tuple[int, int]) -> list[mx.array]:
    ws = [mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate(shapes)]
    ws = [w.astype(mx.bfloat16) for w in ws]
    mx.eval(ws)
    return ws


def _float(w: mx.array) -> tuple[Any, ...]:
    return (w, None, None, 0, 0, False)


def _block() -> Callable[..., tuple[mx.array, ...]]:
    w_gate, w_up, w_down = _weights((48, 40), (48, 40), (40, 48))
    norm = mx.ones((40,))
    mx.eval(norm)

    def block(x: mx.array, residual: mx.array) -> tuple[mx.array, ...]:
        gate, up = native.products(x, [_float(w_gate), _float(w_up)], norm, 1e-6)
        mixed = mx.sigmoid(gate) * up  # mlx's own ops between the kernel's
        out = native.products(mixed, [_float(w_down)], residual=residual)[0]
        return out, gate.reshape(-1), up[..., ::2]  # views among the outputs

    return block


def test_a_tape_gives_the_blocks_bits_call_after_call() -> None:
    block = _block()
    taped = Taped(mx.compile(block))
    for call in range(4):
        x = mx.random.normal((1, 3, 40), key=mx.random.key(10 + call))
        residual = mx.random.normal((1, 3, 40), key=mx.random.key(20 + call))
        if call == 3:  # a strided argument
            wide = mx.random.normal((1, 3, 80), key=mx.random.key(30))
            x = wide[..., ::2]
        got = taped(x, residual)
        if call > 0:
            assert primitive_names(*got) >= {"Tape"}
            assert not primitive_names(*got) & {"RowsProduct", "Sigmoid"}
        want = block(x, residual)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert np.array_equal(np.array(g), np.array(w))
    graph, many = next(iter(taped.graphs.values()))
    assert many and graph.nodes[0] == "RowsProduct" and any(n.endswith("*") for n in graph.nodes)


def _our_block() -> Callable[..., tuple[mx.array, ...]]:
    """The kernel's ops and mlx's views of their outputs (a tape that runs its work again)."""
    w_in, w_up, w_out = _weights((64, 40), (32, 40), (40, 32))
    norm = mx.ones((40,))
    mx.eval(norm)

    def block(x: mx.array, residual: mx.array) -> tuple[mx.array, ...]:
        joined, up = native.products(x, [_float(w_in), _float(w_up)], norm, 1e-6)
        heads = joined.reshape(*joined.shape[:-1], 2, 32)
        first, second = mx.split(heads, 2, axis=-1)  # strided views
        out = native.products(up, [_float(w_out)], gate=first, residual=residual)[0]
        return out, second, heads.transpose(0, 2, 1, 3)

    return block


def test_a_tape_of_the_kernel_s_ops_runs_its_work_again_bit_for_bit() -> None:
    """Its second run records, later runs repeat the recorded work over new arguments (strided
    ones among them) and new outputs: each call's outputs the block's own, and those of an
    earlier call unchanged by later ones."""
    block = _our_block()
    taped = Taped(mx.compile(block))
    kept = []
    for call in range(5):
        x = mx.random.normal((1, 3, 40), key=mx.random.key(40 + call))
        residual = mx.random.normal((1, 3, 40), key=mx.random.key(50 + call))
        if call >= 3:  # a strided argument
            x = mx.random.normal((1, 3, 80), key=mx.random.key(60 + call))[..., 1::2]
        got = taped(x, residual)
        mx.eval(got)
        want = block(x, residual)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and np.array_equal(np.array(g), np.array(w))
        kept.append((got, [np.array(w) for w in want]))
    for got, want in kept:
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(np.array(g), w)
    graph, _ = next(iter(taped.graphs.values()))
    assert graph.runs_again and any(n.endswith("*") for n in graph.nodes)


def test_a_block_of_another_shape_is_traced_anew() -> None:
    block = _block()
    taped = Taped(mx.compile(block))
    for rows in (1, 5, 1, 5):
        x = mx.random.normal((2, rows, 40), key=mx.random.key(rows))
        got, want = taped(x, x), block(x, x)
        assert np.array_equal(np.array(got[0]), np.array(want[0]))
    assert len(taped.graphs) == 2
    graph, _ = next(iter(taped.graphs.values()))
    with pytest.raises(ValueError, match="traced"):
        native.run_tape(graph, [mx.zeros((2, 3, 40)), mx.zeros((2, 3, 40))])


def test_an_argument_or_a_constant_among_the_outputs_is_itself() -> None:
    (w,) = _weights((16, 40))

    def block(x: mx.array) -> tuple[mx.array, ...]:
        return native.products(x, [_float(w)])[0], x, w

    taped = Taped(mx.compile(block))
    for call in range(4):
        x = mx.random.normal((1, 2, 40), key=mx.random.key(80 + call))
        out, same, weight = taped(x)
        assert np.array_equal(np.array(out), np.array(block(x)[0]))
        assert np.array_equal(np.array(same), np.array(x))
        assert weight.dtype == w.dtype
        assert np.array_equal(np.array(weight.astype(mx.float32)), np.array(w.astype(mx.float32)))
    graph, _ = next(iter(taped.graphs.values()))
    assert graph.runs_again


def test_a_block_without_ops_of_its_own_runs_as_itself() -> None:
    taped = Taped(lambda x: x)
    x = mx.arange(4)
    assert taped(x) is x and taped(x) is x


def _decode(trunk: nn.Module, rows: int) -> list[np.ndarray]:
    """Forwards of a decode after a prompt: plain steps and verifies, each verify keeping part
    of its positions (the GDN states rolled back, the KV caches trimmed)."""
    caches = [new_trunk_cache(trunk) for _ in range(rows)]
    for b, cache in enumerate(caches):
        mx.eval(trunk_hidden(trunk, mx.array([[3 + b, 9, 4, 7, 1]]), cache, capture=False))
        mx.eval(cache.arrays())
    outs = []
    for step, (fed, kept) in enumerate([(1, 1), (4, 2), (1, 1), (1, 1), (3, 3), (4, 1), (1, 1)]):
        ids = mx.array([[(5 * step + 3 * b + j) % 50 + 1 for j in range(fed)] for b in range(rows)])
        if rows == 1:
            hidden = trunk_hidden(trunk, ids, caches[0], capture=True)
        else:
            hidden = trunk_hidden_rows(trunk, ids, caches)
        mx.eval(hidden, *(c.arrays() for c in caches))
        outs.append(np.array(hidden))
        for cache in caches:
            cache.commit(kept, fed)
    return outs


def _forget_blocks() -> None:
    for o in gc.get_objects():
        if isinstance(o, nn.Module):
            o.__dict__.pop("_mtpserve_compiled", None)


@pytest.mark.parametrize("rows", [1, 2])
def test_decode_forwards_are_the_compiled_blocks_bits(
    load_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    trunk = load_engine("dense-tied").trunk
    _forget_blocks()
    _decode(trunk, rows)  # every shape traced
    taped = _decode(trunk, rows)
    graphs = [g for o in gc.get_objects() if isinstance(o, Taped) for g, _ in o.graphs.values()]
    assert any(g is not None and g.runs_again for g in graphs)
    monkeypatch.setattr(trunk_module, "Taped", lambda block: block)
    _forget_blocks()
    alone = _decode(trunk, rows)
    monkeypatch.undo()
    _forget_blocks()
    for got, want in zip(taped, alone, strict=True):
        assert np.array_equal(got, want)
