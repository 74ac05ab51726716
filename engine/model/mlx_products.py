"""mlx's own products on a CPU, made fast enough to decode with where the native kernel
(``engine.model.products``) is not built: transposed weights as evaluated views, large weights
multiplied in column parts on several mlx CPU streams, and products of a few rows row by row
where that measures faster on this machine. Every way gives each row bit for bit its one-row
product, so greedy output does not move with K or the batch size on this path either.

Also where prefill chunks run their BLAS products on every core (``prefill_on_all_cores``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

#: where a float linear layer (or embedding) keeps its evaluated transposed weight
_TRANSPOSED = "_mtpserve_transposed"

#: A weight of at least this many parameters is multiplied as column parts, one per part of
#: ``prepare_transposed``, each on its own mlx CPU stream, so that mlx's products (one stream's
#: kernels run on one thread, and BLIS does not thread a product of few rows) read a large weight
#: on every core; the columns are bit-identical, and smaller weights stay whole because their
#: extra dispatches cost what the second core gives (docs/CPU_CHOICES.md).
SPLIT_WEIGHT_PARAMS = 3 << 20
#: Products of more rows than this (prefill chunks) keep one BLAS call: BLIS threads those itself
#: (``engine.blas.all_cores``).
SPLIT_PRODUCT_MAX_ROWS = 64
#: A prefill chunk runs its products on every core (BLIS threads, ``engine.blas.all_cores``)
#: only when it has more rows than this and the model is at least this wide: BLIS's threads wait
#: for each other at spinning barriers, and beside mlx's own threads on the same cores they made
#: shorter chunks and narrower models up to 50x slower (docs/BENCHMARKS.md, "Decode threads and
#: the prefill chunk"); up to 64 rows the column parts below already use both cores.
THREADED_PREFILL_MIN_ROWS = SPLIT_PRODUCT_MAX_ROWS + 1
THREADED_PREFILL_MIN_HIDDEN = 1024
#: Most column parts: one per core, measured on 2 cores only.
MAX_PRODUCT_PARTS = 4
#: On a CPU a float32 product of 2 to this many rows may run row by row (``_times``), by the
#: size of the weight (or column part) in bytes: (most bytes, most rows), first match. Row by
#: row reads the weight once per row, so it can pay only while the weight stays in cache, and
#: whether it pays depends on the CPU and its BLAS, so ``rowwise_rows`` measures it at load
#: (docs/CPU_CHOICES.md). Half-precision products were
#: slower row by row on every CPU measured: they keep one product unmeasured.
ROWWISE_LIMITS = ((8 << 20, 16), (16 << 20, 8))
#: A larger weight streams from memory, and whole it would be read once per row: it may run row
#: by row in row blocks of at most this many bytes, each read from memory once and from cache
#: for the other rows, for 2 to ``BLOCKED_MAX_ROWS`` rows (in 4 MiB blocks against one product,
#: at 95 and 485 MiB on the 32 MiB-L3 CPU: 0.6x for 2 and 5 rows, 0.75-0.8x for 9;
#: ``scripts/experiments/rowwise_products.py --blocks``).
ROWWISE_BLOCK_BYTES = 4 << 20
BLOCKED_MAX_ROWS = 8
#: Row counts at which ``rowwise_rows`` times row by row against one product, smallest first.
ROWWISE_TRIAL_ROWS = (2, 4, 8, 16)
#: Row by row is kept at a row count only when it takes at most this share of one product's
#: time: a clear win, so that timing noise at load rarely flips the choice between runs.
ROWWISE_PAYS = 0.85
#: Each timing multiplies about this many weight parameters (up to ``ROWWISE_TRIAL_PRODUCTS``
#: products of a small weight, one of a large one), best of three rounds.
ROWWISE_TRIAL_PARAMS = 1 << 22
ROWWISE_TRIAL_PRODUCTS = 8

#: measured ``rowwise_rows`` per (shape, dtype, blocked): one measurement per process
_rowwise_rows: dict[tuple[tuple[int, ...], mx.Dtype, bool], int] = {}

#: each thread's streams for column parts (mlx's streams belong to the thread that made them)
_product_streams = threading.local()


def prefill_on_all_cores(trunk: Any, rows: int) -> bool:
    """Whether a prefill chunk of ``rows`` tokens runs its products on every core."""
    return rows >= THREADED_PREFILL_MIN_ROWS and trunk.args.hidden_size >= (
        THREADED_PREFILL_MIN_HIDDEN
    )


def product_parts() -> int:
    """How many column parts a large product runs as here: one per core on a CPU (at most
    ``MAX_PRODUCT_PARTS``), 1 on GPUs (a kernel there uses the whole device)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_PRODUCT_PARTS))


def prepare_transposed(model: nn.Module, parts: int = 1, few_rows: bool = True) -> None:
    """Give every float ``nn.Linear`` and ``nn.Embedding`` under ``model`` its weight's
    transpose, evaluated once: a view of the same buffer (no copy), so ``linear`` and
    ``project_to_vocab`` multiply by it directly; with ``parts`` > 1 also ``parts`` row blocks
    of each weight of ``SPLIT_WEIGHT_PARAMS`` or more and their transposes (views too), for
    products split across streams (``product``).

    Why: ``nn.Linear`` computes ``x @ weight.T``, and a compiled block replays that transpose
    as one more dispatched primitive per projection and step (mlx does not fold constants),
    ~60 of a plain demo-model step's ~800, each costing as much to dispatch as a small product.
    Call it once the weights are final (``engine.model.products.prepare``); a weight replaced
    later is noticed and multiplied as before. ``few_rows`` False: another kernel takes the
    products of few rows, so the views serve long prefills only (no parts, no row by row)."""
    cpu = mx.default_device().type == mx.DeviceType.cpu
    if not few_rows:
        cpu, parts = False, 1
    for module in model.modules():
        if type(module) in (nn.Linear, nn.Embedding):
            weight = module["weight"]
            rows = weight.shape[0]
            split = parts > 1 and weight.size >= SPLIT_WEIGHT_PARAMS
            bounds = [rows * i // parts for i in range(parts + 1)] if split else []
            blocks = [weight[a:b] for a, b in itertools.pairwise(bounds)]
            rowwise = cpu and weight.dtype == mx.float32
            # with column parts the whole weight multiplies only inputs of many rows
            whole = _Operand.of(weight, rowwise and not blocks)
            split_parts = [_Operand.of(block, rowwise) for block in blocks]
            module.__dict__[_TRANSPOSED] = _Prepared(weight, whole, split_parts)


@dataclass(frozen=True)
class _Operand:
    """A weight ``[out, in]`` (or a column part of one) as products use it: views, no copies."""

    view: mx.array  # the transpose [in, out]: ``x @ view``
    #: ``_times`` multiplies 2 .. this many rows row by row (1: never)
    most_rows: int
    #: a weight that stays in cache: for r = 2 .. ``most_rows`` rows, the weight broadcast to
    #: ``[r, out, in]`` (stride 0; made once, so that no product dispatches the broadcast)
    by_rows: tuple[mx.array, ...] = ()
    #: a weight that streams from memory: its row blocks as ``[1, rows, in]``
    blocks: tuple[mx.array, ...] = ()

    @classmethod
    def of(cls, weight: mx.array, rowwise: bool) -> _Operand:
        """``rowwise``: a float32 weight on a CPU; it multiplies 2 .. ``rowwise_rows`` rows
        row by row (``ROWWISE_LIMITS``)."""
        fits = [n for most, n in ROWWISE_LIMITS if weight.nbytes <= most]
        if not rowwise:
            operand = cls(weight.T, 1)
        elif fits:
            stacked = weight[None]
            by_rows = tuple(
                mx.broadcast_to(stacked, (r, *weight.shape)) for r in range(2, fits[0] + 1)
            )
            operand = cls(weight.T, fits[0], by_rows=by_rows)
        else:
            step = max(1, ROWWISE_BLOCK_BYTES // (weight.shape[1] * weight.itemsize))
            blocks = tuple(weight[None, i : i + step] for i in range(0, weight.shape[0], step))
            operand = cls(weight.T, BLOCKED_MAX_ROWS, blocks=blocks)
        mx.eval(operand.view, *operand.by_rows, *operand.blocks)
        if operand.most_rows > 1:
            operand = operand.up_to(rowwise_rows(operand))
        return operand

    def up_to(self, most_rows: int) -> _Operand:
        """This operand multiplying at most ``most_rows`` rows row by row."""
        if most_rows <= 1:
            return _Operand(self.view, 1)
        return _Operand(self.view, most_rows, self.by_rows[: most_rows - 1], self.blocks)


def rowwise_rows(operand: _Operand) -> int:
    """The most rows ``operand`` multiplies row by row on this machine: the largest of
    ``ROWWISE_TRIAL_ROWS`` (up to ``operand.most_rows``) at and below which row by row took at
    most ``ROWWISE_PAYS`` of one product's time; 1 (never) when it does not pay at 2 rows.
    Measured once per weight shape and process, a small part of a load (docs/CPU_CHOICES.md)."""
    view = operand.view
    key = (tuple(view.shape), view.dtype, bool(operand.blocks))
    if key not in _rowwise_rows:
        trials = [r for r in ROWWISE_TRIAL_ROWS if r <= operand.most_rows]
        _rowwise_rows[key] = last_paying_rows(trials, lambda r: _time_both_ways(operand, r))
    return min(_rowwise_rows[key], operand.most_rows)


def last_paying_rows(trials: list[int], seconds: Callable[[int], tuple[float, float]]) -> int:
    """The largest of ``trials`` (ascending) up to which every trial's ``seconds(rows)`` —
    (one product, row by row) — has row by row at most ``ROWWISE_PAYS`` of one product; 1 if
    the first does not. Stops timing at the first trial that does not pay."""
    most = 1
    for rows in trials:
        one, by_row = seconds(rows)
        if by_row > ROWWISE_PAYS * one:
            break
        most = rows
    return most


def _time_both_ways(operand: _Operand, rows: int) -> tuple[float, float]:
    """Seconds per product of ``rows`` random rows by ``operand``: one product and row by
    row, best of three rounds that alternate the two."""
    # its own key: loading a model leaves the global random state as it was
    x = mx.random.normal((rows, operand.view.shape[0]), key=mx.random.key(rows))
    x = x.astype(operand.view.dtype)
    mx.eval(x)
    count = max(1, min(ROWWISE_TRIAL_PRODUCTS, ROWWISE_TRIAL_PARAMS // operand.view.size))
    ways = (lambda: x @ operand.view, lambda: _times(x, operand, rows))
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for i, way in enumerate(ways):
            start = time.perf_counter()
            mx.eval([way() for _ in range(count)])
            best[i] = min(best[i], (time.perf_counter() - start) / count)
    return best[0], best[1]


@dataclass(frozen=True)
class _Prepared:
    """A linear layer's weight with the views its products use (``prepare_transposed``)."""

    weight: mx.array  # [out, in], as loaded
    whole: _Operand
    parts: list[_Operand]  # one per column part (none: the weight is multiplied whole)

    @property
    def rowwise_max_rows(self) -> int:
        """Products of 2 .. this many rows run row by row (``_times``); 1: never."""
        return (self.parts[0] if self.parts else self.whole).most_rows


def _prepared(module: nn.Module) -> _Prepared | None:
    cached = module.__dict__.get(_TRANSPOSED)
    if cached is None or cached.weight is not module.get("weight"):
        return None
    return cached


def product(module: nn.Module, x: mx.array) -> mx.array | None:
    """``x @ weight.T`` by the module's prepared views (None when it has none): one product, or
    for a large weight and few rows one per column part, each on its own CPU stream, joined."""
    prepared = _prepared(module)
    return None if prepared is None else _product(x, prepared)


def _product(x: mx.array, prepared: _Prepared) -> mx.array:
    rows = x.size // x.shape[-1]
    if not prepared.parts or rows > SPLIT_PRODUCT_MAX_ROWS:
        return _times(x, prepared.whole, rows)
    streams: list[mx.Stream] = _product_streams.__dict__.setdefault("streams", [])
    while len(streams) < len(prepared.parts):
        streams.append(mx.default_stream(mx.cpu) if not streams else mx.new_stream(mx.cpu))
    outs = []
    for operand, stream in zip(prepared.parts, streams, strict=False):
        with mx.stream(stream):
            outs.append(_times(x, operand, rows))
    return mx.concatenate(outs, axis=-1)


def _times(x: mx.array, operand: _Operand, rows: int) -> mx.array:
    """``x @ operand.view``; a product of 2 .. ``rowwise_max_rows`` rows as one matrix-vector
    product per row, batched in one op (``weight[None] @ x[..., None]``), or in one op per
    row block of a weight that streams from memory, the columns joined.

    Why: on some CPUs BLAS's matrix-matrix product of a few rows costs several times the
    matrix-vector product of one (BLIS on a 2-core CPU with 32 MiB of L3: a [2, 256] x
    [256, 768] product 83 µs against 14 µs for one row, 28 µs row by row; ``rowwise_rows``
    measures it), and row by row each row's result is bit for bit the one-row product's, so a
    verify position or a batch row multiplies exactly as plain decoding of that row alone
    does."""
    if not 2 <= rows <= operand.most_rows:
        return x @ operand.view
    columns = x.reshape(rows, x.shape[-1], 1)
    if operand.blocks:
        out = mx.concatenate([block @ columns for block in operand.blocks], axis=1)
    else:
        out = operand.by_rows[rows - 2] @ columns
    return out.reshape(*x.shape[:-1], operand.view.shape[1])


def linear(module: nn.Module, x: mx.array) -> mx.array:
    """``module(x)`` for a linear layer, by its prepared transposed weight when it has one (the
    same product: bit-identical), else by the module itself."""
    prepared = _prepared(module)
    if prepared is None:
        return module(x)
    bias = module.get("bias")
    return _product(x, prepared) if bias is None else mx.addmm(bias, x, prepared.whole.view)
