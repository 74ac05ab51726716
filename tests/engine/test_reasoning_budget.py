"""A thinking budget closes the reasoning at its token, exactly: the tokens before it are the
model's own, the one at the budget is the reasoning's end, and what follows is what plain
decoding of the prompt extended by those tokens gives — for every K, alone and in a batch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_batching import batched

from engine.api import GenerationRequest, RequestError
from engine.runtime import Engine
from sampling.params import SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
GREEDY = SamplingParams(temperature=0.0)
BUDGET = 6
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def demo() -> Engine:
    return Engine.load(str(DEMO))


@pytest.fixture(scope="module")
def thinking_prompt(demo: Engine) -> list[int]:
    """A prompt the demo model continues for a while without ``</think>`` (its chat replies
    close their think block at once): the engine counts a reply's tokens as reasoning until
    that id comes, whatever the prompt (the server sets a budget only where the prompt opens
    the block). Code, so that drafts are accepted and cycles cross the budget."""
    return demo.tokenizer.encode("def fibonacci(n):")


def request(
    demo: Engine, prompt: list[int], k: int | None, budget: int | None, max_tokens: int = MAX_TOKENS
) -> GenerationRequest:
    end = demo.tokenizer.get_vocab()["</think>"]
    return GenerationRequest(
        prompt_ids=prompt,
        sampling=GREEDY,
        max_tokens=max_tokens,
        stop_token_ids=demo.eos_token_ids,
        draft_tokens=k,
        reasoning_budget=budget,
        reasoning_end=end if budget is not None else None,
    )


def run(demo: Engine, req: GenerationRequest) -> list[int]:
    return [t for event in demo.generate(req) for t in event.token_ids]


def test_the_budgets_token_ends_the_reasoning_and_the_rest_is_exact(
    demo: Engine, thinking_prompt: list[int]
) -> None:
    end = demo.tokenizer.get_vocab()["</think>"]
    free = run(demo, request(demo, thinking_prompt, 0, None))
    assert end not in free[: BUDGET + 1], "the model ends its reasoning before the budget"
    outputs = {k: run(demo, request(demo, thinking_prompt, k, BUDGET)) for k in (0, 1, 3, None)}
    bounded = outputs[0]
    assert all(tokens == bounded for tokens in outputs.values()), outputs
    assert bounded[:BUDGET] == free[:BUDGET] and bounded[BUDGET] == end
    # after the forced token the caches are as if the model had drawn it: plain decoding of
    # the prompt extended by the reasoning and its end continues the same way
    head = bounded[: BUDGET + 1]
    rest = MAX_TOKENS - len(head)
    cold = run(demo, request(demo, thinking_prompt + head, 0, None, max_tokens=rest))
    assert bounded[BUDGET + 1 :] == cold


def test_a_budget_of_nothing_closes_the_reasoning_at_once_and_a_large_one_changes_nothing(
    demo: Engine, thinking_prompt: list[int]
) -> None:
    end = demo.tokenizer.get_vocab()["</think>"]
    assert run(demo, request(demo, thinking_prompt, 3, 0))[0] == end
    free = run(demo, request(demo, thinking_prompt, 3, None))
    assert run(demo, request(demo, thinking_prompt, 3, MAX_TOKENS)) == free


def test_a_budgeted_row_in_a_batch_is_the_same_as_alone(
    demo: Engine, thinking_prompt: list[int]
) -> None:
    reqs = [
        request(demo, thinking_prompt, None, BUDGET),
        request(demo, thinking_prompt, None, None),
        request(demo, thinking_prompt, 0, BUDGET + 3),
    ]
    tokens, _ = batched(demo, reqs, join_at={2: 3})
    for i, req in enumerate(reqs):
        assert tokens[i] == run(demo, req), i


def test_a_budget_needs_the_end_token_and_is_not_negative(
    demo: Engine, thinking_prompt: list[int]
) -> None:
    req = request(demo, thinking_prompt, 0, BUDGET)
    for bad in (replace(req, reasoning_budget=-1), replace(req, reasoning_end=None)):
        with pytest.raises(RequestError):
            demo.check(bad)
