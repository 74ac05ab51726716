"""Logprobs are the model's: each emitted token's log-probability and the top alternatives equal
log_softmax of a plain mlx-lm forward over prompt + generated tokens (no engine code), for
greedy and sampled decoding with drafts accepted and rejected, through the engine and through
``mtpserve generate --json --logprobs N``. The server's two endpoints are checked the same way in
tests/server/test_server_engine_paths.py (``independent_logprobs``: tests/reference_logprobs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference_logprobs import independent_logprobs

from engine.api import GenerationRequest
from sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "models" / "qwen3.5-demo"
#: float32 forward of the same weights along different paths (compiled blocks, verify rows)
TOLERANCE = 2e-3


def check_logprobs(
    rows: np.ndarray, generated: list[int], chosen: list[float], top: list[list[tuple[int, float]]]
) -> None:
    """``chosen[i]`` is token i's logprob, ``top[i]`` its (id, logprob) alternatives, best first."""
    assert len(chosen) == len(generated) == len(top) == rows.shape[0]
    for i, token in enumerate(generated):
        assert chosen[i] == pytest.approx(rows[i, token], abs=TOLERANCE), f"token {i}"
        ids = [t for t, _ in top[i]]
        values = [v for _, v in top[i]]
        np.testing.assert_allclose(values, np.sort(rows[i])[::-1][: len(ids)], atol=TOLERANCE)
        np.testing.assert_allclose(rows[i, ids], values, atol=TOLERANCE)


@pytest.fixture(scope="module")
def demo_engine():
    from engine.runtime import Engine

    return Engine.load(str(DEMO_MODEL), draft_tokens=0)


@pytest.mark.parametrize(
    "params,k",
    [
        (SamplingParams(temperature=0.0), 2),
        (SamplingParams(temperature=1.0, top_k=20, seed=3), 3),
        (SamplingParams(temperature=0.7, top_p=0.9, seed=4), 0),
    ],
    ids=["greedy-K2", "sampled-K3", "sampled-plain"],
)
@pytest.mark.fast
def test_engine_logprobs_equal_an_independent_forward(
    demo_engine, params: SamplingParams, k: int
) -> None:
    prompt = demo_engine.tokenizer.encode("def read_lines(path):\n")
    request = GenerationRequest(prompt, params, 24, draft_tokens=k, ignore_eos=True, top_logprobs=5)
    events = list(demo_engine.generate(request))
    generated = [t for e in events for t in e.token_ids]
    items = [lp for e in events for lp in e.logprobs]
    assert [lp.token_id for lp in items] == generated
    rows = independent_logprobs(DEMO_MODEL, prompt, generated)
    check_logprobs(rows, generated, [lp.logprob for lp in items], [lp.top for lp in items])
    if k:  # several tokens per cycle (rows of one verify pass), and a rejection or more
        stats = events[-1].stats
        assert stats.completion_tokens > stats.cycles and stats.accepted < stats.proposed
    # informative: the model is unsure at some positions
    assert min(lp.logprob for lp in items) < -1.0


def test_cli_logprobs_equal_an_independent_forward(tiny_checkpoint: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtpserve.cli",
            "generate",
            "--model",
            str(tiny_checkpoint),
            "--prompt",
            "def add(a, b):",
            "--max-tokens",
            "16",
            "--temperature",
            "2.0",
            "--seed",
            "1",
            "--draft-tokens",
            "2",
            "--ignore-eos",
            "--json",
            "--logprobs",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (choice,) = result["choices"]
    generated = choice["token_ids"]
    items = choice["logprobs"]
    assert [i["token_id"] for i in items] == generated and len(generated) == 16
    rows = independent_logprobs(tiny_checkpoint, result["prompt_token_ids"], generated)
    check_logprobs(
        rows,
        generated,
        [i["logprob"] for i in items],
        [[tuple(t) for t in i["top"]] for i in items],
    )
    assert all(len(i["top"]) == 3 for i in items)
