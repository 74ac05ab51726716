"""The native product kernel (engine/model/native) against numpy in float64: every weight type,
every instruction set this CPU runs, odd shapes, and the bit-identity of a row across row counts
and thread counts that keeps greedy output independent of K and the batch size."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from engine.model import products

native = products.native()
pytestmark = pytest.mark.skipif(native is None, reason="the native product kernel is not built")

ISAS = native.supported_isas() if native is not None else []
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    native.set_isa(request.param)
    yield request.param
    native.set_isa("")


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _close(got: mx.array, want: np.ndarray, type_eps: float) -> None:
    got64 = np.array(got.astype(mx.float32)).astype(np.float64)
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got64 - want).max() / scale < type_eps


def test_built_wherever_a_compiler_is() -> None:
    """`make install` builds the kernel on a machine with a C++ compiler: a CI run that silently
    fell back to mlx's products would not be testing what users run."""
    if shutil.which("c++") or shutil.which("g++"):
        assert products.native() is not None, products.description()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("rows", "out", "inner"),
    [(1, 1, 1), (1, 37, 50), (2, 3, 17), (5, 256, 768), (17, 33, 129), (64, 40, 257), (70, 9, 31)],
)
def test_dense_against_float64(isa: str, dtype: mx.Dtype, rows: int, out: int, inner: int) -> None:
    x = _random((rows, inner), 1)
    w = mx.array(_random((out, inner), 2)).astype(dtype)
    want = x.astype(np.float64) @ np.array(w.astype(mx.float32)).astype(np.float64).T
    _close(native.product(mx.array(x), w), want, 1e-5)
    # a prompt's product (on AMX tiles bf16 weights take the activation in three bf16 parts)
    _close(native.product(mx.array(x), w, prompt=True), want, 1e-5)
    wide = mx.array(_random((out, 96), 4)).astype(dtype)  # 32-column steps for the tiles
    x96 = _random((rows, 96), 5)
    want96 = x96.astype(np.float64) @ np.array(wide.astype(mx.float32)).astype(np.float64).T
    _close(native.product(mx.array(x96), wide, prompt=True), want96, 1e-5)
    # a narrower activation: the output takes its type
    y = native.product(mx.array(x).astype(dtype), w)
    assert y.dtype == dtype
    _close(
        y,
        np.array(mx.array(x).astype(dtype).astype(mx.float32)).astype(np.float64)
        @ np.array(w.astype(mx.float32)).astype(np.float64).T,
        1e-2 if dtype != mx.float32 else 1e-5,
    )


def _codes(packed: mx.array, bits: int, inner: int) -> np.ndarray:
    """The codes mlx packed: one little-endian bit stream a row, code i at bit i * bits."""
    data = np.array(packed).view(np.uint8).astype(np.uint32)
    data = np.concatenate([data, np.zeros((data.shape[0], 1), np.uint32)], axis=1)
    bit = np.arange(inner) * bits
    pair = data[:, bit // 8] | (data[:, bit // 8 + 1] << 8)
    return ((pair >> (bit % 8).astype(np.uint32)) & ((1 << bits) - 1)).astype(np.float64)


def _as_the_kernel_quantizes(x: np.ndarray) -> np.ndarray:
    """Activation rows as the 4- and 8-bit path multiplies them: per run of 32 elements,
    q * (max|x| / 127) with q the nearest integer (ties to even) of x * (127 / max|x|), in
    float32 as the kernel computes it."""
    rows, inner = x.shape
    runs = x.reshape(rows, inner // 32, 32).astype(np.float32)
    amax = np.abs(runs).max(axis=-1, keepdims=True)
    inverse = (np.float32(127) / np.where(amax > 0, amax, np.float32(1))).astype(np.float32)
    q = np.clip(np.rint(runs * np.where(amax > 0, inverse, np.float32(0))), -127, 127)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(rows, inner)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_quantized_against_float64(isa: str, bits: int, group: int) -> None:
    """Other widths: scale * code + bias in fp32 times x. 4 and 8 bits: integer sums of the
    codes times 8-bit activations (a scale per 32 of them), scaled and biased in fp32 — exactly
    x quantized that way times the dequantized weight, and within 2% (of the largest output) of the
    unquantized x's
    product."""
    inner = group * 3  # not a multiple of every chunk
    w = mx.array(_random((45, inner), 3))
    for scale_type in (mx.float32, mx.bfloat16):
        packed, scales, biases = mx.quantize(w.astype(scale_type), group_size=group, bits=bits)
        s64 = np.array(scales.astype(mx.float32)).astype(np.float64)
        b64 = np.array(biases.astype(mx.float32)).astype(np.float64)
        codes = _codes(packed, bits, inner).reshape(45, inner // group, group)
        dequantized = (codes * s64[..., None] + b64[..., None]).reshape(45, inner)
        for rows, prompt in ((1, False), (3, False), (9, False), (2, True), (20, True)):
            x = _random((rows, inner), rows)
            got = native.product(
                mx.array(x), packed, scales, biases, bits=bits, group_size=group, prompt=prompt
            )
            exact = x.astype(np.float64) @ dequantized.T
            if bits in (4, 8):
                _close(got, _as_the_kernel_quantizes(x) @ dequantized.T, 1e-5)
                _close(got, exact, 2e-2)
            else:
                _close(got, exact, 1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
def test_interleaved_codes_against_float64(isa: str, bits: int, group: int) -> None:
    """4- and 8-bit weights laid out by ``products.interleave`` (16 output rows side by side):
    the same arithmetic as row-major codes — integer sums against the 8-bit activation, scaled
    and biased in fp32 — so x quantized that way times the dequantized weight, for every row
    count (blocks of five rows and fewer; four tiles at a time and the ones left over at the
    end of the columns)."""
    inner, out = group * 3, 112
    w = mx.array(_random((out, inner), 13))
    for scale_type in (mx.float32, mx.bfloat16):
        packed, scales, biases = mx.quantize(w.astype(scale_type), group_size=group, bits=bits)
        s64 = np.array(scales.astype(mx.float32)).astype(np.float64)
        b64 = np.array(biases.astype(mx.float32)).astype(np.float64)
        codes = _codes(packed, bits, inner).reshape(out, inner // group, group)
        dequantized = (codes * s64[..., None] + b64[..., None]).reshape(out, inner)
        laid_out = products.interleave(packed, scales, biases)
        for rows, prompt in ((1, False), (4, False), (5, False), (11, False), (70, True)):
            x = _random((rows, inner), rows)
            got = native.product(
                mx.array(x), *laid_out, bits=bits, group_size=group, prompt=prompt, interleaved=True
            )
            _close(got, _as_the_kernel_quantizes(x) @ dequantized.T, 1e-5)
            _close(got, x.astype(np.float64) @ dequantized.T, 2e-2)


@pytest.mark.skipif("avx512-vnni" not in ISAS, reason="AVX-512 with VNNI is not on this CPU")
@pytest.mark.parametrize("isa, interleaved", [("avx512", False), ("avx512", True), ("avx2", True)])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_without_vnni_sum_the_codes_to_vnni_s_bits(
    isa: str, interleaved: bool, bits: int
) -> None:
    """Where the tiles are the same (AVX-512 built with and without VNNI; AVX2's interleaved
    tile, its lanes' float work VNNI's), only the integer sums of a block's byte products differ:
    ``vpdpbusd``, or ``vpmaddubsw`` pair sums widened by ``vpmaddwd`` (a 4-bit block's two
    nibbles' pairs added in 16 bits first; 8-bit codes as signed ones, c = u - 128, from the
    row counts ``signed_codes_rows`` says, plus 128 times the run's activation sum). Exact
    integers every way, so every output is VNNI's bits, at every row count."""
    out, inner, group = 288, 960, 64
    packed, scales, biases = mx.quantize(mx.array(_random((out, inner), 21)), group, bits)
    if interleaved:
        packed, scales, biases = products.interleave(packed, scales, biases)
    x = mx.array(_random((24, inner), 22))
    row_counts = (1, 2, 3, 4, 5, 6, 9, 24)
    outputs = {}
    try:
        for name in (isa, "avx512-vnni"):
            native.set_isa(name)
            outputs[name] = [
                np.array(
                    native.product(
                        x[:rows],
                        packed,
                        scales,
                        biases,
                        bits=bits,
                        group_size=group,
                        interleaved=interleaved,
                    )
                )
                for rows in row_counts
            ]
    finally:
        native.set_isa("")
    for rows, got, vnni in zip(row_counts, outputs[isa], outputs["avx512-vnni"], strict=True):
        assert np.array_equal(got, vnni), rows


@pytest.mark.parametrize("kind", ["f32", "bf16", "8", "4", "8-interleaved", "4-interleaved"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_half_output_is_the_fp32_output_rounded_as_mlx_rounds(
    isa: str, kind: str, dtype: mx.Dtype
) -> None:
    """x in bf16 or fp16 gives y in its type: the fp32 product of the same x, rounded to nearest
    even as mlx's astype rounds, bit for bit, whichever way a path stores it (a vector at a time
    or element by element); a row whose activation holds an inf stays inf or NaN (a NaN's
    payload the kernel's own). Rows 1, 3 and 5 and
    columns that leave part of a tile over take each store."""
    inner, out = 192, 77 if "interleaved" not in kind else 96
    w = mx.array(_random((out, inner), 41))
    if kind in ("f32", "bf16"):
        weight: tuple = (w.astype(mx.bfloat16) if kind == "bf16" else w,)
        options: dict = {}
    else:
        bits = int(kind[0])
        weight = tuple(mx.quantize(w, group_size=64, bits=bits))
        options = {"bits": bits, "group_size": 64}
        if kind.endswith("interleaved"):
            weight = products.interleave(*weight)
            options["interleaved"] = True
    for rows in (1, 3, 5):
        x = mx.array(_random((rows, inner), rows + 40) * 3).astype(dtype)
        if rows == 5:
            x[3, 7] = mx.inf
        typed = native.product(x, *weight, **options)
        wide = native.product(x.astype(mx.float32), *weight, **options)
        assert typed.dtype == dtype
        got, want = np.array(typed.view(mx.uint16)), np.array(wide.astype(dtype).view(mx.uint16))
        finite = np.isfinite(np.array(wide))
        assert finite[:3].all() and finite[4:].all() and (rows < 5 or not finite[3].any())
        nan = np.isnan(np.array(wide))  # NaN's payload is the kernel's own
        assert np.isnan(np.array(typed.astype(mx.float32)))[nan].all()
        np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("bits", [4, 8, "4-interleaved", "8-interleaved"])
@pytest.mark.parametrize("rows", [3, 6, 20])
def test_the_integer_path_keeps_a_row_s_non_finite_activation_to_that_row(
    isa: str, bits: int | str, rows: int
) -> None:
    """An inf in one row's activation makes that row's outputs NaN, as a float product's
    would be, and leaves the other rows' outputs what they are alone (whatever path the row
    count takes: lane sums, tiles of a few rows, tiles of many, interleaved 8-bit blocks)."""
    interleaved = str(bits).endswith("interleaved")
    bits = int(str(bits)[0])
    w = mx.array(_random((48, 128), 9))
    packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    if interleaved:
        packed, scales, biases = products.interleave(packed, scales, biases)
    x = _random((rows, 128), 10)

    def run(a: np.ndarray) -> np.ndarray:
        return np.array(
            native.product(
                mx.array(a),
                packed,
                scales,
                biases,
                bits=bits,
                group_size=64,
                interleaved=interleaved,
            )
        )

    clean = run(x)
    x[1, 70] = np.inf
    got = run(x)
    assert np.isnan(got[1]).all()
    others = [r for r in range(rows) if r != 1]
    assert np.array_equal(got[others], clean[others])


@pytest.mark.parametrize(
    "kind",
    [
        "f32",
        "bf16",
        "q4",
        "q8",
        "q8-group32",
        "q8-group32-wide",
        "q8-interleaved",
        "q8-group32-interleaved",
        "q4-interleaved",
        "q4-prompt",
        "q4-group32-prompt",
        "bf16-prompt",
    ],
)
def test_a_row_is_the_same_bits_at_any_row_count_and_thread_count(isa: str, kind: str) -> None:
    """Decoding's products, and a prompt's (``prompt``: on AMX tiles 4-bit weights take
    another path than decoding's, the same for every row count)."""
    # a partial vector at the end of each row, a partial column tile; "wide": rows of 2,080
    # (more than one span of 1,024 codes for the lane sums, the last partial, an odd run count)
    inner, out = (2100 if kind.endswith("wide") else 1000), 300
    x = mx.array(_random((64, inner), 5))
    w = mx.array(_random((out, inner), 6))
    if kind.startswith("q"):
        bits = int(kind[1])
        # group 32 over 992: an odd number of runs of 32 (half a 64-byte block at the end)
        group, width = (32, 992) if "group32" in kind else (64, 960)
        if kind.endswith("wide"):
            width = 2080
        interleaved = kind.endswith("interleaved")
        # interleaved: 288 rows, nine tiles of 16 (a thread's last pair of them may be one)
        weight = w[:288, :width] if interleaved else w[:, :width]
        packed, scales, biases = mx.quantize(weight, group_size=group, bits=bits)
        if interleaved:
            packed, scales, biases = products.interleave(packed, scales, biases)
        x = x[:, :width]
        prompt = kind.endswith("prompt")

        def run(rows: mx.array) -> np.ndarray:
            return np.array(
                native.product(
                    rows,
                    packed,
                    scales,
                    biases,
                    bits=bits,
                    group_size=group,
                    prompt=prompt,
                    interleaved=interleaved,
                )
            )
    else:
        weight = w.astype(mx.bfloat16) if kind.startswith("bf16") else w
        if kind == "bf16-prompt":  # whole 32-column steps: the AMX tiles take it
            weight, x = mx.contiguous(weight[:, :992]), x[:, :992]
        prompt = kind.endswith("prompt")

        def run(rows: mx.array) -> np.ndarray:
            return np.array(native.product(rows, weight, prompt=prompt))

    alone = np.concatenate([run(x[t : t + 1]) for t in range(x.shape[0])])
    before = native.threads()
    try:
        for threads in (1, 2, 3):
            native.set_threads(threads)
            for rows in (2, 5, 9, 24, 64):
                assert np.array_equal(run(x[:rows]), alone[:rows]), (threads, rows)
    finally:
        native.set_threads(before)


def test_a_waiting_thread_takes_part_in_the_products_and_leaves_their_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``products.wait`` evaluates as ``mx.eval`` does while the waiting thread takes parts of
    the products that mlx's stream thread posts meanwhile (``wait_helping`` counts the jobs it
    joined): a chain of products, never scheduled before the wait, comes out with the bits it
    has on one thread, where a pool of one thread posts nothing to join. The pool's worker
    does not spin after a product (``MTPSERVE_SPIN_US=0``, read when the pool is made), as a
    worker that slept does: a spinning one could take every part of a product before the
    waiting thread, and the count would say nothing. Even so, on a loaded machine the stream
    thread and the worker can finish a chain before the waiting thread gets a turn: the chain
    runs again (its bits checked each time) until the waiting thread joins a job."""
    monkeypatch.setenv("MTPSERVE_SPIN_US", "0")
    x = mx.array(_random((3, 1024), 7))
    w = mx.array(_random((2048, 1024), 8))

    def chain() -> mx.array:
        y = x
        for _ in range(24):
            y = native.product(y, w)[:, :1024] * 0.03
        return y

    before = native.threads()
    try:
        native.set_threads(1)
        alone = chain()
        assert native.wait_helping([alone]) == 0  # no job to join: it waits as mx.eval does
        alone = np.array(alone)
        native.set_threads(2)
        joined = []
        for _ in range(20):  # until it joins one: on a loaded machine it may get no turn
            waited = chain()
            joined.append(native.wait_helping([waited]))
            assert np.array_equal(np.array(waited), alone)
            if joined[-1] > 0:
                break
        assert joined[-1] > 0, joined
        waited = chain()
        products.wait(waited)
        assert np.array_equal(np.array(waited), alone)
    finally:
        monkeypatch.undo()  # the pool made next spins as configured
        native.set_threads(before)


def test_lazy_compiled_and_strided() -> None:
    """A node of the graph like any op: inside mx.compile, on a strided (transposed) input."""
    w = mx.array(_random((24, 40), 7))
    x = mx.array(_random((40, 3), 8)).T  # [3, 40], not row-contiguous
    want = np.array(x) @ np.array(w).T

    @mx.compile
    def f(a: mx.array) -> mx.array:
        return native.product(a * 2.0, w) + 1.0

    assert np.allclose(np.array(f(x)), 2 * want + 1, rtol=1e-5, atol=1e-5)
    assert np.allclose(np.array(native.product(x, w)), want, rtol=1e-5, atol=1e-5)
    stacked = native.product(mx.stack([x, x]), w)  # leading dimensions are rows too
    assert stacked.shape == (2, 3, 24)


def test_bad_operands_raise() -> None:
    w = mx.zeros((4, 8))
    with pytest.raises(ValueError):
        native.product(mx.zeros((2, 7)), w)
    with pytest.raises(ValueError):
        native.product(mx.zeros((2, 8), dtype=mx.int32), w)
    packed, scales, biases = mx.quantize(mx.zeros((4, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError):
        native.product(mx.zeros((1, 64)), packed, scales, biases, bits=8, group_size=32)
    with pytest.raises(ValueError):
        native.product(mx.zeros((1, 64)), packed, scales, None, bits=4, group_size=32)
    packed, scales, biases = mx.quantize(mx.zeros((16, 64)), group_size=32, bits=2)
    with pytest.raises(ValueError, match="interleaved"):  # 2-bit
        native.product(mx.zeros((1, 64)), packed, scales, biases, 2, 32, interleaved=True)
    packed, scales, biases = mx.quantize(mx.zeros((24, 64)), group_size=32, bits=8)
    with pytest.raises(ValueError, match="interleaved"):  # 24 rows: not whole tiles of 16
        native.product(mx.zeros((1, 64)), packed, scales, biases, 8, 32, interleaved=True)


@pytest.mark.parametrize("name", ISAS)
def test_the_environment_forces_an_instruction_set(name: str) -> None:
    env = {**os.environ, "MTPSERVE_PRODUCTS_ISA": name, "MTPSERVE_THREADS": "3"}
    code = "from engine.model import products; print(products.description())"
    line = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert f"native kernel, {name}, 3 threads" in line


def test_the_model_s_projections_run_on_the_kernel_row_by_row_exact() -> None:
    """``products.linear`` and ``products.product`` (every projection of decoding, the vocabulary's
    too) take the kernel for float and quantized layers: the same numbers as the kernel itself,
    and a verify's or batch's row bit for bit that row alone."""
    import mlx.nn as nn

    mx.random.seed(3)
    layers = {
        "linear": nn.Linear(96, 160, bias=True),
        "half": nn.Linear(96, 160, bias=False),
        "quantized": nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4),
        "table": nn.Embedding(300, 96),
    }
    layers["half"].set_dtype(mx.bfloat16)
    for name, layer in layers.items():
        mx.eval(layer.parameters())
        inner = 128 if name == "quantized" else 96
        x = mx.random.normal((5, inner))
        run = products.product if name == "table" else products.linear
        together = np.array(run(layer, x).astype(mx.float32))
        alone = np.concatenate(
            [np.array(run(layer, x[i : i + 1]).astype(mx.float32)) for i in range(5)]
        )
        assert np.array_equal(together, alone), name
        reference = layer.as_linear(x) if name == "table" else layer(x)
        assert np.allclose(together, np.array(reference.astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_quantized_layers_laid_out_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``interleave_layers`` lays out the 4- and 8-bit layers whose shapes allow it (whole tiles
    of 16 rows, groups of a multiple of 32) and no other; each then behaves as before wherever it is
    called from: an embedding looks up the same rows bit for bit (``quantized_rows`` too), a
    layer called directly (as mlx-lm's MoE block calls its shared expert) or through
    ``products`` runs the kernel, its rows bit for bit those of one row alone and within the
    8-bit activation's error of mlx's own product."""
    import mlx.nn as nn

    monkeypatch.setattr(products, "INTERLEAVED_ISAS", (native.isa(),))
    mx.random.seed(5)
    model = nn.Module()
    model.linear = nn.Linear(128, 48, bias=False).to_quantized(group_size=64, bits=8)
    model.table = nn.Embedding(320, 64).to_quantized(group_size=32, bits=8)
    model.four = nn.Linear(128, 48, bias=False).to_quantized(group_size=64, bits=4)
    model.odd = nn.Linear(128, 40, bias=False).to_quantized(group_size=64, bits=8)
    model.two = nn.Linear(128, 48, bias=False).to_quantized(group_size=64, bits=2)
    mx.eval(model.parameters())
    x = mx.random.normal((5, 128))
    ids = mx.array([[0, 17, 319, 16, 15]])
    before = model.linear(x), model.table(ids), model.table.as_linear(x[:, :64])
    rows_before = products.quantized_rows(model.table, ids[0])
    four = model.four(x)
    assert products.interleave_layers(model) == 3
    assert type(model.linear) is products.InterleavedLinear
    assert type(model.four) is products.InterleavedLinear
    assert type(model.table) is products.InterleavedEmbedding
    assert type(model.odd) is nn.QuantizedLinear and type(model.two) is nn.QuantizedLinear
    assert np.array_equal(np.array(model.table(ids)), np.array(before[1]))
    for got, want in zip(products.quantized_rows(model.table, ids[0]), rows_before, strict=True):
        assert np.array_equal(np.array(got), np.array(want))
    for got, want in (
        (model.linear(x), before[0]),
        (products.linear(model.linear, x), before[0]),
        (model.table.as_linear(x[:, :64]), before[2]),
        (products.product(model.table, x[:, :64]), before[2]),
        (model.four(x), four),
    ):
        assert np.allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2)
    together = np.array(products.linear(model.linear, x))
    alone = np.concatenate(
        [np.array(products.linear(model.linear, x[i : i + 1])) for i in range(5)]
    )
    assert np.array_equal(together, alone)
    with pytest.raises(TypeError, match="native kernel only"):
        model.linear(x.astype(mx.int32))


def test_several_weights_in_one_op_are_each_weight_s_own_product(isa: str) -> None:
    """``products`` (a layer's projections of one input in one op) gives every weight bit for bit
    its own ``product``, whatever mix of kinds and sizes shares the op and whatever the thread
    count; ``products.linears`` takes it for layers the kernel takes, one layer at a time
    otherwise."""
    import mlx.nn as nn

    x = mx.array(_random((2, 3, 128), 21))
    packed4 = mx.quantize(mx.array(_random((48, 128), 22)), group_size=64, bits=4)
    packed8 = mx.quantize(mx.array(_random((8, 128), 23)), group_size=32, bits=8)
    # two of each quantized kind: they take x quantized once for both
    packed4b = mx.quantize(mx.array(_random((32, 128), 27)), group_size=64, bits=4)
    packed8b = mx.quantize(mx.array(_random((24, 128), 28)), group_size=32, bits=8)
    weights = [
        (mx.array(_random((1000, 128), 24)), None, None, 0, 0, False),
        (mx.array(_random((3, 128), 25)).astype(mx.bfloat16), None, None, 0, 0, False),
        (*packed4, 4, 64, False),
        (mx.array(_random((16, 128), 26)).astype(mx.float16), None, None, 0, 0, False),
        (*packed8, 8, 32, False),
        (*packed4b, 4, 64, False),
        (*packed8b, 8, 32, False),
    ]
    before = native.threads()
    try:
        for threads, prompt in ((1, False), (2, False), (3, False), (2, True)):
            native.set_threads(threads)
            together = native.products(x, weights, prompt=prompt)
            for out, (w, scales, biases, bits, group, _) in zip(together, weights, strict=True):
                alone = native.product(
                    x, w, scales, biases, bits=bits, group_size=group, prompt=prompt
                )
                assert out.shape == (2, 3, w.shape[0])
                assert np.array_equal(np.array(out), np.array(alone)), (threads, bits, w.dtype)
    finally:
        native.set_threads(before)
    with pytest.raises(ValueError):
        native.products(x, [])
    with pytest.raises(ValueError):
        native.products(x, [(mx.zeros((4, 127)), None, None, 0, 0, False)])

    class Sharded(nn.Linear):  # another type (a tensor-parallel layer): its own product
        pass

    mx.random.seed(4)
    layers = [nn.Linear(128, 40, bias=True), nn.QuantizedLinear(128, 64, group_size=64, bits=4)]
    layers.append(Sharded(128, 24))
    mx.eval([layer.parameters() for layer in layers])
    for modules in (layers[:2], layers):
        got = products.linears(modules, x)
        for out, layer in zip(got, modules, strict=True):
            assert np.array_equal(np.array(out), np.array(products.linear(layer, x)))


def test_a_norm_before_and_a_residual_after_are_the_separate_ops_bit_for_bit() -> None:
    """The input's RMS norm inside the projections' op, and the SwiGLU activation and the
    residual inside the output projection's: the same bits as ``rms_norm`` then the products,
    and ``swiglu`` then the product plus the residual, at every thread count; ``linears``,
    ``linear``, ``swiglu_linear`` and ``joined_linear`` (two normed inputs side by side) take
    them."""
    import mlx.nn as nn

    from engine.model.norms import RMSNorm, rms_norm

    x = mx.array(_random((2, 3, 200), 31)) * 3
    norm_weight = (mx.array(_random((200,), 32)) * 0.1 + 1).astype(mx.bfloat16)
    packed = mx.quantize(mx.array(_random((64, 256), 33)), group_size=64, bits=4)
    weights = [
        (mx.array(_random((300, 200), 34)), None, None, 0, 0, False),
        (mx.array(_random((16, 200), 35)).astype(mx.bfloat16), None, None, 0, 0, False),
    ]
    residual = mx.array(_random((2, 3, 300), 36))
    normed = rms_norm(x, norm_weight, 1e-6)
    before = native.threads()
    try:
        for threads in (1, 2):
            native.set_threads(threads)
            got = native.products(x, weights, norm_weight=norm_weight, eps=1e-6)
            for out, want in zip(got, native.products(normed, weights), strict=True):
                assert np.array_equal(np.array(out), np.array(want)), threads
            [added] = native.products(
                x, weights[:1], norm_weight=norm_weight, eps=1e-6, residual=residual
            )
            want = native.product(normed, weights[0][0]) + residual
            assert np.array_equal(np.array(added), np.array(want)), threads
            up = mx.array(_random((2, 3, 200), 38))
            [down] = native.products(x, weights[:1], residual=residual, up=up)  # an MLP's down
            want = native.product(native.swiglu(x, up), weights[0][0]) + residual
            assert np.array_equal(np.array(down), np.array(want)), threads
            x4 = mx.array(_random((2, 3, 256), 37))
            [added] = native.products(x4, [(*packed, 4, 64, False)], residual=residual[..., :64])
            want = native.product(x4, *packed, bits=4, group_size=64) + residual[..., :64]
            assert np.array_equal(np.array(added), np.array(want)), threads
    finally:
        native.set_threads(before)
    with pytest.raises(ValueError, match="residual"):
        native.products(x, weights, residual=residual)  # two weights
    with pytest.raises(ValueError, match="norm"):
        native.products(x, weights, norm_weight=norm_weight[:10], eps=1e-6)

    norm = RMSNorm(200, eps=1e-6)
    norm.weight = norm_weight
    layers = [nn.Linear(200, 300, bias=False), nn.Linear(200, 16, bias=False)]
    mx.eval([layer.parameters() for layer in layers])
    for out, layer in zip(products.linears(layers, x, norm), layers, strict=True):
        assert np.array_equal(np.array(out), np.array(products.linear(layer, norm(x))))
    fused = products.linear(layers[0], x, residual=residual)
    assert np.array_equal(np.array(fused), np.array(residual + products.linear(layers[0], x)))
    hidden = mx.array(_random((2, 3, 56), 40))  # the MTP head's fc: [norm(x) | norm2(hidden)]
    norm2 = RMSNorm(56, eps=1e-5)
    fc = nn.Linear(256, 24, bias=False)
    mx.eval(fc.parameters())
    joined = products.joined_linear(fc, x, norm, hidden, norm2)
    want = products.linear(fc, mx.concatenate([norm(x), norm2(hidden)], axis=-1))
    assert np.array_equal(np.array(joined), np.array(want))
    up = mx.array(_random((2, 3, 200), 39))
    down = products.swiglu_linear(layers[0], x, up, residual)
    want = residual + products.linear(layers[0], native.swiglu(x, up))
    assert np.array_equal(np.array(down), np.array(want))


def test_a_gate_inside_the_output_projection_is_its_sigmoid_then_the_product() -> None:
    """A gated attention's output projection, ``linear(o_proj, x * sigmoid(gate), residual)``
    in one op: against float64 (the exp is the elementwise ops' polynomial), the residual added
    bit for bit as a separate add; the gate read as it lies, a query projection's split heads
    ``[B, L, H, D]`` the same bits as the same gate contiguous ``[B, L, H * D]``; where the
    kernel does not take it, None."""
    import mlx.nn as nn

    x = mx.array(_random((2, 3, 128), 41)) * 2
    joined = mx.array(_random((2, 3, 4, 64), 42)) * 3  # [query | gate] of 4 heads of 32
    gate = mx.split(joined, 2, axis=-1)[1]  # [2, 3, 4, 32], strided
    contiguous = mx.contiguous(gate.reshape(2, 3, 128))
    residual = mx.array(_random((2, 3, 48), 43))
    layer = nn.Linear(128, 48, bias=False)
    mx.eval(layer.parameters())
    got = products.gated_linear(layer, x, gate, residual)
    same = products.gated_linear(layer, x, contiguous, residual)
    assert np.array_equal(np.array(got), np.array(same))
    g = np.array(contiguous).astype(np.float64)
    gated = np.array(x).astype(np.float64) / (1 + np.exp(-g))
    want = gated @ np.array(layer.weight).astype(np.float64).T + np.array(residual)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    alone = products.gated_linear(layer, x, gate)
    assert np.array_equal(np.array(got), np.array(alone + residual))
    assert products.gated_linear(layer, x, gate[..., :16]) is None  # not x's size
    with pytest.raises(ValueError, match="gate"):
        native.products(x, [(layer.weight, None, None, 0, 0, False)], gate=gate[..., :16])
