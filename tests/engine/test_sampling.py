"""Sampler exactness.

* ``truncated_probs`` against an independent numpy implementation of the documented order;
* parameter validation and default resolution (generation_config -> preset/config -> request);
* end to end through the engine: the first three generated tokens are distributed the same with
  K = 1, 2, 3 as with K = 0 (chi-square homogeneity, alpha = 0.001, fixed seeds: deterministic);
* first-cycle acceptance equals the theoretical sum_y min(p(y), q(y)) of the truncated
  distributions, computed independently here;
* the first token, drafts, residual and bonus tokens all respect the truncation.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VARIANTS
from graphs import primitive_names
from reference_head import ReferenceHead
from scipy.stats import chi2 as chi2_dist
from scipy.stats import chi2_contingency

from engine.api import GenerationRequest
from sampling.acceptance import (
    accept_drafts,
    accept_drafts_rows,
    accept_drafts_with,
    accept_greedy,
    accept_greedy_rows,
)
from sampling.distribution import (
    TOP_K_BLOCK,
    PenaltyHistory,
    Truncated,
    sample,
    top_k_ids,
    truncate,
    truncated_probs,
)
from sampling.params import (
    SamplingOverrides,
    SamplingParamError,
    SamplingParams,
    generation_config_defaults,
    preset,
    resolve,
)

ALPHA = 0.001


@pytest.fixture(params=["native", "mlx"])
def truncation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each truncation test on both implementations of top_k truncation: the native op (a CPU
    with mtpserve's kernels) and mlx's compiled formulation (GPUs, and CPUs without them)."""
    import sampling.distribution as distribution
    from engine.model import products

    if request.param == "native" and not products.on_native():
        pytest.skip("the native kernel is not built")
    if request.param == "mlx":
        monkeypatch.setattr(distribution, "_native_truncation", lambda logits, params: None)
    return request.param


@pytest.fixture
def acceptance_rule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The implementation of the candidate acceptance rule a test runs, ``request.param``: the
    native op ("native", a CPU with mtpserve's kernels) or mlx's compiled formulation ("mlx",
    GPUs and CPUs without them — which a machine with the kernel would otherwise never run).
    The dense rule (no top_k) has only mlx's, so its cases run as "mlx" alone."""
    import sampling.acceptance as acceptance
    from engine.model import products

    if request.param == "native" and not products.on_native():
        pytest.skip("the native kernel is not built")
    if request.param == "mlx":
        monkeypatch.setattr(acceptance, "_native_rule", lambda draft_ids: None)
    return request.param


def assert_rule_ran(acceptance_rule: str, *outputs: mx.array) -> None:
    """The (unevaluated) graph behind an acceptance's outputs holds the native op exactly when
    the test asked for it: the path under test is the one that ran."""
    names = primitive_names(*outputs)
    assert names, "the outputs were evaluated before their graph was read"
    assert ("AcceptCandidates" in names) == (acceptance_rule == "native"), sorted(names)


DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"


def reference_probs(logits: np.ndarray, p: SamplingParams, counts=None, seen=None) -> np.ndarray:
    """Independent numpy version: penalties -> temperature -> top_k -> top_p -> min_p."""
    x = logits.astype(np.float64).copy()
    for tok, b in p.logit_bias.items():
        x[tok] += b
    if seen is not None and p.repetition_penalty != 1.0:
        x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if counts is not None:
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if p.temperature == 0 or p.top_k == 1:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    x = x / p.temperature
    if 0 < p.top_k < len(x):
        kth = np.sort(x)[-p.top_k]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(len(x), dtype=bool)
        keep[order[before < p.top_p]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


SETTINGS = {
    "temp1-topk-topp": SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
    "temp0.6-minp": SamplingParams(temperature=0.6, min_p=0.1),
    "presence-repetition": SamplingParams(
        temperature=1.0, presence_penalty=1.5, repetition_penalty=1.1
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS) + ["greedy", "bias"])
@pytest.mark.fast
def test_truncated_probs_matches_reference(name: str, truncation: str) -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 3
    params = {
        "greedy": SamplingParams(temperature=0.0),
        "bias": SamplingParams(temperature=0.8, top_p=0.5, logit_bias={7: 5.0, 9: -100.0}),
    }.get(name) or SETTINGS[name]
    history = PenaltyHistory(300, [1, 2, 3, 250])
    history.extend([5, 5, 6])
    drafts = mx.array([7, 8, 5])
    counts, seen = history.rows(drafts, 4)
    got = np.array(truncated_probs(mx.array(logits), params, (counts, seen)))
    for row in range(4):
        expected = reference_probs(logits[row], params, np.array(counts[row]), np.array(seen[row]))
        np.testing.assert_allclose(got[row], expected, atol=2e-5)
        assert np.all((got[row] > 0) == (expected > 0))


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("seed", -5),
    ],
)
@pytest.mark.fast
def test_invalid_values_are_rejected_with_the_param_named(field: str, value: float) -> None:
    with pytest.raises(SamplingParamError) as err:
        resolve(SamplingOverrides(**{field: value}), vocab_size=100)
    assert err.value.param == field


@pytest.mark.fast
def test_top_k_at_or_above_vocab_means_off() -> None:
    logits = mx.array(np.random.default_rng(1).standard_normal((1, 50)).astype(np.float32))
    off = truncated_probs(logits, SamplingParams(top_k=0))
    assert np.allclose(np.array(truncated_probs(logits, SamplingParams(top_k=50))), np.array(off))
    assert np.allclose(np.array(truncated_probs(logits, SamplingParams(top_k=500))), np.array(off))


@pytest.mark.fast
def test_defaults_resolve_checkpoint_then_preset_then_request(tiny_checkpoint: Path) -> None:
    checkpoint = generation_config_defaults(tiny_checkpoint)
    assert (checkpoint.temperature, checkpoint.top_k, checkpoint.top_p) == (1.0, 20, 0.95)
    only_temperature = resolve(checkpoint, SamplingOverrides(temperature=0.3))
    assert (only_temperature.temperature, only_temperature.top_k, only_temperature.top_p) == (
        0.3,
        20,
        0.95,
    )
    coding = resolve(checkpoint, preset("coding"), SamplingOverrides(top_p=0.5))
    assert (coding.temperature, coding.top_k, coding.top_p) == (0.6, 20, 0.5)
    assert resolve(checkpoint, preset("non-thinking")).presence_penalty == 1.5


@pytest.mark.parametrize("with_ids", [False, True])
def test_sample_draws_each_row_from_its_probabilities(with_ids: bool) -> None:
    """The inverse-CDF draw: frequencies match each row (chi-square), zero-probability tokens
    (inside the row and at its end) are never drawn, unnormalised rows are normalised; with
    candidate ids, column j stands for token ids[j]."""
    rows = np.array(
        [
            [0.1, 0.0, 0.4, 0.2, 0.3, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
            [3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        ],
        dtype=np.float32,
    )
    ids = np.array([[40, 7, 12, 3, 99, 5, 6], [1, 2, 3, 4, 5, 6, 0], [9, 8, 7, 6, 5, 4, 3]])
    n = 20000
    keys = mx.random.split(mx.random.key(5), n)
    truncated = Truncated(mx.array(rows), mx.array(ids, dtype=mx.int32) if with_ids else None)
    draws = np.array(mx.stack([sample(truncated, keys[i]) for i in range(n)]).tolist())
    for r, row in enumerate(rows):
        tokens = ids[r] if with_ids else np.arange(row.size)
        counts = np.array([(draws[:, r] == t).sum() for t in tokens])
        assert counts.sum() == n  # every draw is one of the row's tokens
        assert counts[row == 0].sum() == 0
        expected = row[row > 0] / row.sum() * n
        chi2 = ((counts[row > 0] - expected) ** 2 / expected).sum()
        assert chi2 < 20.5  # at most 4 degrees of freedom, alpha 0.001


@pytest.mark.fast
def test_keyed_uniforms_are_uniform_independent_and_fixed_by_seed_position_purpose() -> None:
    """Every random number of a sequence is ``keyed_uniform(seed, position, purpose)``: over
    positions the values are uniform (chi-square over 20 bins) and uncorrelated between
    neighbouring positions and between purposes; the same key always gives the same value,
    and another seed, position or purpose another one."""
    from sampling.distribution import ACCEPT, DRAFT, EMIT, keyed_uniform, keyed_uniforms

    n = 20000
    draws = {
        purpose: np.array(keyed_uniforms(7, range(n), purpose).tolist())
        for purpose in (DRAFT, ACCEPT, EMIT)
    }
    for u in draws.values():
        assert ((u > 0) & (u < 1)).all()
        counts = np.histogram(u, bins=20, range=(0, 1))[0]
        expected = n / 20
        assert ((counts - expected) ** 2 / expected).sum() < chi2_dist.ppf(1 - ALPHA, 19)
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.04  # |r| < 4 / sqrt(n)
    assert abs(np.corrcoef(draws[DRAFT], draws[EMIT])[0, 1]) < 0.04
    assert abs(np.corrcoef(draws[ACCEPT], draws[EMIT])[0, 1]) < 0.04
    assert keyed_uniform(7, 123, EMIT) == pytest.approx(draws[EMIT][123], abs=1e-7)
    other_seed = np.array(keyed_uniforms(8, range(n), EMIT).tolist())
    assert (other_seed != draws[EMIT]).mean() > 0.99


@pytest.mark.fast
def test_top_k_candidates_are_in_token_order(truncation: str) -> None:
    """A draw walks a row's candidates in column order, so the order must not move with the
    last bits of the logits (a batch row's can differ from the same row's alone): each row's
    candidates come in increasing token order, and the same uniforms draw the same tokens from
    logits perturbed by rounding-sized noise."""
    from sampling.distribution import draw_tokens_with

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64, 4096)).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=40)
    rows = truncate(mx.array(logits), params)
    ids = np.array(rows.ids)
    assert (np.diff(ids, axis=-1) > 0).all()
    nudged = truncate(mx.array(logits + rng.standard_normal(logits.shape) * 1e-6), params)
    assert (np.array(nudged.ids) == ids).all()
    uniforms = mx.array(rng.random(64).astype(np.float32))
    drawn = draw_tokens_with(rows.probs, rows.ids, uniforms)
    assert drawn.tolist() == draw_tokens_with(nudged.probs, nudged.ids, uniforms).tolist()


@pytest.mark.fast
def test_top_k_ids_are_the_k_largest() -> None:
    """The two-stage (blocked) top-k selects the k largest logits of every row: on random rows,
    on rows with half the vocabulary at -inf (a draft vocabulary), with many ties (the kept
    values are the k largest as a multiset), and on a vocabulary that is not a multiple of the
    block (the one-stage fallback)."""
    rng = np.random.default_rng(4)
    vocab = 64 * TOP_K_BLOCK
    random_rows = rng.standard_normal((5, vocab)).astype(np.float32)
    masked = random_rows.copy()
    masked[:, rng.permutation(vocab)[: vocab // 2]] = -np.inf
    ties = rng.integers(0, 50, (5, vocab)).astype(np.float32)
    odd = rng.standard_normal((3, vocab + 5)).astype(np.float32)
    for rows in (random_rows, masked, ties, odd):
        for k in (1, 20, 32):
            got = np.array(top_k_ids(mx.array(rows), k))
            assert got.dtype == np.int32 and got.shape == (rows.shape[0], k)
            for row, ids in zip(rows, got, strict=True):
                assert len(set(ids.tolist())) == k
                np.testing.assert_array_equal(np.sort(row[ids]), np.sort(row)[-k:])


@pytest.mark.fast
def test_candidate_rows_match_the_whole_vocabulary(truncation: str) -> None:
    """With top_k, ``truncate`` keeps the k candidates (ids and probabilities); spread over the
    vocabulary they are the rows of the reference truncation, and without top_k the rows are
    the whole vocabulary (ids None)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 64 * TOP_K_BLOCK)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.8)
    rows = truncate(mx.array(logits), params)
    assert rows.ids is not None and rows.ids.shape == (3, 20)
    dense = np.array(rows.dense(logits.shape[1]))
    for r in range(3):
        np.testing.assert_allclose(dense[r], reference_probs(logits[r], params), atol=2e-5)
    assert truncate(mx.array(logits), SamplingParams(temperature=0.9, top_p=0.8)).ids is None


@pytest.mark.fast
def test_greedy_acceptance_over_rows_is_each_rows_own() -> None:
    """``accept_greedy_rows`` gives each row what ``accept_greedy`` gives it alone, and both
    follow the rule: accept while draft i equals target i, then emit the target there."""
    rng = np.random.default_rng(3)
    for k in (1, 2, 4):
        targets = rng.integers(0, 3, (16, k + 1)).astype(np.int32)
        drafts = rng.integers(0, 3, (16, k)).astype(np.int32)
        drafts[0] = targets[0, :k]  # every draft accepted: the bonus is emitted
        n_rows, next_rows = accept_greedy_rows(mx.array(drafts), mx.array(targets))
        for b in range(16):
            n = next(i for i in range(k + 1) if i == k or drafts[b, i] != targets[b, i])
            n_one, next_one = accept_greedy(mx.array(drafts[b]), mx.array(targets[b]))
            assert n_rows[b].item() == n_one.item() == n
            assert next_rows[b].item() == next_one.item() == targets[b, n]


@pytest.mark.fast
@pytest.mark.parametrize(
    ("top_k", "acceptance_rule"),
    [(0, "mlx"), (6, "native"), (6, "mlx")],
    indirect=["acceptance_rule"],
)
def test_sampled_acceptance_over_rows_is_each_rows_own(top_k: int, acceptance_rule: str) -> None:
    """``accept_drafts_rows`` gives each row, bit for bit, what ``accept_drafts_with`` gives
    it alone, at K = 1..4, with every count of accepted drafts 0..K met; under top_k by the
    native op and by mlx's formulation."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=1.0, top_k=top_k)
    rows, vocab = 32, 12
    for k in (1, 2, 4):
        sharp = np.where(rng.random((rows, 1, 1)) < 0.5, 1.0, 4.0)  # some rows accept all
        base = rng.standard_normal((rows, 1, vocab)) * sharp
        p_logits = (base + 0.3 * rng.standard_normal((rows, k + 1, vocab))).astype(np.float32)
        q_logits = (base + 0.3 * rng.standard_normal((rows, k, vocab))).astype(np.float32)
        p = truncate(mx.array(p_logits.reshape(-1, vocab)), params)
        q = truncate(mx.array(q_logits.reshape(-1, vocab)), params)
        width = p.probs.shape[-1]
        drafts = mx.array(rng.integers(0, vocab, (rows, k)).astype(np.int32))
        if q.ids is not None:  # drafts among q's candidates, as a draw makes them
            pick = mx.array(rng.integers(0, top_k, (rows * k, 1)).astype(np.int32))
            drafts = mx.take_along_axis(q.ids, pick, axis=-1).reshape(rows, k)
        u_accept = mx.array(rng.random((rows, k)).astype(np.float32))
        u_emit = mx.array(rng.random((rows, k + 1)).astype(np.float32))
        n_rows, next_rows = accept_drafts_rows(
            drafts,
            q.probs.reshape(rows, k, width),
            None if q.ids is None else q.ids.reshape(rows, k, width),
            p.probs.reshape(rows, k + 1, width),
            None if p.ids is None else p.ids.reshape(rows, k + 1, width),
            u_accept,
            u_emit,
        )
        assert_rule_ran(acceptance_rule, n_rows, next_rows)
        seen = set()
        for b in range(rows):
            mine_q, mine_p = slice(b * k, (b + 1) * k), slice(b * (k + 1), (b + 1) * (k + 1))
            one_q = Truncated(q.probs[mine_q], None if q.ids is None else q.ids[mine_q])
            one_p = Truncated(p.probs[mine_p], None if p.ids is None else p.ids[mine_p])
            n, token = accept_drafts_with(drafts[b], one_q, one_p, u_accept[b], u_emit[b])
            if b == 0:
                assert_rule_ran(acceptance_rule, n, token)
            assert (n_rows[b].item(), next_rows[b].item()) == (n.item(), token.item()), b
            seen.add(n.item())
        assert seen == set(range(k + 1)), f"K={k}: accepted counts met {sorted(seen)}"


@pytest.mark.parametrize(
    ("candidates", "acceptance_rule"),
    [(False, "mlx"), (True, "native"), (True, "mlx")],
    indirect=["acceptance_rule"],
)
def test_acceptance_rule_reproduces_target_distribution(
    candidates: bool, acceptance_rule: str
) -> None:
    """Unit check of accept_drafts: emitted first token ~ p_1 whatever q is, and a draft is
    accepted with probability sum_y min(p_1(y), q_1(y)). With candidate rows, p and q hold
    different, partly overlapping token sets (in different orders): a residual or an acceptance
    that read the wrong column would show — by the native op and by mlx's formulation."""
    rng = np.random.default_rng(3)
    v, width = 10, 6
    if candidates:
        p_ids = np.array([[5, 0, 3, 1, 2, 4], [9, 8, 7, 6, 5, 4]])
        q_ids = np.array([[8, 3, 6, 4, 7, 5]])
    else:
        p_ids, q_ids = np.tile(np.arange(v), (2, 1)), np.arange(v)[None]
    p_rows = rng.dirichlet(np.ones(p_ids.shape[1]), size=2).astype(np.float32)
    q_rows = rng.dirichlet(np.ones(q_ids.shape[1]), size=1).astype(np.float32)
    p, q = np.zeros((2, v), np.float32), np.zeros((1, v), np.float32)
    np.put_along_axis(p, p_ids, p_rows, axis=1)
    np.put_along_axis(q, q_ids, q_rows, axis=1)
    assert not candidates or (p_ids.shape[1], q_ids.shape[1]) == (width, width)
    target = Truncated(mx.array(p_rows), mx.array(p_ids, dtype=mx.int32) if candidates else None)
    draft = Truncated(mx.array(q_rows), mx.array(q_ids, dtype=mx.int32) if candidates else None)
    n = 20000
    keys = mx.random.split(mx.random.key(0), n)
    draft_keys = mx.random.split(mx.random.key(1), n)
    drafts = mx.random.categorical(mx.log(mx.array(q))[0], shape=(n,), key=draft_keys[0])
    counts = np.zeros(v)
    accepted = 0
    for i in range(n):
        d = drafts[i : i + 1].astype(mx.int32)
        m, nxt = accept_drafts(d, draft, target, keys[i])
        if i == 0:
            assert_rule_ran(acceptance_rule, m, nxt)
        m = m.item()
        first = d.item() if m >= 1 else nxt.item()
        counts[first] += 1
        accepted += m
    assert counts[p[0] == 0].sum() == 0
    support = p[0] > 0
    expected = p[0][support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < chi2_dist.ppf(1 - ALPHA, support.sum() - 1)
    theory = np.minimum(p[0], q[0]).sum()
    assert 0.1 < theory < 0.9
    assert abs(accepted / n - theory) < 4 * np.sqrt(theory * (1 - theory) / n)


#: plain (K=0) samples by model, prompt, settings and size: deterministic (seeded), and drawn
#: by several tests (speculative, penalised and batched sampling are each compared with them)
_PLAIN_SAMPLES: dict[tuple, np.ndarray] = {}


def _first_tokens(
    engine, prompt: list[int], params: SamplingParams, k: int, n: int, counts: list | None = None
) -> np.ndarray:
    """The first three tokens of n seeded generations; ``counts`` (if given) collects
    [accepted, proposed] drafts."""
    key = (str(engine.loaded.model_dir), tuple(prompt), repr(params), n)
    if k == 0 and counts is None and key in _PLAIN_SAMPLES:
        return _PLAIN_SAMPLES[key]
    rows = []
    for seed in range(n):
        request = GenerationRequest(
            prompt,
            SamplingParams(**{**params.__dict__, "seed": seed}),
            3,
            draft_tokens=k,
            ignore_eos=True,
        )
        tokens = []
        for event in engine.generate(request):
            tokens += event.token_ids
        if counts is not None:
            counts[0] += event.stats.accepted
            counts[1] += event.stats.proposed
        rows.append(tokens[:3])
    if k == 0 and counts is None:
        _PLAIN_SAMPLES[key] = np.array(rows)
    return np.array(rows)


def _homogeneity_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity of two samples of categories; rare categories pooled."""
    cats, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = cats[counts >= 10]
    table = [
        [int(np.sum(s == c)) for c in common] + [int(np.sum(~np.isin(s, common)))] for s in (a, b)
    ]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table)[1])


@pytest.fixture(scope="module")
def demo_engine():
    """The shipped demo model: a trained trunk and head, so sampled distributions are spread
    out and drafts are accepted about half the time. (The random test checkpoints are either
    nearly deterministic under these settings or accept almost nothing, which would leave the
    test below unable to fail, or exercising only the residual path.)

    With the conversation cache on: the tests here run the same short prompt thousands of
    times, and after the first its prefill is restored (exact against a cold run:
    tests/engine/test_prefix_cache.py), so each generation costs its cycles, not a prefill."""
    from engine.runtime import Engine

    engine = Engine.load(str(DEMO_MODEL), draft_tokens=0)
    engine.enable_prefix_cache(64 << 20)
    return engine


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_matches_plain_sampling(demo_engine, name: str) -> None:
    prompt = demo_engine.tokenizer.encode("def add(a, b):")
    # 400 seeds per K: the chi-square's false-alarm rate is ALPHA at any n. The sharp tests of
    # the acceptance rule itself are exact and fast (test_acceptance_exact.py); this is their
    # end-to-end check on the real engine, sized for the suite's time budget.
    n = 400
    plain = _first_tokens(demo_engine, prompt, SETTINGS[name], 0, n)
    # informative: no position is (nearly) deterministic
    assert all(np.bincount(plain[:, i]).max() < 0.8 * n for i in range(3))
    for k in (1, 2, 3, 4) if name == "temp1-topk-topp" else (1, 2, 3):
        counts = [0, 0]
        spec = _first_tokens(demo_engine, prompt, SETTINGS[name], k, n, counts)
        # both paths of the rule ran often: acceptances and rejections (residual draws)
        assert 0.15 < counts[0] / counts[1] < 0.85, counts
        for position in range(3):
            p = _homogeneity_pvalue(plain[:, position], spec[:, position])
            assert p > ALPHA, f"K={k} position {position + 1}: p={p:.2g}"


def counted_entropy(monkeypatch: pytest.MonkeyPatch, start: int) -> None:
    """Unseeded requests take their seed from ``os.urandom``: count instead, so that a test of
    the unseeded path is as deterministic as the seeded ones."""
    from engine.cycle import sequence

    counter = iter(range(start, start + 1_000_000))
    monkeypatch.setattr(sequence, "_entropy", lambda: next(counter).to_bytes(7, "little"))


def test_unseeded_speculative_sampling_matches_plain_sampling(
    demo_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests without a seed draw from a random seed by the same keyed rule: their first
    three tokens at K = 1..4 against plain seeded sampling, as the test above (a fresh seed per
    request; the seeds counted, not random, so that the test is deterministic)."""
    counted_entropy(monkeypatch, 1 << 40)
    prompt = demo_engine.tokenizer.encode("def add(a, b):")
    params = SETTINGS["temp1-topk-topp"]
    n = 400
    plain = _first_tokens(demo_engine, prompt, params, 0, n)
    for k in (1, 2, 3, 4):
        accepted = proposed = 0
        rows = []
        for _ in range(n):
            request = GenerationRequest(prompt, params, 3, draft_tokens=k, ignore_eos=True)
            events = list(demo_engine.generate(request))
            rows.append([t for e in events for t in e.token_ids][:3])
            accepted += events[-1].stats.accepted
            proposed += events[-1].stats.proposed
        assert 0.15 < accepted / proposed < 0.85, (accepted, proposed)
        spec = np.array(rows)
        for position in range(3):
            p = _homogeneity_pvalue(plain[:, position], spec[:, position])
            assert p > ALPHA, f"K={k} position {position + 1}: p={p:.2g}"


@pytest.mark.fast
def test_top_k_one_equals_greedy_exactly(load_engine) -> None:
    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode("The quick brown fox")
    greedy = [
        t
        for e in engine.generate(
            GenerationRequest(
                prompt, SamplingParams(temperature=0.0), 60, draft_tokens=0, ignore_eos=True
            )
        )
        for t in e.token_ids
    ]
    for k in (0, 1, 3):
        params = SamplingParams(temperature=1.3, top_k=1, seed=k)
        out = [
            t
            for e in engine.generate(
                GenerationRequest(prompt, params, 60, draft_tokens=k, ignore_eos=True)
            )
            for t in e.token_ids
        ]
        assert out == greedy


def _reference_distributions(engine, model_dir: Path, prompt: list[int], params: SamplingParams):
    """p (trunk at the last prompt position) and q (head on the pair (h_{n-2}, x_{n-1})),
    truncated by the numpy reference — no engine code involved."""
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    lm = model.language_model
    hidden = lm.model(mx.array(prompt)[None])
    logits = lm(mx.array(prompt)[None])[0, -1]
    ref = ReferenceHead(model_dir)
    h = np.array(hidden[0]).astype(np.float64)
    p = reference_probs(np.array(logits), params)
    head_logits = ref.step_logits(h, prompt)
    q = reference_probs(head_logits, params)
    return p, q, np.array(logits), head_logits


@pytest.mark.parametrize(
    "variant,temperature", [("dense-tied", 1.0), ("dense-untied-sharded", 2.0)]
)
def test_first_cycle_acceptance_equals_overlap_of_truncated_distributions(
    load_engine, make_checkpoint, variant: str, temperature: float
) -> None:
    engine = load_engine(variant, draft_tokens=0)
    prompt = engine.tokenizer.encode("The quick")
    params = SamplingParams(temperature=temperature, top_k=20, top_p=0.95)
    p, q, _, _ = _reference_distributions(
        engine, make_checkpoint(VARIANTS[variant]), prompt, params
    )
    theory = float(np.minimum(p, q).sum())
    n, accepted = 1000, 0
    for seed in range(n):
        trace: list[dict] = []
        request = GenerationRequest(
            prompt,
            SamplingParams(**{**params.__dict__, "seed": seed}),
            2,
            draft_tokens=1,
            ignore_eos=True,
        )
        for _ in engine.generate(request, trace=trace.append):
            pass
        assert trace[0]["context_len"] == len(prompt) and len(trace[0]["draft"]) == 1
        accepted += trace[0]["accepted"]
    sigma = np.sqrt(theory * (1 - theory) / n)
    assert 0.05 < theory < 0.95, "pick a prompt where acceptance is informative"
    assert abs(accepted / n - theory) < 4 * sigma, (accepted / n, theory)


def test_every_emitted_and_drafted_token_respects_truncation(load_engine, make_checkpoint) -> None:
    """top_k=3 at a high temperature: an untruncated first/bonus/residual draw or draft would
    often fall outside the top 3 — so any path that skipped truncation fails this."""
    from mlx_lm.utils import load_model

    variant = VARIANTS["dense-untied-sharded"]
    model_dir = make_checkpoint(variant)
    engine = load_engine(variant.name, draft_tokens=0)
    model, _ = load_model(model_dir)
    ref = ReferenceHead(model_dir)
    prompt = engine.tokenizer.encode("def add(a, b):")
    params = dict(temperature=2.0, top_k=3)
    drafts_checked = emitted_checked = 0
    for seed in range(12):
        trace: list[dict] = []
        request = GenerationRequest(
            prompt, SamplingParams(**params, seed=seed), 30, draft_tokens=3, ignore_eos=True
        )
        generated = [t for e in engine.generate(request, trace=trace.append) for t in e.token_ids]
        everything = prompt + generated
        logits = np.array(model.language_model(mx.array(everything)[None])[0])
        hidden = np.array(model.language_model.model(mx.array(everything)[None])[0]).astype(
            np.float64
        )
        for position in range(len(prompt), len(everything)):
            top3 = set(np.argsort(-logits[position - 1])[:3].tolist())
            assert everything[position] in top3
            emitted_checked += 1
        for line in trace:
            c = line["context_len"]
            if line["draft"]:
                head_logits = ref.step_logits(hidden, everything[:c])
                assert line["draft"][0] in set(np.argsort(-head_logits)[:3].tolist())
                drafts_checked += 1
    assert emitted_checked == 12 * 30 and drafts_checked > 50


def test_generation_config_defaults_reach_generation(tmp_path: Path, make_checkpoint) -> None:
    """A checkpoint whose generation_config says top_k=1 decodes greedily when the user sets
    nothing — and the request can still override it."""
    import shutil

    from engine.runtime import Engine

    src = make_checkpoint(VARIANTS["dense-tied"])
    dst = tmp_path / "topk1"
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    engine = Engine.load(str(dst), draft_tokens=2)
    prompt = engine.tokenizer.encode("def add(a, b):")

    def run(overrides: SamplingOverrides) -> list[int]:
        params = resolve(engine.sampling_defaults, overrides)
        request = GenerationRequest(prompt, params, 40, draft_tokens=2, ignore_eos=True)
        return [t for e in engine.generate(request) for t in e.token_ids]

    greedy = run(SamplingOverrides(temperature=0.0))
    assert run(SamplingOverrides(seed=1)) == greedy
    assert run(SamplingOverrides(seed=2)) == greedy
    sampled = {tuple(run(SamplingOverrides(top_k=0, seed=s))) for s in range(4)}
    assert len(sampled) > 1


def test_speculative_sampling_with_a_draft_vocabulary_matches_plain(demo_engine) -> None:
    """q restricted to a token subset is still an exact draft distribution: with the demo
    model drafting over its 256 most frequent tokens, a fifth of the emitted tokens lie outside
    the subset (only residual draws can produce them), and the first three tokens are
    distributed as with plain sampling."""
    demo_engine.set_draft_vocab(256)
    try:
        subset = set(
            json.loads((DEMO_MODEL / "draft_vocab.json").read_text())["ids_by_frequency"][:256]
        )
        prompt = demo_engine.tokenizer.encode("The quick")
        params = SamplingParams(temperature=1.0, top_k=40)
        plain = _first_tokens(demo_engine, prompt, params, 0, 700)
        counts = [0, 0]
        spec = _first_tokens(demo_engine, prompt, params, 2, 700, counts)
    finally:
        demo_engine.set_draft_vocab(None)  # the checkpoint's default, for the other tests
    assert 0.15 < counts[0] / counts[1] < 0.85, counts
    assert np.mean([t not in subset for t in spec.ravel()]) > 0.05
    for position in range(3):
        p = _homogeneity_pvalue(plain[:, position], spec[:, position])
        assert p > ALPHA, f"position {position + 1}: p={p:.2g}"
