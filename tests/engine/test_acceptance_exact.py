"""The acceptance rule, exactly, for K > 1 — and truncation where a skipped one shows at once.

* ``accept_drafts`` for K = 2 and 3 over a 4-token vocabulary (whole rows, and top-k candidate
  rows whose token sets differ between p and q): the whole emitted tuple — accepted drafts, then
  the residual or the bonus, completed by plain draws from the remaining target rows — must be
  distributed as the product of the target rows p_1..p_{K+1} (chi-square over every cell, fixed
  keys: deterministic). A bonus drawn from the wrong row, a residual off by one, an acceptance
  test on the wrong column: each moves whole cells.
* The engine on a bigram checkpoint whose every row is nearly uniform over 8,192 tokens, where the
  head drafts the target rows (so most drafting cycles end with a bonus draw): with
  top_k=3 an untruncated draw — first token, draft, bonus — falls outside the kept three with
  probability ~0.999, so 40 tokens show it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from bigram_checkpoint import write_bigram_checkpoint
from scipy.stats import chi2 as chi2_dist

from engine.api import GenerationRequest
from sampling.acceptance import accept_drafts
from sampling.distribution import Truncated
from sampling.params import SamplingParams

pytestmark = pytest.mark.fast  # quick, and what `make mutants` relies on

ALPHA = 0.001
VOCAB = 4
SAMPLES = 40_000


def rows_over(ids: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Candidate rows spread over the vocabulary."""
    dense = np.zeros((ids.shape[0], VOCAB))
    np.put_along_axis(dense, ids, probs, axis=1)
    return dense


def make_rows(k: int, candidates: bool, rng: np.random.Generator):
    """Target rows p_1..p_{K+1} and draft rows q_1..q_K, as ``Truncated`` and dense. The q rows
    lean towards p (acceptance ~0.6, so every path of the rule runs often); with candidates each
    row keeps 3 of the 4 tokens, p's and q's sets differing."""
    width = 3 if candidates else VOCAB
    p_ids = np.array([rng.permutation(VOCAB)[:width] for _ in range(k + 1)])
    q_ids = np.array([rng.permutation(VOCAB)[:width] for _ in range(k)])
    if not candidates:
        p_ids, q_ids = np.tile(np.arange(VOCAB), (k + 1, 1)), np.tile(np.arange(VOCAB), (k, 1))
    p_probs = rng.dirichlet(np.full(width, 2.0), size=k + 1)
    p = rows_over(p_ids, p_probs)
    q = 0.6 * p[:k] + 0.4 * rng.dirichlet(np.ones(VOCAB), size=k)
    q = np.where(rows_over(q_ids, np.ones_like(q_ids, dtype=float)) > 0, q, 0.0)
    q /= q.sum(axis=1, keepdims=True)
    q_probs = np.take_along_axis(q, q_ids, axis=1)
    as_ids = (lambda a: mx.array(a, dtype=mx.int32)) if candidates else (lambda a: None)
    target = Truncated(mx.array(p_probs.astype(np.float32)), as_ids(p_ids))
    draft = Truncated(mx.array(q_probs.astype(np.float32)), as_ids(q_ids))
    return p, q, target, draft


@pytest.mark.parametrize("candidates", [False, True], ids=["whole-rows", "top-k-candidates"])
@pytest.mark.parametrize("k", [2, 3])
def test_emitted_tuple_is_distributed_as_plain_sampling(k: int, candidates: bool) -> None:
    rng = np.random.default_rng(10 * k + candidates)
    p, q, target, draft = make_rows(k, candidates, rng)
    drafts = np.stack([rng.choice(VOCAB, size=SAMPLES, p=q[i]) for i in range(k)], axis=1)
    keys = mx.random.split(mx.random.key(k), SAMPLES)
    rule = mx.vmap(lambda d, key: accept_drafts(d, draft, target, key))
    n_accepted, next_token = rule(mx.array(drafts, dtype=mx.int32), keys)
    n_accepted, next_token = np.array(n_accepted), np.array(next_token)

    # the tuple: accepted drafts, the rule's token, then plain draws from the rows after it
    tuples = np.empty((SAMPLES, k + 1), dtype=np.int64)
    for row in range(k + 1):
        plain = rng.choice(VOCAB, size=SAMPLES, p=p[row])
        accepted = drafts[:, row] if row < k else plain
        tuples[:, row] = np.where(
            row < n_accepted, accepted, np.where(row == n_accepted, next_token, plain)
        )
    cells = (tuples * VOCAB ** np.arange(k + 1)).sum(axis=1)
    observed = np.bincount(cells, minlength=VOCAB ** (k + 1))
    expected = np.ones(1)
    for row in range(k + 1):
        expected = np.outer(p[row], expected).ravel()  # cell index: token of row r * V**r
    expected *= SAMPLES
    assert observed[expected == 0].sum() == 0  # nothing outside the rows' support
    big = expected >= 5  # pool the rare cells into one
    obs = np.append(observed[big], observed[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert chi2 < chi2_dist.ppf(1 - ALPHA, len(exp) - 1), (chi2, len(exp))
    # informative: every outcome of the rule (m = 0..K) is common
    assert np.bincount(n_accepted, minlength=k + 1).min() > 0.05 * SAMPLES


@pytest.fixture(scope="module")
def flat_engine(tmp_path_factory: pytest.TempPathFactory):
    from engine.runtime import Engine

    model_dir = write_bigram_checkpoint(tmp_path_factory.mktemp("flat"), flat_scale=0.5)
    return Engine.load(str(model_dir), draft_tokens=0), model_dir


def test_bonus_and_every_draw_respect_top_k_on_a_flat_model(flat_engine) -> None:
    """The top 3 of each row come from the checkpoint's weights in numpy (the bigram row of the
    previous token), not from engine code."""
    from safetensors.numpy import load_file

    engine, model_dir = flat_engine
    weights = load_file(str(model_dir / "model.safetensors"))
    embed = weights["model.language_model.embed_tokens.weight"].astype(np.float64)
    lm_head = weights["lm_head.weight"].astype(np.float64)

    def row(token: int) -> np.ndarray:  # the logits after ``token``
        normed = embed[token] / np.sqrt(np.mean(embed[token] ** 2) + 1e-6)
        return lm_head @ normed

    prompt = engine.tokenizer.encode("def add(a, b):")
    accepted = proposed = 0
    for k, seed in ((2, 0), (3, 1), (2, 2), (3, 3)):
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        request = GenerationRequest(prompt, params, 20, draft_tokens=k, ignore_eos=True)
        events = list(engine.generate(request))
        generated = [t for e in events for t in e.token_ids]
        accepted += events[-1].stats.accepted
        proposed += events[-1].stats.proposed
        everything = prompt + generated
        for before, token in zip(everything[len(prompt) - 1 :], generated, strict=False):
            logits = row(before)
            kept = np.sort(np.exp(logits))[-3:].sum() / np.exp(logits).sum()
            assert kept < 0.01  # flat: an untruncated draw would land outside the top 3
            assert token in np.argsort(-logits)[:3], (k, before, token)
    # the head drafts close to the target rows (~0.75 accepted over many seeds): the drafts'
    # rows are truncated like the targets', or acceptance would collapse
    assert accepted > 0.6 * proposed > 0
