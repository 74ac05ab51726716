"""The native elementwise ops (engine/model/native/elementwise.cpp): the causal conv + silu,
SwiGLU and the rotary embedding against numpy in float64 (silu's exp is a polynomial within
~2 ulp, mlx's path powf); the bit-identities decoding relies on — a position's conv or rotary
output does not depend on how many positions are computed with it, and the 16-lane and
one-at-a-time silu agree — for every length decoding and prefill use, taps of every float
type, with and without a bias, strided inputs; the head's draft logits scattered into the
vocabulary as mlx places them; token embeddings, float and quantized, as mlx looks them up and
dequantizes them; one lazy primitive each; their errors."""

from __future__ import annotations

import io
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model import norms, products
from engine.model.activations import swiglu
from engine.model.gated_deltanet import causal_conv_silu, conv_window_silu
from engine.model.trunk import rotated
from tests.graphs import primitive_names

native = products.native()
pytestmark = pytest.mark.skipif(native is None, reason="the native kernel is not built")


def _conv(channels: int, bias: bool, dtype: mx.Dtype) -> nn.Conv1d:
    mx.random.seed(channels)
    conv = nn.Conv1d(channels, channels, 4, groups=channels, bias=bias)
    conv.set_dtype(dtype)
    mx.eval(conv.parameters())
    return conv


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _conv_reference(conv: nn.Conv1d, window: np.ndarray) -> np.ndarray:
    taps = np.array(conv.weight.astype(mx.float32))[:, :, 0].T.astype(np.float64)  # [K, C]
    k = taps.shape[0]
    positions = window.shape[1] - k + 1
    out = sum(window[:, j : j + positions].astype(np.float64) * taps[j] for j in range(k))
    if "bias" in conv:
        out = out + np.array(conv.bias.astype(mx.float32), dtype=np.float64)
    return _silu(out)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_matches_numpy_and_each_position_is_its_own(bias: bool, dtype: mx.Dtype) -> None:
    conv = _conv(37, bias, dtype)
    window = 4 * mx.random.normal((2, 133, 37), key=mx.random.key(1))
    whole = causal_conv_silu(conv, window)
    # float32 sums of four products of up to ~8 each: a few 1e-7 absolute where they cancel
    np.testing.assert_allclose(
        np.array(whole), _conv_reference(conv, np.array(window)), rtol=1e-5, atol=1e-5
    )
    for positions in (1, 2, 5, 9, 64):
        for first in (0, 7, 130 - positions):
            part = causal_conv_silu(conv, window[:, first : first + positions + 3])
            assert mx.array_equal(part, whole[:, first : first + positions]).item()


def test_the_window_and_its_conv_in_one_op_are_the_two_ops_bit_for_bit() -> None:
    """``conv_window_silu``: the window [state | new] and the conv over it in one op give the
    concatenation and ``causal_conv_silu`` of it, bit for bit, with and without a bias."""
    for bias in (False, True):
        conv = _conv(40, bias, mx.float32)
        state = mx.random.normal((2, 3, 40), key=mx.random.key(8))
        new = mx.random.normal((2, 5, 40), key=mx.random.key(9))
        window, out = conv_window_silu(conv, state, new)
        joined = mx.concatenate([state, new], axis=1)
        assert mx.array_equal(window, joined).item()
        assert mx.array_equal(out, causal_conv_silu(conv, joined)).item()
    with pytest.raises(ValueError, match="taps"):
        native.causal_conv_silu_window(state[:, :2], new, mx.ones((4, 40)))


def test_swiglu_matches_numpy_and_lanes_agree_with_the_tail() -> None:
    rng = np.random.default_rng(2)
    gate = (20 * rng.standard_normal((3, 53))).astype(np.float32)
    up = rng.standard_normal((3, 53)).astype(np.float32)
    got = np.array(swiglu(mx.array(gate), mx.array(up)))
    np.testing.assert_allclose(got, _silu(gate.astype(np.float64)) * up, rtol=1e-6, atol=1e-30)
    # element 16 + i is lane i of the second vector in the whole rows, a tail element here
    shifted = np.array(swiglu(mx.array(gate[:, 16:20]), mx.array(up[:, 16:20])))
    assert np.array_equal(got[:, 16:20], shifted)


def test_strided_inputs_are_read_as_their_values() -> None:
    conv = _conv(16, False, mx.bfloat16)
    window = mx.random.normal((2, 8, 32))[:, :, ::2]  # a view mlx did not copy
    assert mx.array_equal(
        causal_conv_silu(conv, window), causal_conv_silu(conv, mx.contiguous(window))
    ).item()
    gate, up = mx.random.normal((6, 8)).T, mx.random.normal((8, 6))
    assert mx.array_equal(swiglu(gate, up), swiglu(mx.contiguous(gate), up)).item()


def test_one_lazy_primitive_each() -> None:
    conv = _conv(16, True, mx.float32)
    window, gate = mx.random.normal((1, 4, 16)), mx.random.normal((2, 16))
    mx.eval(window, gate)
    dot = io.StringIO()
    mx.export_to_dot(dot, causal_conv_silu(conv, window), swiglu(gate, gate))
    assert sorted(re.findall(r'label ="([A-Za-z]+)', dot.getvalue())) == [
        "CausalConvSilu",
        "SwiGlu",
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: native.causal_conv_silu(mx.ones((1, 4, 8), mx.bfloat16), mx.ones((4, 8))),
            "float32",
        ),
        (lambda: native.causal_conv_silu(mx.ones((4, 8)), mx.ones((4, 8))), "float32"),
        (lambda: native.causal_conv_silu(mx.ones((1, 4, 8)), mx.ones((4, 7))), "taps"),
        (lambda: native.causal_conv_silu(mx.ones((1, 3, 8)), mx.ones((4, 8))), "taps"),
        (lambda: native.causal_conv_silu(mx.ones((1, 4, 8)), mx.ones((4, 8), mx.int32)), "float"),
        (lambda: native.swiglu(mx.ones((2, 8)), mx.ones((2, 7))), "one shape"),
        (lambda: native.swiglu(mx.ones((2, 8), mx.bfloat16), mx.ones((2, 8))), "float32"),
    ],
)
def test_bad_operands_are_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def _rope_reference(x: np.ndarray, offsets: list[int], dims: int, base: float) -> np.ndarray:
    """mlx's rotary embedding (non-traditional) in float64, [B, L, H, D] -> [B, H, L, D]."""
    half = dims // 2
    frequency = np.exp(-np.arange(half) * (np.log(base) / half))
    out = x.astype(np.float64).copy()
    for b, offset in enumerate(offsets):
        theta = (np.arange(x.shape[1]) + offset)[:, None, None] * frequency  # [L, 1, half]
        x1, x2 = out[b, ..., :half].copy(), out[b, ..., half:dims].copy()
        out[b, ..., :half] = x1 * np.cos(theta) - x2 * np.sin(theta)
        out[b, ..., half:dims] = x1 * np.sin(theta) + x2 * np.cos(theta)
    return out.transpose(0, 2, 1, 3)


def test_rope_matches_numpy_and_mlx_and_each_position_is_its_own() -> None:
    """The rotary embedding of queries or keys, transposed and scaled in one op: within float32
    rounding of the float64 formula and of mlx's own ``mx.fast.rope``, per-row offsets for a
    batch, and a position's output the same bits whichever positions share the op."""
    rope = nn.RoPE(64, base=1e7)
    x = mx.random.normal((3, 5, 4, 256), key=mx.random.key(5))
    offsets = [0, 17, 300]
    got = rotated(rope, x, mx.array(offsets), 0.5)
    assert got.shape == (3, 4, 5, 256)
    want = _rope_reference(np.array(x), offsets, 64, 1e7) * 0.5
    assert np.abs(np.array(got) - want).max() < 1e-5
    for b, offset in enumerate(offsets):
        theirs = rope(x[b : b + 1].transpose(0, 2, 1, 3), offset=offset) * 0.5
        assert np.abs(np.array(got[b : b + 1]) - np.array(theirs)).max() < 1e-5
        for t in range(5):  # position t alone, at its own offset
            alone = rotated(rope, x[b : b + 1, t : t + 1], mx.array(offset + t), 0.5)
            assert np.array_equal(np.array(alone), np.array(got[b : b + 1, :, t : t + 1]))
    norm = nn.RMSNorm(256, eps=1e-6)
    norm.weight = mx.random.normal((256,), key=mx.random.key(6)) * 0.1 + 1
    normed_inside = rotated(rope, x, mx.array(offsets), 0.5, norm)  # the head norm in the op
    normed_before = rotated(rope, norms.rms_norm(x, norm.weight, 1e-6), mx.array(offsets), 0.5)
    assert np.array_equal(np.array(normed_inside), np.array(normed_before))
    traditional = nn.RoPE(64, traditional=True, base=1e7)
    theirs = traditional(x[:1].transpose(0, 2, 1, 3), offset=9)
    ours = rotated(traditional, x[:1], mx.array(9))
    assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-5
    with pytest.raises(ValueError, match="offset"):
        native.rope(x, mx.array([1, 2]), 64, 1e7, 1.0, False)
    with pytest.raises(ValueError, match="dims"):
        native.rope(x, mx.array(1), 63, 1e7, 1.0, False)


def test_scattered_columns_are_mlx_s_put_along_axis_into_minus_infinity() -> None:
    """The MTP head's draft logits placed in the full vocabulary: one op, bit for bit mlx's
    ``full(-inf)`` and ``put_along_axis``; an id outside the row places nothing."""
    values = mx.random.normal((2, 3, 5), key=mx.random.key(7))
    ids = mx.array([0, 4, 9, 17, 31], dtype=mx.int32)
    got = native.scatter_columns(values, ids, 32)
    empty = mx.full((2, 3, 32), -mx.inf, dtype=mx.float32)
    want = mx.put_along_axis(empty, mx.broadcast_to(ids, values.shape), values, axis=-1)
    assert got.shape == (2, 3, 32) and np.array_equal(np.array(got), np.array(want))
    assert primitive_names(native.scatter_columns(values, ids, 32)) == {"ScatterColumns"}
    outside = native.scatter_columns(values[..., :2], mx.array([3, 40], dtype=mx.int32), 32)
    row = np.array(outside)[0, 0]
    assert row[3] == np.array(values)[0, 0, 0] and np.isneginf(np.delete(row, 3)).all()
    with pytest.raises(ValueError, match="scatter_columns"):
        native.scatter_columns(values, ids[:4], 32)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_embedded_rows_are_mlx_s_lookup_and_cast(dtype: mx.Dtype) -> None:
    """A token embedding and its cast to float32 as one op, bit for bit mlx's gather and
    ``astype`` for every float table type and id shape (a decode step's ``[1, T]``, a batch's
    ``[B, T]``); an id outside the table gives zeros; ``products.embedded`` runs it for a float
    ``nn.Embedding`` and int32 ids, and mlx's ops for other ids."""
    table = nn.Embedding(50, 24)
    table.set_dtype(dtype)
    mx.eval(table.parameters())
    ids = mx.array([[3, 0, 49, 7], [1, 1, 2, 3]], dtype=mx.int32)
    for shape in ((1, 4), (2, 4), (4,)):
        chosen = ids.reshape(-1)[: int(np.prod(shape))].reshape(shape)
        got = native.embed_rows(table.weight, chosen)
        want = table(chosen).astype(mx.float32)
        assert got.dtype == mx.float32 and got.shape == (*shape, 24)
        assert np.array_equal(np.array(got), np.array(want))
    assert primitive_names(products.embedded(table, ids)) == {"EmbedRows"}
    assert np.array_equal(
        np.array(products.embedded(table, ids.astype(mx.uint32))),
        np.array(native.embed_rows(table.weight, ids)),
    )
    outside = np.array(native.embed_rows(table.weight, mx.array([2, 50, -1], dtype=mx.int32)))
    assert np.array_equal(outside[0], np.array(table.weight[2].astype(mx.float32)))
    assert not outside[1:].any()
    with pytest.raises(ValueError, match="embed_rows"):
        native.embed_rows(table.weight, ids.astype(mx.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_embedded_rows_are_mlx_s_lookup_dequantize_and_cast(
    dtype: mx.Dtype, bits: int
) -> None:
    """A quantized token embedding as one op, bit for bit mlx's gather, ``dequantize`` and
    ``astype`` (which take ~70 ops on a CPU) for every bit width it packs in whole words, every
    group size, every scale type, laid out 16 rows side by side (``products.interleave``) or
    not, and every id shape; an id outside the table gives zeros; ``products.embedded`` runs it
    for an ``nn.QuantizedEmbedding`` (laid out or not) and int32 ids."""
    ids = mx.array([[3, 0, 63, 17], [16, 31, 32, 47]], dtype=mx.int32)
    for group in (32, 64, 128):
        table = nn.Embedding(64, 256)
        table.set_dtype(dtype)
        table.weight = table.weight * 3  # codes spread over every bit of their range
        quantized = nn.QuantizedEmbedding.from_embedding(table, group_size=group, bits=bits)
        mx.eval(quantized.parameters())
        layouts = [(quantized, False)]
        if bits in (4, 8):
            laid_out = nn.QuantizedEmbedding.from_embedding(table, group_size=group, bits=bits)
            laid_out.weight, laid_out.scales, laid_out.biases = products.interleave(
                laid_out.weight, laid_out.scales, laid_out.biases
            )
            mx.eval(laid_out.parameters())
            layouts.append((laid_out, True))
        for shape in ((1, 4), (2, 4), (4,)):
            chosen = ids.reshape(-1)[: int(np.prod(shape))].reshape(shape)
            want = quantized(chosen).astype(mx.float32)
            for layer, interleaved in layouts:
                got = native.embed_quantized_rows(
                    layer.weight, layer.scales, layer.biases, chosen, bits, group, interleaved
                )
                assert got.dtype == mx.float32 and got.shape == (*shape, 256)
                assert np.array_equal(np.array(got), np.array(want)), (group, shape, interleaved)
    assert primitive_names(products.embedded(quantized, ids)) == {"EmbedQuantizedRows"}
    assert np.array_equal(
        np.array(products.embedded(quantized, ids.astype(mx.uint32))),
        np.array(quantized(ids).astype(mx.float32)),
    )
    outside = native.embed_quantized_rows(
        quantized.weight,
        quantized.scales,
        quantized.biases,
        mx.array([2, 64, -1], dtype=mx.int32),
        bits,
        128,
    )
    assert np.array_equal(
        np.array(outside)[0], np.array(quantized(mx.array([2])).astype(mx.float32))[0]
    )
    assert not np.array(outside)[1:].any()
    with pytest.raises(ValueError, match="embed_quantized_rows"):  # groups that do not fit
        native.embed_quantized_rows(
            quantized.weight, quantized.scales, quantized.biases, ids, bits, 64
        )


def test_products_embed_a_laid_out_quantized_table_in_one_op() -> None:
    """``products.embedded`` over a table ``interleave_layers`` laid out: one op, the bits of
    the same table's lookup before it was laid out."""
    table = nn.Embedding(64, 256)
    quantized = nn.QuantizedEmbedding.from_embedding(table, group_size=64, bits=8)
    mx.eval(quantized.parameters())
    ids = mx.array([[5, 21, 63]], dtype=mx.int32)
    want = np.array(quantized(ids).astype(mx.float32))
    model = nn.Module()
    model.table = quantized
    if not products.interleave_layers(model):
        pytest.skip("this CPU's kernel keeps row-major codes")
    assert type(model.table) is products.InterleavedEmbedding
    assert products.embeds_in_one_op(model.table)
    got = products.embedded(model.table, ids)
    assert primitive_names(got) == {"EmbedQuantizedRows"}
    assert np.array_equal(np.array(got), want)
