"""Attention over KV caches during decoding: one set of ops for every row of a batch, and for
each row exactly the numbers it gets alone.

A batch's rows have caches of different lengths. Attending row by row costs ~35 dispatched mlx
ops per row and layer (slices, the cache write, the attention and its mask); on a CPU, where a
decode step is bound by per-op dispatch, that was most of what an 8-row cycle added over a
one-row cycle. Here the rows' keys and values live in one stacked buffer between cycles
(``BatchKV``, ``[B, H_kv, P, D]``, P the longest row rounded up to ``KV_BLOCK``), every row's
new positions are written with one op, and one masked attention runs over all rows.

Exactness. A row's result must not depend on its neighbours, so every decode-time attention —
a row alone too — is ``attend``: over the cache padded to a multiple of ``KV_BLOCK`` positions,
the positions past the row's length masked out. Padding then changes nothing, bit for bit:

* the scores are dot products over the head dimension, the same whatever the number of keys;
* the softmax's masked terms are exp(-inf) = 0, added after the real ones;
* ``probs @ values`` runs per block of ``KV_BLOCK`` keys (the same product shapes for a row
  alone and in a batch), and the blocks are summed in order: a block past the row's length
  adds exact zeros.

(A product over all P keys at once would not do: a BLAS blocks and vectorises its inner
dimension by its length, so a longer padded product rounds differently.)
On a CPU with the native kernel ``attend`` is one op (``Attend``) whose every query runs over
its own visible keys alone, in key order, so the same holds there by construction.
``tests/unit/test_attention.py`` checks a row alone against the same row in batches of other
lengths, bit for bit.

Writes. mlx's slice update and scatter copy the whole buffer unless nothing else holds it, and
the decode loop evaluates step n + 1 while step n's tasks still hold it: each step would copy
every attention layer's cache, a cost that grows with the context. On the native kernel a
write is ``write_positions``, in place (the output shares the buffer's memory; tasks run in the
order they are handed out, so what was handed out before reads the old values and what comes
after reads the new). It takes a buffer only while the cache owns it alone: a buffer that code
outside the decode path has read (a conversation-cache snapshot's lazy copy) or set is written
once with mlx's copying update, and the copy is the cache's own again. Positions a write
replaces are never read by ops handed out before it: a step writes past the cache's length,
and a rollback (a verify's rejected positions) moves the length back only after the cycle
that wrote them has been read.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.model import products

#: keys per block of ``attend``'s value product; caches are padded to a multiple of it
KV_BLOCK = 256


def padded(length: int) -> int:
    """``length`` rounded up to a whole number of blocks (at least one)."""
    return max(1, -(-length // KV_BLOCK)) * KV_BLOCK


def attend(queries: mx.array, keys: mx.array, values: mx.array, ends: tuple[int, ...]) -> mx.array:
    """Attention of T positions of each row over its cache.

    ``queries [B, Hq, T, D]``, already scaled; ``keys``, ``values [B, Hkv, P, D]`` with P a
    multiple of ``KV_BLOCK`` (Hq a multiple of Hkv: grouped-query attention); row b's cache
    holds ``ends[b]`` positions, its T queries the last of them, each seeing the keys up to its
    own position. Returns ``[B, T, Hq * D]``: each position's heads joined, as the output
    projection takes them.

    On a CPU with the native kernel one op (``Attend``: each query over its own keys alone, in
    key order, so padding, the other queries and the other rows change none of its bits) where
    mlx takes ~14; elsewhere mlx's ops over the padded cache (see the module's notes).
    """
    if (native := products.native_for(queries, keys, values)) is not None:
        return native.attend(queries, keys, values, mx.array(ends, dtype=mx.int32))
    rows, q_heads, t, dim = queries.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    visible = visibility(ends, t, group, width, keys.dtype)
    # a KV head's queries side by side: [B, Hkv, group * T, D]
    grouped = queries.reshape(rows, kv_heads, group * t, dim)
    scores = grouped @ keys.swapaxes(-1, -2) + visible  # [B, Hkv, group * T, P]
    # mlx's softmax, not one from power(e, x) as elsewhere on CPUs: over thousands of keys its
    # single kernel took 0.4x the time of the compiled four-op form; exp(-inf) is exactly 0
    probs = mx.softmax(scores, axis=-1, precise=True)
    blocks = width // KV_BLOCK
    probs = probs.reshape(rows, kv_heads, group * t, blocks, KV_BLOCK).swapaxes(2, 3)
    parts = probs @ values.reshape(rows, kv_heads, blocks, KV_BLOCK, values.shape[-1])
    out = parts.sum(axis=2).reshape(rows, q_heads, t, -1)
    return out.transpose(0, 2, 1, 3).reshape(rows, t, -1)


def visibility(
    ends: tuple[int, ...], t: int, group: int, width: int, dtype: mx.Dtype = mx.float32
) -> mx.array:
    """What to add to each query's scores, ``[B, 1, group * T, P]``: 0 where it sees the key,
    -inf elsewhere. Row b's cache holds ``ends[b]`` positions, its T queries the last of them,
    each seeing the keys up to its own position. Made on the host: no dispatched ops (and not
    kept: a cache of arrays would hold memory between requests)."""
    bias = np.full((len(ends), 1, group, t, width), -np.inf, dtype=np.float32)
    for b, end in enumerate(ends):
        for j in range(t):
            bias[b, 0, :, j, : end - t + j + 1] = 0.0
    # in the scores' type: a float32 mask would turn a half-precision model's activations float32
    return mx.array(bias.reshape(len(ends), 1, group * t, width), dtype=dtype)


class RowKVCache(KVCache):
    """mlx-lm's ``KVCache`` whose buffers may live in a batch's stacked buffers (``BatchKV``)
    between batched cycles. Reading ``keys`` or ``values`` (a row alone again, the conversation
    cache saving it) takes the row's part out first, so every reader sees an ordinary cache."""

    def __init__(self) -> None:
        self._batch: BatchKV | None = None
        self._row = 0
        #: whether the buffers are this cache's alone since its last write: no reader outside
        #: the decode path has seen them (the module's notes, "Writes")
        self._owned = False
        super().__init__()

    @property
    def keys(self) -> mx.array | None:
        if self._batch is not None:
            self._batch.release(self)
        self._owned = False
        return self._keys

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        if self._batch is not None:
            self._batch.release(self)
        self._owned = False
        self._keys = value

    @property
    def values(self) -> mx.array | None:
        if self._batch is not None:
            self._batch.release(self)
        self._owned = False
        return self._values

    @values.setter
    def values(self, value: mx.array | None) -> None:
        if self._batch is not None:
            self._batch.release(self)
        self._owned = False
        self._values = value

    def own_buffers(self) -> tuple[mx.array | None, mx.array | None]:
        """The buffers, read by the decode path itself (ownership unchanged; out of any
        batch first)."""
        if self._batch is not None:
            self._batch.release(self)
        return self._keys, self._values

    def write(self, start: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``keys``, ``values [1, Hkv, T, D]`` at positions ``start..start+T-1`` (room
        reserved); returns the buffers. In place while the cache owns them, else by mlx's
        copying update, after which it does."""
        native = products.native_for(keys, values)
        if native is not None and self._owned and self._batch is None:
            # a constant, not an op: the step dispatches nothing more for it
            positions = mx.array([list(range(start, start + keys.shape[2]))], dtype=mx.int32)
            self._keys = native.write_positions(self._keys, keys, positions)
            self._values = native.write_positions(self._values, values, positions)
        else:
            self.keys[..., start : start + keys.shape[2], :] = keys
            self.values[..., start : start + keys.shape[2], :] = values
        self._owned = True
        return self._keys, self._values

    def buffers(self) -> list[mx.array]:
        """What the next cycle reads of this cache (its batch's buffers while it has one)."""
        if self._batch is not None:
            return [self._batch.keys, self._batch.values]
        return [] if self._keys is None else [self._keys, self._values]


def _widened(buffer: mx.array, kept: int, width: int) -> mx.array:
    """The first ``kept`` positions of a ``[B, H, P, D]`` buffer, zeros after them up to
    ``width``."""
    if kept == buffer.shape[2] == width:
        return buffer
    head = buffer[..., :kept, :]
    if kept == width:
        return head
    zeros = mx.zeros((*buffer.shape[:2], width - kept, buffer.shape[3]), buffer.dtype)
    return mx.concatenate([head, zeros], axis=2)


def _buffers(cache: KVCache) -> tuple[mx.array | None, mx.array | None]:
    """A cache's buffers as the decode path reads them (a ``RowKVCache`` keeps owning its own)."""
    if isinstance(cache, RowKVCache):
        return cache.own_buffers()
    return cache.keys, cache.values


def reserve(cache: KVCache, length: int) -> None:
    """Make room in a row's own buffers for ``length`` positions, a multiple of ``KV_BLOCK``
    (new positions are zeros)."""
    width = padded(length)
    keys, values = _buffers(cache)
    if keys is not None and keys.shape[2] >= width and keys.shape[2] % KV_BLOCK == 0:
        return
    if keys is None:
        raise ValueError("reserve needs the cache's first positions (its shapes)")
    kept = min(cache.offset, keys.shape[2])
    cache.keys, cache.values = _widened(keys, kept, width), _widened(values, kept, width)


def attend_row(queries: mx.array, keys: mx.array, values: mx.array, cache: KVCache) -> mx.array:
    """One row: write its T new positions (``keys``, ``values [1, Hkv, T, D]``) into ``cache``
    and ``attend`` with its scaled queries ``[1, Hq, Tq, D]`` (the last Tq of the T
    positions): ``[1, Tq, Hq * D]``."""
    new = keys.shape[2]
    if _buffers(cache)[0] is None:
        cache.keys, cache.values = _widened(keys, 0, padded(new)), _widened(values, 0, padded(new))
    start = cache.offset
    reserve(cache, start + new)
    if isinstance(cache, RowKVCache):
        row_keys, row_values = cache.write(start, keys, values)
    else:
        cache.keys[..., start : start + new, :] = keys
        cache.values[..., start : start + new, :] = values
        row_keys, row_values = cache.keys, cache.values
    cache.offset = start + new
    width = padded(cache.offset)
    if row_keys.shape[2] != width:
        row_keys, row_values = row_keys[..., :width, :], row_values[..., :width, :]
    return attend(queries, row_keys, row_values, (cache.offset,))


class BatchKV:
    """One attention layer's KV caches of a batch's rows, stacked: ``keys``, ``values [B, Hkv,
    P, D]``. Formed when a batched cycle runs rows whose caches are not stacked together, and
    kept while the same rows in the same order run again; each row's ``offset`` stays its own.

    The rows refer to it and it refers back only weakly (a finished row's cache dies with its
    sequence); a row read alone takes its part out (``release``) and leaves the batch, and the
    next batched cycle stacks anew."""

    def __init__(self, caches: list[RowKVCache], width: int, like: tuple[mx.array, ...]) -> None:
        """``like``: new keys and values of the rows (the shapes of an empty row's buffers)."""
        old = caches[0]._batch
        if old is not None and all(c._batch is old for c in caches):
            # rows of one earlier stack (some left it): one gather, not a copy out per row
            rows = mx.array([c._row for c in caches])
            kept = min(old.keys.shape[2], width)
            self.keys = _widened(mx.take(old.keys, rows, axis=0), kept, width)
            self.values = _widened(mx.take(old.values, rows, axis=0), kept, width)
            self._attach(caches)
            return
        keys, values = [], []
        for cache in caches:
            k, v = cache.keys, cache.values  # out of any other batch
            if k is None:
                k, v = (a[:1, :, :0] for a in like)
            kept = min(k.shape[2], width)
            keys.append(_widened(k, kept, width))
            values.append(_widened(v, kept, width))
        self.keys = mx.concatenate(keys)
        self.values = mx.concatenate(values)
        self._attach(caches)

    def _attach(self, caches: list[RowKVCache]) -> None:
        self.rows = [weakref.ref(cache) for cache in caches]
        for row, cache in enumerate(caches):
            cache._keys = cache._values = None
            cache._batch, cache._row = self, row

    @classmethod
    def of(cls, caches: list[RowKVCache], length: int, like: tuple[mx.array, ...]) -> BatchKV:
        """The rows' stacked caches with room for ``length`` positions."""
        batch = caches[0]._batch
        if batch is None or not batch.holds(caches):
            return cls(caches, padded(length), like)
        if batch.keys.shape[2] < length:
            kept, width = batch.keys.shape[2], padded(length)
            batch.keys = _widened(batch.keys, kept, width)
            batch.values = _widened(batch.values, kept, width)
        return batch

    def holds(self, caches: list[RowKVCache]) -> bool:
        """Whether ``caches`` are exactly this batch's rows, in order."""
        if len(caches) != len(self.rows):
            return False
        return all(c._batch is self and c._row == b for b, c in enumerate(caches))

    def write(self, positions: mx.array, keys: mx.array, values: mx.array) -> None:
        """Row b's new keys and values ``[B, Hkv, T, D]`` at its positions ``positions[b]``.
        The stacked buffers are the batch's alone (made by it; a row leaving takes a copy, and
        the rows that stay stack anew), so on the native kernel in place (the module's notes,
        "Writes"); else one scatter each."""
        native = products.native_for(keys, values)
        if native is not None:
            self.keys = native.write_positions(self.keys, keys, positions)
            self.values = native.write_positions(self.values, values, positions)
            return
        index = positions[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(index, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(
            self.values, mx.broadcast_to(index, values.shape), values, axis=2
        )

    def release(self, cache: RowKVCache) -> None:
        """Give ``cache`` its own copy of its row and take it out of the batch."""
        row = mx.array([cache._row])
        cache._batch = None
        cache._owned = False
        cache._keys = mx.take(self.keys, row, axis=0)
        cache._values = mx.take(self.values, row, axis=0)


def attend_rows(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    caches: list[KVCache],
    lengths: list[int] | None = None,
) -> mx.array:
    """B rows at once: write row b's new positions (``keys``, ``values [B, Hkv, T, D]``; with
    ``lengths``, only its last ``lengths[b]`` columns are real, the earlier ones padding that
    its cache never keeps) and ``attend`` with ``queries [B, Hq, Tq, D]`` (scaled):
    ``[B, Tq, Hq * D]``."""
    t = keys.shape[2]
    real = lengths if lengths is not None else [t] * len(caches)
    if len(caches) == 1 or not all(isinstance(c, RowKVCache) for c in caches):
        out = []
        for b, cache in enumerate(caches):
            cols = slice(t - real[b], None)
            out.append(
                attend_row(
                    queries[b : b + 1],
                    keys[b : b + 1, :, cols],
                    values[b : b + 1, :, cols],
                    cache,
                )
            )
        return out[0] if len(out) == 1 else mx.concatenate(out)
    starts = [c.offset for c in caches]
    batch = BatchKV.of(caches, max(starts) + t, (keys, values))
    # Row b's real columns go to its next positions; its padding columns (before them) go past
    # its new length, where they are masked now and overwritten later.
    pad = [t - n for n in real]
    positions = [
        [s + n + j if j < p else s + j - p for j in range(t)]
        for s, n, p in zip(starts, real, pad, strict=True)
    ]
    batch.write(mx.array(positions), keys, values)
    for cache, n in zip(caches, real, strict=True):
        cache.offset += n
    ends = tuple(c.offset for c in caches)
    return attend(queries, batch.keys, batch.values, ends)
