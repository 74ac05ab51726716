"""The speculative cycle: draft K with the MTP head, verify K+1 in one trunk pass, accept, commit.

State of one sequence (``engine.cycle.sequence.Sequence``) between cycles — the invariant kept
at every yield and on every stop:

* ``tokens`` = prompt + emitted tokens; the trunk cache holds exactly ``tokens[:-1]`` (the last
  token is fed by the next cycle);
* the head's KV cache holds the pairs (h_t, x_{t+1}) for t < ``head_position`` (=
  ``head_cache.offset + head_skipped``) except ``head_skipped`` positions it skipped, and
  ``head_pending`` holds the trunk states h_t for the remaining committed positions
  t = head_position .. len(tokens)-2, whose pairs the next draft step runs first. The head never
  holds a rejected position. After a stretch of plain cycles a drafting cycle's first step
  catches up on every pending position in one batch (of earlier pairs the head computes only
  keys and values: 136 positions cost ~2.8 ms on the demo model, about half a plain step), up to
  ``MAX_CATCH_UP``, the longest plain stretch between auto K's probes; beyond it the head skips
  the older positions. RoPE positions stay exact (the head is told the true position); skipped
  pairs are just missing from its attention. Drafts are proposals, so skipping can only change
  acceptance, never the output — but it does change acceptance: when the head kept only the
  latest 9 positions, a K=4 cycle after 16..64 plain ones accepted 6-10% fewer drafts than in
  steady drafting (3.02 vs 3.23 and 2.88 vs 3.18 of 4, greedy, bench prompts), so auto K's
  probes undersold drafting.

``launch_cycle`` is the whole step in one place; K=0 takes the same path (no draft, a
one-position verify, the same acceptance function drawing the next token from p_1). Only one
device->host transfer happens per cycle (``read_cycle``): the accepted count, the drafts and the
next token, together. ``run_cycle`` = ``read_cycle(launch_cycle(...))``: launching builds the
graph and starts it evaluating; reading waits for it.

Plain (K=0) cycles use the gap (as mlx-lm's generate does): a K=0 cycle keeps its one token
whatever it is, so ``commit_unread`` commits it before it is read back and the next cycle is
launched on the device token while the host still waits — the graph of one step is built while
the previous one runs. ``Sequence.unread_token`` is that token; a look-ahead cycle that turns
out unwanted (a stop) is undone with ``CacheSnapshot``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cycle.sequence import (
    HeadAhead,
    Sequence,
    absorb_pending,
    absorb_pending_rows,
    take_head_ahead,
    take_heads_ahead,
)
from engine.model import products
from engine.model.mtp import MTPHead, project_to_vocab
from engine.model.trunk import leads_a_group, trunk_hidden, trunk_hidden_rows
from sampling.acceptance import (
    accept_drafts_rows,
    accept_drafts_with,
    accept_greedy,
    accept_greedy_rows,
)
from sampling.constraint import GrammarDeadEnd
from sampling.distribution import (
    ACCEPT,
    DRAFT,
    EMIT,
    Truncated,
    greedy_tokens,
    keyed_uniform_rows,
    keyed_uniforms,
    truncate,
    truncate_and_sample,
)
from sampling.params import SamplingParams


@dataclass
class LaunchedCycle:
    """A cycle whose graph is built and evaluating; nothing read back yet."""

    k: int
    drafts: mx.array  # [K]
    n_accepted: mx.array  # scalar
    next_token: mx.array  # scalar
    logits: mx.array  # [depth+1, V]
    hidden: mx.array  # [1, depth+1, H]
    draft_seconds: float
    verify_seconds: float
    launched_at: float
    #: the draft steps the cycle ran (its verify fed depth + 1 positions): K, or more for a
    #: row drafting fewer than the rows beside it (``launch_cycles``'s ``ks``)
    depth: int


@dataclass
class CycleResult:
    draft_ids: list[int]
    n_accepted: int
    emitted: list[int]  # accepted drafts + the residual/bonus token (before stop handling)
    verify_logits: mx.array  # [depth+1, V] raw trunk logits, for logprobs
    verify_hidden: mx.array  # [1, depth+1, H] post-norm trunk states, the kept ones go to the head
    depth: int  # ``LaunchedCycle.depth``
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accept_seconds: float = 0.0
    #: sequences that shared the cycle (a batch's rows)
    rows: int = 1
    #: a batch committed this plain cycle before reading it (``commit_unread``): the row
    #: finishes it with ``finish_unread``
    committed: bool = False
    #: the row's next (plain) cycle was launched before this one was read back
    followed: bool = False


def run_cycle(
    trunk: Any, head: MTPHead | None, seq: Sequence, k: int, profile: bool = False
) -> CycleResult:
    """Draft ``k`` tokens, verify ``k+1`` positions in one trunk pass and pick what to emit.

    Caches are left with the verify pass captured; the caller decides how many emitted tokens
    survive stop conditions and then calls ``commit``. ``profile`` adds a sync after the draft
    and after the verify forward so their times can be split (benchmarks only: it costs speed).
    """
    return read_cycle(launch_cycle(trunk, head, seq, k, profile))


def launch_cycle(
    trunk: Any, head: MTPHead | None, seq: Sequence, k: int, profile: bool = False
) -> LaunchedCycle:
    """Build a cycle's graph (draft, verify, accept) and start evaluating it."""
    return launch_cycles(trunk, head, [seq], k, profile)[0]


def launch_cycles(
    trunk: Any,
    head: MTPHead | None,
    seqs: list[Sequence],
    k: int,
    profile: bool = False,
    ks: list[int] | None = None,
) -> list[LaunchedCycle]:
    """One cycle of B sequences at once (a batch of one is the single-request cycle).

    Every row drafts ``k`` (0 when any row cannot draft), or with ``ks`` row b drafts
    ``ks[b]`` (1..k): each draft depth runs the head once for all rows, the verify is one trunk
    pass over every row's k+1 positions (``engine.model.trunk.trunk_hidden_rows``); the draws,
    the acceptance and later the commit are per row, with each row's own sampler, seed and
    penalty history (rows that draw the same way — all plain greedy, or all sampling by one
    setting, all drafting k — as one op over rows, each row's bits unchanged). Rows accept
    different lengths: each row's caches are committed on their own (``commit``).

    A row drafting fewer than k is what it is alone at its own K: its draws stop at its K (the
    head's further steps and the verify's further positions are fed its last draft, and read
    by nothing), its acceptance reads its first K+1 verify positions, and its commit drops
    what the further positions wrote (each position of a verify the same bits whatever
    follows it: the products row by row, attention, the conv and the recurrence causal). So
    rows of different K share one pass instead of one pass each.
    """
    rows = len(seqs)
    if ks is not None and (len(ks) != rows or not all(1 <= n <= k for n in ks)):
        raise ValueError("ks: one draft count a row, each 1..k")
    limits = ks if ks is not None else [k] * rows
    if not all(seq.can_draft for seq in seqs):
        k, limits = 0, [0] * rows
    if k > 0 and any(seq.unread_token is not None for seq in seqs):
        raise RuntimeError("a drafting cycle needs the last token on the host (read_cycle)")
    if k == 0:  # a step run ahead serves only the row's next drafting cycle
        for seq in seqs:
            seq.head_ahead = None
    alike = all(n == k for n in limits)
    # Rows that draw argmaxes of the raw logits (greedy, no bias, penalties or grammar) draw
    # and accept as one op over all rows: the same comparisons, row by row, in fewer ops.
    greedy_rows = alike and rows > 1 and all(_plain_greedy(seq) for seq in seqs)
    # Rows that sample with one truncation setting and nothing of their own before it (no
    # bias, penalties or grammar) draw, truncate and accept as one op over all rows too, each
    # row with its own keyed uniforms.
    sampled_rows = alike and rows > 1 and not greedy_rows and _shared_sampling(seqs)
    t0 = time.perf_counter()

    # 1. Draft: the first step runs every pending committed pair (normally one: the pair of the
    #    last emitted token); later steps feed the head's own output and its draft token.
    drafts = [_RowDrafts(seq, limit) for seq, limit in zip(seqs, limits, strict=True)]
    # Start each draft step while the next is built; not under mlx.launch, where a draft step
    # holds collectives (engine.distributed): mlx's async eval of one can block for good when a
    # rank dies, instead of raising.
    overlap = not profile and not leads_a_group(trunk)
    draft_columns: list[mx.array] = []  # greedy or sampled rows: draft i of every row, ``[B]``
    draft_rows: list[Truncated] = []  # sampled rows: the rows q draft i was drawn from, [B, W]
    if k > 0:
        if rows == 1:
            ahead = take_head_ahead(seqs[0])
            state, logits = ahead or absorb_pending(trunk, head, seqs[0], keep_last=False)
        else:
            ahead = take_heads_ahead(seqs)
            state, logits = ahead or absorb_pending_rows(trunk, head, seqs)
        caches = [seq.head_cache for seq in seqs]
        for i in range(k):
            if greedy_rows:
                draft_columns.append(greedy_tokens(logits[:, -1], seqs[0].params))
                if overlap:
                    mx.async_eval(draft_columns[-1])
            elif sampled_rows:
                positions = [row.position + i for row in drafts]
                uniforms = keyed_uniform_rows([seq.seed for seq in seqs], positions, 1, DRAFT)
                q, tokens = truncate_and_sample(logits[:, -1], seqs[0].params, uniforms[:, 0])
                draft_rows.append(q)
                draft_columns.append(tokens)
                if overlap:
                    mx.async_eval(tokens)
            else:
                step_logits = [logits[b, -1:] for b in range(rows)]
                drawing = [
                    (row, row_logits)
                    for row, row_logits in zip(drafts, step_logits, strict=True)
                    if i < row.limit
                ]
                for row, row_logits in drawing:
                    row.draw(row_logits, i)
                    if overlap:
                        mx.async_eval(row.ids[-1])
                for row, _ in drawing:
                    row.follow()
                if rows == 1 and drafts[0].confident_stop(step_logits[0], i, k):
                    break
            if i + 1 < k:
                if draft_columns:
                    tokens = draft_columns[-1][:, None]
                else:
                    # a row past its own K feeds its last draft again
                    tokens = _stack([row.ids[-1][None] for row in drafts])
                if rows == 1:
                    seq = seqs[0]
                    state, logits = head(trunk, tokens, state, seq.head_cache, seq.head_position)
                else:
                    # each step appends to the head's caches: its positions move with them
                    positions = [seq.head_position for seq in seqs]
                    state, logits = head(trunk, tokens, state, caches, positions)
    if draft_columns:
        batch_drafts = mx.stack(draft_columns, axis=1)
        for row, row_drafts in zip(drafts, mx.split(batch_drafts, rows), strict=True):
            row.drafts = row_drafts.squeeze(0)
    for row in drafts:
        row.finish()
    if profile:
        mx.eval(*(row.drafts for row in drafts), *(row.q.probs for row in drafts if row.q))
    t1 = time.perf_counter()

    # 2. Verify the last token and the K drafts in one trunk pass (GDN states captured).
    if draft_columns:
        lasts = mx.array([[seq.tokens[-1]] for seq in seqs], dtype=mx.int32)
        verify_in = mx.concatenate([lasts, batch_drafts], axis=1)
    elif k == 0:
        verify_in = _stack([row.last for row in drafts])[:, None]
    else:
        # a row drafting fewer than the others fills the further positions with its last draft
        depth = max(len(row.ids) for row in drafts)
        verify_in = _stack([mx.concatenate([row.last, *row.padded(depth)])[None] for row in drafts])
    if rows == 1:
        hidden = trunk_hidden(trunk, verify_in, seqs[0].trunk_cache, capture=True)
    else:
        hidden = trunk_hidden_rows(trunk, verify_in, [seq.trunk_cache for seq in seqs])
    logits = project_to_vocab(trunk, hidden)
    if profile:
        mx.eval(logits, *(a for seq in seqs for a in seq.trunk_cache.arrays()))
    t_verified = time.perf_counter()

    # 3. Accept, per row (on device); read_cycles syncs once for every row. Under mlx.launch
    #    the verify holds collectives: evaluated synchronously, like the draft steps.
    if greedy_rows:
        accepted = _accept_greedy_rows(
            logits, batch_drafts if draft_columns else None, seqs[0].params
        )
    elif sampled_rows:
        accepted = _accept_sampled_rows(
            logits,
            seqs,
            [row.position for row in drafts],
            batch_drafts if draft_columns else None,
            draft_rows,
        )
    else:
        accepted = [row.accept(_row(logits, b)[: len(row.ids) + 1]) for b, row in enumerate(drafts)]
    start = mx.async_eval if overlap else mx.eval
    launched = []
    for b, (row, (n_acc, next_token)) in enumerate(zip(drafts, accepted, strict=True)):
        row_hidden = hidden if rows == 1 else hidden[b : b + 1]
        start(n_acc, next_token, row.drafts, row_hidden, row.seq.trunk_cache.arrays())
        launched.append(
            LaunchedCycle(
                k=len(draft_columns) or len(row.ids),
                drafts=row.drafts,
                n_accepted=n_acc,
                next_token=next_token,
                logits=_row(logits, b),
                hidden=row_hidden,
                draft_seconds=t1 - t0,
                verify_seconds=t_verified - t1,
                launched_at=t_verified,
                depth=verify_in.shape[1] - 1,
            )
        )
    return launched


def _raw_logits(seq: Sequence) -> bool:
    """Whether nothing of the row's own comes between its logits and its truncation (no logit
    bias, penalties or grammar): only such rows draw as one op with other rows."""
    params = seq.params
    return not params.logit_bias and not params.uses_history and seq.constraint is None


def _truncation_setting(params: SamplingParams) -> tuple[float, int, float, float]:
    """What truncates a row's logits: rows of one setting truncate alike (one op over rows)."""
    return (params.temperature, params.top_k, params.top_p, params.min_p)


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the row's every draw is the argmax of the raw logits."""
    return seq.params.greedy and _raw_logits(seq)


def _accept_greedy_rows(
    logits: mx.array, batch_drafts: mx.array | None, params: SamplingParams
) -> list[tuple[mx.array, mx.array]]:
    """Every row's (accepted count, next token) from the verify logits ``[B, K+1, V]`` of
    rows that ``_plain_greedy`` holds for, as one op over rows (``accept_greedy_rows``)."""
    rows = logits.shape[0]
    targets = greedy_tokens(logits, params)
    if batch_drafts is None:  # plain cycles: the argmax of the one position
        return [(mx.array(0, dtype=mx.int32), t) for t in mx.split(targets[:, 0], rows)]
    n_accepted, next_tokens = accept_greedy_rows(batch_drafts, targets)
    return list(zip(mx.split(n_accepted, rows), mx.split(next_tokens, rows), strict=True))


def _shared_sampling(seqs: list[Sequence]) -> bool:
    """Whether every row samples by one truncation setting and nothing else decides its
    draws: no logit bias, penalties, grammar or confidence cut (``_accept_sampled_rows``)."""
    setting = _truncation_setting(seqs[0].params)
    return all(
        not seq.params.greedy
        and _raw_logits(seq)
        and seq.draft_confidence is None
        and _truncation_setting(seq.params) == setting
        for seq in seqs
    )


def _accept_sampled_rows(
    logits: mx.array,
    seqs: list[Sequence],
    positions: list[int],
    batch_drafts: mx.array | None,
    draft_rows: list[Truncated],
) -> list[tuple[mx.array, mx.array]]:
    """Every row's (accepted count, next token) from the verify logits ``[B, K+1, V]`` of
    rows that ``_shared_sampling`` holds for: one truncation of every row's K+1 positions and
    the acceptance rule mapped over rows (``accept_drafts_rows``), each row's uniforms keyed by
    its own seed and positions, so row b gets what ``_RowDrafts.accept`` gives it alone."""
    rows, width, vocab = logits.shape
    params = seqs[0].params
    seeds = [seq.seed for seq in seqs]
    emit = keyed_uniform_rows(seeds, positions, width, EMIT)
    if batch_drafts is None:  # plain cycles: one draw from each row's p_1
        _, tokens = truncate_and_sample(logits[:, 0], params, emit[:, 0])
        return [(mx.array(0, dtype=mx.int32), t) for t in mx.split(tokens, rows)]
    k = width - 1
    p = truncate(logits.reshape(rows * width, vocab), params)
    q_probs = mx.stack([q.probs for q in draft_rows], axis=1)
    q_ids = None if p.ids is None else mx.stack([q.ids for q in draft_rows], axis=1)
    n_accepted, tokens = accept_drafts_rows(
        batch_drafts,
        q_probs,
        q_ids,
        p.probs.reshape(rows, width, -1),
        None if p.ids is None else p.ids.reshape(rows, width, -1),
        keyed_uniform_rows(seeds, positions, k, ACCEPT),
        emit,
    )
    return list(zip(mx.split(n_accepted, rows), mx.split(tokens, rows), strict=True))


def _row(a: mx.array, b: int) -> mx.array:
    """Row ``b`` of ``a`` as a view: mlx turns ``a[b]`` into a gather, a copy (of a verify's
    K+1 vocabulary rows at the 0.8B shape: 3 MB, and up to ~8 ms a cycle where the copy's
    fresh pages faulted in), where a slice and a squeeze only view the buffer."""
    return a[b : b + 1].squeeze(0)


def _stack(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


class _RowDrafts:
    """One row's side of a cycle: its draws from the head, then its acceptance.

    A row under a grammar (``Sequence.constraint``) masks every draw: draft i with the tokens
    allowed after the drafts before it (its draft is read back to advance the grammar: one host
    sync per draft step), the verify's position i with the same mask and position K with the
    mask after every draft; the grammar is then rolled back to the committed tokens
    (``sampling.constraint`` states why this keeps the output exact)."""

    def __init__(self, seq: Sequence, limit: int) -> None:
        self.seq = seq
        self.limit = limit  # the drafts this row draws (its K)
        self.ids: list[mx.array] = []
        self.rows: list[Truncated] = []
        self.position = seq.next_position
        last = seq.unread_token
        self.last = last if last is not None else mx.array([seq.tokens[-1]], dtype=mx.int32)

        self.drafts = mx.zeros((0,), dtype=mx.int32)
        self.q: Truncated | None = None
        #: grammar masks of the verified positions so far (None: past a draft the grammar
        #: forbids, never read), whether the grammar still follows the drafts, and how many
        #: drafts it advanced over
        self.masks: list[np.ndarray | None] = []
        self.following = True
        self.advanced = 0
        self.verify_mask: mx.array | None = None

    def padded(self, depth: int) -> list[mx.array]:
        """The drafts, then the last one again up to ``depth`` (what a verify of that many
        drafts feeds a row drafting fewer)."""
        if len(self.ids) == depth:
            return [self.drafts]
        return [self.drafts, mx.repeat(self.ids[-1], depth - len(self.ids))]

    def finish(self) -> None:
        """Join the draws: the drafts ``[K]`` and the distributions they came from."""
        if self.ids:
            self.drafts = mx.concatenate(self.ids)
        if self.rows:
            self.q = Truncated.concatenate(self.rows)
        constraint = self.seq.constraint
        if constraint is not None:
            self.masks.append(self._allowed() if self.following else None)
            constraint.rollback(self.advanced)
            full = np.ones(constraint.vocab_size, dtype=bool)
            self.verify_mask = mx.array(np.stack([full if m is None else m for m in self.masks]))

    def draw(self, step_logits: mx.array, i: int) -> None:
        """Draft token ``i`` from the head's logits ``[1, V]``."""
        seq, params = self.seq, self.seq.params
        if seq.constraint is not None:
            step_logits = self._masked_draft_logits(step_logits)
        # Penalties see the drafts so far, exactly as plain decoding would have.
        history = seq.history.row_after(self.ids) if seq.history else None
        if params.greedy:
            d = greedy_tokens(step_logits, params, history)
        else:
            position = self.position + i
            uniform = keyed_uniforms(seq.seed, range(position, position + 1), DRAFT)
            q, d = truncate_and_sample(step_logits, params, uniform, history)
            self.rows.append(q)
        self.ids.append(d)

    def _masked_draft_logits(self, step_logits: mx.array) -> mx.array:
        """The head's logits under the grammar's mask for this position; unmasked once a
        draft was refused, or when the head's draft vocabulary holds no allowed token (such a
        draft is rejected for certain, and q stays a distribution)."""
        if not self.following:
            self.masks.append(None)
            return step_logits
        allowed = self._allowed()
        self.masks.append(allowed)
        if allowed is None:
            return step_logits
        masked = mx.where(mx.array(allowed), step_logits, -mx.inf)
        return mx.where(mx.any(masked > -mx.inf), masked, step_logits)

    def _allowed(self) -> np.ndarray | None:
        """The grammar's mask here; None (every token, and the grammar no longer followed)
        where it allows none. A dead end after drafts is this row's alone and decides nothing
        yet: if the verify rejects a draft before it, the output never goes there; if not, the
        row's commit meets it (``GrammarDeadEnd``) and fails this row only, as plain decoding
        would have failed it one token later."""
        try:
            return self.seq.constraint.allowed()
        except GrammarDeadEnd:
            self.following = False
            return None

    def follow(self) -> None:
        """Advance the grammar over the draft just drawn (a host sync), or stop following it
        if the grammar forbids that draft."""
        constraint = self.seq.constraint
        if constraint is None or not self.following:
            return
        token = self.ids[-1].item()
        if not self.masks[-1][token]:
            self.following = False
            return
        self.advanced += constraint.consume(token)

    def confident_stop(self, step_logits: mx.array, i: int, k: int) -> bool:
        """Confidence cut (llama.cpp's p-min): stop drafting once the head's top probability
        falls below the threshold. Costs one host sync per draft step (one row only)."""
        threshold = self.seq.draft_confidence
        if threshold is None or i + 1 >= k:
            return False
        if self.seq.params.greedy:
            top = mx.softmax(step_logits.astype(mx.float32), -1)
        else:
            top = self.rows[-1].probs
        return top.max().item() < threshold

    def accept(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The accepted count and the next token from the verify logits ``[K+1, V]``."""
        seq, params, drafts = self.seq, self.seq.params, self.drafts
        if self.verify_mask is not None:
            logits = mx.where(self.verify_mask, logits, -mx.inf)
        # Rows for the drafts made, not the K asked for: a confidence cut may have drafted fewer.
        history = seq.history.rows(drafts, len(self.ids) + 1) if seq.history else None
        if params.greedy:
            return accept_greedy(drafts, greedy_tokens(logits, params, history))
        # Position i's uniforms serve only the token at position i: the first rejection ends
        # the scan, so those past it decide nothing and the next cycle may draw them again.
        first, k = self.position, len(self.ids)
        emit = keyed_uniforms(seq.seed, range(first, first + k + 1), EMIT)
        if not self.ids:  # plain decoding: a draw from p_1, truncation and draw in one call
            token = truncate_and_sample(logits, params, emit, history)[1][0]
            return mx.array(0, dtype=mx.int32), token
        p_all = truncate(logits, params, history)
        accept = keyed_uniforms(seq.seed, range(first, first + k), ACCEPT)
        return accept_drafts_with(drafts, self.q, p_all, accept, emit)


def launch_heads_ahead(
    trunk: Any, head: MTPHead | None, seqs: list[Sequence], launched: list[LaunchedCycle]
) -> None:
    """Start the next drafting cycle's first head step behind ``launched`` (a drafting cycle of
    the rows ``seqs``, one pass), before it is read back (``HeadAhead``).

    Why: a drafting cycle's device work waits on the host between its read-back and the next
    cycle's first draft step (reading, committing, each request's event, building the step),
    and that step needs only what the device already holds: the pairs a row's next cycle
    catches up on are the verify's states h_j with the emitted tokens x_{j+1} — draft j+1 while
    j is below the accepted count n, the next token at j = n. So the head runs every verified
    position j = 0..depth of every row with those tokens and returns each row's position n
    (``MTPHead``'s ``pick``): each position's numbers are its own (row-wise products, each
    query over its own keys), so that output and the cache's first n+1 new entries are bit for
    bit what catching up on the n+1 kept pairs writes and returns, alone or in any batch
    (tests/engine/test_head_ahead.py), and the entries past them lie beyond the cache's length,
    overwritten by the next write. Native kernel only: mlx's own products are not row-wise
    exact, and a seed must repeat whichever way its drafts were computed."""
    depth = launched[0].depth
    caches = [seq.head_cache for seq in seqs]
    if head is None or depth < 1 or leads_a_group(trunk) or not products.on_native():
        return
    if any(cache is None or seq.head_pending for seq, cache in zip(seqs, caches, strict=True)):
        return
    offsets = [cache.offset for cache in caches]
    # the cycle's further draft steps wrote past ``base``: its commit drops them
    bases = [offset - (depth - 1) for offset in offsets]
    emitted, lasts = [], []
    for cycle in launched:
        last = cycle.next_token.reshape(1).astype(mx.int32)
        # a row that drafted fewer than the pass's depth: its next token fills the rest
        short = depth + 1 - cycle.drafts.shape[0]
        fill = last if short == 1 else mx.repeat(last, short)
        emitted.append(mx.concatenate([cycle.drafts.astype(mx.int32), fill]))
        lasts.append(last)
    accepted = _stack([cycle.n_accepted.reshape(1) for cycle in launched])
    positions = mx.arange(depth + 1)[None]
    tokens = mx.where(positions < accepted[:, None], mx.stack(emitted), _stack(lasts)[:, None])
    for cache, base in zip(caches, bases, strict=True):
        cache.offset = base
    hidden = _stack([cycle.hidden for cycle in launched])
    if len(seqs) == 1:  # as a row alone catches up: its one cache
        out = head(trunk, tokens, hidden, caches[0], seqs[0].head_position, pick=accepted)
    else:
        where = [seq.head_position for seq in seqs]
        out = head(trunk, tokens, hidden, caches, where, pick=accepted)
    mx.async_eval(*out)
    for row, seq in enumerate(seqs):
        seq.head_cache.offset = offsets[row]
        seq.head_ahead = HeadAhead(bases[row], depth, *out, row=row)


def read_cycles(launched: list[LaunchedCycle]) -> list[CycleResult]:
    """``read_cycle`` for every row of a batched cycle, with one device->host sync."""
    products.wait(*(a for c in launched for a in (c.n_accepted, c.next_token, c.drafts)))
    return [_result(c) for c in launched]


def read_cycle(launched: LaunchedCycle) -> CycleResult:
    """Wait for a launched cycle and read back what it emits (the one device->host sync)."""
    return read_cycles([launched])[0]


def _result(launched: LaunchedCycle) -> CycleResult:
    """What a launched cycle emits, its arrays already evaluated."""
    n_accepted = launched.n_accepted.item()
    draft_list = launched.drafts.tolist()
    next_token = launched.next_token.item()
    return CycleResult(
        draft_ids=draft_list,
        n_accepted=n_accepted,
        emitted=draft_list[:n_accepted] + [next_token],
        verify_logits=launched.logits,
        verify_hidden=launched.hidden,
        depth=launched.depth,
        draft_seconds=launched.draft_seconds,
        verify_seconds=launched.verify_seconds,
        accept_seconds=time.perf_counter() - launched.launched_at,
    )


def commit_unread(seq: Sequence, launched: LaunchedCycle) -> None:
    """Commit a plain (K=0) cycle before its token is read back.

    A K=0 cycle keeps its one token whatever it is (a stop token is emitted too), so its
    commit needs no host value: the trunk keeps the one position, the head gets its pending
    pair, the penalties count the device token, and the token becomes ``seq.unread_token``
    for the next launch. Once read, ``finish_unread`` only appends it to ``seq.tokens``.
    """
    if launched.k != 0:
        raise ValueError("only a plain cycle keeps its token unconditionally")
    if seq.constraint is not None:
        raise ValueError("a constrained sequence's next mask needs the token on the host")
    _keep_positions(seq, launched.hidden, 0, 1, complete=False)
    token = launched.next_token.reshape(1)
    if seq.history is not None:
        seq.history.extend(token)
    seq.unread_token = token


def finish_unread(seq: Sequence, result: CycleResult) -> list[int]:
    """``commit`` for a cycle already committed by ``commit_unread``: the host side only."""
    seq.tokens.extend(result.emitted)
    seq.unread_token = None
    return result.emitted


def commit(seq: Sequence, result: CycleResult, n_keep: int) -> list[int]:
    """Keep the first ``n_keep`` emitted tokens (1..len(emitted)); restore the invariant."""
    emitted = result.emitted[:n_keep]
    complete = n_keep == len(result.emitted)
    _keep_positions(seq, result.verify_hidden, result.depth, n_keep, complete)
    seq.tokens.extend(emitted)
    if seq.history is not None:
        seq.history.extend(emitted)
    if seq.constraint is not None:
        seq.constraint.consume_all(emitted)
    return emitted


def _keep_positions(
    seq: Sequence, verify_hidden: mx.array, depth: int, n_keep: int, complete: bool
) -> None:
    """The caches' side of a commit: of the depth+1 verified positions keep the first n_keep
    (``complete``: every token the cycle emitted, so a ``HeadAhead`` ran the pending pairs)."""
    ahead, seq.head_ahead = seq.head_ahead, None
    seq.trunk_cache.commit(n_keep, depth + 1)
    if seq.head_cache is not None:
        # The verify states of the kept positions become pending head pairs; drop the head's
        # speculative positions (draft steps 2..depth) — they were fed drafts, not committed
        # pairs.
        kept = verify_hidden[:, :n_keep]
        seq.head_pending.append(kept)
        if depth > 1:
            seq.head_cache.trim(depth - 1)
        if ahead is not None and complete and ahead.depth == depth and len(seq.head_pending) == 1:
            ahead.pending = kept
            seq.head_ahead = ahead
