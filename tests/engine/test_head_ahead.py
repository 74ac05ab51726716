"""A drafting cycle's next first head step run ahead of its read-back (``HeadAhead``) is the
catch-up it replaces, bit for bit: the same output, the same head cache, the same drafts."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from engine.cycle.sequence import (
    absorb_pending,
    absorb_pending_rows,
    take_head_ahead,
    take_heads_ahead,
)
from engine.cycle.speculative import (
    commit,
    launch_cycle,
    launch_cycles,
    launch_heads_ahead,
    read_cycle,
    read_cycles,
)
from engine.model import products
from sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(
    not products.on_native(), reason="a step runs ahead on the native kernel only"
)

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
PROMPTS = (PROMPT, "The quick brown fox jumps over", "class Point:\n    def __init__(self, x, y):")
SAMPLERS = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=1.0, seed=11),
}


def head_entries(seq: Any) -> list[mx.array]:
    """The head cache's keys and values up to its length."""
    cache = seq.head_cache
    return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]]


def holds_step_ahead(seq: Any) -> bool:
    """Whether the sequence's next drafting cycle will take a step run ahead (its commit kept
    every emitted token)."""
    return seq.head_ahead is not None and seq.head_ahead.pending is not None


def same_bits(a: list[mx.array], b: list[mx.array]) -> bool:
    pairs = zip(a, b, strict=True)
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in pairs)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_step_run_ahead_is_the_catch_up_it_replaces(tiny_engine, sampler: str, k: int) -> None:
    """Two copies of one sequence run the same cycles, one with each next first head step run
    ahead, the other catching up as the cycle begins: every cycle drafts and emits the same,
    and after the last one the step run ahead returns the catch-up's output and leaves the
    head's cache as the catch-up does, bit for bit, whatever the cycle accepted."""
    trunk, head = tiny_engine.trunk, tiny_engine.head
    params = SAMPLERS[sampler]
    prompt = list(tiny_engine.tokenizer.encode(PROMPT))
    ahead = tiny_engine.new_sequence(prompt, params, draft=True)
    plain = tiny_engine.new_sequence(prompt, params, draft=True)
    plain.seed = ahead.seed
    accepted, taken = set(), 0
    for _ in range(16):
        taken += holds_step_ahead(ahead)
        launched = launch_cycle(trunk, head, ahead, k)
        launch_heads_ahead(trunk, head, [ahead], [launched])
        result = read_cycle(launched)
        reference = run_cycle_plainly(trunk, head, plain, k)
        assert (result.draft_ids, result.emitted) == (reference.draft_ids, reference.emitted)
        commit(ahead, result, len(result.emitted))
        commit(plain, reference, len(reference.emitted))
        accepted.add(result.n_accepted)
    assert taken == 15  # every cycle after the first took the step its predecessor ran ahead
    assert len(accepted) >= 2, f"the cycles accepted {accepted} drafts only: too few cases"
    run_ahead = take_head_ahead(ahead)
    caught_up = absorb_pending(trunk, head, plain, keep_last=False)
    assert run_ahead is not None and caught_up is not None
    assert ahead.head_cache.offset == plain.head_cache.offset and not ahead.head_pending
    assert same_bits(list(run_ahead), list(caught_up))
    assert same_bits(head_entries(ahead), head_entries(plain))


def run_cycle_plainly(trunk: Any, head: Any, seq: Any, k: int) -> Any:
    return read_cycle(launch_cycle(trunk, head, seq, k))


def test_a_cycle_cut_by_a_stop_keeps_no_step_ahead(tiny_engine) -> None:
    """A commit that keeps fewer tokens than the cycle emitted (a stop among them) leaves
    pending pairs the step run ahead did not run: the sequence drops it and catches up."""
    trunk, head = tiny_engine.trunk, tiny_engine.head
    params = SAMPLERS["greedy"]
    prompt = list(tiny_engine.tokenizer.encode(PROMPT))
    seq = tiny_engine.new_sequence(prompt, params, draft=True)
    for _ in range(8):
        launched = launch_cycle(trunk, head, seq, 3)
        launch_heads_ahead(trunk, head, [seq], [launched])
        result = read_cycle(launched)
        if len(result.emitted) > 1:
            break
        commit(seq, result, len(result.emitted))
    else:
        pytest.fail("no cycle accepted a draft")
    commit(seq, result, len(result.emitted) - 1)
    assert seq.head_ahead is None
    assert take_head_ahead(seq) is None and seq.head_pending
    n = len(seq.tokens) - 1
    assert seq.head_cache.offset + seq.head_skipped + seq.head_pending[0].shape[1] == n


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_batch_step_run_ahead_is_each_rows_catch_up(tiny_engine, sampler: str) -> None:
    """Three rows in one batch, some drafting fewer than the pass's K (``ks``): with each next
    first head step run ahead for the batch, every row drafts and emits what the same batch
    catching up does; the batch's step returns its catch-up's outputs bit for bit, and one
    row's part of it is what that row catching up alone returns."""
    trunk, head = tiny_engine.trunk, tiny_engine.head
    params = SAMPLERS[sampler]
    prompts = [list(tiny_engine.tokenizer.encode(text)) for text in PROMPTS]

    def batch() -> list[Any]:
        seqs = [tiny_engine.new_sequence(ids, params, draft=True) for ids in prompts]
        for b, seq in enumerate(seqs):
            seq.seed = 100 + b
        return seqs

    ahead, plain = batch(), batch()
    ks = [3, 1, 2]
    accepted, taken = set(), 0
    for _ in range(12):
        taken += all(
            seq.head_ahead is not None and seq.head_ahead.pending is not None for seq in ahead
        )
        launched = launch_cycles(trunk, head, ahead, 3, ks=ks)
        launch_heads_ahead(trunk, head, ahead, launched)
        results = read_cycles(launched)
        references = read_cycles(launch_cycles(trunk, head, plain, 3, ks=ks))
        for seq, result in zip(ahead, results, strict=True):
            commit(seq, result, len(result.emitted))
            accepted.add(result.n_accepted)
        for seq, reference in zip(plain, references, strict=True):
            commit(seq, reference, len(reference.emitted))
        assert [r.emitted for r in results] == [r.emitted for r in references]
        assert [r.draft_ids for r in results] == [r.draft_ids for r in references]
    assert taken == 11
    assert len(accepted) >= 2, f"the rows accepted {accepted} drafts only: too few cases"
    one_ahead = ahead[1].head_ahead
    run_ahead = take_heads_ahead(ahead)
    caught_up = absorb_pending_rows(trunk, head, plain)
    assert run_ahead is not None
    assert same_bits(list(run_ahead), list(caught_up))
    for seq, reference in zip(ahead, plain, strict=True):
        assert seq.head_cache.offset == reference.head_cache.offset and not seq.head_pending
    # the middle row's part, taken by the row alone, against the row catching up alone
    alone = batch()[1]
    for _ in range(12):
        result = read_cycle(launch_cycle(trunk, head, alone, 1))
        commit(alone, result, len(result.emitted))
    assert alone.tokens == ahead[1].tokens
    row = take_head_ahead_of(ahead[1], one_ahead)
    assert same_bits(list(row), list(absorb_pending(trunk, head, alone, keep_last=False)))


def take_head_ahead_of(seq: Any, ahead: Any) -> tuple[mx.array, mx.array]:
    """The row's part of a batch's step run ahead, as the row alone would take it (the state
    before the batch took it: the caches and pending pairs as its commit left them)."""
    seq.head_cache.offset = ahead.base
    seq.head_pending = [ahead.pending]
    seq.head_ahead = ahead
    taken = take_head_ahead(seq)
    assert taken is not None
    return taken
