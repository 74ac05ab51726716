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

import mlx.core as mx

from sampling.distribution import Truncated, draw_tokens, sample


def accept_drafts(
    draft_ids: mx.array,
    draft: Truncated | None,
    target: Truncated,
    key: mx.array,
) -> tuple[mx.array, mx.array]:
    """Run the acceptance rule.

    Args:
        draft_ids: ``[K]`` int, the proposed tokens (K may be 0).
        draft: the K rows q_i each draft was drawn from (None when K is 0).
        target: the K+1 rows p_i from the verify pass, truncated by the same settings (so both
            hold their top_k candidates, or both the whole vocabulary).
        key: a PRNG key; the uniforms and the final draw are split from it.

    Returns:
        ``(n_accepted, next_token)``: scalar int32 number of accepted drafts m (0..K) and the
        token emitted after them (residual draw at m < K, bonus draw from p_{K+1} at m == K).
    """
    if draft is None or draft_ids.shape[0] == 0:  # plain decoding: a draw from p_1
        return mx.array(0, dtype=mx.int32), sample(target, key)[0]
    if target.ids is None:
        return _compiled_dense_rule(draft_ids, draft.probs, target.probs, key)
    return _compiled_candidate_rule(
        draft_ids, draft.probs, draft.ids, target.probs, target.ids, key
    )


def _dense_rule(
    draft_ids: mx.array, q: mx.array, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """The rule on rows over the whole vocabulary (column = token id)."""
    k = draft_ids.shape[0]
    rows = mx.arange(k)
    n_accepted, chosen, draw_key = _accept(p[rows, draft_ids], q[rows, draft_ids], p, q, key)
    return n_accepted, draw_tokens(chosen[None], None, draw_key)[0]


def _candidate_rule(
    draft_ids: mx.array,
    q: mx.array,
    q_ids: mx.array,
    p: mx.array,
    p_ids: mx.array,
    key: mx.array,
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
    n_accepted, chosen, draw_key = _accept(p_at_d, q_at_d, p, q_on_p, key)
    return n_accepted, draw_tokens(chosen[None], p_ids[n_accepted][None], draw_key)[0]


def _accept(
    p_at_d: mx.array, q_at_d: mx.array, p: mx.array, q_on_p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The scan and the row to draw from, on p's columns: ``p`` ``[K+1, W]``, ``q_on_p``
    ``[K, W]`` (q_i at p_i's columns), ``p_at_d``/``q_at_d`` ``[K]`` (p_i and q_i of d_i).
    Returns (m, the residual row m — or p_{K+1} when m == K —, the key for the draw)."""
    k = p_at_d.shape[0]
    u_key, draw_key = mx.random.split(key)
    # accept iff u < p/q (strict): a zero-probability target is never accepted, a ratio >= 1
    # always is. u * q < p avoids dividing by q.
    u = mx.random.uniform(shape=(k,), key=u_key)
    accepted = u * q_at_d < p_at_d
    n_accepted = mx.cumprod(accepted.astype(mx.int32)).sum().astype(mx.int32)

    # Residual rows for every position (cheap: K rows); row K is p_{K+1} itself (bonus).
    residual = mx.maximum(p[:k] - q_on_p, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # mass == 0 only when p_i == q_i, in which case d_i is accepted with probability 1 and the
    # residual row is never used; fall back to p_i to keep the row a valid distribution.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    candidates = mx.concatenate([residual, p[k:]], axis=0)
    return n_accepted, candidates[n_accepted], draw_key


#: Compiled once per K (shapes): ~25 small ops that cost more dispatched one by one on CPUs.
_compiled_dense_rule = mx.compile(_dense_rule)
_compiled_candidate_rule = mx.compile(_candidate_rule)


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


def accept_coupled(draft_ids: mx.array, target_ids: mx.array) -> tuple[mx.array, mx.array]:
    """The acceptance rule of seeded requests: drafts and targets were drawn with the same noise
    per position (``distribution.coupled_draw``); a draft is accepted while it equals the
    target's draw, and the target's draw at the first mismatch (or the bonus) is emitted.

    Every emitted token is the target's own draw at its position, so the output is exactly
    plain sampling with that noise — the same text for a seed whatever K each cycle drafts.
    The price is acceptance: the coupling agrees less often than rejection sampling's
    ``min(1, p/q)`` (at total-variation distance d between q and p, at least (1-d)/(1+d)
    instead of 1-d).

    Args:
        draft_ids: ``[K]`` drafts; target_ids: ``[K+1]`` the verify rows' coupled draws.

    Returns:
        ``(n_accepted, next_token)`` as ``accept_drafts``.
    """
    k = draft_ids.shape[0]
    if k == 0:
        return mx.array(0, dtype=mx.int32), target_ids[0]
    matches = (draft_ids == target_ids[:k]).astype(mx.int32)
    n_accepted = mx.cumprod(matches).sum().astype(mx.int32)
    return n_accepted, target_ids[n_accepted]
