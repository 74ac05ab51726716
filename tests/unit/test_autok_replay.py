"""Auto K replayed on recorded acceptance: within 3% of the best fixed K, without timing noise
in the verdict.

``tests/data/acceptance_demo.json`` (``scripts/experiments/record_acceptance.py``) holds, for the
24 bench prompts x 256 tokens of the demo model, greedy and with the Qwen preset, how many of 4
drafts the model accepts at every position, and the start-up cost tables of a bench run on this
machine. The replay drives the real ``AutoK``/``RequestAutoK``: a K-cycle at position t accepts
``min(K, accepted[t])`` drafts and costs the table's seconds (with the head's catch-up over what
the previous cycle committed). Auto K decides with a *misstated* table — plain or drafting
cycles priced 15% off, as a start-up measurement on a loaded machine can be, or one drafting K
5% off against the others — while the true
table prices what it chose and, with 20% noise, is what its calibration gets to see. Every case
also runs on a compute-bound variant of the table (``MACHINES``), where the best K is another.

A bench run compares auto with fixed K too, but on a 2-core machine whose noise moves each
configuration 5-15%; this is the exact version of the issue's "within 3% of the best fixed K".
Switching between plain and drafting cycles is priced as the engine runs it (a plain cycle
after drafting is not launched ahead; a probe catches up on the plain positions), plus a
penalty for cold caches in one test. The engine's auto K decides exactly as the replay does
on the same table (the last test); what the replay cannot see is what those decisions cost in
a real run beyond the table and how noisy the run's calibration is: greedy auto has come out
1-10% behind K=4 in bench runs where this replay put it level (docs/BENCHMARKS.md, "Speed-up and
acceptance against mlx-lm").
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cycle.sequence import MAX_CATCH_UP
from engine.scheduling.autok import POLICIES, AutoK, KindPolicy, RequestAutoK
from engine.scheduling.costs import CostTable

ROOT = Path(__file__).resolve().parents[2]
RECORD = json.loads((ROOT / "tests" / "data" / "acceptance_demo.json").read_text())


def policy(sampler: str) -> KindPolicy:
    return POLICIES["greedy" if sampler == "greedy" else "sampled"]


#: Seconds each verified position beyond the first adds to a trunk forward. "measured": the
#: record's table as timed on this machine (verify cost grows slowly with T, so with the tuned
#: head's acceptance K=4 is the best fixed K, greedy and sampled). "compute-bound": 1 ms more
#: per position, a machine where compute per byte is scarce (Apple GPUs, small
#: CPUs); there a sampled K=2 is best and K=4 falls behind plain decoding.
MACHINES = {"measured": 0.0, "compute-bound": 1e-3}


#: the start-up tables of a ``make bench`` run on the demo model at today's speed, where a plain
#: cycle takes ~0.6 ms and greedy K=3 pays ~1.1x (the record's table is an older, slower build
#: where drafting paid far more): ``true_table``'s machine "today"
TODAY = json.loads((ROOT / "tests" / "data" / "costs_demo_today.json").read_text())


def true_table(sampler: str, machine: str = "measured") -> CostTable:
    if machine == "today":
        table, extra = TODAY["costs"][sampler], 0.0
    else:
        table, extra = RECORD["costs"][sampler], MACHINES[machine]
    return CostTable(
        cycle=[c + k * extra for k, c in enumerate(table["cycle"])],
        trunk=[t + i * extra for i, t in enumerate(table["trunk"])],
        head_step=table["head_step"],
        absorb=table["absorb"],
        # today's switch cost is measured beyond a catch-up priced up to MAX_CATCH_UP; the
        # record's cases price long catch-ups at ``absorb``'s last count, as they were tuned
        absorb_far=table["absorb_far"] if machine == "today" else 0.0,
    )


def cycle_seconds(table: CostTable, k: int, committed_before: int) -> float:
    """What a cycle costs, written here rather than taken from ``CostTable.expected_seconds`` (the
    code under test): a K-cycle's measured seconds (whose head caught up on one position) plus
    the head's catch-up over the ``committed_before`` positions instead of one — the measured
    ``absorb`` counts, then linear up to ``absorb_far`` at ``MAX_CATCH_UP``."""
    if k == 0:
        return table.cycle[0]
    absorb = table.absorb or [table.head_step]

    def catch_up(n: int) -> float:
        if n <= len(absorb) or not table.absorb_far:
            return absorb[min(n, len(absorb)) - 1]
        share = (min(n, MAX_CATCH_UP) - len(absorb)) / (MAX_CATCH_UP - len(absorb))
        return absorb[-1] + share * (table.absorb_far - absorb[-1])

    return table.cycle[k] + catch_up(committed_before) - catch_up(1)


def replay(
    sampler: str,
    policy: int | AutoK,
    noise: float = 0.0,
    slow_prompts: range = range(0),
    switch_penalty: tuple[float, float] = (0.0, 0.0),
    prompts: list[int] | None = None,
    machine: str = "measured",
    warm_up: tuple[float, ...] = (),
    pauses: tuple[float, float] = (0.0, 0.0),
    spells: tuple[float, float] = (0.0, 1.0),
) -> tuple[float, list[int]]:
    """Tokens per second of ``policy`` (a fixed K, or auto K) over every recorded prompt (or
    those listed in ``prompts``, in that order), and its histogram of K. The ``slow_prompts``
    run on a machine 1.5x slower.

    Switching costs as in the engine: a plain cycle after a drafting one (or a request's
    first) is not launched ahead and costs a synchronous forward (``trunk[0]``); a drafting
    cycle after plain ones catches up on up to ``MAX_CATCH_UP`` of their positions.
    ``switch_penalty`` adds seconds to the first plain cycle after drafting and to the first
    drafting cycle after plain ones (cold caches; what the table does not price), and
    ``warm_up`` multiplies the second, third, ... cycle of a stretch of one class (plain or
    drafting) by its factors, in that order. ``pauses``: (rate a second, seconds) of the
    machine's pauses (a preemption, another process's burst), each cycle paused with the
    probability its length gives: paid and seen, so long cycles are paused more often.
    ``spells``: (seconds, factor): the machine runs every cycle ``factor`` times slower in every
    other period of that many seconds (of the replay's own clock), both classes alike.
    """
    rng = random.Random(0)
    pause_rng = random.Random(1)
    tokens = seconds = 0.0
    truth = true_table(sampler, machine)
    histogram = [0] * len(truth.cycle)
    rows = RECORD["samplers"][sampler]
    for i, row in enumerate(rows if prompts is None else [rows[i] for i in prompts]):
        table = truth.scaled(1.5, 1.5) if i in slow_prompts else truth
        accepted = row["accepted"]
        request = policy.for_request() if isinstance(policy, AutoK) else None
        position, pending, previous_k, stretch = 0, 1, 0, 0
        while position < len(accepted):
            k = request.choose(None) if request else policy
            k = max(0, min(k, len(accepted) - position - 1))  # as the engine caps at max_tokens
            n_accepted = min(k, accepted[position])
            if k:
                cost = cycle_seconds(table, k, min(pending, MAX_CATCH_UP))
                cost += switch_penalty[1] if previous_k == 0 and position else 0.0
            elif previous_k or not position:
                cost = max(table.cycle[0], table.trunk[0]) + switch_penalty[0]
            else:
                cost = table.cycle[0]
            stretch = stretch + 1 if position and (k > 0) == (previous_k > 0) else 0
            cost *= warm_up[stretch - 1] if 0 < stretch <= len(warm_up) else 1.0
            cost += pauses[1] if pause_rng.random() < pauses[0] * cost else 0.0
            if spells[0] and int(seconds / spells[0]) % 2:
                cost *= spells[1]
            seconds += cost
            if request:
                request.observe(k, n_accepted)
                seen = cost * math.exp(rng.gauss(0.0, noise)) if position else None
                request.observe_seconds(k, n_accepted + 1, seen)
            pending = n_accepted + 1 if k else (pending + 1 if previous_k == 0 else 1)
            previous_k = k
            position += n_accepted + 1
            histogram[k] += 1
        tokens += len(accepted)
    return tokens / seconds, histogram


#: a slow spell of the machine over prompts that decode mostly plain (the prose ones), then
#: prompts where drafting pays: plain decoding's factor, timed in the spell, must not stay there
SLOW_SPELL = range(10, 14)

MISSTATED = {
    "exact": (1.0, 1.0),
    "plain-15%": (0.85, 1.0),
    "plain+15%": (1.15, 1.0),
    "drafting-15%": (1.0, 0.85),
    "drafting+15%": (1.0, 1.15),
    "slow spell": (1.0, 1.0),
}


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
@pytest.mark.parametrize("table_error", list(MISSTATED))
def test_auto_k_is_within_3_percent_of_the_best_fixed_k(
    sampler: str, table_error: str, machine: str
) -> None:
    truth = true_table(sampler, machine)
    auto_k = AutoK(truth.scaled(*MISSTATED[table_error]), policy=policy(sampler))
    slow = SLOW_SPELL if table_error == "slow spell" else range(0)
    fixed = {
        k: replay(sampler, k, slow_prompts=slow, machine=machine)[0]
        for k in range(len(truth.cycle))
    }
    best = max(fixed, key=fixed.__getitem__)
    auto, histogram = replay(sampler, auto_k, noise=0.2, slow_prompts=slow, machine=machine)
    assert auto >= 0.97 * fixed[best], (
        f"auto {auto / fixed[0]:.3f}x of plain, best fixed K={best} {fixed[best] / fixed[0]:.3f}x;"
        f" auto's K histogram {histogram}"
    )


@pytest.mark.parametrize("machine", [*MACHINES, "marginal"])
@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
@pytest.mark.parametrize("spell", [0.5, 2.0])
def test_auto_k_keeps_drafting_priced_against_plain_through_the_machines_spells(
    sampler: str, machine: str, spell: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine runs every cycle 1.3x slower in every other ``spell`` seconds, as this 2-core
    VM did (settled plain cycles at 1.03x, then 1.32x, then 1.06x the table within one run). Auto
    K chooses on what drafting costs against plain decoding, which the spells leave alone: a
    class timed in a slow spell while the other did not run must not misprice the two against
    each other. Also on a "marginal" machine, 1.5 ms more per verified position, where sampled
    drafting loses ~6% and greedy drafting pays ~10%: there, with one factor per class each
    timed on its own, sampled auto came to 0.927x of the best fixed K (spells of 0.5 s)."""
    monkeypatch.setitem(MACHINES, "marginal", 1.5e-3)
    spells = (spell, 1.3)
    truth = true_table(sampler, machine)
    fixed = {
        k: replay(sampler, k, machine=machine, spells=spells)[0] for k in range(len(truth.cycle))
    }
    auto, histogram = replay(
        sampler, AutoK(truth, policy=policy(sampler)), noise=0.2, machine=machine, spells=spells
    )
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"


def test_auto_k_re_times_plain_decoding_where_it_only_drafts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a machine where sampled drafting loses ~6% (1.5 ms more per verified position), a
    start-up table that prices plain cycles 15% over makes drafting look better: auto drafts,
    and its calibration, which learns drafting's cost over plain cycles only where both run,
    never sees a plain cycle to correct it (0.929x of the best fixed K, 8 plain cycles of
    2,650). A short plain stretch every ``RETIME_PLAIN_EVERY`` timed drafting cycles re-times
    plain decoding, and auto stops drafting."""
    monkeypatch.setitem(MACHINES, "marginal", 1.5e-3)
    truth = true_table("preset:qwen", "marginal")
    fixed = {k: replay("preset:qwen", k, machine="marginal")[0] for k in range(len(truth.cycle))}
    auto_k = AutoK(truth.scaled(1.15, 1.0), policy=policy("preset:qwen"))
    auto, histogram = replay("preset:qwen", auto_k, noise=0.2, machine="marginal")
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"
    assert histogram[0] > sum(histogram[1:])


#: what starting to draft costs beyond the table at today's speed: a K=3 cycle after 30 plain
#: ones ~0.7 ms over its settled cost and the table's catch-up (``GREEDY_STOP_MARGIN``)
TODAY_SWITCH = (0.0, 0.7e-3)


@pytest.mark.parametrize("table_error", [e for e in MISSTATED if e != "slow spell"])
def test_greedy_auto_k_prices_its_switches_at_todays_costs(table_error: str) -> None:
    """At today's costs a plain cycle is short and starting to draft again dear against it (a
    probe, the head's catch-up, a cold first cycle, the stretch's warm-up): a greedy request
    that stopped drafting at the first cycle plain decoding looked 1% better came to 0.946-0.969x
    of the best fixed K in four of these five cases."""
    truth = true_table("greedy", "today")
    costs = {"machine": "today", "warm_up": WARM_UP, "switch_penalty": TODAY_SWITCH}
    fixed = {k: replay("greedy", k, **costs)[0] for k in range(len(truth.cycle))}
    auto_k = AutoK(truth.scaled(*MISSTATED[table_error]), policy=policy("greedy"))
    auto, histogram = replay("greedy", auto_k, noise=0.2, **costs)
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
@pytest.mark.parametrize("cheap_k", [2, 3])
def test_auto_k_learns_the_price_of_a_drafting_k_the_table_gets_wrong(
    sampler: str, machine: str, cheap_k: int
) -> None:
    """The start-up table prices one drafting K 5% under its true cost relative to the others
    (in a bench run the in-run/table ratio ranged 1.05-1.11 across K=1..4). The class factors
    cannot see that; the K's own tilt does once it runs. Without the tilts, auto came to 0.952x
    of the best fixed K here (compute-bound, greedy, K=2 cheap)."""
    truth = true_table(sampler, machine)
    misstated = replace(
        truth, cycle=[c * (0.95 if k == cheap_k else 1.0) for k, c in enumerate(truth.cycle)]
    )
    fixed = {k: replay(sampler, k, machine=machine)[0] for k in range(len(truth.cycle))}
    auto, histogram = replay(
        sampler, AutoK(misstated, policy=policy(sampler)), noise=0.2, machine=machine
    )
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"


@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
def test_auto_k_pays_for_its_switches(sampler: str) -> None:
    """Switching costs more than the table says: in traces of auto's cycle times the first
    plain cycle after drafting took 3.9-4.5 ms against 2.0 ms steady, and a probe's first
    cycle ~1 ms over the table. Auto K must stay within 3% of the best fixed K with that too."""
    penalty = (2.0e-3, 1.0e-3)
    fixed = {k: replay(sampler, k, switch_penalty=penalty)[0] for k in range(5)}
    auto_k = AutoK(true_table(sampler), policy=policy(sampler))
    auto, histogram = replay(sampler, auto_k, 0.2, switch_penalty=penalty)
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"


#: a stretch's second, third and fourth cycles against its settled ones, as the demo model's
#: decode loop ran a drafting stretch after 64 plain cycles (``plain_stretch.py timing``)
WARM_UP = (1.23, 1.08, 1.03)


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
def test_a_stretchs_first_cycles_do_not_price_its_settled_ones(sampler: str, machine: str) -> None:
    """A stretch's first cycles after a switch cost more than its settled ones (``WARM_UP``),
    and auto K chooses between settled costs: priced exactly, with no noise, the calibration
    must stay at 1 however often auto switches, and auto stay within 3% of the best fixed K
    under the same costs. A probe's second cycle, when it was timed, priced drafting ~5-15%
    over its settled cost here (more where a run is mostly plain), and a bench run's greedy
    auto, calibrated by its probes, decoded mostly plain where K=3 paid 1.13x."""
    truth = true_table(sampler, machine)
    auto_k = AutoK(truth, policy=policy(sampler))
    auto, histogram = replay(sampler, auto_k, machine=machine, warm_up=WARM_UP)
    assert histogram[0] > 0 and sum(histogram[1:]) > 100  # both classes ran
    assert auto_k.calibration == pytest.approx([1.0, 1.0], abs=1e-9)
    fixed = {
        k: replay(sampler, k, machine=machine, warm_up=WARM_UP)[0] for k in range(len(truth.cycle))
    }
    noisy, noisy_histogram = replay(
        sampler, AutoK(truth, policy=policy(sampler)), 0.2, machine=machine, warm_up=WARM_UP
    )
    assert noisy >= 0.97 * max(fixed.values()), f"auto's K histogram {noisy_histogram}"


@pytest.mark.parametrize("sampler", ["greedy", "preset:qwen"])
def test_exact_timings_leave_the_table_uncalibrated(sampler: str) -> None:
    """Timings that are exactly what the table says (priced by ``cycle_seconds``, no noise)
    must leave every calibration factor at 1: the calibration compares each timed cycle with
    the table's price for the catch-up that cycle ran. Drafting cycles here catch up on 1..5
    positions (whatever the previous one committed), so a price that forgot the catch-up would
    read every multi-token commit as a slow machine."""
    auto_k = AutoK(true_table(sampler), policy=policy(sampler))
    _, histogram = replay(sampler, auto_k)
    assert sum(histogram[1:]) > 1000 and auto_k.timed_cycles > 1000
    assert auto_k.calibration == pytest.approx([1.0, 1.0], abs=1e-9)
    assert auto_k.tilt == pytest.approx([1.0] * len(auto_k.tilt), abs=1e-9)


def test_the_record_is_informative() -> None:
    """The replay means something only if the choice matters: neither trivial policy, "never
    draft" (K=0) nor "always draft MAX_AUTO_K" (K=4), comes within the 3% auto K must keep of
    the best fixed K on both machines of the test above, so neither would pass it; and
    acceptance varies within prompts."""
    behind = {0: [], 4: []}
    for machine in MACHINES:
        for sampler in ("greedy", "preset:qwen"):
            fixed = {k: replay(sampler, k, machine=machine)[0] for k in range(5)}
            for k in behind:
                behind[k].append(fixed[k] / max(fixed.values()))
    assert min(behind[0]) < 0.97 and min(behind[4]) < 0.97, behind
    row = RECORD["samplers"]["greedy"][0]["accepted"]
    assert min(row) == 0 and max(row) == RECORD["draft_tokens"]


def test_the_replay_decides_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay is only as good as its likeness to the engine. Greedy text is the same for
    every K, so with the same cost table and the calibration frozen, auto K in the real decode
    loop must choose exactly the K the replay chooses, cycle for cycle — which holds only while
    the head's cache is fed as in steady drafting (the record's) after plain stretches too:
    when a probe caught up on the latest 9 plain positions only, the 4-layer model ran 1,755
    plain cycles over the 24 prompts where the replay ran 1,917."""
    from engine.api import GenerationRequest
    from engine.bench.prompts import load_prompts
    from engine.runtime import Engine
    from engine.scheduling.autok import EngineAutoK
    from sampling.params import SamplingParams

    monkeypatch.setattr(AutoK, "calibrate", lambda self, *args, **kwargs: None)
    # Priced as a machine where greedy drafting pays ~10% (1.5 ms more per verified position):
    # there auto runs plain stretches on these prompts (with the measured table the tuned head
    # hardly ever goes plain). Code, then prose and chats with plain stretches, probes and
    # switches between several K.
    chosen, machine = [0, 9, 16, 19], "marginal"
    monkeypatch.setitem(MACHINES, machine, 1.5e-3)
    engine = Engine.load(str(ROOT / "models" / "qwen3.5-demo"), draft_tokens=0)
    engine.default_draft_tokens = None  # auto, with the table below instead of a measured one
    engine.autok = EngineAutoK(engine)
    engine.autok.kinds["greedy"] = AutoK(true_table("greedy", machine))
    prompts = load_prompts(ROOT / "configs" / "bench_prompts.jsonl", engine.tokenizer, None)
    histogram = [0] * 5
    for i in chosen:
        assert prompts[i]["id"] == RECORD["samplers"]["greedy"][i]["id"]
        request = GenerationRequest(
            prompts[i]["ids"],
            SamplingParams(temperature=0.0),
            RECORD["max_tokens"],
            draft_tokens=None,
            ignore_eos=True,
        )
        for event in engine.generate(request):
            pass
        histogram = [a + b for a, b in zip(histogram, event.stats.k_histogram, strict=False)]
    _, replayed = replay(
        "greedy", AutoK(true_table("greedy", machine)), prompts=chosen, machine=machine
    )
    assert histogram == replayed
    assert histogram[0] > 30 and sum(histogram[1:]) > 100  # both kinds of cycle ran


def test_the_sampled_kind_starts_from_the_seeded_plan_not_from_its_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampled kind's long-run estimates are every later request's prior. Explored on the
    first request alone, a first request that happens to accept little (sampled acceptance
    varies by prompt) sets them low and later requests start plain (in a bench run, an
    unseeded kind whose first request accepted 0.61 stayed plain for 3,471 of 3,524 cycles).
    ``EngineAutoK`` starts the kind from the seeded plan's acceptance on fixed texts instead:
    replayed with the prompts that accept least in their first cycles going first, on a
    machine where drafting pays ~6% over plain decoding (as the demo's sampled cycles do on a
    2-core CPU), auto from the plan comes within 1.5% of the best fixed K. (Explored there, its
    probes now lift the kind as well: 750 plain cycles, 0.996x; from the plan 626, 0.987x.)"""
    import engine.scheduling.autok as autok
    from engine.scheduling.autok import EXPLORE_CYCLES, EngineAutoK, SeededPlan
    from sampling.params import SamplingParams

    sampler, machine = "preset:qwen", "break-even"
    monkeypatch.setitem(MACHINES, machine, 0.7e-3)
    truth = true_table(sampler, machine)
    rows = RECORD["samplers"][sampler]
    order = sorted(range(len(rows)), key=lambda i: sum(a >= 1 for a in rows[i]["accepted"][:40]))
    positions = [a for row in rows for a in row["accepted"]]
    acceptance = [sum(a > i for a in positions) / sum(a >= i for a in positions) for i in range(4)]

    monkeypatch.setattr(autok, "cached_costs", lambda engine, kind: truth)
    engine_auto_k = EngineAutoK(engine=None)  # type: ignore[arg-type]
    engine_auto_k.seeded = SeededPlan(acceptance, truth.cycle)
    engine_auto_k.costs(SamplingParams(temperature=0.7, seed=None))
    from_plan = engine_auto_k.kinds["sampled"]
    counts = from_plan.counts
    assert [h / t for h, t in zip(counts.hits, counts.trials, strict=True)] == pytest.approx(
        acceptance
    )
    assert from_plan.drafting_cycles_seen == EXPLORE_CYCLES  # no exploration

    fixed = {k: replay(sampler, k, prompts=order, machine=machine)[0] for k in range(5)}
    best = max(fixed.values())
    assert best > 1.05 * fixed[0]  # drafting pays, a little
    auto, histogram = replay(sampler, from_plan, 0.2, prompts=order, machine=machine)
    assert auto >= 0.985 * best, histogram


def raising_after_four(auto: AutoK, factor: float) -> AutoK:
    """``auto`` with its drafting-over-plain ratio multiplied by ``factor`` as its fifth request
    starts: a price raised mid-run, as switches at the machine's moments raise it."""
    served = [0]

    def for_request() -> RequestAutoK:
        served[0] += 1
        if served[0] == 5:
            auto.ratio += math.log(factor)
        return AutoK.for_request(auto)

    auto.for_request = for_request  # type: ignore[method-assign]
    return auto


def test_auto_k_re_times_drafting_where_it_only_decodes_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a machine where sampled K=2 pays ~1.10x (0.5 ms more per verified position), the
    sampled kind's drafting price is raised 12% after four requests, as switches at the
    machine's moments raise it on this VM. Probes alone cannot bring it down (a probe's second
    cycle only bounds it, and it is still warming up), so without a re-timing probe auto
    decoded plain from then on: 0.923x of the best fixed K, 4,987 plain cycles of 5,341. A
    probe that drafts past the warm-up every ``RETIME_DRAFTING_EVERY`` plain timings prices
    drafting afresh, and auto drafts again."""
    monkeypatch.setitem(MACHINES, "slight", 0.5e-3)
    costs = {"machine": "slight", "warm_up": WARM_UP, "switch_penalty": TODAY_SWITCH}
    truth = true_table("preset:qwen", "slight")
    fixed = {k: replay("preset:qwen", k, **costs)[0] for k in range(len(truth.cycle))}
    auto_k = raising_after_four(AutoK(truth, policy=policy("preset:qwen")), 1.12)
    auto, histogram = replay("preset:qwen", auto_k, noise=0.1, **costs)
    assert auto >= 0.97 * max(fixed.values()), f"auto's K histogram {histogram}"
    assert histogram[0] < sum(histogram[1:])
