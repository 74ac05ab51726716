"""One sequence's state between cycles (``Sequence``) and what changes it outside a cycle:
starting it, prefilling its prompt in chunks, appending tokens it did not generate, and the
head's catch-up on pending committed pairs. The invariant this state keeps at every cycle's end,
and why the head may skip positions, are in ``engine.cycle.speculative``'s docstring (the cycle
keeps it; this module only builds and extends it).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.blas import all_cores
from engine.model import products
from engine.model.attention import RowKVCache
from engine.model.mlx_products import prefill_on_all_cores
from engine.model.mtp import MTPHead
from engine.model.trunk import TrunkCache, new_trunk_cache, trunk_hidden
from sampling.constraint import TokenConstraint
from sampling.distribution import PenaltyHistory
from sampling.params import SamplingParams

#: Prompt tokens per prefill forward, and the conversation cache's block: chunks end at its
#: multiples (``prefill``), so a prompt resumed at a cached block boundary runs the chunks a
#: cold prefill runs, and the prefill checks for cancellation between chunks. At
#: Qwen3.5-0.8B's shape on a CPU, chunks of 64 and 128 prefilled ~21 tokens per CPU second and
#: chunks of 256 ~5 (the Gated-DeltaNet layers' per-chunk work grows faster than the chunk);
#: on the demo model 128 to 512 are within 6% (docs/BENCHMARKS.md, "Decode threads and the
#: prefill chunk").
PREFILL_CHUNK = 128
#: most pending positions a drafting cycle's first head step catches up on:
#: engine.scheduling.autok's MAX_PROBE_INTERVAL (plain cycles between probes) plus one
#: cycle's commit, so that auto K's probes never skip
MAX_CATCH_UP = 136

T = TypeVar("T")


@dataclass
class HeadAhead:
    """A drafting cycle's next first head step, launched before the cycle was read back
    (``engine.cycle.speculative.launch_heads_ahead``): the head run over every position the
    cycle verified, its cache written from position ``base`` on, and the output of the
    position after the cycle's last accepted draft — row ``row`` of ``state [B, 1, H]`` and
    ``logits [B, 1, V]``, the outputs of the B rows the step ran for. The cycle's commit leaves
    the caches as if nothing had run ahead and sets ``pending`` when the step ran exactly the
    pairs that are then pending (every emitted token kept); the row's next drafting cycle then
    takes it (``take_head_ahead``, ``take_heads_ahead``) instead of running them."""

    base: int
    depth: int
    state: mx.array
    logits: mx.array
    row: int = 0
    pending: mx.array | None = None

    def ready(self, seq: Sequence) -> bool:
        """Whether it ran exactly ``seq``'s pending pairs and its cache is as the commit left it."""
        cache = seq.head_cache
        return (
            self.pending is not None
            and cache is not None
            and len(seq.head_pending) == 1
            and seq.head_pending[0] is self.pending
            and cache.offset == self.base
        )

    def taken(self, seq: Sequence) -> None:
        """Its pairs leave ``head_pending`` for the head's cache, where it wrote them."""
        seq.head_cache.offset += self.pending.shape[1]
        seq.head_pending = []


@dataclass
class Sequence:
    tokens: list[int]
    params: SamplingParams
    trunk_cache: TrunkCache
    head_cache: KVCache | None
    history: PenaltyHistory | None
    #: the request's seed, or a random one: every random number of the sequence is a
    #: ``keyed_uniform`` of (seed, sequence position, purpose), so its draws do not depend on
    #: when, in which cycle or beside which rows they run; with a fixed K per cycle its text
    #: is a function of the request
    seed: int
    head_pending: list[mx.array] = field(default_factory=list)
    #: stop drafting when the head's top probability is below this (None: always draft K)
    draft_confidence: float | None = None
    #: the token after ``tokens`` while only the device has it (``commit_unread``), ``[1]``
    unread_token: mx.array | None = None
    #: committed positions the head's cache skipped (``engine.cycle.speculative``)
    head_skipped: int = 0
    #: prompt positions restored from the prefix cache instead of prefilled
    restored: int = 0
    #: structured output: the grammar the emitted tokens follow (``sampling.constraint``)
    constraint: TokenConstraint | None = None
    #: the next first head step, run while the last cycle was read back (``HeadAhead``)
    head_ahead: HeadAhead | None = None

    @property
    def next_position(self) -> int:
        """The sequence position of the next token to draw."""
        return len(self.tokens) + (0 if self.unread_token is None else 1)

    @property
    def head_position(self) -> int:
        """The sequence position of the head's next pair."""
        return self.head_cache.offset + self.head_skipped

    @property
    def can_draft(self) -> bool:
        return self.head_cache is not None and bool(self.head_pending)


@dataclass
class CacheSnapshot:
    """What launching a plain cycle changes: the trunk cache (a plain cycle touches neither the
    head cache nor the history, and its draw is keyed by position). Restoring undoes a
    launched cycle."""

    trunk: list[tuple[Any, ...]]

    @classmethod
    def of(cls, seq: Sequence) -> CacheSnapshot:
        return cls(seq.trunk_cache.snapshot())

    def restore(self, seq: Sequence) -> None:
        seq.trunk_cache.restore(self.trunk)


def start_sequence(
    trunk: Any,
    head: MTPHead | None,
    prompt_ids: list[int],
    params: SamplingParams,
    use_head: bool,
) -> Sequence:
    """Prefill ``prompt_ids[:-1]`` through the trunk (and the head's cache) in chunks."""
    seq = new_sequence(trunk, head, prompt_ids, params, use_head)
    prefill(trunk, head, seq, prompt_ids[:-1])
    return seq


def new_sequence(
    trunk: Any,
    head: MTPHead | None,
    prompt_ids: list[int],
    params: SamplingParams,
    use_head: bool,
) -> Sequence:
    """A sequence for ``prompt_ids`` with empty caches, its penalty history and seed."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    seed = params.seed if params.seed is not None else int.from_bytes(_entropy(), "little")
    history = PenaltyHistory(trunk.args.vocab_size, prompt_ids) if params.uses_history else None
    return Sequence(
        tokens=list(prompt_ids),
        params=params,
        trunk_cache=new_trunk_cache(trunk),
        head_cache=RowKVCache() if (head is not None and use_head) else None,
        history=history,
        seed=seed,
    )


def prefill(
    trunk: Any,
    head: MTPHead | None,
    seq: Sequence,
    body: list[int],
    chunk_tokens: int = PREFILL_CHUNK,
    after_chunk: Callable[[Sequence], bool] | None = None,
) -> bool:
    """Feed ``body`` (tokens after the cache's end) through the trunk in chunks, and their
    committed pairs through the head's cache (the last pair stays pending for the next draft).

    Chunks end at multiples of ``chunk_tokens`` counted from position 0, so a prefill resumed
    from a cached block boundary runs the same chunks as a cold one. ``after_chunk(seq)`` runs
    after each chunk (the sequence is then at a consistent point); when it returns False the
    prefill stops there and this returns False (cancellation).
    """
    return drive(prefill_steps(trunk, head, seq, body, chunk_tokens, after_chunk))


def prefill_steps(
    trunk: Any,
    head: MTPHead | None,
    seq: Sequence,
    body: list[int],
    chunk_tokens: int = PREFILL_CHUNK,
    after_chunk: Callable[[Sequence], bool] | None = None,
    score: Callable[[int, mx.array], None] | None = None,
) -> Generator[None, None, bool]:
    """``prefill`` one chunk per step: yields after each chunk, so that a batch can run its
    other rows' cycles between a newcomer's chunks; returns what ``prefill`` returns.
    ``score(position, hidden)`` sees each chunk's hidden states ``[1, n, H]`` (positions
    ``position..position+n-1``) before they are evaluated (a prompt's logprobs)."""
    done = seq.trunk_cache.length
    start = 0
    while start < len(body):
        end = min(len(body), start + chunk_tokens - (done + start) % chunk_tokens)
        with all_cores(prefill_on_all_cores(trunk, end - start)), products.prompt_products():
            chunk = mx.array(body[start:end])[None]
            position = seq.trunk_cache.length
            hidden = trunk_hidden(trunk, chunk, seq.trunk_cache, capture=False)
            if score is not None:
                score(position, hidden)
            if seq.head_cache is not None:
                seq.head_pending.append(hidden)
                absorb_pending(trunk, head, seq, keep_last=True)
            products.wait(hidden, *seq.trunk_cache.arrays(), *seq.head_pending)
        start = end
        if after_chunk is not None and not after_chunk(seq):
            return False
        if start < len(body):
            yield
    return True


def drive(steps: Generator[Any, None, T]) -> T:
    """Run a step generator to its end and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def take_head_ahead(seq: Sequence) -> tuple[mx.array, mx.array] | None:
    """The head's output over the pending pairs from ``seq.head_ahead`` — which already wrote
    them to the head's cache: they leave ``head_pending`` — or None when it does not hold
    exactly those pairs. Either way the sequence holds no step ahead afterwards."""
    ahead, seq.head_ahead = seq.head_ahead, None
    if ahead is None or not ahead.ready(seq):
        return None
    ahead.taken(seq)
    if ahead.state.shape[0] == 1:
        return ahead.state, ahead.logits
    row = slice(ahead.row, ahead.row + 1)
    return ahead.state[row], ahead.logits[row]


def take_heads_ahead(seqs: list[Sequence]) -> tuple[mx.array, mx.array] | None:
    """``take_head_ahead`` for the rows of a batch: their outputs ``[B, 1, ...]`` when one step
    ran ahead for exactly these rows in this order and holds each row's pending pairs, else
    None (and the rows catch up as the cycle begins). No row holds a step ahead afterwards."""
    aheads = [seq.head_ahead for seq in seqs]
    for seq in seqs:
        seq.head_ahead = None
    first = aheads[0]
    if first is None or first.state.shape[0] != len(seqs):
        return None
    for b, (seq, ahead) in enumerate(zip(seqs, aheads, strict=True)):
        shared = ahead is not None and ahead.state is first.state and ahead.row == b
        if not shared or not ahead.ready(seq):
            return None
    for seq, ahead in zip(seqs, aheads, strict=True):
        ahead.taken(seq)
    return first.state, first.logits


def absorb_pending(trunk: Any, head: MTPHead, seq: Sequence, keep_last: bool) -> mx.array | None:
    """Run the head over pending committed pairs, appending them to its cache.

    Returns the head output ``(out, logits)`` of the last pair run, or None when nothing ran.
    With ``keep_last`` the final pending state stays pending (prefill: its pair is the next
    cycle's first draft step).
    """
    pairs = _pending_pairs(seq, keep_last)
    if pairs is None:
        return None
    tokens, hidden, start = pairs
    return head(trunk, tokens, hidden, seq.head_cache, start)


def absorb_pending_rows(
    trunk: Any, head: MTPHead, seqs: list[Sequence]
) -> tuple[mx.array, mx.array]:
    """``absorb_pending`` (a drafting cycle's first head step) for B rows in one head call.

    Rows have different numbers of pending pairs (what their last cycles committed): each row's
    pairs are right-aligned in a ``[B, N]`` input, so every row's last pair sits in the last
    column (the only output a draft needs), and only a row's own pairs enter its cache.
    Returns ``out [B, 1, H]`` and ``logits [B, 1, V]``."""
    pairs = [_pending_pairs(seq, keep_last=False) for seq in seqs]
    width = max(tokens.shape[1] for tokens, _, _ in pairs)
    token_rows, hidden_rows, positions, lengths = [], [], [], []
    for tokens, hidden, start in pairs:
        pad = width - tokens.shape[1]
        if pad:
            tokens = mx.concatenate([mx.zeros((1, pad), dtype=tokens.dtype), tokens], axis=1)
            hidden = mx.concatenate([mx.zeros((1, pad, hidden.shape[2]), hidden.dtype), hidden], 1)
        token_rows.append(tokens)
        hidden_rows.append(hidden)
        positions.append(start - pad)
        lengths.append(width - pad)
    caches = [seq.head_cache for seq in seqs]
    return head(
        trunk,
        mx.concatenate(token_rows),
        mx.concatenate(hidden_rows),
        caches,
        positions,
        lengths,
    )


def _pending_pairs(seq: Sequence, keep_last: bool) -> tuple[mx.array, mx.array, int] | None:
    """The pending pairs a head step runs now: tokens ``[1, n]``, trunk states ``[1, n, H]``
    and the position of the first; what stays pending is left in ``seq.head_pending``."""
    hidden = mx.concatenate(seq.head_pending, axis=1) if seq.head_pending else None
    if hidden is None:
        return None
    n = hidden.shape[1] - (1 if keep_last else 0)
    if n <= 0:
        return None
    if not keep_last and n > MAX_CATCH_UP:  # after plain cycles: the latest positions only
        skip = n - MAX_CATCH_UP
        hidden, n = hidden[:, skip:], MAX_CATCH_UP
        seq.head_skipped += skip
    start = seq.head_position
    tokens = mx.array(seq.tokens[start + 1 : start + 1 + n])[None]
    seq.head_pending = [hidden[:, n:]] if keep_last else []
    return tokens, hidden[:, :n], start


def extend_sequence(trunk: Any, head: MTPHead | None, seq: Sequence, token_ids: list[int]) -> None:
    """Append tokens the model did not generate (e.g. the next chat turn) and prefill them."""
    if not token_ids:
        return
    body = [seq.tokens[-1], *token_ids[:-1]]
    seq.tokens.extend(token_ids)
    prefill(trunk, head, seq, body)
    if seq.history is not None:
        # Appended text counts as prompt (seen) for the repetition penalty, not as output.
        seq.history.seen[mx.array(token_ids)] = True


def _entropy() -> bytes:
    import os

    return os.urandom(7)
