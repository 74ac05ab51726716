"""Engine exactness: greedy speculative output equals plain decoding, drafts equal an
independent reference head, and every kind of stop leaves the caches consistent."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VARIANTS, Variant, write_checkpoint
from reference_head import ReferenceHead

from engine.api import GenerationRequest
from engine.model import products
from engine.runtime import Engine
from sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "class Point:\n    def __init__(self, x, y):",
]

#: tests of the products' path without the native kernel (row by row, column parts on streams):
#: `make test` runs this file a second time with MTPSERVE_NATIVE_PRODUCTS=0
mlx_products_only = pytest.mark.skipif(
    products.on_native(), reason="mlx's products only; `make test` runs them without the kernel"
)


def greedy_request(
    prompt_ids: list[int], k: int | None, max_tokens: int, **kw
) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt_ids, sampling=GREEDY, max_tokens=max_tokens, draft_tokens=k, **kw
    )


def run(
    engine: Engine, request: GenerationRequest, trace: list | None = None
) -> tuple[list[int], object]:
    tokens: list[int] = []
    event = None
    for event in engine.generate(request, trace=trace.append if trace is not None else None):
        tokens += event.token_ids
    return tokens, event


def assert_invariant(seq) -> None:
    """Caches hold exactly tokens[:-1]: trunk positions, head cache + pending head pairs."""
    n = len(seq.tokens) - 1
    assert seq.trunk_cache.length == n
    if seq.head_cache is not None:
        pending = sum(h.shape[1] for h in seq.head_pending)
        assert seq.head_cache.offset + seq.head_skipped + pending == n


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=pytest.mark.fast if v == "dense-tied" else ()) for v in VARIANTS],
)
def test_greedy_speculative_equals_plain(load_engine, variant: str) -> None:
    engine = load_engine(variant, draft_tokens=0)
    proposed = accepted = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain, _ = run(engine, greedy_request(ids, 0, 200, ignore_eos=True))
        assert len(plain) == 200
        for k in range(1, 5):
            spec, event = run(engine, greedy_request(ids, k, 200, ignore_eos=True))
            assert spec == plain, f"K={k} differs from plain greedy decoding"
            proposed += event.stats.proposed
            accepted += event.stats.accepted
    # Both paths of the cycle ran: some drafts accepted, some rejected.
    assert 0 < accepted < proposed


@pytest.mark.parametrize("variant", ["dense-tied", "dense-untied-sharded", "moe-tied"])
@pytest.mark.parametrize("k", [1, 2])
def test_drafts_match_independent_reference_head(
    load_engine, make_checkpoint, variant: str, k: int
) -> None:
    from mlx_lm.utils import load_model

    engine = load_engine(variant, draft_tokens=0)
    model_dir = make_checkpoint(VARIANTS[variant])
    reference = ReferenceHead(model_dir)
    plain_model, _ = load_model(model_dir)  # mlx-lm's own trunk: post-norm hidden states
    prompt = engine.tokenizer.encode(PROMPTS[0])
    trace: list[dict] = []
    generated, _ = run(engine, greedy_request(prompt, k, 40, ignore_eos=True), trace)
    everything = prompt + generated
    checked = 0
    for line in trace:
        if not line["draft"]:
            continue
        c = line["context_len"]
        fixed = everything[:c]
        hidden = plain_model.language_model.model(mx.array(fixed[:-1])[None])
        hidden = np.array(hidden[0].astype(mx.float32)).astype(np.float64)
        assert reference.drafts(hidden, fixed, len(line["draft"])) == line["draft"]
        checked += 1
    assert checked >= 10


@pytest.mark.fast
def test_trace_indices_follow_the_contract(tiny_engine) -> None:
    """draft[j] proposes the token at index c+j; accepted drafts are what was emitted."""
    prompt = tiny_engine.tokenizer.encode(PROMPTS[1])
    trace: list[dict] = []
    generated, _ = run(tiny_engine, greedy_request(prompt, 3, 60, ignore_eos=True), trace)
    everything = prompt + generated
    for line in trace:
        c, n = line["context_len"], line["accepted"]
        assert everything[c : c + len(line["emitted"])] == line["emitted"]
        assert line["draft"][:n] == everything[c : c + n]
        if n < len(line["draft"]):
            assert line["draft"][n] != everything[c + n]


def started(engine, request):
    """A sequence prefilled with the request's prompt, drafting unless the request is plain."""
    return engine.new_sequence(request.prompt_ids, request.sampling, request.draft_tokens != 0)


@pytest.mark.parametrize("k", [0, 1, 3, pytest.param(None, marks=pytest.mark.fast)])
def test_stop_at_every_point_keeps_caches_consistent(load_engine, k: int | None) -> None:
    """max_tokens and EOS at every position (inside draft blocks too), and a consumer that stops
    early: the caches hold exactly prompt+emitted (minus the last), and continuing gives what a
    fresh run on prompt+emitted gives. K=0 and auto K (None) run plain cycles one ahead: a stop
    must undo the cycle launched past it."""
    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[2])
    reference, _ = run(engine, greedy_request(prompt, 0, 24, ignore_eos=True))

    def check_continuation(seq) -> None:
        assert_invariant(seq)
        so_far = list(seq.tokens)
        cont = greedy_request(so_far, k, 12, ignore_eos=True)
        continued = [t for e in engine.decode(seq, cont) for t in e.token_ids]
        fresh, _ = run(engine, greedy_request(so_far, 0, 12, ignore_eos=True))
        assert continued == fresh
        assert_invariant(seq)

    for max_tokens in range(1, 10):
        request = greedy_request(prompt, k, max_tokens, ignore_eos=True)
        seq = started(engine, request)
        events = list(engine.decode(seq, request))
        assert events[-1].finish_reason == "length"
        assert seq.tokens == prompt + reference[:max_tokens]
        check_continuation(seq)

    for position in range(1, 12):
        eos = reference[position]
        if eos in reference[:position]:
            continue
        request = greedy_request(prompt, k, 40, stop_token_ids=frozenset({eos}))
        seq = started(engine, request)
        events = list(engine.decode(seq, request))
        assert events[-1].finish_reason == "stop"
        assert seq.tokens == prompt + reference[: position + 1]
        check_continuation(seq)

    request = greedy_request(prompt, k, 40, ignore_eos=True)
    seq = started(engine, request)
    stream = engine.decode(seq, request)
    next(stream)
    stream.close()  # the consumer walks away after the first event
    check_continuation(seq)


@pytest.mark.parametrize("k", [0, 3, None])
def test_draft_marking_is_exact_at_every_stop(load_engine, k: int | None) -> None:
    """Each event marks its tokens: drafts the trunk accepted, then the trunk's own token, cut
    at a stop (EOS inside a draft block, max_tokens, or a plain cycle run one ahead); the
    marked count is ``stats.accepted`` and the per-event K is ``stats.k_histogram``."""
    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    reference, _ = run(engine, greedy_request(prompt, 0, 16, ignore_eos=True))
    requests = [greedy_request(prompt, k, n, ignore_eos=True) for n in (1, 5, 16)]
    requests += [
        greedy_request(prompt, k, 40, stop_token_ids=frozenset({reference[p]}))
        for p in range(1, 12)
        if reference[p] not in reference[:p]
    ]
    saw_cut = False
    for request in requests:
        trace: list[dict] = []
        events = list(engine.generate(request, trace=trace.append))
        stats = events[-1].stats
        assert len(events) == len(trace)
        histogram = [0] * len(stats.k_histogram)
        for event, line in zip(events, trace, strict=True):
            n = sum(event.drafted)
            assert len(event.drafted) == len(event.token_ids)
            assert event.drafted == [True] * n + [False] * (len(event.drafted) - n)
            assert event.cycle_draft_tokens == len(line["draft"])
            assert event.token_ids[:n] == line["draft"][:n]
            assert n == min(line["accepted"], len(event.token_ids))
            saw_cut |= n < line["accepted"]
            histogram[event.cycle_draft_tokens] += 1
        assert sum(sum(e.drafted) for e in events) == stats.accepted
        assert histogram == stats.k_histogram
        assert sum(len(e.token_ids) for e in events) == stats.completion_tokens
    if k == 3:
        assert saw_cut, "no EOS fell inside an accepted draft block: the cut went untested"


@pytest.mark.parametrize("k", [0, None])
def test_plain_look_ahead_changes_no_token(load_engine, k: int | None) -> None:
    """Plain cycles launched one ahead (the default) emit exactly what cycles run one at a
    time emit (profiling disables the look-ahead): same seed, sampled with penalties (whose
    history then counts device tokens not yet read back), greedy, and auto K's mix."""
    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    # This checkpoint's logits are steep (std ~10): a high temperature makes draws vary and
    # the penalties change them (checked below), so a history missing a token would show.
    sampled = SamplingParams(
        temperature=8.0, top_k=40, presence_penalty=2.0, repetition_penalty=3.0, seed=2
    )
    unpenalised = SamplingParams(temperature=8.0, top_k=40, seed=2)

    def tokens(params: SamplingParams, profile: bool) -> list[int]:
        engine.profile = profile
        try:
            request = GenerationRequest(prompt, params, 60, draft_tokens=k, ignore_eos=True)
            return run(engine, request)[0]
        finally:
            engine.profile = False

    for params in (sampled, GREEDY):
        ahead = tokens(params, profile=False)
        assert ahead == tokens(params, profile=True) and len(ahead) == 60
    assert tokens(sampled, False) != tokens(unpenalised, False)


def test_confidence_cut_with_penalties_runs(load_engine) -> None:
    """A draft-confidence cut drafts fewer than K tokens; with penalties the verify pass's
    history rows must follow the drafts made (they followed the K asked for and crashed)."""
    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    penalised = [
        SamplingParams(temperature=1.0, top_k=40, presence_penalty=1.0, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    engine.draft_confidence = 0.9
    try:
        for params in penalised:
            trace: list[dict] = []
            request = GenerationRequest(prompt, params, 40, draft_tokens=3, ignore_eos=True)
            tokens, _ = run(engine, request, trace)
            assert len(tokens) == 40
            assert any(0 < len(line["draft"]) < 3 for line in trace)  # the cut happened
    finally:
        engine.draft_confidence = None


def test_a_request_asks_for_automatic_k_whatever_the_engines_default(load_engine) -> None:
    """``draft_tokens="auto"`` is automatic K on an engine loaded with a fixed K (None is
    that default): the cycles choose K themselves, and the text is what auto K gives on an
    engine whose default is automatic."""
    fixed = load_engine("dense-tied", draft_tokens=2)
    assert fixed.policy(None).fixed == 2
    assert fixed.policy("auto").fixed is None and fixed.policy("auto").chooser is not None
    prompt = fixed.tokenizer.encode(PROMPTS[0])
    tokens, event = run(fixed, GenerationRequest(prompt, GREEDY, 24, draft_tokens="auto"))
    auto, _ = run(load_engine("dense-tied"), GenerationRequest(prompt, GREEDY, 24))
    assert tokens == auto
    histogram = event.stats.k_histogram
    assert histogram[2] < sum(histogram)  # not the engine's fixed K=2 in every cycle


def test_seeded_auto_k_request_gives_the_same_text_every_run(load_engine) -> None:
    """Auto K follows the machine's timings; a seeded sampled request under it chooses its K
    from the plan measured once for the build and machine and from its own draws alone
    (``EngineAutoK.seeded_plan``), and its draws are keyed by (seed, position), so its text
    and its K per cycle are the same on every run. Three runs with the unseeded kind's
    calibration skewed between them (as a slow spell of the machine would), each with a fresh
    auto K that reads the plan back from the cache."""
    from engine.scheduling.autok import SeededPlan
    from engine.scheduling.costs import seeded_plan_path

    engine = load_engine("dense-untied-sharded")
    prompt = engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=8.0, top_k=40, presence_penalty=0.5, seed=11)
    request = GenerationRequest(prompt, params, 48, draft_tokens=None, ignore_eos=True)
    runs = []
    for calibration in ([1.0, 1.0], [0.3, 3.0], [3.0, 0.3]):  # as measured, plain, drafting
        engine.autok = None  # a fresh auto K each run: only the cache carries the plan
        engine.policy(None, SamplingParams(temperature=1.0))  # the sampled kind's costs exist
        engine.autok.kinds["sampled"].calibration = calibration
        tokens, event = run(engine, request)
        runs.append((tokens, event.stats.k_histogram))
    assert runs[0] == runs[1] == runs[2] and len(runs[0][0]) == 48
    record = json.loads(seeded_plan_path(engine).read_text())
    assert engine.autok.seeded_plan(params) == SeededPlan(**record)


def test_seeded_plan_is_measured_on_the_probe_texts(load_engine, monkeypatch, tmp_path) -> None:
    """The seeded plan comes from the model's own acceptance on fixed texts, not from the prior:
    the probe counts a_i (draft i accepted given 1..i-1 were) as the request's stats do and
    repeats itself exactly (keyed draws). Its cycles are timed through the decode loop, and
    the K a seeded request starts at is the one those times and that acceptance favour, not
    the cost table's: drafts always accepted favour the longest K, drafts never accepted K=0,
    whatever the table says."""
    from engine.scheduling import autok
    from engine.scheduling.costs import MAX_AUTO_K, CostTable

    engine = load_engine("dense-untied-sharded")
    params = SamplingParams(temperature=1.0, top_k=20, seed=0)
    cycles = 6
    probed = autok.probe_acceptance(engine, params, cycles)
    assert autok.probe_acceptance(engine, params, cycles) == probed
    texts = len(autok.ACCEPTANCE_PROBE_TEXTS)
    # No timed cycle is its request's last: that one has no cycle launched behind it and
    # reads back early (its time would pull a plain median down).
    finished: list[bool] = []
    decode = engine.decode

    def watched(*args: Any) -> Iterator[Any]:
        for event in decode(*args):
            finished.append(event.finish_reason is not None)
            yield event

    monkeypatch.setattr(engine, "decode", watched)
    for k in (0, 2):
        timed: list[tuple[int, int, float]] = []
        autok.time_probe_cycles(engine, params, k, timed, cycles)
        assert len(timed) == texts * (cycles - autok.PROBE_WARM_CYCLES)
        assert all(j == k and t > 0 for j, _, t in timed)
        assert k > 0 or all(n == 1 for _, n, _ in timed)  # plain cycles commit one token
    assert len(finished) == 2 * texts * cycles and not any(finished)
    monkeypatch.undo()

    counts = autok.AcceptanceCounts()
    for text in autok.ACCEPTANCE_PROBE_TEXTS:  # each text's stats after `cycles` cycles
        seq = engine.new_sequence(list(engine.tokenizer.encode(text)), params, draft=True)
        request = GenerationRequest(
            seq.tokens, params, 200, draft_tokens=MAX_AUTO_K, ignore_eos=True
        )
        events = engine.decode(seq, request)
        drafting = (e.stats for e in events if e.cycle_draft_tokens)
        for _ in range(cycles):
            stats = copy.deepcopy(next(drafting))  # a running request's stats change: a copy
        events.close()
        assert stats is not None and stats.k_histogram[MAX_AUTO_K] == cycles
        revealed = [cycles, *stats.accepted_per_position[: MAX_AUTO_K - 1]]
        for i in range(MAX_AUTO_K):
            counts.hits[i] += stats.accepted_per_position[i]
            counts.trials[i] += revealed[i]
    assert probed == pytest.approx(counts.estimates())

    def probe(*_, acceptance, **__) -> list[float]:
        return acceptance

    order: list[int] = []

    def time_cycles(_engine, _params, k, timings, *_, **__) -> None:
        order.append(k)
        timings.append((k, 1, 1.0 + 0.1 * k))

    monkeypatch.setattr(autok, "time_probe_cycles", time_cycles)
    engine.autok = None
    engine.policy(None, SamplingParams(temperature=1.0))
    # A table that prices drafting far above plain decoding (start-up's few timed forwards
    # can be that wrong): the plan follows the probe's own cycle times instead.
    engine.autok.kinds["sampled"].costs = CostTable(
        cycle=[1.0, 9.0, 9.0, 9.0, 9.0], trunk=[1.0] * 5, head_step=1.0, absorb=[1.0] * 5
    )
    for acceptance, want in (([1.0] * MAX_AUTO_K, MAX_AUTO_K), ([0.0] * MAX_AUTO_K, 0)):
        monkeypatch.setattr(autok, "probe_acceptance", partial(probe, acceptance=acceptance))
        monkeypatch.setattr(autok, "seeded_plan_path", lambda _, a=acceptance: tmp_path / f"{a}")
        engine.autok.seeded = None
        plan = engine.autok.seeded_plan(params)
        assert plan.k == want
        assert plan.cycle_seconds == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])
    # plain cycles are timed both before and after the drafting K's (the machine drifts), in
    # as many rounds as the time allows (here instant: all of them, for each of the two plans)
    assert order[0] == order[-1] == 0 and sorted(set(order)) == list(range(MAX_AUTO_K + 1))
    assert len(order) == 2 * autok.TIMED_PROBE_ROUNDS * len(autok.TIMED_PROBE_ORDER)


def test_the_seeded_plan_is_measured_when_the_engine_loads(
    make_checkpoint, monkeypatch, tmp_path
) -> None:
    """A checkpoint that samples by default gets its seeded plan (the acceptance probe) at load,
    so the first seeded request waits no longer than the second; an empty cost cache makes the
    probe run."""
    from engine.scheduling import autok, costs

    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path)
    probes: list[object] = []
    probe = autok.probe_acceptance
    monkeypatch.setattr(
        autok, "probe_acceptance", lambda *a, **k: probes.append(a) or probe(*a, **k)
    )
    engine = Engine.load(str(make_checkpoint(VARIANTS["dense-tied"])))
    rounds = len(probes)  # a round a call, as many as fit its time
    assert 1 <= rounds <= autok.ACCEPTANCE_PROBE_ROUNDS and engine.autok.seeded is not None
    prompt = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=1.0, seed=5)
    tokens, event = run(engine, GenerationRequest(prompt, params, 12, ignore_eos=True))
    assert len(probes) == rounds and len(tokens) == 12


def test_drafting_after_a_plain_stretch_catches_up_on_the_latest_positions(load_engine) -> None:
    """After MAX_CATCH_UP + 30 plain cycles the head runs only the latest MAX_CATCH_UP pending
    pairs (at their true positions); the output stays exactly plain greedy decoding and drafts
    are still good."""
    from engine.cycle.sequence import MAX_CATCH_UP, start_sequence
    from engine.cycle.speculative import commit, run_cycle

    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[2])
    plain = MAX_CATCH_UP + 30
    reference, _ = run(engine, greedy_request(prompt, 0, plain + 40, ignore_eos=True))
    seq = start_sequence(engine.trunk, engine.loaded.head, prompt, GREEDY, use_head=True)
    accepted = proposed = 0
    for k in [0] * plain + [2] * 12:
        result = run_cycle(engine.trunk, engine.loaded.head, seq, k)
        commit(seq, result, len(result.emitted))
        assert_invariant(seq)
        accepted, proposed = accepted + result.n_accepted, proposed + len(result.draft_ids)
    assert seq.head_skipped == plain + 1 - MAX_CATCH_UP
    assert seq.tokens[len(prompt) :] == reference[: len(seq.tokens) - len(prompt)]
    assert accepted > 0.3 * proposed  # this checkpoint accepts ~half its drafts


def test_plain_cycles_are_not_timed_at_the_edges_of_a_plain_stretch(
    tiny_engine, monkeypatch
) -> None:
    """Auto K calibrates its costs with the decode loop's cycle times. Plain cycles run one
    ahead, so at the edges of a plain stretch the time between two cycles is not a plain
    cycle's cost: the first plain cycle after drafting reads back ~2 steps after the drafting
    cycle (``RequestAutoK.observe_seconds`` drops class switches), the last one before drafting
    ~0.4 step after its predecessor (the loop passes None for it). Timed, the last ones made
    plain decoding look cheaper the shorter its stretches were."""
    from engine.runtime import DraftPolicy
    from engine.scheduling.autok import PatternChooser

    pattern = PatternChooser([2, 2, 0, 0, 0, 0, 0])
    prompt = tiny_engine.tokenizer.encode(PROMPTS[0])
    request = greedy_request(prompt, None, 80, ignore_eos=True)
    seq = tiny_engine.new_sequence(prompt, request.sampling, draft=True)
    # the pattern chooses each cycle's K where auto K would
    monkeypatch.setattr(tiny_engine, "policy", lambda *_: DraftPolicy(fixed=None, chooser=pattern))
    for _ in tiny_engine.decode(seq, request):
        pass
    timed = pattern.timed
    last_plain = [i for i in range(len(timed) - 1) if timed[i][0] == 0 and timed[i + 1][0] > 0]
    inner_plain = [
        i
        for i in range(1, len(timed) - 1)
        if timed[i - 1][0] == timed[i][0] == timed[i + 1][0] == 0
    ]
    assert len(last_plain) >= 3 and len(inner_plain) >= 6
    assert all(timed[i][1] is None for i in last_plain)
    assert all(timed[i][1] is not None for i in inner_plain)


@pytest.mark.fast
def test_cancelled_request_ends_within_one_cycle(tiny_engine) -> None:
    prompt = tiny_engine.tokenizer.encode(PROMPTS[0])
    cycles = 0

    def cancelled() -> bool:
        return cycles >= 2

    events = []
    for event in tiny_engine.generate(greedy_request(prompt, 2, 100, ignore_eos=True), cancelled):
        cycles += 1
        events.append(event)
    assert events[-1].finish_reason == "cancelled"
    assert len(events) == 3


@pytest.mark.fast
def test_checkpoint_without_head_serves_plain_decoding(make_checkpoint, caplog) -> None:
    variant = Variant("no-mtp", with_mtp=False, agreement=0.1, seed=5)
    with caplog.at_level(logging.WARNING, logger="mtpserve.loader"):
        engine = Engine.load(str(make_checkpoint(variant)), draft_tokens=3)
    assert not engine.has_head
    assert "no MTP head" in caplog.text and "no mtp.* tensors" in caplog.text
    tokens, event = run(engine, greedy_request([5, 6, 7], None, 20, ignore_eos=True))
    assert len(tokens) == 20 and event.stats.proposed == 0


def test_sharded_head_is_read_from_its_shard_only(make_checkpoint) -> None:
    from engine.model import loader

    model_dir = make_checkpoint(VARIANTS["dense-untied-sharded"])
    files = loader._files_holding_mtp(model_dir)
    assert [f.name for f in files] == ["model-00003-of-00003.safetensors"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert {index["weight_map"][k] for k in index["weight_map"] if k.startswith("mtp.")} == {
        files[0].name
    }


def test_head_shares_embedding_and_lm_head(load_engine) -> None:
    """The head has no embedding or output projection of its own: one copy of every weight."""
    from mlx.utils import tree_flatten

    for variant in ("dense-tied", "dense-untied-sharded"):
        engine = load_engine(variant, draft_tokens=0)
        names = [n for n, _ in tree_flatten(engine.loaded.head.parameters())]
        assert not any("embed_tokens" in n or "lm_head" in n for n in names)
        assert len([n for n in names if "norm" in n]) == 7
        trunk_ids = {id(a) for _, a in tree_flatten(engine.trunk.parameters())}
        head_ids = {id(a) for _, a in tree_flatten(engine.loaded.head.parameters())}
        # The head lives inside the trunk's module tree (attached in place), nothing duplicated.
        assert head_ids <= trunk_ids


def test_converted_layout_gives_the_same_drafts(tmp_path: Path, make_checkpoint) -> None:
    """mlx-converted trunk (conv1d moved, norms +1) with an already-shifted head must equal the
    raw HF checkpoint: the +1 norm shift is applied exactly once on both paths."""
    from safetensors.numpy import load_file, save_file

    from engine.model.loader import ZERO_CENTRED_NORMS

    raw_dir = make_checkpoint(VARIANTS["dense-tied"])
    conv_dir = tmp_path / "converted"
    write_checkpoint(conv_dir, VARIANTS["dense-tied"])
    weights = load_file(str(conv_dir / "model.safetensors"))
    converted = {}
    for name, value in weights.items():
        if "conv1d.weight" in name:
            value = np.ascontiguousarray(np.moveaxis(value, 2, 1))
        elif value.ndim == 1 and name.endswith(ZERO_CENTRED_NORMS) and "linear_attn" not in name:
            value = value + 1.0
        converted[name] = value
    (conv_dir / "model.safetensors").unlink()
    save_file(converted, str(conv_dir / "model.safetensors"))

    outputs = []
    for model_dir in (raw_dir, conv_dir):
        engine = Engine.load(str(model_dir), draft_tokens=2)
        trace: list[dict] = []
        tokens, _ = run(
            engine,
            greedy_request(engine.tokenizer.encode(PROMPTS[0]), 2, 40, ignore_eos=True),
            trace,
        )
        outputs.append((tokens, [line["draft"] for line in trace]))
    assert outputs[0] == outputs[1]


def _converted_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What mlx-lm's conversion does to raw HF tensors: conv1d moved, zero-centred norms +1."""
    from engine.model.loader import ZERO_CENTRED_NORMS

    out = {}
    for name, value in weights.items():
        if "conv1d.weight" in name:
            value = np.ascontiguousarray(np.moveaxis(value, 2, 1))
        elif value.ndim == 1 and name.endswith(ZERO_CENTRED_NORMS) and "linear_attn" not in name:
            value = value + 1.0
        out[name] = value
    return out


def test_head_file_norms_follow_its_own_weights_not_the_trunk_folder(
    tmp_path: Path, make_checkpoint
) -> None:
    """A raw-HF head extracted by hand (no metadata) beside an mlx-converted trunk, and an
    mlx-shifted head beside a raw-HF trunk, both draft exactly what the checkpoint's own head
    drafts: the +1 follows the head's weights (near 0 or near 1), not the trunk's layout."""
    import shutil

    from safetensors.numpy import load_file, save_file

    raw_dir = make_checkpoint(VARIANTS["dense-tied"])
    weights = load_file(str(raw_dir / "model.safetensors"))
    raw_head = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    raw_trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    cases = []
    for name, trunk, head in (
        ("converted-trunk", _converted_layout(raw_trunk), raw_head),
        ("raw-trunk", raw_trunk, _converted_layout(raw_head)),
    ):
        folder = tmp_path / name
        shutil.copytree(raw_dir, folder)
        save_file(trunk, str(folder / "model.safetensors"))
        save_file(head, str(tmp_path / f"{name}-head.safetensors"))
        cases.append((folder, str(tmp_path / f"{name}-head.safetensors")))

    def drafts(model_dir: Path, mtp_weights: str | None) -> tuple[list[int], list]:
        engine = Engine.load(str(model_dir), draft_tokens=2, mtp_weights=mtp_weights)
        trace: list[dict] = []
        request = greedy_request(engine.tokenizer.encode(PROMPTS[0]), 2, 40, ignore_eos=True)
        tokens, _ = run(engine, request, trace)
        return tokens, [line["draft"] for line in trace]

    reference = drafts(raw_dir, None)
    for folder, head in cases:
        assert drafts(folder, head) == reference, folder.name


@pytest.mark.parametrize("change", ["two-layers", "dedicated-embeddings"])
def test_head_the_engine_cannot_run_serves_plain_with_one_warning(
    tmp_path: Path, make_checkpoint, caplog, change: str
) -> None:
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / change
    shutil.copytree(make_checkpoint(VARIANTS["dense-tied"]), folder)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    weights = load_file(str(folder / "model.safetensors"))
    if change == "two-layers":
        text["mtp_num_hidden_layers"] = 2
        for k in [k for k in weights if k.startswith("mtp.layers.0.")]:
            weights[k.replace("layers.0.", "layers.1.")] = weights[k]
    else:
        text["mtp_use_dedicated_embeddings"] = True
        weights["mtp.embed_tokens.weight"] = weights["model.language_model.embed_tokens.weight"]
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))

    with caplog.at_level(logging.WARNING, logger="mtpserve.loader"):
        engine = Engine.load(str(folder), draft_tokens=3)
    assert not engine.has_head
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "serving plain decoding" in warnings[0]
    assert ("2 MTP layers" if change == "two-layers" else "dedicated embeddings") in warnings[0]
    tokens, event = run(engine, greedy_request([5, 6, 7], None, 12, ignore_eos=True))
    assert len(tokens) == 12 and event.stats.proposed == 0


def test_flat_text_config_with_plain_model_prefix(tmp_path: Path, load_engine) -> None:
    """A text-only checkpoint: flat config (model_type qwen3_5_text), tensors named
    ``model.layers.*`` / ``model.embed_tokens`` and the head under ``mtp.*``."""
    from safetensors.numpy import load_file, save_file

    variant = VARIANTS["dense-untied-sharded"]
    flat_dir = tmp_path / "flat"
    write_checkpoint(flat_dir, variant)
    config = json.loads((flat_dir / "config.json").read_text())
    (flat_dir / "config.json").write_text(json.dumps(config["text_config"]))
    index_path = flat_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(flat_dir / shard))
        renamed = {k.replace("model.language_model.", "model."): v for k, v in tensors.items()}
        save_file(renamed, str(flat_dir / shard))
    index["weight_map"] = {
        k.replace("model.language_model.", "model."): v for k, v in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))

    flat = Engine.load(str(flat_dir), draft_tokens=2)
    nested = load_engine(variant.name, draft_tokens=0)
    prompt = nested.tokenizer.encode(PROMPTS[0])
    outputs = []
    for engine in (flat, nested):
        trace: list[dict] = []
        tokens, _ = run(engine, greedy_request(prompt, 2, 40, ignore_eos=True), trace)
        outputs.append((tokens, [line["draft"] for line in trace]))
    assert flat.has_head and outputs[0] == outputs[1]


@pytest.mark.fast
def test_draft_vocabulary_subset_keeps_greedy_exact(make_checkpoint) -> None:
    """Drafting over a token subset changes acceptance, never the output; drafts stay inside it."""
    engine = Engine.load(str(make_checkpoint(VARIANTS["dense-untied-sharded"])), draft_tokens=0)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    plain, _ = run(engine, greedy_request(prompt, 0, 120, ignore_eos=True))
    engine.set_draft_vocab(64)
    allowed = set(range(64)) | set(engine.eos_token_ids)
    assert engine.draft_vocab_size >= 64 and engine.draft_vocab_bytes > 0
    for k in (1, 3):
        trace: list[dict] = []
        spec, _ = run(engine, greedy_request(prompt, k, 120, ignore_eos=True), trace)
        assert spec == plain
        drafted = {d for line in trace for d in line["draft"]}
        assert drafted and drafted <= allowed | set(engine.tokenizer.added_tokens_decoder)
    engine.set_draft_vocab(0)
    assert engine.draft_vocab_size == engine.vocab_size


@pytest.mark.fast
def test_a_large_vocabulary_drafted_whole_gets_a_hint_at_start(
    make_checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint with a vocabulary larger than ``LARGE_VOCABULARY`` and no listed draft
    vocabulary logs one line at load suggesting ``--draft-vocab``; a size the caller chose
    (a subset, or 0 for the whole vocabulary) logs none."""
    import engine.runtime as runtime

    monkeypatch.setattr(runtime, "LARGE_VOCABULARY", 0)
    with caplog.at_level("INFO", logger="mtpserve.engine"):
        engine = Engine.load(str(make_checkpoint(VARIANTS["dense-untied-sharded"])), draft_tokens=0)
    assert f"--draft-vocab {runtime.SUGGESTED_DRAFT_VOCAB}" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="mtpserve.engine"):
        engine.set_draft_vocab(64)
        engine.set_draft_vocab(0)
    assert "--draft-vocab" not in caplog.text


def test_extending_a_sequence_then_decoding_equals_a_fresh_run(load_engine) -> None:
    """Tokens appended after a generation (the next turn) are prefilled into trunk and head
    caches exactly: continuing equals a fresh run on the whole text."""
    from engine.cycle.sequence import extend_sequence

    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    first, turn = engine.tokenizer.encode(PROMPTS[0]), engine.tokenizer.encode(PROMPTS[1])
    request = greedy_request(first, 2, 7, ignore_eos=True)
    seq = started(engine, request)
    list(engine.decode(seq, request))
    extend_sequence(engine.trunk, engine.loaded.head, seq, turn)
    assert_invariant(seq)
    so_far = list(seq.tokens)
    continued = [
        t
        for e in engine.decode(seq, greedy_request(so_far, 2, 20, ignore_eos=True))
        for t in e.token_ids
    ]
    fresh, _ = run(engine, greedy_request(so_far, 0, 20, ignore_eos=True))
    assert continued == fresh


def _unsplit(x: mx.array, weight: mx.array, rowwise_max_rows: int) -> mx.array:
    """``x @ weight.T`` as an unsplit weight multiplies it: row by row for 2 to
    ``rowwise_max_rows`` rows, one product otherwise."""
    if 2 <= x.shape[0] <= rowwise_max_rows:
        return mx.concatenate([x[i : i + 1] @ weight.T for i in range(x.shape[0])])
    return x @ weight.T


@mlx_products_only
@pytest.mark.fast
def test_a_product_of_a_few_rows_is_each_rows_own_product(monkeypatch) -> None:
    """On a CPU a float32 product of 2 to ``rowwise_max_rows`` rows (a verify pass's K+1
    positions, a batch's rows), where row by row pays, gives every row bit for bit what that
    row alone gives, as plain decoding multiplies it, for 2-D and 3-D inputs and for a tied
    embedding's vocabulary projection; past that many rows the product is one matrix-matrix
    product. The most rows fall with the weight's size (``ROWWISE_LIMITS``), a weight too large
    for the cache runs in row blocks, and half-precision weights keep one product. Whether row
    by row pays is measured per machine: here it is taken to pay at every trial."""
    import mlx.nn as nn

    from engine.model import mlx_products

    monkeypatch.setattr(mlx_products, "_rowwise_rows", {})
    monkeypatch.setattr(mlx_products, "last_paying_rows", lambda trials, seconds: trials[-1])
    mx.random.seed(1)
    layer, table = nn.Linear(96, 160, bias=False), nn.Embedding(300, 96)
    large, half = nn.Linear(1024, 4200, bias=False), nn.Linear(96, 160, bias=False)
    half.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters(), table.parameters(), large.parameters(), half.parameters())
    holder = nn.Module()
    holder.layer, holder.table, holder.large, holder.half = layer, table, large, half
    mlx_products.prepare_transposed(holder)
    limit = mlx_products._prepared(layer).rowwise_max_rows
    assert limit == 16 and mlx_products._prepared(table).rowwise_max_rows == 16
    blocked = mlx_products._prepared(large)  # 16.4 MiB: row by row in row blocks of 4 MiB
    assert blocked.rowwise_max_rows == mlx_products.BLOCKED_MAX_ROWS
    assert len(blocked.whole.blocks) == 5
    assert mlx_products._prepared(half).rowwise_max_rows == 1
    for rows in (2, 3, 5, limit):
        x = mx.random.normal((rows, 96))
        whole = mlx_products.linear(layer, x)
        for i in range(rows):
            assert mx.array_equal(whole[i : i + 1], mlx_products.linear(layer, x[i : i + 1])).item()
        h = x.reshape(1, rows, 96)
        vocab = mlx_products.product(table, h)
        assert vocab.shape == (1, rows, 300)
        for i in range(rows):
            alone = mlx_products.product(table, h[:, i : i + 1])
            assert mx.array_equal(vocab[:, i : i + 1], alone).item()
    for rows in (2, mlx_products.BLOCKED_MAX_ROWS):
        x = mx.random.normal((rows, 1024))
        whole = mlx_products.linear(large, x)
        assert whole.shape == (rows, 4200)
        for i in range(rows):
            assert mx.array_equal(whole[i : i + 1], mlx_products.linear(large, x[i : i + 1])).item()
    many = mx.random.normal((limit + 1, 96))
    assert mx.array_equal(mlx_products.linear(layer, many), many @ layer.weight.T).item()


def test_row_by_row_is_kept_up_to_the_last_row_count_that_pays() -> None:
    """``last_paying_rows`` keeps row by row up to the last trial row count at and below which
    it took at most ``ROWWISE_PAYS`` of one product's time, never past one that did not pay, 1
    when 2 rows do not pay, and times no trial past the first that does not pay."""
    from engine.model import mlx_products

    def timings(by_row_share: dict[int, float]):
        timed: list[int] = []

        def seconds(rows: int) -> tuple[float, float]:
            timed.append(rows)
            return 1e-3, by_row_share[rows] * 1e-3

        return seconds, timed

    trials = [2, 4, 8, 16]
    seconds, timed = timings({2: 0.4, 4: 0.5, 8: 0.8, 16: 0.95})
    assert mlx_products.last_paying_rows(trials, seconds) == 8 and timed == [2, 4, 8, 16]
    seconds, timed = timings({2: 0.4, 4: 1.2, 8: 0.5, 16: 0.5})
    assert mlx_products.last_paying_rows(trials, seconds) == 2 and timed == [2, 4]
    seconds, timed = timings({2: 1.5, 4: 0.5, 8: 0.5, 16: 0.5})
    assert mlx_products.last_paying_rows(trials, seconds) == 1 and timed == [2]
    seconds, _ = timings({2: mlx_products.ROWWISE_PAYS, 4: 0.1, 8: 0.1, 16: 0.1})
    assert mlx_products.last_paying_rows(trials, seconds) == 16


@mlx_products_only
def test_an_engine_multiplies_row_by_row_only_where_it_measured_a_gain(load_engine) -> None:
    """Every prepared float32 weight of a loaded engine multiplies row by row up to exactly the
    row count measured for its shape on this machine (``rowwise_rows``), within its size's
    limit."""
    from engine.model import mlx_products

    engine = load_engine("dense-untied-sharded", draft_tokens=0)
    seen = 0
    for module in engine.loaded.model.modules():
        prepared = mlx_products._prepared(module)
        if prepared is None:
            continue
        operand = prepared.parts[0] if prepared.parts else prepared.whole
        if operand.view.dtype != mx.float32:
            assert operand.most_rows == 1
            continue
        key = (tuple(operand.view.shape), operand.view.dtype, bool(operand.blocks))
        fits = [n for most, n in mlx_products.ROWWISE_LIMITS if operand.view.nbytes <= most]
        cap = fits[0] if fits else mlx_products.BLOCKED_MAX_ROWS
        assert operand.most_rows == min(mlx_products._rowwise_rows[key], cap)
        assert len(operand.by_rows) == max(0, operand.most_rows - 1)
        seen += 1
    assert seen > 0


@mlx_products_only
def test_a_product_split_across_streams_is_bit_identical() -> None:
    """``mlx_products.product`` over column parts on two CPU streams equals the whole product bit
    for bit, for a linear layer and a tied embedding's vocabulary projection, 2-D and 3-D inputs,
    1 to 64 rows; more rows keep one product; the parts are views (no second copy)."""
    import mlx.nn as nn

    from engine.model import mlx_products

    mx.random.seed(0)
    layer, table = nn.Linear(192, 3 << 10, bias=False), nn.Embedding(3 << 10, 192)
    mx.eval(layer.parameters(), table.parameters())
    holder = nn.Module()
    holder.layer, holder.table = layer, table
    before = mx.get_active_memory()
    old = mlx_products.SPLIT_WEIGHT_PARAMS
    mlx_products.SPLIT_WEIGHT_PARAMS = 1
    try:
        mlx_products.prepare_transposed(holder, parts=2)
    finally:
        mlx_products.SPLIT_WEIGHT_PARAMS = old
    assert mx.get_active_memory() - before < layer.weight.nbytes // 4
    for rows in (1, 5, 24, 64, 65):
        x = mx.random.normal((rows, 192))
        limit = mlx_products._prepared(layer).rowwise_max_rows
        assert mx.array_equal(
            mlx_products.linear(layer, x), _unsplit(x, layer.weight, limit)
        ).item()
        h = x.reshape(1, rows, 192)
        whole = _unsplit(x, table.weight, limit).reshape(1, rows, -1)
        assert mx.array_equal(mlx_products.product(table, h), whole).item(), rows
    x = mx.random.normal((3, 192))
    split = mx.concatenate([x @ p.view for p in mlx_products._prepared(layer).parts], axis=-1)
    assert mx.array_equal(split, x @ layer.weight.T).item()


@mlx_products_only
def test_weights_split_across_streams_change_no_token(load_engine, make_checkpoint) -> None:
    """An engine whose weights are all split into column parts on two CPU streams (the
    threshold lowered so the tiny checkpoint's weights split) emits exactly the tokens of one
    that multiplies them whole: greedy plain and K=3, and a seeded sampled request."""
    import engine.model.loader as loader
    from engine.model import mlx_products

    whole = load_engine("dense-untied-sharded", draft_tokens=0)
    old = mlx_products.SPLIT_WEIGHT_PARAMS, loader.product_parts
    mlx_products.SPLIT_WEIGHT_PARAMS, loader.product_parts = 1, lambda: 2
    try:
        split = Engine.load(str(make_checkpoint(VARIANTS["dense-untied-sharded"])), draft_tokens=0)
    finally:
        mlx_products.SPLIT_WEIGHT_PARAMS, loader.product_parts = old
    assert mlx_products._prepared(split.trunk.lm_head).parts, (
        "the vocabulary projection was not split"
    )
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=5)
    for prompt in PROMPTS[:2]:
        ids = whole.tokenizer.encode(prompt)
        for k, sampling in ((0, GREEDY), (3, GREEDY), (2, seeded)):
            request = GenerationRequest(ids, sampling, 40, draft_tokens=k, ignore_eos=True)
            assert run(split, request)[0] == run(whole, request)[0], (prompt, k)


@pytest.mark.skipif(not products.on_native(), reason="the native recurrence runs on a CPU only")
def test_a_prefill_leaves_the_same_caches_however_its_chunks_split_it(load_engine) -> None:
    """On the native kernel a prefill's Gated-DeltaNet layers run position by position and its
    attention query by query over the keys each query sees, so a prompt prefilled in one go,
    resumed at 100, or in pieces ending at 37, 200 and 251 leaves the same caches bit for bit:
    every GDN layer's conv and recurrent states (the closed form's blocks of 64 depended on
    where the pieces began) and every attention layer's keys and values (mlx's attention over
    a chunk depended on the chunk)."""
    assert_prefill_splits_alike(load_engine("dense-tied", draft_tokens=0))


def assert_prefill_splits_alike(engine: Engine) -> None:
    """A 300-token prompt prefilled in one go, resumed at 100, in pieces ending at 37, 200 and
    251, and in pieces of 5, 125, 166 and 3 tokens (the short ones through the compiled blocks
    decoding uses too) leaves the same trunk caches bit for bit."""
    from engine.cycle.sequence import new_sequence, prefill

    ids = engine.tokenizer.encode(" ".join(PROMPTS) * 12)[:300]
    assert len(ids) == 300

    def states(ends: list[int]) -> list[mx.array]:
        seq = new_sequence(engine.trunk, engine.head, ids, GREEDY, True)
        done = 0
        for end in [*ends, len(ids) - 1]:
            prefill(engine.trunk, engine.head, seq, ids[done:end])
            done = end
        held = []
        for c in seq.trunk_cache.layers:
            if hasattr(c, "recurrent"):
                held += [c.conv, c.recurrent]
            else:
                held += [a[..., : c.offset, :] for a in (c.keys, c.values)]
        mx.eval(held)
        return held

    whole = states([])
    for ends in ([100], [37, 200, 251], [5, 130, 296]):
        assert all(mx.array_equal(a, b).item() for a, b in zip(whole, states(ends), strict=True))


def _mlx_lm_rule(q, k, v, a, b, a_log, dt_bias, start, n: int) -> tuple[mx.array, mx.array]:
    """mlx-lm's step-by-step gated delta rule over the first ``n`` positions: (y, state)."""
    from mlx_lm.models.gated_delta import gated_delta_update

    prefix = (x[:, :n] for x in (q, k, v, a, b))
    return gated_delta_update(*prefix, a_log, dt_bias, start, None, use_kernel=False)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8])
@pytest.mark.fast
def test_chunked_delta_rule_matches_the_recurrence(length: int) -> None:
    """The verify pass's closed-form GDN step (outputs, and the state after every position,
    which is what rollback commits) equals mlx-lm's step-by-step gated delta rule."""
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import gated_delta_update

    from engine.model.delta_rule import delta_rule_chunk

    mx.random.seed(length)
    heads, dk, dv = 4, 32, 16
    q = 0.2 * mx.random.normal((1, length, heads, dk))
    k = mx.random.normal((1, length, heads, dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, length, heads, dv))
    a, b = mx.random.normal((1, length, heads)), mx.random.normal((1, length, heads))
    a_log, dt_bias = mx.random.normal((heads,)), mx.random.normal((heads,))
    start = 0.3 * mx.random.normal((1, heads, dv, dk))
    log_g = -mx.exp(a_log) * nn.softplus(a + dt_bias)

    y, capture = delta_rule_chunk(q, k, v, log_g, mx.sigmoid(b), start)
    y_ref, _ = gated_delta_update(q, k, v, a, b, a_log, dt_bias, start, None, use_kernel=False)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), atol=2e-6)
    for n in range(1, length + 1):
        _, state_ref = _mlx_lm_rule(q, k, v, a, b, a_log, dt_bias, start, n)
        np.testing.assert_allclose(np.array(capture.state_after(n)), np.array(state_ref), atol=2e-6)


@pytest.mark.parametrize("keys", ["random", "repeated"])
@pytest.mark.fast
def test_prefill_delta_rule_matches_the_recurrence(keys: str) -> None:
    """A prefill's closed-form GDN blocks (``delta_rule_prefill``) equal the step-by-step rule,
    computed in float64, over 150 positions starting mid-block (blocks [37, 64), [64, 128),
    [128, 187)) — also when one key repeats with little decay and beta near 1, where the
    verify pass's squaring series would overflow float32 at these lengths."""
    from engine.model.delta_rule import PREFILL_GDN_BLOCK, delta_rule_prefill

    assert PREFILL_GDN_BLOCK == 64
    rng = np.random.default_rng(3)
    length, heads, dk, dv = 150, 4, 32, 16
    q = 0.2 * rng.standard_normal((1, length, heads, dk))
    k = rng.standard_normal((1, length, heads, dk))
    if keys == "repeated":
        k[:] = k[:, :1]
        log_g = np.full((1, length, heads), -1e-4)
        beta = np.full((1, length, heads), 0.99)
    else:
        log_g = -(rng.uniform(0, 1, (1, length, heads)) ** 3)
        beta = rng.uniform(0, 1, (1, length, heads))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, length, heads, dv))
    state = 0.3 * rng.standard_normal((1, heads, dv, dk))

    def f32(x: np.ndarray) -> mx.array:
        return mx.array(x.astype(np.float32))

    y, final = delta_rule_prefill(*map(f32, (q, k, v, log_g, beta, state)), start=37)
    s, y_ref = state.copy(), np.zeros_like(v)
    for t in range(length):
        s = s * np.exp(log_g[:, t])[..., None, None]
        u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhvk,bhk->bhv", s, k[:, t]))
        s = s + np.einsum("bhv,bhk->bhvk", u, k[:, t])
        y_ref[:, t] = np.einsum("bhvk,bhk->bhv", s, q[:, t])
    np.testing.assert_allclose(np.array(y), y_ref, atol=2e-6)
    np.testing.assert_allclose(np.array(final), s, atol=2e-5)


@pytest.mark.parametrize("heads", [(4, 4), (2, 4)])
@pytest.mark.fast
def test_one_position_delta_rule_matches_the_recurrence(heads: tuple[int, int]) -> None:
    """A plain cycle's GDN step (``delta_rule_step``: output and new state) equals mlx-lm's
    gated delta rule, with as many key heads as value heads and with fewer (repeated)."""
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import gated_delta_update

    from engine.model.delta_rule import delta_rule_step

    mx.random.seed(7)
    k_heads, v_heads = heads
    dk, dv = 32, 16
    q = 0.2 * mx.random.normal((2, 1, k_heads, dk))
    k = mx.random.normal((2, 1, k_heads, dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((2, 1, v_heads, dv))
    a, b = mx.random.normal((2, 1, v_heads)), mx.random.normal((2, 1, v_heads))
    a_log, dt_bias = mx.random.normal((v_heads,)), mx.random.normal((v_heads,))
    start = 0.3 * mx.random.normal((2, v_heads, dv, dk))
    log_g = -mx.exp(a_log) * nn.softplus(a + dt_bias)

    y_ref, state_ref = gated_delta_update(
        q, k, v, a, b, a_log, dt_bias, start, None, use_kernel=False
    )
    repeat = v_heads // k_heads
    q, k = mx.repeat(q, repeat, axis=-2), mx.repeat(k, repeat, axis=-2)
    y, capture = delta_rule_step(q, k, v, log_g, mx.sigmoid(b), start)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), atol=2e-6)
    np.testing.assert_allclose(np.array(capture.state_after(1)), np.array(state_ref), atol=2e-6)
    np.testing.assert_allclose(np.array(capture.row(1).final), np.array(state_ref[1:]), atol=2e-6)


@pytest.mark.parametrize("heads", [(4, 4), (2, 4)])
@pytest.mark.fast
def test_native_delta_rule_matches_mlx_lm(heads: tuple[int, int]) -> None:
    """The kernel's pass over a verify's positions (``delta_rule_native``: outputs and the
    state after each kept count) equals mlx-lm's q/k normalization and gated delta rule, the
    key heads mapped to the value heads as mlx-lm repeats them."""
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import normalize_qk

    from engine.model import products
    from engine.model.delta_rule import delta_rule_native

    if products.native() is None:
        pytest.skip("the native kernel is not built")
    mx.random.seed(8)
    k_heads, v_heads = heads
    dk, dv, T = 32, 16, 3
    q = mx.random.normal((2, T, k_heads, dk))
    k = mx.random.normal((2, T, k_heads, dk))
    v = mx.random.normal((2, T, v_heads, dv))
    a, b = mx.random.normal((2, T, v_heads)), mx.random.normal((2, T, v_heads))
    a_log, dt_bias = mx.random.normal((v_heads,)), mx.random.normal((v_heads,))
    start = 0.3 * mx.random.normal((2, v_heads, dv, dk))
    log_g = -mx.exp(a_log) * nn.softplus(a + dt_bias)

    y, capture = delta_rule_native(q, k, v, log_g, mx.sigmoid(b), start)  # q, k normalized there
    q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
    for n in range(1, T + 1):
        y_ref, state_ref = _mlx_lm_rule(q, k, v, a, b, a_log, dt_bias, start, n)
        np.testing.assert_allclose(np.array(y[:, :n]), np.array(y_ref), atol=2e-6)
        np.testing.assert_allclose(np.array(capture.state_after(n)), np.array(state_ref), atol=2e-6)


@pytest.mark.fast
def test_causal_conv_is_mlx_s_conv1d() -> None:
    """The GDN layer's depthwise conv as shifted multiply-adds (``causal_conv``) computes what
    mlx's grouped ``nn.Conv1d`` does, with and without a bias, over one position and many."""
    import mlx.nn as nn

    from engine.model.gated_deltanet import causal_conv

    mx.random.seed(9)
    for bias in (False, True):
        conv = nn.Conv1d(40, 40, 4, groups=40, bias=bias)
        for positions in (1, 5, 70):
            window = mx.random.normal((2, positions + 3, 40))
            np.testing.assert_allclose(
                np.array(causal_conv(conv, window)), np.array(conv(window)), atol=1e-6
            )
