"""Products of the few rows of decoding: ``y[T, out] = x[T, in] @ W^T``.

On a CPU these run on mtpserve's own kernel, an mlx custom primitive (``engine/model/native``,
built by ``make install``): each thread owns a slice of the output columns and reads its weight
rows once for all T rows, on every core, for fp32, bf16, fp16 and mlx's affine-quantized
weights. mlx's own products run one stream's kernels on one thread, and its bf16 and quantized
CPU products are several times slower than fp32 (1024x3584: fp32 0.93 ms, bf16 5.1 ms, 4-bit
5.1 ms), so without the kernel a plain step reads its weights on one core and a verify of K+1
rows costs several plain steps.

A layer's projections of one input take one op together (``linears``), the RMS norm before
them inside it, and an output projection adds its layer's residual (an MLP's down projection
also applies the SwiGLU activation, ``swiglu_linear``) inside its op: mlx evaluates every op of
a step as its own task on one stream thread, so the same numbers from fewer ops make a faster
step.

Row t of a T-row product is bit for bit the one-row product of that row (the kernel's
accumulation order depends only on the weight's width and kind, never on T or the thread
count), so greedy output does not move with K or the batch size.

Metal and CUDA keep mlx's own products, and so does a CPU without the built extension (one log
line says which runs: ``description``). Products of more than ``NATIVE_MAX_ROWS`` rows
(long prefills) keep BLAS, which threads them itself (half-precision and quantized weights
widened to float32 for it, one weight at a time: mlx has no fast CPU product for them), except
by 4- and 8-bit layers laid out for the kernel (``interleave_layers``), which only it reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from engine.model import mlx_products

log = logging.getLogger("mtpserve.products")

#: Products of more rows than this run on BLAS, which threads a product of many rows itself;
#: half-precision and quantized weights are widened to float32 for it, one weight at a time.
#: A prefill chunk (``PREFILL_CHUNK``, 128 positions) runs on the kernel: BLAS's products alone
#: overtake the kernel's past ~64 rows (``scripts/bench_kernel.py --crossover``), but with the
#: widening a 512-token prefill at the Qwen3.5-0.8B shape ran 84 tokens/s on BLAS past 64 rows
#: against 145 on the kernel, 30 against 212-219 in mlx 8-bit (docs/BENCHMARKS.md, "Prefill on
#: the kernel").
NATIVE_MAX_ROWS = 128

#: set to 0 to run mlx's own products on a CPU even where the kernel is built
DISABLE_ENV = "MTPSERVE_NATIVE_PRODUCTS"

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

_native: ModuleType | None = None
_reason = ""

#: whether the products being built are a prompt's (``prompt_products``)
_PROMPT: ContextVar[bool] = ContextVar("prompt_products", default=False)


@contextmanager
def prompt_products() -> Iterator[None]:
    """The products built inside are a prompt's (a prefill chunk's, the trunk's and the head's):
    the kernel may take another path for them than for decoding's, the same one for every row
    count, so that a prompt's caches do not depend on where its chunks split (on AMX tiles,
    4-bit and bf16 weights: tile products for a prefill chunk of up to 128 rows, where
    decoding's few rows keep the VNNI kernel's lane sums)."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


def in_prompt() -> bool:
    """Whether the products being built are a prompt's (``prompt_products``)."""
    return _PROMPT.get()


def _load() -> None:
    global _native, _reason
    if os.environ.get(DISABLE_ENV, "1") == "0":
        _reason = f"{DISABLE_ENV}=0"
        return
    try:
        from engine.model.native import _products
    except ImportError as error:
        _reason = f"not built ({error}; `make install` builds it)"
        return
    if not hasattr(_products, "run_tape"):
        _reason = "a stale build (`make install` rebuilds it)"
        return
    _native = _products


_load()


def native() -> ModuleType | None:
    """The kernel's module when it is built and enabled, else None."""
    return _native


def on_native() -> bool:
    """Whether products run on the kernel here: built, enabled and mlx's device is the CPU."""
    return _native is not None and mx.default_device().type == mx.DeviceType.cpu


def native_for(*arrays: mx.array) -> ModuleType | None:
    """The kernel's module when it runs here and every one of ``arrays`` is float32 (what its
    norms and elementwise ops take), else None: the caller keeps mlx's formulation."""
    if on_native() and all(a.dtype == mx.float32 for a in arrays):
        return _native
    return None


def wait(*arrays: mx.array) -> None:
    """``mx.eval(*arrays)`` for a read-back. On the kernel the waiting thread spins instead of
    sleeping and takes a share of each product (attention, delta rule) that mlx's stream thread
    posts meanwhile: on two cores the pool's sleeping worker woke too late for most of a small
    model's products while the waiting thread sat idle (``native.wait_helping``)."""
    if on_native():
        _native.wait_helping(list(arrays))
    mx.eval(*arrays)


def description() -> str:
    """One line for the server log: which products run, on what."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "products: mlx's own (GPU)"
    if _native is None:
        return f"products: mlx's own on the CPU; the native kernel is off: {_reason}"
    return f"products: native kernel, {_native.isa()}, {_native.threads()} threads"


def embedded(table: nn.Module, token_ids: mx.array) -> mx.array:
    """``activations(table(token_ids))``: tokens embedded as the layers carry them. On the
    kernel, for int32 ids, one op (so that a compiled block of it runs as a replayed tape,
    ``engine.model.tape``): for a float ``nn.Embedding`` ``embed_rows`` (the lookup and the
    cast, bit for bit mlx's gather and ``astype``, which take four ops), for an affine-quantized
    one (``embeds_in_one_op``) ``embed_quantized_rows`` (bit for bit mlx's gather, dequantize
    and cast, which take ~70 on a CPU: the trunk's lookup and every head step's)."""
    if token_ids.dtype != mx.int32 or not embeds_in_one_op(table):
        return activations(table(token_ids))
    if type(table) is nn.Embedding:
        return _native.embed_rows(table.weight, token_ids)
    return _native.embed_quantized_rows(
        table.weight,
        table["scales"],
        table["biases"],
        token_ids,
        table.bits,
        table.group_size,
        interleaved=type(table) is InterleavedEmbedding,
    )


def embeds_in_one_op(table: nn.Module) -> bool:
    """Whether ``embedded`` looks a token up in ``table`` as one op of the kernel: a float
    ``nn.Embedding``, or an ``nn.QuantizedEmbedding`` (laid out or not) of 2, 4 or 8 bits with
    affine scales and biases."""
    if not on_native():
        return False
    if type(table) is nn.Embedding:
        return table.weight.dtype in (mx.float32, mx.bfloat16, mx.float16)
    quantized = _quantized(table) if type(table) in _QUANTIZED_TABLES else None
    return quantized is not None and quantized[0] in (2, 4, 8) and "biases" in table


def activations(x: mx.array) -> mx.array:
    """Embedded tokens as the layers should carry them: float32 on a CPU that runs the kernel.

    The kernel reads half-precision and quantized weights as stored and returns its input's
    type, so with float32 activations every product, norm, attention and recurrence runs in
    float32 while the weights keep the checkpoint's size (mlx's CPU elementwise kernels are
    also fastest in float32); elsewhere the activations keep the embedding's type."""
    if on_native() and x.dtype in (mx.bfloat16, mx.float16):
        return x.astype(mx.float32)
    return x


#: the layers the kernel multiplies by; a tensor-parallel layer (mlx-lm's shard()) is another
#: type and keeps its own product, which sums the ranks' parts
_PROJECTIONS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def _quantized(module: nn.Module) -> tuple[int, int] | None:
    """(bits, group size) of an affine-quantized layer the kernel takes; None otherwise."""
    if getattr(module, "mode", "affine") != "affine" or "scales" not in module:
        return None
    return module.bits, module.group_size


def prepare(model: nn.Module, parts: int = 1) -> None:
    """Ready every projection under ``model`` for decoding once its weights are final: the
    transposed views mlx's own products use (``mlx_products.prepare_transposed``), with column
    parts and row-by-row products only where the kernel does not take few rows; 4- and 8-bit layers
    laid out for the kernel where its instruction set multiplies them faster so
    (``interleave_layers``)."""
    mlx_products.prepare_transposed(model, parts, few_rows=not on_native())
    if count := interleave_layers(model):
        log.info("products: %d 4/8-bit layers laid out for the %s kernel", count, _native.isa())


#: instruction sets whose kernel multiplies 4- and 8-bit weights faster laid out by
#: ``interleave``: AVX-512 VNNI sums four codes of sixteen outputs in one instruction, where
#: row-major 8-bit codes take four instructions every 64 codes and row. At the 0.8B shape on an
#: AMD EPYC, in one process against row-major layers: 8-bit plain steps 0.93-0.95x the time,
#: verifies of 4-5 0.72-0.79x; 4-bit 0.95x and 0.87-0.89x. The same CPU running the kernel
#: without VNNI (``avx512``: two instructions a 4-code sum): 0.93x and 0.76-0.78x, 4-bit 0.96x
#: and 0.77-0.80x. AVX2 there (``MTPSERVE_PRODUCTS_ISA=avx2``, each layout in its own process,
#: three rounds in turns, medians): 8-bit plain steps 0.89-0.93x, verifies of 5 0.77-0.80x; 4-bit
#: 0.86-0.97x and 0.78-0.88x (an earlier measurement, with other integer sums, had 8-bit plain
#: steps at 1.10x). Not measured on an AVX2-only CPU. AMX keeps row-major codes for its tiles;
#: NEON is unmeasured.
INTERLEAVED_ISAS = ("avx512-vnni", "avx512", "avx2")
INTERLEAVED_BITS = (4, 8)
#: output rows ``interleave`` lays side by side (the kernel's ``kInterleave``)
INTERLEAVE = 16


def interleave(
    weight: mx.array, scales: mx.array, biases: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """An affine layer's packed codes, scales and biases with every ``INTERLEAVE`` output rows
    side by side: word (tile, w, row) of the codes holds output tile * 16 + row's word w (its
    codes 32 / bits * w on), and (tile, group, row) of the scales and biases that row's of the
    group. The shapes stay the checkpoint's, and so do memory and byte counts; only the kernel
    reads them (4- and 8-bit: ``interleaved=True``)."""
    out = weight.shape[0]

    def tiles(a: mx.array) -> mx.array:
        return mx.contiguous(
            a.reshape(out // INTERLEAVE, INTERLEAVE, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        )

    return tiles(weight), tiles(scales), tiles(biases)


def interleave_layers(model: nn.Module) -> int:
    """Lay out every 4- and 8-bit ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` under
    ``model`` by ``interleave`` where the kernel's instruction set is one of
    ``INTERLEAVED_ISAS`` (and the layer's shape allows: a multiple of 16 rows, groups of a
    multiple of 32), each becoming an ``InterleavedLinear`` or ``InterleavedEmbedding``;
    returns how many."""
    count = 0
    for _, module in model.named_modules():
        kind = _INTERLEAVED_KINDS.get(type(module))
        quantized = _quantized(module) if kind is not None else None
        weight = module.get("weight")
        if quantized is None or not interleaves(*quantized, weight.shape[0]):
            continue
        laid_out = interleave(weight, module["scales"], module["biases"])
        mx.eval(*laid_out)  # one layer at a time: a layer's bytes over the checkpoint's at most
        module.weight, module.scales, module.biases = laid_out
        module.__class__ = kind
        count += 1
    return count


def interleaves(bits: int, group: int, rows: int) -> bool:
    """Whether ``interleave_layers`` lays out an affine weight of ``bits`` bits, groups of
    ``group`` and ``rows`` output rows on this machine's kernel."""
    if not on_native() or _native.isa() not in INTERLEAVED_ISAS:
        return False
    return bits in INTERLEAVED_BITS and group % 32 == 0 and rows % INTERLEAVE == 0


class InterleavedLinear(nn.QuantizedLinear):
    """A 4- or 8-bit ``nn.QuantizedLinear`` laid out by ``interleave``: multiplied by the kernel
    alone, wherever it is called from (mlx's own product would read the codes in the wrong
    order)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _interleaved_product(self, x)


class InterleavedEmbedding(nn.QuantizedEmbedding):
    """A 4- or 8-bit ``nn.QuantizedEmbedding`` laid out by ``interleave``: its rows read through
    ``quantized_rows``, its projection (a tied output) by the kernel alone."""

    def __call__(self, x: mx.array) -> mx.array:
        return dequantized_rows(self, x)

    def as_linear(self, x: mx.array) -> mx.array:
        return _interleaved_product(self, x)


#: the quantized embedding tables ``embedded`` looks rows up in as one op
_QUANTIZED_TABLES = (nn.QuantizedEmbedding, InterleavedEmbedding)
#: the layers laid out for the kernel (``interleave_layers``)
_LAID_OUT = (InterleavedLinear, InterleavedEmbedding)
_INTERLEAVED_KINDS: dict[type, type] = {
    nn.QuantizedLinear: InterleavedLinear,
    nn.QuantizedEmbedding: InterleavedEmbedding,
}


def _interleaved_product(module: nn.Module, x: mx.array) -> mx.array:
    out = _on_kernel(module, x)
    if out is None:
        raise TypeError(
            f"an interleaved quantized layer multiplies float inputs on the native kernel only, "
            f"not {x.dtype} on {mx.default_device()}"
        )
    return out


def quantized_rows(table: nn.Module, index: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
    """Rows ``index`` of a quantized table's codes, scales and biases (None without them),
    row-major as ``mx.dequantize`` takes them, whether or not ``interleave`` laid the table
    out."""
    biases = table.get("biases")
    arrays = table["weight"], table["scales"], biases
    if type(table) not in _LAID_OUT:
        return arrays[0][index], arrays[1][index], None if biases is None else biases[index]
    tile, row = index // INTERLEAVE, index % INTERLEAVE

    def rows(a: mx.array) -> mx.array:
        return a.reshape(a.shape[0] // INTERLEAVE, a.shape[1], INTERLEAVE)[tile, :, row]

    return rows(arrays[0]), rows(arrays[1]), rows(biases)


def dequantized_rows(table: nn.Module, index: mx.array) -> mx.array:
    """Rows ``index`` of a quantized table (an embedding's lookup), as floats."""
    return mx.dequantize(
        *quantized_rows(table, index),
        group_size=table.group_size,
        bits=table.bits,
        mode=getattr(table, "mode", "affine"),
    )


def product(module: nn.Module, x: mx.array) -> mx.array | None:
    """``x @ module.weight.T``: by the kernel where it takes the product, else by the module's
    prepared views (None when it has none)."""
    out = _on_kernel(module, x)
    return mlx_products.product(module, x) if out is None else out


def linear(module: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``module(x)`` (plus ``residual``) for a linear layer: by the kernel on a CPU (the residual
    added inside its one op, column block by column block), else by mlx's own product of its
    prepared views (``mlx_products.linear``)."""
    if residual is not None:
        outs = _on_kernel_together([module], x, residual=residual)
        if outs is not None:
            return outs[0]
    out = _on_kernel(module, x)
    out = mlx_products.linear(module, x) if out is None else out
    return out if residual is None else residual + out


def linears(
    modules: Sequence[nn.Module], x: mx.array, norm: nn.Module | None = None
) -> list[mx.array]:
    """``[linear(m, norm(x)) for m in modules]`` (no norm: of x itself): on the kernel one op
    for them all (a layer's projections of one normed input), where it takes every one of them.
    mlx evaluates each op of a decode step as its own task on its stream's thread (a few
    microseconds each, and a small model's step is a few hundred of them), so the projections
    of a Gated-DeltaNet layer's input (four), an MLP's gate and up and an attention layer's
    queries, keys and values each take one op instead of one a weight, the RMS norm before them
    inside it: the outputs are bit for bit the separate ops' (the kernel's norm is the
    ``RMSNorm`` primitive's arithmetic)."""
    outs = _on_kernel_together(modules, x, norm=norm)
    if outs is not None:
        return outs
    x = x if norm is None else norm(x)
    return [linear(module, x) for module in modules]


def swiglu_linear(
    module: nn.Module, gate: mx.array, up: mx.array, residual: mx.array | None = None
) -> mx.array | None:
    """``linear(module, silu(gate) * up, residual)`` (an MLP's down projection) in one op of the
    kernel, the activation computed as the ``SwiGlu`` primitive does, bit for bit; None where
    the kernel does not take it (the caller runs the activation and ``linear``)."""
    outs = _on_kernel_together([module], gate, residual=residual, up=up)
    return None if outs is None else outs[0]


def gated_linear(
    module: nn.Module, x: mx.array, gate: mx.array, residual: mx.array | None = None
) -> mx.array | None:
    """``linear(module, x * sigmoid(gate), residual)`` (a gated attention's output projection)
    in one op of the kernel, ``gate`` of x's size in any shape (read in row-major order: the
    heads of a query projection's split, as they lie); None where the kernel does not take it
    (the caller gates and runs ``linear``)."""
    if gate.dtype != mx.float32 or gate.size != x.size:
        return None
    outs = _on_kernel_together([module], x, residual=residual, gate=gate)
    return None if outs is None else outs[0]


def joined_linear(
    module: nn.Module, x: mx.array, norm: nn.Module, x2: mx.array, norm2: nn.Module
) -> mx.array | None:
    """``linear(module, concatenate([norm(x), norm2(x2)], -1))`` (the MTP head's fc over its
    normed embedding and hidden state) in one op of the kernel, bit for bit the two norms, the
    concatenation and the product; None where the kernel does not take it."""
    if x2.dtype != mx.float32 or x2.shape[:-1] != x.shape[:-1] or not isinstance(norm2, nn.RMSNorm):
        return None
    outs = _on_kernel_together([module], x, norm=norm, joined=(x2, norm2))
    return None if outs is None else outs[0]


def _on_kernel_together(
    modules: Sequence[nn.Module],
    x: mx.array,
    norm: nn.Module | None = None,
    residual: mx.array | None = None,
    up: mx.array | None = None,
    joined: tuple[mx.array, nn.Module] | None = None,
    gate: mx.array | None = None,
) -> list[mx.array] | None:
    """``linears`` (or ``linear`` with a residual, ``swiglu_linear``, ``gated_linear``,
    ``joined_linear``) by one op of the kernel; None unless the kernel takes every product, the
    norm (an RMS norm), the residual, the activation's ``up``, the gate and the joined input
    (float32 throughout)."""
    if len(modules) < 2 and norm is None and residual is None and up is None and gate is None:
        return None
    if gate is not None and x.dtype != mx.float32:
        return None
    if up is not None and (x.dtype != mx.float32 or up.dtype != mx.float32 or up.shape != x.shape):
        return None
    operands = [_operand(module, x) for module in modules]
    if any(operand is None for operand in operands):
        return None
    norm_weight, eps = None, 0.0
    if norm is not None:
        if not isinstance(norm, nn.RMSNorm) or x.dtype != mx.float32:
            return None
        norm_weight, eps = norm["weight"], norm.eps
    if residual is not None and (
        x.dtype != mx.float32
        or residual.dtype != mx.float32
        or residual.shape != (*x.shape[:-1], operands[0][0].shape[0])
        or modules[0].get("bias") is not None
    ):
        return None
    second, second_weight, second_eps = None, None, 0.0
    if joined is not None:
        if norm is None:
            return None
        second, second_norm = joined
        second_weight, second_eps = second_norm["weight"], second_norm.eps
    outs = _native.products(
        x,
        operands,
        norm_weight=norm_weight,
        eps=eps,
        residual=residual,
        up=up,
        gate=gate,
        joined=second,
        joined_norm_weight=second_weight,
        joined_eps=second_eps,
        prompt=in_prompt(),
    )
    return [
        out if (bias := module.get("bias")) is None else out + bias
        for out, module in zip(outs, modules, strict=True)
    ]


#: a weight as the kernel takes it: (w, scales, biases, bits, group size, interleaved)
_Operand = tuple[mx.array, mx.array | None, mx.array | None, int, int, bool]


def _operand(module: nn.Module, x: mx.array) -> _Operand | None:
    """``module``'s weight as the kernel multiplies ``x`` by it, for an ``nn.Linear``,
    ``nn.QuantizedLinear``, ``nn.Embedding`` or ``nn.QuantizedEmbedding`` used as a projection
    of at most ``NATIVE_MAX_ROWS`` rows (any number for a layer ``interleave_layers`` laid out);
    None where the kernel does not take it (not on a CPU, not built, more rows, a type mlx
    would promote differently)."""
    weight = _kernel_weight(module, x)
    # an interleaved weight is the kernel's alone, whatever the row count
    interleaved = type(module) in _LAID_OUT
    if weight is None or (x.size // x.shape[-1] > NATIVE_MAX_ROWS and not interleaved):
        return None
    if weight.dtype == mx.uint32:
        quantized = _quantized(module)
        if quantized is None:
            return None
        return weight, module["scales"], module["biases"], *quantized, interleaved
    if weight.dtype in _FLOATS and (x.dtype == weight.dtype or x.dtype == mx.float32):
        return weight, None, None, 0, 0, False
    return None


def _kernel_weight(module: nn.Module, x: mx.array) -> mx.array | None:
    """The weight of a layer whose product with ``x`` the kernel's path takes (on a CPU with
    the kernel, a float ``x``, a layer type it knows); None otherwise."""
    known = type(module) in _PROJECTIONS or type(module) in _LAID_OUT
    if not on_native() or x.dtype not in _FLOATS or not known:
        return None
    return module.get("weight")


def _on_kernel(module: nn.Module, x: mx.array) -> mx.array | None:
    """``x @ module.weight.T`` (plus the bias) by the kernel (``_operand``); a product of more
    than ``NATIVE_MAX_ROWS`` rows is BLAS's, by float32 weights; None where neither takes it."""
    operand = _operand(module, x)
    if operand is not None:
        weight, scales, biases, bits, group, interleaved = operand
        out = _native.product(
            x,
            weight,
            scales,
            biases,
            bits=bits,
            group_size=group,
            prompt=in_prompt(),
            interleaved=interleaved,
        )
    else:
        out = _many_rows(module, x)
        if out is None:
            return None
    bias = module.get("bias")
    return out if bias is None else out + bias


def _many_rows(module: nn.Module, x: mx.array) -> mx.array | None:
    """``x @ module.weight.T`` by BLAS for a product of more than ``NATIVE_MAX_ROWS`` rows on a
    CPU with the kernel (half-precision and quantized weights widened to float32 for it); None
    where the kernel's products do not apply."""
    weight = _kernel_weight(module, x)
    if weight is None or x.size // x.shape[-1] <= NATIVE_MAX_ROWS:
        return None
    if weight.dtype == mx.uint32:
        quantized = _quantized(module)
        if quantized is None:
            return None
        bits, group = quantized
        scales, biases = module["scales"], module["biases"]
        wide = mx.dequantize(weight, scales, biases, group_size=group, bits=bits)
        return x @ wide.astype(x.dtype).T
    return _dense(x, weight, True)


def _dense(x: mx.array, weight: mx.array, many: bool) -> mx.array | None:
    """``x @ weight.T`` for a float weight on a CPU with the kernel: BLAS for ``many`` rows;
    None where mlx would promote x to a wider weight type (the kernel returns x's type)."""
    if weight.dtype not in _FLOATS or (x.dtype != weight.dtype and x.dtype != mx.float32):
        return None
    return x @ weight.astype(x.dtype).T if many else _native.product(x, weight)


def multiply(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for a float weight array that is no layer's own (the head's gathered
    draft vocabulary): on the kernel where ``product`` would take it, else mlx's product."""
    out = None
    if on_native() and x.dtype in _FLOATS and weight.dtype in _FLOATS:
        out = _dense(x, weight, x.size // x.shape[-1] > NATIVE_MAX_ROWS)
    return x @ weight.T if out is None else out
