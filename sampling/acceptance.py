"""Speculative acceptance (Leviathan et al. 2023; Chen et al. 2023), entirely on device.

Given K draft tokens d_i drawn from the draft distributions q_i, and the K+1 target
distributions p_1..p_{K+1} from one verify pass (all produced by ``distribution.truncate``):

* accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), scanning i = 1..K and stopping at the
  first rejection;
* on a rejection at i emit a draw from normalise(max(p_i - q_i, 0)) (the residual);
* when all K are accepted emit a bonus draw from p_{K+1}.

The emitted tokens are then distributed exactly as K+1 plain draws from p (token by token). With
point-mass distributions (temperature 0 / top_k 1) this reduces to greedy verification: accept
while d_i == argmax p_i, then emit argmax p at the first mismatch (or the bonus argmax).

Returns device arrays only; the caller syncs once per cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import mlx.core as mx

from engine.model.products import native, on_native
from sampling.distribution import Truncated, draw_tokens_with, inverse_cdf_index


def accept_drafts(
    draft_ids: mx.array,
    draft: Truncated | None,
    target: Truncated,
    key: mx.array,
) -> tuple[mx.array, mx.array]:
    """``accept_drafts_with`` on uniforms drawn from a PRNG key: K for the acceptance tests,
    K+1 for the emitted token's draw (one of which is used)."""
    k = 0 if draft is None else draft_ids.shape[0]
    accept_key, emit_key = mx.random.split(key)
    return accept_drafts_with(
        draft_ids,
        draft,
        target,
        mx.random.uniform(shape=(k,), key=accept_key),
        mx.random.uniform(shape=(k + 1,), key=emit_key),
    )


def accept_drafts_with(
    draft_ids: mx.array,
    draft: Truncated | None,
    target: Truncated,
    accept_uniforms: mx.array,
    emit_uniforms: mx.array,
) -> tuple[mx.array, mx.array]:
    """Run the acceptance rule with the uniforms given.

    Args:
        draft_ids: ``[K]`` int, the proposed tokens (K may be 0).
        draft: the K rows q_i each draft was drawn from (None when K is 0).
        target: the K+1 rows p_i from the verify pass, truncated by the same settings (so both
            hold their top_k candidates, or both the whole vocabulary).
        accept_uniforms: ``[K]`` in [0, 1), u_i tests d_i: accepted iff u_i q_i(d_i) < p_i(d_i).
        emit_uniforms: ``[K+1]`` in [0, 1); the token emitted after m accepted drafts is the
            inverse-CDF draw of ``emit_uniforms[m]`` from its row. The engine keys both by
            sequence position (``distribution.keyed_uniforms``).

    Exactness needs every uniform independent and uniform, and none reused once it has
    decided an emitted token. Uniforms at positions after the first rejection decide nothing
    (the scan has stopped), so a later cycle may draw those positions with the same ones.

    Returns:
        ``(n_accepted, next_token)``: scalar int32 number of accepted drafts m (0..K) and the
        token emitted after them (residual draw at m < K, bonus draw from p_{K+1} at m == K).
    """
    if draft is None or draft_ids.shape[0] == 0:  # plain decoding: a draw from p_1
        ids = None if target.ids is None else target.ids[:1]
        token = draw_tokens_with(target.probs[:1], ids, emit_uniforms[:1])[0]
        return mx.array(0, dtype=mx.int32), token
    if target.ids is None:
        return _compiled_dense_rule(
            draft_ids, draft.probs, target.probs, accept_uniforms, emit_uniforms
        )
    rule = _candidate_rule_for(draft_ids, _compiled_candidate_rule)
    return rule(
        draft_ids,
        draft.probs,
        draft.ids,
        target.probs,
        target.ids,
        accept_uniforms,
        emit_uniforms,
    )


def _dense_rule(
    draft_ids: mx.array, q: mx.array, p: mx.array, u_accept: mx.array, u_emit: mx.array
) -> tuple[mx.array, mx.array]:
    """The rule on rows over the whole vocabulary (column = token id)."""
    k = draft_ids.shape[0]
    rows = mx.arange(k)
    n_accepted, chosen = _accept(p[rows, draft_ids], q[rows, draft_ids], p, q, u_accept)
    return n_accepted, inverse_cdf_index(chosen[None], u_emit[n_accepted][None])[0]


def _candidate_rule(
    draft_ids: mx.array,
    q: mx.array,
    q_ids: mx.array,
    p: mx.array,
    p_ids: mx.array,
    u_accept: mx.array,
    u_emit: mx.array,
) -> tuple[mx.array, mx.array]:
    """The rule on top_k candidate rows: ``p[i, j]`` is p_i of token ``p_ids[i, j]``, and the
    same for q. A token outside a row's candidates has probability 0 in it. The residual
    max(p_i - q_i, 0) is 0 wherever p_i is, so it lives on p_i's candidates: q_i is looked up
    there (``q_on_p``, a k x k comparison per row)."""
    k = draft_ids.shape[0]
    drafted = draft_ids[:, None]
    p_at_d = (p[:k] * (p_ids[:k] == drafted)).sum(axis=-1)
    q_at_d = (q * (q_ids == drafted)).sum(axis=-1)
    q_on_p = ((p_ids[:k, :, None] == q_ids[:, None, :]) * q[:, None, :]).sum(axis=-1)
    n_accepted, chosen = _accept(p_at_d, q_at_d, p, q_on_p, u_accept)
    drawn = draw_tokens_with(chosen[None], p_ids[n_accepted][None], u_emit[n_accepted][None])
    return n_accepted, drawn[0]


def _accept(
    p_at_d: mx.array, q_at_d: mx.array, p: mx.array, q_on_p: mx.array, u: mx.array
) -> tuple[mx.array, mx.array]:
    """The scan and the row to draw from, on p's columns: ``p`` ``[K+1, W]``, ``q_on_p``
    ``[K, W]`` (q_i at p_i's columns), ``p_at_d``/``q_at_d`` ``[K]`` (p_i and q_i of d_i),
    ``u`` ``[K]`` the acceptance uniforms. Returns (m, the residual row m — or p_{K+1} when
    m == K)."""
    k = p_at_d.shape[0]
    # accept iff u < p/q (strict): a zero-probability target is never accepted, a ratio >= 1
    # always is. u * q < p avoids dividing by q.
    accepted = u * q_at_d < p_at_d
    n_accepted = mx.cumprod(accepted.astype(mx.int32)).sum().astype(mx.int32)

    # Residual rows for every position (cheap: K rows); row K is p_{K+1} itself (bonus).
    residual = mx.maximum(p[:k] - q_on_p, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # mass == 0 only when p_i == q_i, in which case d_i is accepted with probability 1 and the
    # residual row is never used; fall back to p_i to keep the row a valid distribution.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    candidates = mx.concatenate([residual, p[k:]], axis=0)
    return n_accepted, candidates[n_accepted]


def _candidate_rule_for(
    draft_ids: mx.array, compiled: Callable[..., tuple[mx.array, mx.array]]
) -> Callable[..., tuple[mx.array, mx.array]]:
    """The candidate rule to run: the native op where ``_native_rule`` gives one (it takes the
    same operands, one row or a batch), else ``compiled`` (mlx's formulation)."""
    op = _native_rule(draft_ids)
    if op is None:
        return compiled
    return lambda *operands: tuple(op.accept_candidates(*operands))


def _native_rule(draft_ids: mx.array) -> ModuleType | None:
    """The native op module when the candidate rule runs as one op (``accept_candidates``:
    ``_candidate_rule`` row by row in C++, the scan stopped at the first rejection and only the
    emitted row's residual built): on a CPU with mtpserve's kernels, where mlx's formulation
    is ~25 primitives, each a task on the stream's one thread. Both are the same rule; a
    process runs one of them for every row, alone or batched."""
    if on_native() and draft_ids.dtype == mx.int32:
        return native()
    return None


#: Compiled once per K (shapes): ~25 small ops that cost more dispatched one by one on CPUs.
_compiled_dense_rule = mx.compile(_dense_rule)
_compiled_candidate_rule = mx.compile(_candidate_rule)


def accept_drafts_rows(
    draft_ids: mx.array,
    q: mx.array,
    q_ids: mx.array | None,
    p: mx.array,
    p_ids: mx.array | None,
    accept_uniforms: mx.array,
    emit_uniforms: mx.array,
) -> tuple[mx.array, mx.array]:
    """``accept_drafts_with`` for B rows of one truncation setting at once: drafts ``[B, K]``
    (K >= 1), their rows ``q`` ``[B, K, W]``, the targets ``p`` ``[B, K+1, W]`` (with their
    candidates' ids ``[B, ., W]`` under top_k, else None), uniforms ``[B, K]`` and ``[B, K+1]``.
    Returns the accepted counts and the emitted tokens, ``[B]`` each: row b is the rule on row
    b's operands alone (the same ops, mapped over rows: one dispatch group instead of B)."""
    if p_ids is None:
        return _compiled_dense_rows(draft_ids, q, p, accept_uniforms, emit_uniforms)
    rule = _candidate_rule_for(draft_ids, _compiled_candidate_rows)
    return rule(draft_ids, q, q_ids, p, p_ids, accept_uniforms, emit_uniforms)


_compiled_dense_rows = mx.compile(mx.vmap(_dense_rule))
_compiled_candidate_rows = mx.compile(mx.vmap(_candidate_rule))


def accept_greedy(draft_ids: mx.array, target_ids: mx.array) -> tuple[mx.array, mx.array]:
    """``accept_drafts`` specialised to point masses (temperature 0 / top_k 1).

    With p_i and q_i one-hot, p_i(d_i)/q_i(d_i) is 1 when d_i == argmax p_i and 0 otherwise, the
    residual of a rejection is p_i itself, and the bonus is argmax p_{K+1}: so the rule is
    "accept while d_i == target_i, then emit target at the first mismatch". Same result as
    ``accept_drafts`` on the one-hot rows, without materialising them.
    """
    k = draft_ids.shape[0]
    if k == 0:
        return mx.array(0, dtype=mx.int32), target_ids[0]
    matches = (draft_ids == target_ids[:k]).astype(mx.int32)
    n_accepted = mx.cumprod(matches).sum().astype(mx.int32)
    return n_accepted, target_ids[n_accepted]


def accept_greedy_rows(draft_ids: mx.array, target_ids: mx.array) -> tuple[mx.array, mx.array]:
    """``accept_greedy`` for B rows at once: drafts ``[B, K]`` (K >= 1) and targets
    ``[B, K+1]`` give the accepted counts ``[B]`` and the emitted tokens ``[B]``; row b is
    ``accept_greedy(draft_ids[b], target_ids[b])`` (the same comparisons, row by row)."""
    k = draft_ids.shape[1]
    matches = (draft_ids == target_ids[:, :k]).astype(mx.int32)
    n_accepted = mx.cumprod(matches, axis=1).sum(axis=1).astype(mx.int32)
    return n_accepted, mx.take_along_axis(target_ids, n_accepted[:, None], axis=1)[:, 0]
