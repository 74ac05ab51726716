"""The native sampler ops (engine/model/native/sampler.cpp) against mlx's formulations of the
same rules (sampling/distribution.py, sampling/acceptance.py) and numpy: ``top_k_truncate``
gives the same candidates in token order, the same probabilities to rounding and the same
draws (-inf logits, vocabularies that are not a multiple of its scan block, rows wide enough to
be shared over threads; each row its own whatever the row count), and where mlx's formulation
has no one answer — logits tied at the k-th place, NaN logits — its own rule: the lower ids,
NaN as -inf; ``argmax`` is numpy's on rows without NaN and never picks a NaN over a number,
where numpy and ``mx.argmax`` return a NaN's index; ``accept_candidates`` accepts as many
drafts and emits the same token as ``_candidate_rule``, batched or alone; and their errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from graphs import primitive_names

import sampling.distribution as distribution
from engine.model import products
from sampling.distribution import (
    _truncate,
    draw_tokens_with,
    truncate,
    truncate_and_sample,
)
from sampling.params import SamplingParams

native = products.native()
pytestmark = [
    pytest.mark.fast,
    pytest.mark.skipif(not products.on_native(), reason="the native kernel is not built"),
]

SETTINGS = (
    SamplingParams(temperature=1.0, top_k=20, top_p=0.95),  # Qwen's defaults
    SamplingParams(temperature=0.6, top_k=40, top_p=0.5, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.7, top_k=128, min_p=0.2),
)


def _mlx_rows(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    probs, ids = _truncate(mx.array(logits), p.temperature, p.top_k, p.top_p, p.min_p)
    return np.array(probs), np.array(ids)


@pytest.mark.parametrize("vocab", [300, 4097, 8192, 40_000])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_rows_match_mlxs_formulation(vocab: int, setting: int) -> None:
    """Candidates and probabilities as mlx's ops compute them, for 1..64 rows; the draw is the
    inverse-CDF draw of its own row, bit for bit."""
    p = SETTINGS[setting]
    rng = np.random.default_rng(vocab + setting)
    for rows in (1, 5, 64):
        logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
        uniforms = rng.random(rows).astype(np.float32)
        probs, ids, tokens = native.top_k_truncate(
            mx.array(logits), p.temperature, p.top_k, p.top_p, p.min_p, mx.array(uniforms)
        )
        want_probs, want_ids = _mlx_rows(logits, p)
        np.testing.assert_array_equal(np.array(ids), want_ids)
        np.testing.assert_allclose(np.array(probs), want_probs, rtol=1e-5, atol=1e-7)
        assert ((np.array(probs) > 0) == (want_probs > 0)).all()
        drawn = draw_tokens_with(probs, ids, mx.array(uniforms))
        assert tokens.tolist() == drawn.tolist()
        alone = native.top_k_truncate(
            mx.array(logits[-1:]), p.temperature, p.top_k, p.top_p, p.min_p, mx.array(uniforms[-1:])
        )
        assert np.array_equal(np.array(alone[0])[0], np.array(probs)[-1])  # row t is its own
        assert alone[2].tolist() == tokens.tolist()[-1:]


@pytest.mark.parametrize("top_k", [5_000, 39_999])
def test_a_large_top_k_is_mlxs_formulation_too(top_k: int) -> None:
    """top_k up to the vocabulary less one (what a request may ask): the same candidates and
    probabilities (the selection keeps its k in a heap: a scan for the smallest after each
    entry took seconds a row at top_k 50,000 of 248,320)."""
    rng = np.random.default_rng(top_k)
    logits = rng.integers(-40, 40, (3, 40_000)).astype(np.float32) / 4  # many ties
    p = SamplingParams(temperature=0.8, top_k=top_k, top_p=0.9)
    probs, ids = native.top_k_truncate(mx.array(logits), p.temperature, top_k, p.top_p, 0.0)
    want_probs, want_ids = _mlx_rows(logits, p)
    for row in range(3):  # among equal logits at the k-th place either may be kept
        got = logits[row][np.array(ids)[row]]
        np.testing.assert_array_equal(np.sort(got), np.sort(logits[row][want_ids[row]]))
        assert (np.diff(np.array(ids)[row]) > 0).all()
    np.testing.assert_allclose(
        np.sort(np.array(probs), axis=-1), np.sort(want_probs, axis=-1), rtol=1e-4, atol=1e-7
    )


def test_ties_keep_the_lower_token_and_infinities_and_nans_never_win() -> None:
    """The op's own rule where mlx's formulation has no one answer: of equal logits at the
    k-th place the lower token ids are the candidates (mlx's argpartition may keep either);
    -inf (tokens outside a draft vocabulary) and NaN (counted as -inf) take a place only when
    nothing else is left, with probability 0."""
    logits = np.full((1, 1000), -np.inf, dtype=np.float32)
    logits[0, [900, 5, 600, 7, 300]] = 2.0
    logits[0, 42] = 3.0
    logits[0, 43] = np.nan
    probs, ids = native.top_k_truncate(mx.array(logits), 1.0, 4, 1.0, 0.0)
    assert ids.tolist() == [[5, 7, 42, 300]]
    probs, ids = native.top_k_truncate(mx.array(logits), 1.0, 8, 1.0, 0.0)
    assert ids.tolist() == [[0, 1, 5, 7, 42, 300, 600, 900]]  # two -inf places: the lowest ids
    want = np.exp(np.array([-np.inf, -np.inf, 2, 2, 3, 2, 2, 2]) - 3.0)
    np.testing.assert_allclose(np.array(probs)[0], want / want.sum(), rtol=1e-6)


def test_a_draw_never_lands_on_a_token_without_mass() -> None:
    """A uniform just below 1 on a row whose last candidates top_p removed draws the last
    candidate with mass, not one past it."""
    logits = np.zeros((1, 500), dtype=np.float32)
    logits[0, :3] = [5.0, 4.0, 3.0]
    probs, ids, tokens = native.top_k_truncate(
        mx.array(logits), 1.0, 10, 0.9, 0.0, mx.array([1 - 2**-24], dtype=mx.float32)
    )
    kept = np.array(ids)[0][np.array(probs)[0] > 0]
    assert tokens.item() == kept[-1]


def test_sampling_runs_the_native_op_on_cpus_with_top_k() -> None:
    """``truncate`` and ``truncate_and_sample`` take the one op where top_k is set (their graphs
    hold ``TopKTruncate``), and mlx's compiled formulation without it (theirs do not): the op
    gives the rows of mlx's formulation."""
    rng = np.random.default_rng(9)
    logits = mx.array(rng.standard_normal((3, 2048)).astype(np.float32))
    p = SamplingParams(temperature=0.8, top_k=30, top_p=0.9)
    assert distribution._native_truncation(logits, p) is native
    assert distribution._native_truncation(logits, SamplingParams(temperature=0.8)) is None
    rows = truncate(logits, p)
    q, tokens = truncate_and_sample(logits, p, mx.array([0.1, 0.5, 0.9]))
    assert "TopKTruncate" in primitive_names(rows.probs, rows.ids)
    assert "TopKTruncate" in primitive_names(q.probs, q.ids, tokens)
    whole = truncate(logits, SamplingParams(temperature=0.8, top_p=0.9))
    whole_names = primitive_names(whole.probs)
    assert whole_names and "TopKTruncate" not in whole_names
    want_probs, want_ids = _mlx_rows(np.array(logits), p)
    np.testing.assert_array_equal(np.array(rows.ids), want_ids)
    np.testing.assert_allclose(np.array(q.probs), want_probs, rtol=1e-5, atol=1e-7)
    assert tokens.tolist() == draw_tokens_with(q.probs, q.ids, mx.array([0.1, 0.5, 0.9])).tolist()


def test_inside_compile_and_its_errors() -> None:
    logits = mx.array(np.random.default_rng(2).standard_normal((2, 256)).astype(np.float32))
    compiled = mx.compile(lambda x: native.top_k_truncate(x, 1.0, 8, 0.9, 0.0))
    np.testing.assert_array_equal(
        np.array(compiled(logits)[0]), np.array(native.top_k_truncate(logits, 1.0, 8, 0.9, 0.0)[0])
    )
    with pytest.raises(ValueError, match="top_k"):
        native.top_k_truncate(logits, 1.0, 256, 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        native.top_k_truncate(logits, 0.0, 8, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        native.top_k_truncate(logits[0], 1.0, 8, 1.0, 0.0)
    with pytest.raises(ValueError, match="uniforms"):
        native.top_k_truncate(logits, 1.0, 8, 1.0, 0.0, mx.array([0.5]))


def test_argmax_is_numpys_without_nans_and_never_picks_a_nan_over_a_number() -> None:
    """``argmax`` of rows of any width (not a multiple of its scan block, wide enough to be
    shared over threads), of 3-D and strided operands and half-precision rows, against numpy;
    of equal values the first. A NaN counts as -inf: it never wins over a number, where
    ``mx.argmax`` (as numpy's) returns a NaN's index — the two differ there, and a process
    takes one of them for every argmax (``argmax_ids``)."""
    rng = np.random.default_rng(11)
    for shape in [(1, 7), (5, 300), (3, 4097), (2, 3, 40_000), (64, 1000)]:
        x = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(np.array(native.argmax(mx.array(x))), np.argmax(x, axis=-1))
    wide = rng.standard_normal((4, 2 * 4097)).astype(np.float32)
    strided = mx.array(wide)[:, ::2]
    assert np.array_equal(np.array(native.argmax(strided)), np.argmax(wide[:, ::2], axis=-1))
    half = mx.array(wide).astype(mx.bfloat16)
    assert np.array_equal(
        np.array(native.argmax(half)), np.argmax(np.array(half.astype(mx.float32)), -1)
    )
    ties = np.zeros((2, 1000), dtype=np.float32)
    ties[0, [700, 300, 900]] = 1.0
    ties[1, :] = np.nan
    ties[1, 600] = -np.inf
    ties[1, 800] = -5.0
    assert native.argmax(mx.array(ties)).tolist() == [300, 800]
    assert np.isnan(ties[1, mx.argmax(mx.array(ties[1:]), axis=-1).item()])  # mlx's: a NaN


def test_greedy_tokens_take_the_native_argmax() -> None:
    from sampling.distribution import argmax_ids, greedy_tokens

    x = mx.array(np.random.default_rng(12).standard_normal((2, 5, 3000)).astype(np.float32))
    want = np.argmax(np.array(x), axis=-1)
    assert np.array_equal(np.array(argmax_ids(x)), want)
    assert np.array_equal(np.array(greedy_tokens(x, SamplingParams(temperature=0.0))), want)
    assert "RowsArgmax" in primitive_names(argmax_ids(x))


def _candidate_rows(rng: np.random.Generator, rows: int, width: int, vocab: int) -> np.ndarray:
    """``rows`` candidate id rows, each ``width`` distinct ids in increasing order, drawn from a
    small vocabulary so that q's and p's candidates overlap."""
    return np.sort(
        np.stack([rng.choice(vocab, width, replace=False) for _ in range(rows)]), axis=-1
    ).astype(np.int32)


def _distributions(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    w = rng.random(shape).astype(np.float32) ** 3
    w[rng.random(shape) < 0.2] = 0.0  # some candidates cut by top_p / min_p
    w[..., 0] += 0.01
    return (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_acceptance_rule_is_mlxs_formulation(k: int) -> None:
    """``accept_candidates`` against ``_candidate_rule`` (mlx ops) on random rows: drafts
    inside and outside p's candidates, q and p that share candidates or not, p = q (a residual
    without mass), every uniform from 0 to 1 — the same accepted count and emitted token, for
    a batch, for each row alone, with candidate rows out of token order and under ``mx.vmap``."""
    from sampling.acceptance import _candidate_rule

    rng = np.random.default_rng(k)
    width, vocab, batch = 20, 40, 200
    q_ids = _candidate_rows(rng, batch * k, width, vocab).reshape(batch, k, width)
    p_ids = _candidate_rows(rng, batch * (k + 1), width, vocab).reshape(batch, k + 1, width)
    q = _distributions(rng, (batch, k, width))
    p = _distributions(rng, (batch, k + 1, width))
    p[:20, :k], p_ids[:20, :k] = q[:20], q_ids[:20]  # p = q: every draft accepted
    drafts = np.take_along_axis(q_ids, rng.integers(0, width, (batch, k, 1)), -1)[..., 0]
    u_accept = rng.random((batch, k)).astype(np.float32)
    u_emit = rng.random((batch, k + 1)).astype(np.float32)
    args = [mx.array(a) for a in (drafts, q, q_ids, p, p_ids, u_accept, u_emit)]
    n, tokens = native.accept_candidates(*args)
    assert 0 < (np.array(n) == k).mean() < 1 and (np.array(n) == 0).any()
    # candidate rows in another order than the ids' (looked up one by one, not merged)
    order_q, order_p = rng.permutation(width), rng.permutation(width)
    shuffled = [
        mx.array(a)
        for a in (
            drafts,
            q[..., order_q],
            q_ids[..., order_q],
            p[..., order_p],
            p_ids[..., order_p],
        )
    ]
    shuffled += args[5:]
    sn, stokens = native.accept_candidates(*shuffled)
    for b in range(0, batch, 7):
        want = _candidate_rule(*(a[b] for a in shuffled))
        assert (sn[b].item(), stokens[b].item()) == (want[0].item(), want[1].item())
    mapped = mx.vmap(native.accept_candidates, in_axes=(0, 0, 0, 0, 0, 1, 0))
    vn, vtokens = mapped(*args[:5], args[5].T, args[6])  # one operand mapped along another axis
    assert vn.tolist() == n.tolist() and vtokens.tolist() == tokens.tolist()
    # int operands as strided views (read by a walk of their strides, not as their buffers)
    every_other = mx.array(np.repeat(drafts, 2, axis=-1))[..., ::2]
    q_ids_t, p_ids_t = (mx.array(np.swapaxes(a, 1, 2)).swapaxes(1, 2) for a in (q_ids, p_ids))
    views = (every_other, args[1], q_ids_t, args[3], p_ids_t, *args[5:])
    wn, wtokens = native.accept_candidates(*views)
    assert wn.tolist() == n.tolist() and wtokens.tolist() == tokens.tolist()
    for b in range(batch):
        want = _candidate_rule(*(a[b] for a in args))
        alone = native.accept_candidates(*(a[b] for a in args))
        assert (n[b].item(), tokens[b].item()) == (want[0].item(), want[1].item())
        assert (alone[0].item(), alone[1].item()) == (want[0].item(), want[1].item())


def test_acceptance_rule_errors() -> None:
    ids = mx.array([[1, 2]], dtype=mx.int32)
    q, p = mx.ones((1, 1, 2)) / 2, mx.ones((1, 2, 2)) / 2
    with pytest.raises(ValueError, match="drafts"):
        native.accept_candidates(
            mx.array([[1.0]]),
            q,
            ids[None],
            p,
            mx.stack([ids, ids], 1),
            mx.array([[0.5]]),
            mx.array([[0.5, 0.5]]),
        )
    with pytest.raises(ValueError, match="p and p_ids"):
        native.accept_candidates(
            mx.array([[1]], dtype=mx.int32),
            q,
            ids[None],
            q,
            ids[None],
            mx.array([[0.5]]),
            mx.array([[0.5, 0.5]]),
        )
    with pytest.raises(ValueError, match="uniforms"):
        native.accept_candidates(
            mx.array([[1]], dtype=mx.int32),
            q,
            ids[None],
            p,
            mx.stack([ids, ids], 1),
            mx.array([0.5]),
            mx.array([[0.5, 0.5]]),
        )
