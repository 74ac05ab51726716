"""Continuous batching is exact: every row of a batch emits what the same request emits alone.

Rows mix prompts, lengths, fixed K (0..4) and automatic K, greedy and seeded sampling, and
join and leave at different cycles; a row's stop, cancellation or departure never changes
another row's output. Dense and MoE test checkpoints and the demo model. Sampled rows of a
batch pass the chi-square homogeneity test against plain sampling (demo model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_sampling import ALPHA, SETTINGS, _first_tokens, _homogeneity_pvalue, counted_entropy

from engine.api import MAX_DRAFT_TOKENS, GenerationRequest, RequestError
from engine.cycle import speculative
from engine.runtime import Engine
from engine.scheduling import batching as batching_module
from engine.scheduling.batching import (
    EXPLORE_CYCLES,
    FAR_WAIT,
    RETIME_EVERY,
    BatchDecoder,
    BatchK,
)
from sampling.params import SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "class Point:\n    def __init__(self, x, y):",
    "import os\nimport sys\n\ndef main():",
    "for i in range(10):",
    "Once upon a time",
    "x = [1, 2, 3]\nprint(",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
]
#: per row: draft tokens (None: automatic) and max_tokens
ROWS = [(0, 40), (1, 17), (2, 33), (3, 25), (4, 48), (None, 30), (None, 12), (None, 41)]
GREEDY = SamplingParams(temperature=0.0)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=seed)


def requests(engine: Engine, sampling: list[SamplingParams]) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=engine.tokenizer.encode(prompt),
            sampling=params,
            max_tokens=max_tokens,
            draft_tokens=k,
            ignore_eos=True,
        )
        for prompt, (k, max_tokens), params in zip(PROMPTS, ROWS, sampling, strict=True)
    ]


def alone(engine: Engine, request: GenerationRequest) -> list[int]:
    return [t for event in engine.generate(request) for t in event.token_ids]


def batched(
    engine: Engine,
    reqs: list[GenerationRequest],
    capacity: int = 8,
    join_at: dict[int, int] | None = None,
    cancel_after: dict[int, int] | None = None,
) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Run ``reqs`` as rows of one batch; ``join_at[i]``: row i joins at that step;
    ``cancel_after[i]``: row i is cancelled after that many of its events."""
    batch = BatchDecoder(engine, capacity)
    join_at = join_at or {}
    cancel_after = cancel_after or {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    events: dict[int, int] = dict.fromkeys(range(len(reqs)), 0)
    finish: dict[int, str] = {}
    waiting = list(range(len(reqs)))
    step = 0
    while waiting or len(batch):
        for i in [i for i in waiting if join_at.get(i, 0) <= step]:
            if len(batch) == capacity:
                break
            waiting.remove(i)
            batch.add(i, reqs[i], cancelled=lambda i=i: events[i] >= cancel_after.get(i, 1 << 30))
        for key, item in batch.step():
            assert not isinstance(item, BaseException), item
            tokens[key] += item.token_ids
            events[key] += 1
            if item.finish_reason is not None:
                finish[key] = item.finish_reason
        step += 1
        assert step < 2000
    return tokens, finish


@pytest.fixture(autouse=True)
def widest_cycle(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows per batched cycle, so each test can show its rows really shared cycles."""
    widths: list[int] = []
    launch = batching_module.launch_cycles

    def counted(trunk, head, seqs, k, profile=False, ks=None):
        widths.append(len(seqs))
        return launch(trunk, head, seqs, k, profile, ks)

    monkeypatch.setattr(batching_module, "launch_cycles", counted)
    return widths


@pytest.fixture(scope="module", params=["dense-tied", "moe-tied", "demo"])
def engine(request, load_engine) -> Engine:
    if request.param == "demo":
        return Engine.load(str(DEMO))
    return load_engine(request.param)


def test_greedy_rows_equal_each_request_alone(engine: Engine, widest_cycle: list[int]) -> None:
    reqs = requests(engine, [GREEDY] * len(ROWS))
    # row 2 stops at a stop token (its 8th token) mid-way, inside a draft block or not
    plain = alone(engine, reqs[2])
    reqs[2] = replace(reqs[2], stop_token_ids=frozenset({plain[7]}), ignore_eos=False)
    expected = [alone(engine, r) for r in reqs]
    assert len(expected[2]) <= 8
    widest_cycle.clear()
    got, finish = batched(engine, reqs, join_at={5: 3, 6: 7, 7: 7})
    for i, want in enumerate(expected):
        assert got[i] == want, f"row {i} (K={ROWS[i][0]})"
        assert finish[i] == ("stop" if i == 2 else "length")
    assert max(widest_cycle) >= 3  # the automatic rows (and whoever shares their K) together


def test_seeded_sampled_rows_equal_each_request_alone(
    engine: Engine, widest_cycle: list[int]
) -> None:
    """Each row's draws are keyed by (its seed, position) and its K per cycle is a function of
    the request (a seeded row under automatic K follows ``EngineAutoK.seeded_plan`` and its own
    draws), so a seeded row's text is the text of the same request alone, whatever else runs
    beside it: two batches with other neighbours, joining at other steps, each give every row's
    own text."""
    reqs = requests(engine, [sampled(100 + i) for i in range(len(ROWS))])
    reqs[2] = requests(engine, [GREEDY] * len(ROWS))[2]  # greedy and sampled rows mix
    expected = [alone(engine, r) for r in reqs]
    widest_cycle.clear()
    got, _ = batched(engine, reqs, capacity=5)
    for i, want in enumerate(expected):
        assert got[i] == want, f"row {i} (K={ROWS[i][0]})"
    assert max(widest_cycle) >= 2
    # other neighbours: the rows in reverse, three at a time, an unseeded row among them
    order = [*reversed(range(len(reqs)))]
    others = [reqs[i] for i in order]
    others[1] = replace(others[1], sampling=replace(others[1].sampling, seed=None))
    got, _ = batched(engine, others, capacity=3, join_at={0: 2, 4: 1})
    for j, i in enumerate(order):
        if j != 1:
            assert got[j] == expected[i], f"row {i} (K={ROWS[i][0]}) beside other rows"


def test_rows_of_several_k_in_one_pass_equal_each_request_alone(
    engine: Engine, widest_cycle: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows drafting different K share one pass (each drafting its own K, the lower ones
    padded to the pass's): with every drafting row forced into one pass, greedy and seeded
    sampled rows of K = 1..4 (auto among them) each emit their text alone, joining and
    stopping at other steps."""

    def one_pass(self: BatchDecoder, groups: dict[int, list]) -> list[list]:
        rows = [row for k in sorted(groups, reverse=True) for row in groups[k]]
        return [rows] if rows else []

    monkeypatch.setattr(BatchDecoder, "_passes", one_pass)
    reqs = requests(engine, [sampled(200 + i) for i in range(len(ROWS))])
    reqs[1] = requests(engine, [GREEDY] * len(ROWS))[1]
    reqs[3] = requests(engine, [GREEDY] * len(ROWS))[3]
    expected = [alone(engine, r) for r in reqs]
    depths: list[tuple[int, tuple[int, ...]]] = []
    launch = batching_module.launch_cycles

    def recorded(trunk, head, seqs, k, profile=False, ks=None):
        depths.append((k, tuple(ks or ())))
        return launch(trunk, head, seqs, k, profile, ks)

    monkeypatch.setattr(batching_module, "launch_cycles", recorded)
    got, _ = batched(engine, reqs, join_at={4: 3, 6: 5})
    for i, want in enumerate(expected):
        assert got[i] == want, f"row {i} (K={ROWS[i][0]})"
    assert any(len(set(ks)) >= 3 for _, ks in depths)  # several K in one pass


@pytest.mark.fast
def test_passes_join_a_lower_k_when_its_padding_costs_less_than_its_own_pass() -> None:
    """Down from the highest K, a K's rows join the pass above while padding them costs less
    than the pass they would run alone and adds no more positions than the pass verifies: a
    pass that is mostly reading weights takes them, one whose verify positions cost most does
    not."""

    @dataclass
    class Row:
        k: int

    @dataclass
    class Table:
        trunk: list[float]
        head_step: float

    def passes(table: Table, ks: list[int]) -> list[list[int]]:
        decoder = BatchDecoder.__new__(BatchDecoder)
        decoder._cost_table = lambda: table  # type: ignore[method-assign]
        groups: dict[int, list[Row]] = {}
        for k in ks:
            groups.setdefault(k, []).append(Row(k))
        return [[row.k for row in rows] for rows in decoder._passes(groups)]

    # weights dominate (a 0.8B shape in bf16: a verify of 5 ~1.12x one position)
    reads = Table(trunk=[60.0, 61.8, 63.6, 65.4, 67.2], head_step=8.0)
    assert passes(reads, [1, 3]) == [[3, 1]]
    assert passes(reads, [1, 1, 1, 4]) == [[4, 1, 1, 1]]
    # ... but never more padded positions than the pass's own
    assert passes(reads, [1] * 7 + [4]) == [[4], [1] * 7]
    # positions dominate (the demo model: 1.2 ms a pass, 0.27 a position)
    positions = Table(trunk=[1.47, 1.74, 2.01, 2.28, 2.55], head_step=0.3)
    assert passes(positions, [1] * 7 + [4]) == [[4], [1] * 7]
    assert passes(positions, [4, 4, 3, 3, 2, 2, 1, 1]) == [[4, 4, 3, 3, 2, 2], [1, 1]]
    assert passes(None, [1, 3]) == [[1], [3]]  # no table yet: each K its own pass


#: seeded plans that start plain, at K=1 and at K=3, with cycle costs that make drafting pay
#: only at good acceptance, so that rows move between K as their own drafts fare
SEEDED_PLANS = {
    "plain-first": ([0.3, 0.3, 0.3, 0.3], [1.0, 1.4, 1.7, 2.0, 2.3]),
    "k1": ([0.6, 0.6, 0.6, 0.6], [1.0, 1.3, 1.7, 2.1, 2.5]),
    "k3": ([0.9, 0.9, 0.9, 0.9], [1.0, 1.2, 1.4, 1.6, 2.4]),
}


@pytest.mark.parametrize("plan", sorted(SEEDED_PLANS))
def test_seeded_auto_rows_equal_each_request_alone_under_any_seeded_plan(
    load_engine, plan: str
) -> None:
    """Whatever plan the build and machine measured for seeded rows under automatic K (the
    suite's own machine may measure any): each row's K follows the plan and its own draws, so
    its text is its text alone; plain rows too (K=0, no head), which draw from the verify rows
    of a batched trunk pass."""
    from engine.scheduling.autok import SeededPlan

    engine = load_engine("dense-tied")
    engine.policy(None, sampled(0))
    engine.autok.seeded = SeededPlan(*SEEDED_PLANS[plan])
    reqs = requests(engine, [sampled(100 + i) for i in range(len(ROWS))])
    reqs[2] = requests(engine, [GREEDY] * len(ROWS))[2]
    expected = [alone(engine, r) for r in reqs]
    got, _ = batched(engine, reqs, capacity=5)
    for i, want in enumerate(expected):
        assert got[i] == want, f"row {i} (K={ROWS[i][0]}, seeded plan {plan})"


@pytest.mark.parametrize("mix", ["greedy", "greedy-and-seeded", "seeded", "seeded-top-p"])
def test_rows_sharing_a_k_each_draft_from_their_own_head_position(
    engine: Engine, mix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four rows in every cycle at K=4: each draft step writes and rotates each row's head
    keys at that row's next position, so every row accepts the drafts it accepts alone (greedy
    rows: the same accepted-draft flags; seeded rows: the same draws, hence the same text).
    All-greedy rows draw together (``accept_greedy_rows``), rows sampling by one setting too
    (``accept_drafts_rows``: top_k candidates, or the whole vocabulary), mixed rows one by
    one."""
    if mix == "greedy":
        params = [GREEDY] * 4
    elif mix == "greedy-and-seeded":
        params = [GREEDY, sampled(7)] * 2
    elif mix == "seeded":
        params = [sampled(7 + i) for i in range(4)]
    else:
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i) for i in range(4)]
    params += params
    reqs = [replace(r, draft_tokens=4, max_tokens=40) for r in requests(engine, params)[:4]]

    def flags(events: Any) -> tuple[list[int], list[bool]]:
        events = list(events)
        tokens = [t for e in events for t in e.token_ids]
        return tokens, [d for e in events for d in e.drafted or []]

    expected = [flags(engine.generate(r)) for r in reqs]
    together = []  # cycles whose sampled rows were accepted as one op
    accept_rows = speculative._accept_sampled_rows
    monkeypatch.setattr(
        speculative,
        "_accept_sampled_rows",
        lambda *args: together.append(1) or accept_rows(*args),
    )
    batch = BatchDecoder(engine, len(reqs))
    for i, r in enumerate(reqs):
        batch.add(i, r)
    got: dict[int, list[Any]] = {i: [] for i in range(len(reqs))}
    while len(batch):
        for key, item in batch.step():
            assert not isinstance(item, BaseException), item
            got[key].append(item)
    assert any(expected[0][1]), "the head's drafts are accepted at all"
    assert bool(together) == mix.startswith("seeded")
    for i, want in enumerate(expected):
        assert flags(got[i]) == want, f"row {i}"


def test_a_cancelled_row_leaves_and_changes_no_other_row(engine: Engine) -> None:
    reqs = requests(engine, [GREEDY] * len(ROWS))[:4]
    expected = [alone(engine, r) for r in reqs]
    got, finish = batched(engine, reqs, cancel_after={1: 2, 3: 0})
    assert finish[1] == finish[3] == "cancelled"
    assert got[1] == expected[1][: len(got[1])] and len(got[1]) < len(expected[1])
    assert got[3] == []
    for i in (0, 2):
        assert got[i] == expected[i]


def test_a_rejected_request_ends_its_row_alone_and_quietly(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A request the engine refuses (here a K past the most it drafts) ends its own row with
    the error the client gets as a 400 — logged as no fault of the server's — while the row
    beside it emits what it emits alone."""
    good = requests(engine, [GREEDY] * len(ROWS))[0]
    bad = replace(good, draft_tokens=MAX_DRAFT_TOKENS + 1)
    batch = BatchDecoder(engine, 2)
    batch.add("bad", bad)
    batch.add("good", good)
    outcomes: dict[str, list] = {"bad": [], "good": []}
    with caplog.at_level(logging.INFO):
        while len(batch):
            for key, item in batch.step():
                outcomes[key].append(item)
    assert len(outcomes["bad"]) == 1 and isinstance(outcomes["bad"][0], RequestError)
    assert [t for event in outcomes["good"] for t in event.token_ids] == alone(engine, good)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_rows_that_left_hold_no_memory(engine: Engine) -> None:
    """What a row held (KV caches, GDN states and a batched verify's captures) is freed when
    it leaves — finished or cancelled — not whenever Python's cycle collector next runs: with
    the collector off, mlx's active memory after a batch is exactly what it was before."""
    import gc

    import mlx.core as mx

    reqs = requests(engine, [GREEDY] * len(ROWS))[:5]
    # compiles every block the batch below runs (the same rows joining and leaving alike:
    # rows of several K share passes, whose shapes follow who is in them), and runs each twice:
    # a block's second run on the kernel records the work its later runs repeat, and keeps the
    # values between its ops (engine/model/tape.py)
    for _ in range(2):
        batched(engine, reqs, join_at={4: 2}, cancel_after={1: 2})
    gc.collect()
    gc.disable()
    try:
        before = mx.get_active_memory()
        batched(engine, reqs, join_at={4: 2}, cancel_after={1: 2})
        after = mx.get_active_memory()
    finally:
        gc.enable()
    assert after == before


@pytest.mark.fast
def test_batch_k_explores_then_picks_the_best_rate() -> None:
    choice = BatchK()
    seen = []
    for _ in range(5 * EXPLORE_CYCLES):
        k = choice.choose(8, [[0.9] * 4] * 8)
        seen.append(k)
        # per cycle: K=0 costs 1, drafting costs 1 + 0.05 K: drafting at 0.9 pays
        choice.observe(8, k, 1.0 + 0.05 * k)
    # plain cycles in a row (so that they run ahead, as a plain stretch does), then the
    # drafting K's interleaved
    assert seen == [0] * EXPLORE_CYCLES + [1, 2, 3, 4] * EXPLORE_CYCLES
    assert choice.choose(8, [[0.9] * 4] * 8) == 4
    assert choice.choose(6, [[0.9] * 4] * 6) == 4  # 5-8 rows share what 8 rows measured
    assert choice.choose(3, [[0.9] * 4] * 3) == 0  # 3-4 rows: not measured yet, explore
    # drafting comes to cost 3x a plain cycle: once re-timed, at acceptance 0.1 it never pays
    for _ in range(5 * RETIME_EVERY):
        k = choice.choose(8, [[0.1] * 4] * 8)
        choice.observe(8, k, 1.0 if k == 0 else 3.0)
    assert choice.choose(8, [[0.1] * 4] * 8) == 0


@pytest.mark.fast
def test_batch_k_prices_a_cell_by_its_warm_cycles() -> None:
    """A cycle that first meets a shape also compiles its blocks: its K is priced by the
    cycles after it, not held at the slow first one (nor at any one slow moment)."""
    choice = BatchK()
    # K=2 is the best rate when warm (2.71 tokens for 1.2, K=3 2.79 for 1.25); its first
    # cycle compiles (3x), the other K's shapes ran before (rows with a fixed K)
    warm = {k: 1.0 if k == 0 else 1.1 + 0.05 * k for k in range(5)}
    compiled = False
    for _ in range(5 * EXPLORE_CYCLES):
        k = choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8)
        choice.observe(8, k, warm[k] * (3.0 if k == 2 and not compiled else 1.0))
        compiled |= k == 2
    for _ in range(10):
        k = choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8)
        assert k == 2
        choice.observe(8, k, warm[k])
    choice.observe(8, 2, 10.0)  # one slow moment of the machine
    assert choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8) == 2
    # a slow spell: every K costs 1.5x; K=2, timed all along, is still priced beside K=1 and
    # K=0, timed before it began
    for _ in range(10):
        k = choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8)
        assert k == 2
        choice.observe(8, k, 1.5 * warm[k])
    warm = {k: 1.5 * cost for k, cost in warm.items()}
    # the machine changes: K=3 now costs what K=0 does; a K not running is priced anew
    warm[3] = warm[0]
    for _ in range(5 * RETIME_EVERY):
        k = choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8)
        choice.observe(8, k, warm[k])
    assert choice.choose(8, [[0.9, 0.9, 0.1, 0.1]] * 8) == 3


def test_plain_rows_run_one_cycle_ahead_and_equal_each_request_alone(engine: Engine) -> None:
    """Rows that all decode plain launch their next cycle before reading the current one
    (as a request alone does); a row that stops at a stop token, reaches its length, or is
    cancelled while its next cycle runs has that cycle undone, and every row emits what it
    emits alone — greedy, seeded sampled, and a batch of one."""
    reqs = [
        replace(r, draft_tokens=0)
        for r in requests(engine, [GREEDY, sampled(7), GREEDY, GREEDY] + [GREEDY] * 4)[:4]
    ]
    plain = alone(engine, reqs[2])
    reqs[2] = replace(reqs[2], stop_token_ids=frozenset({plain[8]}), ignore_eos=False)
    expected = [alone(engine, r) for r in reqs]
    assert len(expected[2]) <= 9
    for rows in ([0, 1, 2, 3], [2]):
        batch = BatchDecoder(engine, len(rows))
        events = dict.fromkeys(rows, 0)
        for i in rows:
            batch.add(i, reqs[i], cancelled=lambda i=i, events=events: i == 3 and events[3] >= 6)
        got: dict[int, list[int]] = {i: [] for i in rows}
        ahead_steps = 0
        while len(batch):
            for key, item in batch.step():
                assert not isinstance(item, BaseException), item
                got[key] += item.token_ids
                events[key] += 1
            ahead_steps += any(row.ahead is not None for row in batch.rows.values())
        assert ahead_steps >= 5  # the rows really ran one cycle ahead
        for i in rows:
            if i == 3:
                assert got[3] == expected[3][: len(got[3])] and 5 <= len(got[3]) < 40
            else:
                assert got[i] == expected[i], f"row {i}"


def test_automatic_rows_run_plain_stretches_ahead_and_still_retime(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows under automatic K look ahead while BatchK picks K=0 by price; the cycles run
    ahead are timed too, by their period (read-back to read-back: what the overlap leaves of
    them), and count towards re-timing, so a drafting K is priced again within a long plain
    stretch. Every row emits what it emits alone."""
    choice = BatchK()
    # drafting priced at 10x a plain cycle, far from the best: re-timed only at the re-times
    # open to every K (each FAR_WAIT-th), so the history ends 42 cycles before one of them and
    # the batch's plain stretch runs into it (what follows the re-time depends on what the
    # drafting cycle really costs on this machine and path: it may draft from there on)
    open_retime = RETIME_EVERY * FAR_WAIT - 1
    while choice.cycles.get(4, 0) < open_retime - 45:
        k = choice.choose(4, [[0.5] * 4] * 4)
        choice.observe(4, k, 1.0 if k == 0 else 10.0)
    for _ in range(3):  # plain cycles since: a drafting K is the least recently timed
        assert choice.choose(4, [[0.5] * 4] * 4) == 0
        choice.observe(4, 0, 1.0)
    reqs = [
        GenerationRequest(engine.tokenizer.encode(p), GREEDY, 90, ignore_eos=True)
        for p in PROMPTS[:4]
    ]
    expected = [alone(engine, r) for r in reqs]
    monkeypatch.setattr(engine, "batch_k", choice)
    launched_ks: list[int] = []  # the batch's cycles only (not the requests run alone)
    launch = batching_module.launch_cycles

    def recorded(trunk, head, seqs, k, profile=False, ks=None):
        launched_ks.append(k)
        return launch(trunk, head, seqs, k, profile, ks)

    monkeypatch.setattr(batching_module, "launch_cycles", recorded)
    periods: list[tuple[int, float]] = []
    observe = choice.observe

    def timed(rows: int, k: int, seconds: float) -> None:
        periods.append((k, seconds))
        observe(rows, k, seconds)

    monkeypatch.setattr(choice, "observe", timed)
    batch = BatchDecoder(engine, 4)
    for i, request in enumerate(reqs):
        batch.add(i, request)
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    ahead_steps = 0
    while len(batch):
        for key, item in batch.step():
            assert not isinstance(item, BaseException), item
            got[key] += item.token_ids
        ahead_steps += any(row.ahead is not None for row in batch.rows.values())
    assert [got[i] for i in range(4)] == expected
    assert ahead_steps >= 30
    plain = [seconds for k, seconds in periods if k == 0]
    assert len(plain) >= 30 and all(0 < seconds < 1 for seconds in plain)
    plain_then_drafting = [
        i for i in range(1, len(launched_ks)) if launched_ks[i - 1] == 0 and launched_ks[i] > 0
    ]
    assert plain_then_drafting and launched_ks.index(0) < plain_then_drafting[0]  # re-timed


@pytest.mark.fast
def test_a_row_that_ends_with_a_cycle_launched_ahead_leaves_exact_caches() -> None:
    """A plain row that stops, is cancelled or is dropped with its next cycle already
    launched leaves caches holding exactly what it emitted: the conversation cache keeps its
    whole turn, and the next turn restores it and emits what a cold run emits."""
    block = 16
    cached = Engine.load(str(DEMO))
    cached.enable_prefix_cache(64 << 20, block_tokens=block)
    cold = Engine.load(str(DEMO))
    first = [
        GenerationRequest(
            cold.tokenizer.encode(p * 3), GREEDY, max_tokens=30, ignore_eos=True, draft_tokens=0
        )
        for p in PROMPTS[:3]
    ]
    stop = alone(cold, first[0])[10]
    first[0] = replace(first[0], stop_token_ids=frozenset({stop}), ignore_eos=False)
    batch = BatchDecoder(cached, 3)
    replies: dict[int, list[int]] = {i: [] for i in range(3)}
    for i, request in enumerate(first):
        batch.add(i, request, cancelled=lambda i=i: i == 1 and len(replies[1]) >= 7)
    finish: dict[int, str | None] = {}
    seqs: dict[int, Any] = {}
    while len(batch):
        for key, item in batch.step():
            replies[key] += item.token_ids
            finish[key] = item.finish_reason
        seqs.update({key: row.need.seq for key, row in batch.rows.items() if row.need})
        if len(replies[2]) >= 12 and 2 in batch:
            assert batch.rows[2].ahead is not None  # dropped with its next cycle running
            batch.drop(2)
    assert finish[0] == "stop" and replies[0][-1] == stop
    assert finish[1] == "cancelled" and len(replies[1]) < 12
    for i, request in enumerate(first):
        seq = seqs[i]
        assert seq.tokens == request.prompt_ids + replies[i]
        assert seq.trunk_cache.length == len(seq.tokens) - 1, f"row {i}"
        follow = seq.tokens + cold.tokenizer.encode(" and then?")
        second = replace(request, prompt_ids=follow, max_tokens=12, ignore_eos=True)
        events = list(cached.generate(second))
        assert [t for e in events for t in e.token_ids] == alone(cold, second), f"row {i}"
        assert events[-1].stats.cached_tokens >= (len(seq.tokens) - 1) // block * block


def test_a_newcomer_is_served_between_the_running_rows_cycles(engine: Engine) -> None:
    """A short request that arrives while a long generation runs gets its first token after
    its own prefill chunks plus two steps, and the long row emits at every step meanwhile
    (a long prompt never freezes the streams that run)."""
    long_request = requests(engine, [GREEDY] * len(ROWS))[4]
    long_request = GenerationRequest(
        long_request.prompt_ids, GREEDY, max_tokens=1000, ignore_eos=True, draft_tokens=None
    )
    prompt = engine.tokenizer.encode(" ".join(PROMPTS) * 3)
    chunks = -(-(len(prompt) - 1) // engine.prefill_chunk)
    assert chunks >= 2
    short = GenerationRequest(prompt, GREEDY, max_tokens=4, ignore_eos=True, draft_tokens=2)
    batch = BatchDecoder(engine, 2)
    batch.add("long", long_request)
    for _ in range(3):
        batch.step()
    batch.add("short", short)
    steps, short_tokens = 0, []
    while not short_tokens:
        steps += 1
        events = batch.step()
        assert any(key == "long" and item.token_ids for key, item in events)
        short_tokens = [t for key, item in events if key == "short" for t in item.token_ids]
    assert steps <= chunks + 2
    batch.drop("long")
    while len(batch):
        batch.step()


def test_newcomers_share_a_prefill_budget_first_come_first_served(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newcomers' prefill shares one budget of prompt tokens per step, in order of arrival:
    short prompts that fit start decoding together; the first that does not fit waits for the
    next step, and so does every newcomer behind it, even one that would fit. (The budget of a
    step where no row decodes is set here; once rows decode it is one chunk, which the short
    prompts left over fit in.)"""
    reqs = requests(engine, [GREEDY] * len(ROWS))
    sizes = [len(r.prompt_ids) - 1 for r in reqs]
    assert min(sizes[4:]) < sizes[3]  # a later, shorter newcomer that could overtake row 3
    assert sum(sizes[3:]) <= engine.prefill_chunk
    budget = sum(sizes[:3]) + sizes[3] - 1
    monkeypatch.setattr(batching_module, "PREFILL_TOKENS_IDLE", budget)
    batch = BatchDecoder(engine, len(reqs))
    for i, request in enumerate(reqs):
        batch.add(i, request)
    first_step: dict[int, int] = {}
    for step in range(3):
        for key, item in batch.step():
            assert not isinstance(item, BaseException), item
            if item.token_ids:
                first_step.setdefault(key, step)
    # prefill at step 0 for rows 0-2, their first cycle at step 1; the rest a step later
    assert [first_step.get(i) for i in range(3)] == [1, 1, 1]
    assert first_step.get(3) == 2, first_step
    assert all(first_step.get(i, 3) >= 2 for i in range(4, len(reqs))), first_step
    for key in range(len(reqs)):
        batch.drop(key)


@pytest.mark.fast
def test_rows_restore_from_and_save_to_the_conversation_cache() -> None:
    """Batch rows go through the conversation cache as single requests do: a second turn run
    as a row restores what the first turn's row saved, and emits what a cold run emits."""
    cached = Engine.load(str(DEMO))
    cached.enable_prefix_cache(64 << 20, block_tokens=32)
    cold = Engine.load(str(DEMO))
    first = [
        GenerationRequest(
            cold.tokenizer.encode(p * 4), GREEDY, max_tokens=24, ignore_eos=True, draft_tokens=None
        )
        for p in PROMPTS[:3]
    ]
    replies, _ = batched(cached, first)
    second = [
        replace(r, prompt_ids=r.prompt_ids + replies[i] + cold.tokenizer.encode(" and then?"))
        for i, r in enumerate(first)
    ]
    batch = BatchDecoder(cached, 3)
    for i, request in enumerate(second):
        batch.add(i, request)
    got: dict[int, list[int]] = {i: [] for i in range(3)}
    reused: dict[int, int] = {}
    while len(batch):
        for key, event in batch.step():
            got[key] += event.token_ids
            if event.finish_reason is not None:
                reused[key] = event.stats.cached_tokens
    for i, request in enumerate(second):
        assert got[i] == alone(cold, request)
        assert reused[i] >= 32  # at least one cached block of the first turn


def test_the_conversation_cache_holds_what_it_counts_after_batched_rows() -> None:
    """After a batched cycle a row's GDN states are views of the batch's stacked states; the
    cache must keep its own copies, or each snapshot would keep the whole batch's states alive
    behind a byte count that shows one row's."""
    import gc

    import mlx.core as mx

    from engine.cycle.sequence import start_sequence
    from engine.cycle.speculative import commit, launch_cycles, read_cycles

    engine = Engine.load(str(DEMO))
    engine.enable_prefix_cache(256 << 20, block_tokens=32)
    trunk, head = engine.trunk, engine.loaded.head
    seqs = [
        start_sequence(trunk, head, engine.tokenizer.encode(p), GREEDY, use_head=True)
        for p in PROMPTS
    ]
    for _ in range(2):
        results = read_cycles(launch_cycles(trunk, head, seqs, 2))
        for seq, result in zip(seqs, results, strict=True):
            commit(seq, result, len(result.emitted))
    cache = engine.prefix_cache
    # every row committed, so their states are views of the stacked ones; one row leaves
    cache.store(seqs[-1], trunk, head)
    counted = cache.describe()["bytes_held"]
    del seqs, results, seq, result
    gc.collect()
    mx.clear_cache()
    with_cache = mx.get_active_memory()
    cache.clear()
    gc.collect()
    mx.clear_cache()
    held = with_cache - mx.get_active_memory()
    assert counted > 0 and held <= 1.25 * counted, (held, counted)


def test_sampled_rows_of_a_batch_are_distributed_as_plain_sampling(
    widest_cycle: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chi-square homogeneity test of tests/engine/test_sampling.py, through batches: 400 rows,
    8 per batch (one K per batch, so that all 8 share every cycle: K = 1, 2, 3, 4 and
    automatic K in turn; seeded and unseeded batches alternate), against 400 requests decoded
    alone without drafts; the first three tokens, position by position."""
    # eight short prompts fit in one step's prefill budget, so that all 8 draw their first
    # tokens together (staggered, they would not all share a 3-token generation's cycles)
    engine = Engine.load(str(DEMO), draft_tokens=0)
    engine.enable_prefix_cache(64 << 20)  # 800 runs of one prompt: prefilled once
    prompt = engine.tokenizer.encode("def add(a, b):")
    params = SETTINGS["temp1-topk-topp"]
    n, capacity, ks = 400, 8, [1, 2, 3, 4, None]
    plain = _first_tokens(engine, prompt, params, 0, n)
    counted_entropy(monkeypatch, 1 << 41)
    rows: dict[int, list[int]] = {}
    accepted = proposed = 0
    widest_cycle.clear()
    for first in range(0, n, capacity):
        batch = BatchDecoder(engine, capacity)
        for seed in range(first, first + capacity):
            request = GenerationRequest(
                prompt,
                replace(params, seed=None if first // capacity % 2 else seed),
                3,
                draft_tokens=ks[first // capacity % len(ks)],
                ignore_eos=True,
            )
            batch.add(seed, request)
            rows[seed] = []
        while len(batch):
            for seed, item in batch.step():
                assert not isinstance(item, BaseException), item
                rows[seed] += item.token_ids
                if item.finish_reason is not None:
                    accepted += item.stats.accepted
                    proposed += item.stats.proposed
    assert max(widest_cycle) == capacity  # the rows really shared cycles
    assert 0.15 < accepted / proposed < 0.85  # acceptances and residual draws both ran
    together = np.array([rows[seed][:3] for seed in range(n)])
    for position in range(3):
        p = _homogeneity_pvalue(plain[:, position], together[:, position])
        assert p > ALPHA, f"position {position + 1}: p={p:.2g}"


def test_a_seeded_rows_chooser_sees_every_cycle_plain_look_aheads_too(
    load_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded row's next K follows every cycle it ran, the plain cycles the batch committed
    unread to launch the next one ahead included: had those gone unobserved, its K (and so its
    text) would depend on when its batch happened to look ahead."""
    from engine.scheduling.autok import SeededAutoK, SeededPlan

    engine = load_engine("dense-tied")
    engine.policy(None, sampled(0))
    engine.autok.seeded = SeededPlan(*SEEDED_PLANS["plain-first"])
    observed: list[int] = []
    observe = SeededAutoK.observe
    monkeypatch.setattr(
        SeededAutoK, "observe", lambda self, k, n: observed.append(k) or observe(self, k, n)
    )
    request = requests(engine, [sampled(7)] * len(ROWS))[0]
    events = list(engine.generate(replace(request, max_tokens=40, draft_tokens=None)))
    histogram = events[-1].stats.k_histogram
    assert histogram[0] > 2  # plain cycles, launched one ahead of the other
    assert len(observed) == sum(histogram) and observed.count(0) == histogram[0]
