"""A drafting cycle's next first head step run ahead of its read-back (``HeadAhead``) is the
catch-up it replaces, bit for bit: the same output, the same head cache, the same drafts."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from engine.cycle.sequence import absorb_pending, take_head_ahead
from engine.cycle.speculative import commit, launch_cycle, launch_head_ahead, read_cycle
from engine.model import products
from sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(
    not products.on_native(), reason="a step runs ahead on the native kernel only"
)

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
SAMPLERS = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=1.0, seed=11),
}


def head_entries(seq: Any) -> list[mx.array]:
    """The head cache's keys and values up to its length."""
    cache = seq.head_cache
    return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]]


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
        taken += ahead.head_ahead is not None and ahead.head_ahead.pending is not None
        launched = launch_cycle(trunk, head, ahead, k)
        launch_head_ahead(trunk, head, ahead, launched)
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
        launch_head_ahead(trunk, head, seq, launched)
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
