"""Decode-time attention (engine/model/attention.py): a row attended in a batch gets exactly,
bit for bit, what it gets alone, whatever its neighbours' lengths; the stacked caches keep
every row's own positions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.model import products
from engine.model.attention import KV_BLOCK, RowKVCache, attend_row, attend_rows

Q_HEADS, KV_HEADS, DIM = 4, 2, 64


def _cache(length: int, seed: int) -> RowKVCache:
    """A row's cache holding ``length`` random positions (written as a prompt would be)."""
    cache = RowKVCache()
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    keys = mx.random.normal((1, KV_HEADS, length, DIM), key=k1)
    values = mx.random.normal((1, KV_HEADS, length, DIM), key=k2)
    cache.update_and_fetch(keys, values)
    return cache


def _step(rows: int, t: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    queries = mx.random.normal((rows, Q_HEADS, t, DIM), key=k1) * DIM**-0.5
    keys = mx.random.normal((rows, KV_HEADS, t, DIM), key=k2)
    values = mx.random.normal((rows, KV_HEADS, t, DIM), key=k3)
    return queries, keys, values


def _reference(queries: mx.array, cache_keys: mx.array, cache_values: mx.array) -> mx.array:
    """Causal grouped-query attention of the last T positions over all ``cache_keys``, each
    position's heads joined (``[B, T, Hq * D]``, as ``attend`` returns it)."""
    b, _, t, _ = queries.shape
    out = mx.fast.scaled_dot_product_attention(
        queries, cache_keys, cache_values, scale=1.0, mask="causal" if t > 1 else None
    )
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1)


@pytest.mark.parametrize("t", [1, 3])
def test_attention_matches_causal_grouped_attention(t: int) -> None:
    cache = _cache(300, seed=1)
    before_k = cache.keys[..., :300, :]
    before_v = cache.values[..., :300, :]
    queries, keys, values = _step(1, t, seed=2)
    out = attend_row(queries, keys, values, cache)
    want = _reference(
        queries,
        mx.concatenate([before_k, keys], axis=2),
        mx.concatenate([before_v, values], axis=2),
    )
    assert cache.offset == 300 + t
    assert mx.allclose(out, want, atol=1e-5).item()


@pytest.mark.parametrize("t", [1, 3, 9])
def test_a_row_in_a_batch_attends_bit_for_bit_as_alone(t: int) -> None:
    # lengths across block boundaries, so the batch is wider than most rows alone
    lengths = [2, 5, 13, 40, 101, KV_BLOCK - 2, KV_BLOCK, 2 * KV_BLOCK + 7]
    queries, keys, values = _step(len(lengths), t, seed=3)
    alone = [
        attend_row(queries[b : b + 1], keys[b : b + 1], values[b : b + 1], _cache(n, seed=b))
        for b, n in enumerate(lengths)
    ]
    caches = [_cache(n, seed=b) for b, n in enumerate(lengths)]
    together = attend_rows(queries, keys, values, caches)
    for b in range(len(lengths)):
        assert mx.array_equal(together[b : b + 1], alone[b]).item(), f"row {b}"
    # a second cycle runs on the stacked caches, still bit for bit
    queries2, keys2, values2 = _step(len(lengths), t, seed=4)
    again = attend_rows(queries2, keys2, values2, caches)
    for b, n in enumerate(lengths):
        cache = _cache(n, seed=b)
        attend_row(queries[b : b + 1], keys[b : b + 1], values[b : b + 1], cache)
        one = attend_row(queries2[b : b + 1], keys2[b : b + 1], values2[b : b + 1], cache)
        assert mx.array_equal(again[b : b + 1], one).item(), f"row {b}, second cycle"


def test_stacked_rows_keep_their_own_positions() -> None:
    lengths = [7, 300]
    caches = [_cache(n, seed=10 + b) for b, n in enumerate(lengths)]
    first = [c.keys[..., : c.offset, :] for c in caches]
    queries, keys, values = _step(2, 3, seed=5)
    attend_rows(queries, keys, values, caches)
    batch = caches[0]._batch
    assert batch is not None and batch is caches[1]._batch
    caches[0].trim(2)  # a row rejects two of its three positions
    queries, keys, values = _step(2, 3, seed=6)
    attend_rows(queries, keys, values, caches)
    assert caches[0]._batch is batch, "the same rows run on the same stacked caches"
    assert [c.offset for c in caches] == [7 + 1 + 3, 300 + 3 + 3]
    # read alone, each row holds its own positions: the first ones as written, the rejected
    # ones overwritten by the next cycle's
    row0 = caches[0].keys
    assert caches[0]._batch is None and caches[1]._batch is batch
    assert mx.array_equal(row0[..., :7, :], first[0]).item()
    assert mx.array_equal(row0[..., 8:11, :], keys[:1]).item()
    assert mx.array_equal(caches[1].keys[..., :300, :], first[1]).item()
    # one row read alone: the next batched cycle stacks anew, from the rows' own caches
    queries, keys, values = _step(2, 1, seed=7)
    attend_rows(queries, keys, values, caches)
    assert caches[0]._batch is not batch and caches[0]._batch is caches[1]._batch


def test_padding_columns_of_a_head_step_never_enter_a_cache() -> None:
    # a batched head step right-aligns each row's pending pairs: row 0 has 1 real column of 3
    caches = [_cache(20, seed=20), _cache(30, seed=21)]
    queries, keys, values = _step(2, 3, seed=8)
    out = attend_rows(queries[:, :, -1:], keys, values, caches, lengths=[1, 3])
    assert [c.offset for c in caches] == [21, 33]
    alone = _cache(20, seed=20)
    want = attend_row(queries[:1, :, -1:], keys[:1, :, -1:], values[:1, :, -1:], alone)
    assert mx.array_equal(out[:1], want).item()
    assert mx.array_equal(caches[0].keys[..., :21, :], alone.keys[..., :21, :]).item()


def test_a_finished_rows_stacked_cache_is_freed_with_it() -> None:
    import gc

    caches = [_cache(50, seed=30 + b) for b in range(3)]
    queries, keys, values = _step(3, 1, seed=9)
    mx.eval(attend_rows(queries, keys, values, caches))
    gc.collect()
    before = mx.get_active_memory()
    del caches  # every row finished
    gc.collect()
    assert mx.get_active_memory() < before


def test_rows_left_in_a_stack_go_on_bit_for_bit() -> None:
    lengths = [30, 280, 100]
    caches = [_cache(n, seed=40 + b) for b, n in enumerate(lengths)]
    alone = [_cache(n, seed=40 + b) for b, n in enumerate(lengths)]
    queries, keys, values = _step(3, 3, seed=11)
    attend_rows(queries, keys, values, caches)
    for b in range(3):
        attend_row(queries[b : b + 1], keys[b : b + 1], values[b : b + 1], alone[b])
    old = caches[0]._batch
    del caches[1], alone[1]  # the middle row finished
    queries, keys, values = _step(2, 3, seed=12)
    together = attend_rows(queries, keys, values, caches)
    assert caches[0]._batch is not old and caches[0]._batch is caches[1]._batch
    for b in range(2):
        one = attend_row(queries[b : b + 1], keys[b : b + 1], values[b : b + 1], alone[b])
        assert mx.array_equal(together[b : b + 1], one).item(), f"row {b}"
        assert caches[b].offset == alone[b].offset
        width = alone[b].offset
        assert mx.array_equal(caches[b].keys[..., :width, :], alone[b].keys[..., :width, :]).item()


@pytest.mark.parametrize(("q_heads", "t"), [(4, 2), (4, 5), (8, 1), (8, 2), (8, 5)])
def test_a_query_attends_bit_for_bit_alone_and_among_a_verify_s_positions(
    q_heads: int, t: int
) -> None:
    """On the native kernel a verify's position attends exactly as the plain step of that
    position (its own keys alone, in key order), whatever padding follows the cache: each
    way the kernel groups a KV head's queries (one at a time, four over a value row at a time,
    fours over blocks of keys, scores of four keys at once) sums the same products in the same
    order."""
    from engine.model import products

    native = products.native_for(mx.zeros(1))
    if native is None:
        pytest.skip("the native kernel is not built")
    length = 300
    queries = mx.random.normal((2, q_heads, t, DIM), key=mx.random.key(11)) * DIM**-0.5
    keys = mx.random.normal((2, KV_HEADS, 2 * KV_BLOCK, DIM), key=mx.random.key(12))
    values = mx.random.normal((2, KV_HEADS, 2 * KV_BLOCK, DIM), key=mx.random.key(13))
    ends = mx.array([length, length - 40], dtype=mx.int32)
    together = native.attend(queries, keys, values, ends)
    for j in range(t):  # position j alone: its cache ends at its own position
        alone = native.attend(queries[:, :, j : j + 1], keys, values, ends - (t - 1 - j))
        assert mx.array_equal(alone, together[:, j : j + 1]).item(), j
    shorter = native.attend(queries, keys[:, :, :412], values[:, :, :412], ends)
    assert mx.array_equal(shorter, together).item()


def _address(a: mx.array) -> int:
    """Where ``a``'s elements lie (evaluated first)."""
    mx.eval(a)
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


needs_kernel = pytest.mark.skipif(
    products.native_for(mx.zeros(1)) is None, reason="the in-place write is the native kernel's"
)


@needs_kernel
def test_decode_steps_write_the_cache_in_place_while_it_owns_its_buffers() -> None:
    """mlx's slice update copies the whole buffer while the step before still holds it (every
    decode step, as the loop runs ahead), a cost that grows with the context: while a cache
    owns its buffers, its steps write where the buffer lies."""
    cache = _cache(40, seed=40)
    queries, keys, values = _step(1, 1, seed=10)
    mx.eval(attend_row(queries, keys, values, cache))  # one copying write: now the cache owns it
    first = _address(cache._keys)
    for seed in range(11, 14):
        queries, keys, values = _step(1, 1, seed=seed)
        mx.async_eval(attend_row(queries, keys, values, cache))
    assert _address(cache._keys) == first and cache.offset == 44
    assert mx.array_equal(cache.keys[..., 43:44, :], keys).item()


@needs_kernel
def test_a_view_read_out_of_the_cache_keeps_its_values_through_later_writes() -> None:
    """A reader outside the decode path (a conversation-cache snapshot's lazy copy) ends the
    cache's sole ownership: the next write copies, so the view, evaluated after a rollback has
    rewritten the positions it covers, still holds what it saw."""
    cache = _cache(40, seed=41)
    queries, keys, values = _step(1, 1, seed=20)
    mx.eval(attend_row(queries, keys, values, cache))
    seen = cache.keys[..., :41, :]  # lazy, not evaluated yet
    before = mx.array(np.array(memoryview(cache._keys))[..., :41, :])  # a copy, for the check
    cache.offset = 35  # a rollback over positions the view covers
    for seed in range(21, 27):
        queries, keys, values = _step(1, 1, seed=seed)
        mx.async_eval(attend_row(queries, keys, values, cache))
    assert mx.array_equal(seen, before).item()
    assert not mx.array_equal(cache.keys[..., 35:41, :], before[..., 35:41, :]).item()


@needs_kernel
def test_stacked_rows_write_in_place_and_bit_for_bit_as_a_scatter() -> None:
    lengths = [30, 60]
    caches = [_cache(n, seed=50 + b) for b, n in enumerate(lengths)]
    queries, keys, values = _step(2, 1, seed=30)
    mx.eval(attend_rows(queries, keys, values, caches))
    batch = caches[0]._batch
    first = _address(batch.keys)
    queries, keys, values = _step(2, 3, seed=31)
    mx.async_eval(attend_rows(queries, keys, values, caches))
    assert _address(batch.keys) == first
    index = mx.array([[31, 32, 33], [61, 62, 63]])[:, None, :, None]
    for stacked, new in ((batch.keys, keys), (batch.values, values)):
        want = mx.take_along_axis(stacked, mx.broadcast_to(index, new.shape), axis=2)
        assert mx.array_equal(want, new).item()
