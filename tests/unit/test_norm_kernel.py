"""The native RMS norms (engine/model/native/norms.cpp) against numpy in float64: widths that
are not a multiple of the kernel's 16 lanes, 1..64 rows, weights and gates of every float type,
strided inputs; the bit-identity decoding relies on (row t of a T-row norm is the one-row norm
of that row); that it is one lazy primitive inside ``mx.compile``; and its errors."""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from engine.model import norms, products

native = products.native()
pytestmark = pytest.mark.skipif(native is None, reason="the native kernel is not built")

EPS = 1e-6
WIDTHS = (1, 7, 16, 17, 100, 1024)
FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def _reference(x: np.ndarray, w: np.ndarray, gate: np.ndarray | None = None) -> np.ndarray:
    x = x.astype(np.float64)
    out = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * w.astype(np.float64)
    if gate is not None:
        g = gate.astype(np.float64)
        out = out * g / (1 + np.exp(-g))
    return out


def _operands(rows: int, width: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)
    x = mx.array(3 * rng.standard_normal((rows, width)).astype(np.float32))
    w = mx.array(rng.standard_normal(width).astype(np.float32)).astype(dtype)
    gate = mx.array(rng.standard_normal((rows, width)).astype(np.float32)).astype(dtype)
    return x, w, gate


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", WIDTHS)
def test_norms_match_numpy(width: int, dtype: mx.Dtype) -> None:
    x, w, gate = _operands(5, width, dtype, width)
    w64 = np.array(w.astype(mx.float32))
    g64 = np.array(gate.astype(mx.float32))
    got = native.rms_norm(x, w, EPS)
    gated = native.gated_rms_norm(x, w, gate, EPS)
    assert got.dtype == gated.dtype == mx.float32 and got.shape == x.shape
    np.testing.assert_allclose(np.array(got), _reference(np.array(x), w64), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(
        np.array(gated), _reference(np.array(x), w64, g64), rtol=2e-6, atol=2e-6
    )


@pytest.mark.parametrize("width", (17, 1024))
def test_row_t_of_t_rows_is_the_one_row_norm(width: int) -> None:
    """The floats of a row do not depend on how many rows are normalised with it."""
    x, w, gate = _operands(64, width, mx.bfloat16, 1)
    for rows in (1, 2, 5, 24, 64):
        many = native.rms_norm(x[:rows], w, EPS)
        many_gated = native.gated_rms_norm(x[:rows], w, gate[:rows], EPS)
        for t in range(rows):
            assert mx.array_equal(many[t], native.rms_norm(x[t : t + 1], w, EPS)[0]).item()
            one = native.gated_rms_norm(x[t : t + 1], w, gate[t : t + 1], EPS)[0]
            assert mx.array_equal(many_gated[t], one).item()


def test_strided_inputs_are_read_as_their_values() -> None:
    """A transposed or sliced x (a view mlx did not copy) gives the norm of what it holds."""
    x, w, gate = _operands(24, 16, mx.float32, 2)
    x3 = x.reshape(4, 6, 16).transpose(1, 0, 2)  # [6, 4, 16], not row-contiguous
    g3 = gate.reshape(4, 6, 16).transpose(1, 0, 2)
    want = native.rms_norm(mx.contiguous(x3), w, EPS)
    assert mx.array_equal(native.rms_norm(x3, w, EPS), want).item()
    want_gated = native.gated_rms_norm(mx.contiguous(x3), w, mx.contiguous(g3), EPS)
    assert mx.array_equal(native.gated_rms_norm(x3, w, g3, EPS), want_gated).item()
    joined = native.gated_rms_norm(x3, w, g3.reshape(6, 64), EPS)  # the heads' gates joined
    assert joined.shape == (6, 64)
    assert mx.array_equal(joined, want_gated.reshape(6, 64)).item()
    fallback = norms.gated_rms_norm(_Norm(w), x3, g3.reshape(6, 64))  # the same shapes either way
    assert fallback.shape == (6, 64)
    sliced = x[:, ::2]
    np.testing.assert_allclose(
        np.array(native.rms_norm(sliced, w[::2], EPS)),
        _reference(np.array(sliced), np.array(w[::2])),
        rtol=2e-6,
        atol=2e-6,
    )


def test_a_norm_is_one_lazy_primitive_also_compiled() -> None:
    """``norms.rms_norm`` on a native CPU is the kernel's one primitive (where mlx's own norm
    is a square, a sum and a fused rest), lazy, and compiles with the rest of a block to the
    same floats."""
    x, w, gate = _operands(3, 100, mx.float32, 3)
    dot = io.StringIO()
    mx.export_to_dot(dot, norms.rms_norm(x, w, EPS), norms.gated_rms_norm(_Norm(w), x, gate))
    kinds = re.findall(r'label ="([A-Za-z]+)', dot.getvalue())
    assert sorted(kinds) == ["GatedRMSNorm", "RMSNorm"]
    block = mx.compile(lambda a, b: norms.rms_norm(a, w, EPS) + b)
    assert mx.array_equal(block(x, gate), native.rms_norm(x, w, EPS) + gate).item()


class _Norm:
    """What ``gated_rms_norm`` reads of a gated norm module."""

    def __init__(self, weight: mx.array) -> None:
        self.weight, self.eps = weight, EPS


def test_model_norms_run_on_the_kernel(load_engine) -> None:
    """Every ``nn.RMSNorm`` of a loaded model is routed through the kernel, its weight kept."""
    import mlx.nn as nn

    engine = load_engine("dense-tied")
    found = [m for _, m in engine.trunk.named_modules() if isinstance(m, nn.RMSNorm)]
    assert found and all(isinstance(m, norms.RMSNorm) for m in found)
    x = mx.random.normal((2, found[0].weight.shape[0]))
    assert mx.array_equal(found[0](x), native.rms_norm(x, found[0].weight, found[0].eps)).item()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: native.rms_norm(mx.ones((2, 8), mx.bfloat16), mx.ones(8), EPS), "float32"),
        (lambda: native.rms_norm(mx.ones((2, 8)), mx.ones(7), EPS), "weight"),
        (lambda: native.rms_norm(mx.ones((2, 8)), mx.ones((1, 8)), EPS), "weight"),
        (lambda: native.rms_norm(mx.ones((2, 8)), mx.ones(8, mx.int32), EPS), "float"),
        (lambda: native.gated_rms_norm(mx.ones((2, 8)), mx.ones(8), mx.ones(8), EPS), "gate"),
    ],
)
def test_bad_operands_are_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
