"""Speculation under history-dependent sampling: penalties and logit_bias.

The i-th verified position must be scored with the history plain decoding would have had there —
the committed tokens plus drafts d_1..d_{i-1} — and so must the i-th draft.

* greedy: K = 1..4 emit exactly what K = 0 emits, with presence / frequency / repetition
  penalties and logit_bias, on the demo model and the tiny test checkpoints (a verify pass that
  ignored the drafts in its history changed 11 of the 24 demo runs: K=1..4 x 3 prompts x 2
  settings);
* sampled: the first six tokens are distributed the same with K = 3 as with K = 0 under
  strong penalties (chi-square homogeneity per position and of the tokens repeated among them,
  fixed seeds: deterministic).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from test_sampling import ALPHA, _homogeneity_pvalue

from engine.api import GenerationRequest
from sampling.params import SamplingParams

DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
PROMPTS = ["def read_lines(path):\n", "The quick brown fox", "class Point:\n    def"]


@pytest.fixture(scope="module")
def demo_engine():
    """The demo model with the conversation cache on: each prompt runs hundreds of times and
    is prefilled once (the cache is exact against a cold run: tests/engine/test_prefix_cache.py)."""
    from engine.runtime import Engine

    engine = Engine.load(str(DEMO_MODEL), draft_tokens=0)
    engine.enable_prefix_cache(64 << 20)
    return engine


def tokens(engine, prompt: list[int], params: SamplingParams, k: int, n: int) -> list[int]:
    request = GenerationRequest(prompt, params, n, draft_tokens=k, ignore_eos=True)
    return [t for event in engine.generate(request) for t in event.token_ids]


def settings(engine, strength: float) -> dict[str, SamplingParams]:
    """Penalty settings, ``strength`` times the base values (the test checkpoints' logits are
    steep: std ~10). The bias favours a common token and bans another (ids from the engine's
    own tokenizer, so every checkpoint gets tokens it writes)."""
    boost, ban = engine.tokenizer.encode(" return")[0], engine.tokenizer.encode(":")[0]
    return {
        "presence+repetition": SamplingParams(
            temperature=0.0,
            presence_penalty=min(2.0, 1.5 * strength),
            repetition_penalty=1.0 + 0.3 * strength,
        ),
        "frequency+bias": SamplingParams(
            temperature=0.0,
            frequency_penalty=min(2.0, 1.0 * strength),
            logit_bias={boost: 2.0 * strength, ban: -100.0},
        ),
    }


def check_greedy_exact(
    engine, params: SamplingParams, prompts: list[str], n: int
) -> tuple[int, int]:
    """Greedy K=1..4 equal K=0 under ``params``; returns (accepted, proposed) drafts."""
    changed = proposed = accepted = 0
    for text in prompts:
        prompt = engine.tokenizer.encode(text)
        plain = tokens(engine, prompt, params, 0, n)
        changed += plain != tokens(engine, prompt, SamplingParams(temperature=0.0), 0, n)
        for k in range(1, 5):
            request = GenerationRequest(prompt, params, n, draft_tokens=k, ignore_eos=True)
            events = list(engine.generate(request))
            spec = [t for e in events for t in e.token_ids]
            assert spec == plain, f"K={k} differs from K=0 on {text!r}"
            proposed += events[-1].stats.proposed
            accepted += events[-1].stats.accepted
    assert changed, "the settings must change the greedy text, or this checks nothing"
    return accepted, proposed


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code", "prose", "class"])
@pytest.mark.parametrize("name", ["presence+repetition", "frequency+bias"])
def test_greedy_with_penalties_equals_plain_on_the_demo_model(
    demo_engine, name: str, prompt: str
) -> None:
    accepted, proposed = check_greedy_exact(
        demo_engine, settings(demo_engine, 1.0)[name], [prompt], 40
    )
    assert 0 < accepted < proposed  # multi-row verifies ran, drafts accepted and rejected


@pytest.mark.parametrize(
    "variant", [pytest.param("dense-tied", marks=pytest.mark.fast), "moe-untied-sharded"]
)
def test_greedy_with_penalties_equals_plain_on_test_checkpoints(load_engine, variant) -> None:
    """The random checkpoints rarely repeat a token greedily, so penalties alone seldom change
    their text: each prompt also bans plain greedy's first token, which changes it for sure."""
    engine = load_engine(variant, draft_tokens=0)
    counts = np.zeros(2)
    for params in settings(engine, 4.0).values():
        for text in PROMPTS[:2]:
            first = tokens(
                engine, engine.tokenizer.encode(text), SamplingParams(temperature=0.0), 0, 1
            )
            banned = replace(params, logit_bias={**params.logit_bias, first[0]: -100.0})
            counts += check_greedy_exact(engine, banned, [text], 30)
    assert 0 < counts[0] < counts[1]


def first_tokens(engine, prompt: list[int], params: SamplingParams, k: int, n: int) -> np.ndarray:
    rows = [tokens(engine, prompt, replace(params, seed=seed), k, POSITIONS) for seed in range(n)]
    return np.array(rows)


POSITIONS = 6


def test_sampled_with_strong_penalties_matches_plain(demo_engine) -> None:
    """Presence, frequency and repetition penalties of 2 at temperature 1: plain sampling then
    almost never repeats a token within the first six, and a position scored without the drafts
    before it would. Chi-square homogeneity per position, and of the number of repeated tokens
    in the six (a verify pass without the drafts' history repeated one in 16 of 300 runs where
    plain sampling repeated none: per-position frequencies alone missed it)."""
    params = SamplingParams(
        temperature=1.0,
        top_k=20,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
    )
    prompt = demo_engine.tokenizer.encode("The quick brown fox")
    n = 300
    plain = first_tokens(demo_engine, prompt, params, 0, n)
    spec = first_tokens(demo_engine, prompt, params, 3, n)
    for position in range(POSITIONS):
        assert np.bincount(plain[:, position]).max() < 0.8 * n  # informative position
        p = _homogeneity_pvalue(plain[:, position], spec[:, position])
        assert p > ALPHA, f"position {position + 1}: p={p:.2g}"
    repeats = [np.array([POSITIONS - len(set(row)) for row in s]) for s in (plain, spec)]
    table = np.array([[np.sum(r == 0), np.sum(r > 0)] for r in repeats])
    p = float(chi2_contingency(table)[1]) if table[:, 1].sum() else 1.0
    assert p > ALPHA, f"repeated tokens: plain {table[0]}, K=3 {table[1]} (p={p:.2g})"
