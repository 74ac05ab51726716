"""Automatic K: the cost model and the per-cycle choice."""

from __future__ import annotations

from dataclasses import replace

import pytest

import engine.scheduling.autok as autok_module
from engine.scheduling.autok import (
    DEEPER_PROBE_EVERY,
    EXPLORE_CYCLES,
    PLAIN_DECIDE_EVERY,
    PROBE_EVERY,
    UNSEEN_DECAY,
    AcceptanceCounts,
    AutoK,
)
from engine.scheduling.costs import (
    MAX_AUTO_K,
    CostTable,
    best_k,
    committed_distribution,
    expected_tokens,
)


def test_expected_tokens_is_one_plus_products_of_acceptance() -> None:
    a = [0.8, 0.5, 0.5]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_best_k_follows_costs_and_acceptance() -> None:
    cheap = CostTable(cycle=[1.0, 1.1, 1.2, 1.3, 1.4], trunk=[1.0] * 5, head_step=0.05)
    dear = CostTable(cycle=[1.0, 1.9, 2.8, 3.7, 4.6], trunk=[1.0] * 5, head_step=0.9)
    assert best_k(cheap, [0.9] * 4) == 4  # bandwidth-bound: long drafts pay
    assert best_k(cheap, [0.05] * 4) == 0  # nothing accepted: do not speculate
    assert best_k(dear, [0.9] * 4) == 0  # drafting costs more than it returns


def test_auto_k_adapts_to_observed_acceptance_and_probes_from_zero() -> None:
    costs = CostTable(cycle=[1.0, 1.2, 1.4, 1.6, 1.8], trunk=[1.0] * 5, head_step=0.1)
    request = AutoK(costs).for_request()
    assert request.choose(None) > 0
    choices = []
    for _ in range(400):  # the head never gets anything right
        choices.append(request.choose(None))
        request.observe(choices[-1], 0)
    plain = choices[choices.index(0) :]
    # plain decoding, with probes (and, as old evidence fades, short retries) now and then
    assert plain.count(0) > 0.9 * len(plain)
    for _ in range(300):  # text turns predictable again: the next probe hits
        request.observe(k := request.choose(None), k)
    choices = [request.choose(None) for _ in range(2 * PROBE_EVERY)]
    assert min(choices) > 0  # drafting again


def test_unobserved_positions_borrow_from_the_previous_one() -> None:
    """Only K=1 has ever run: a high first-position acceptance still justifies trying longer
    drafts when cycles are cheap (otherwise auto K could never leave K=1)."""
    costs = CostTable(cycle=[1.0, 1.05, 1.1, 1.15, 1.2], trunk=[1.0] * 5, head_step=0.02)
    kind = AutoK(costs, drafting_cycles_seen=100)
    request = kind.for_request()
    for _ in range(40):
        request.observe(1, 1)
    long_run = kind.counts.estimates()
    assert long_run[1] == pytest.approx(long_run[0] * UNSEEN_DECAY)
    assert request.estimates()[1] == pytest.approx(long_run[1])
    assert request.choose(None) >= 2


def test_cycle_cost_adds_the_expected_catch_up_of_the_head() -> None:
    """A K-cycle's head first catches up on what the previous cycle committed (1..K+1
    positions); the expected cost weighs each catch-up by how often that many are committed."""
    from engine.scheduling.costs import committed_distribution

    costs = CostTable(
        cycle=[1.0, 2.0, 3.0], trunk=[1.0] * 3, head_step=0.1, absorb=[0.5, 0.75, 1.0]
    )
    dist = committed_distribution([0.6, 0.5], 2)
    assert dist == pytest.approx([0.4, 0.3, 0.3]) and sum(dist) == pytest.approx(1.0)
    assert expected_tokens([0.6, 0.5], 2) == pytest.approx(1 + 0.6 + 0.3)
    assert costs.cycle_cost([1.0, 1.0], 2) == pytest.approx(3.0 + 0.5)  # always 3 committed
    assert costs.cycle_cost([0.0, 0.0], 2) == pytest.approx(3.0)  # always 1: no extra
    assert costs.cycle_cost([0.6, 0.5], 2) == pytest.approx(3.0 + 0.3 * 0.25 + 0.3 * 0.5)
    assert costs.cycle_cost([1.0, 1.0], 0) == 1.0


def test_a_request_without_evidence_explores_at_the_longest_k() -> None:
    """No counts to go on (the first request of its kind): draft MAX_AUTO_K for a few cycles,
    then follow the evidence — plain decoding if nothing is accepted — and never explore again,
    however long a plain stretch lets the decayed counts fade."""
    costs = CostTable(cycle=[1.0, 1.65, 2.0, 2.35, 2.7], trunk=[1.0] * 5, head_step=0.3)
    hits, misses = AutoK(costs).for_request(), AutoK(costs).for_request()
    first = [hits.choose(None), misses.choose(None)]
    assert first == [MAX_AUTO_K, MAX_AUTO_K]
    for _ in range(EXPLORE_CYCLES + 10):
        hits.observe(k := hits.choose(None), k)
        misses.observe(k := misses.choose(None), 0)
    assert hits.choose(None) >= 3 and misses.choose(None) == 0
    choices = []
    for _ in range(300):
        misses.observe(k := misses.choose(None), 0)
        choices.append(k)
    assert MAX_AUTO_K not in choices and choices.count(0) > 0.9 * len(choices)


def test_one_hit_probe_from_plain_decoding_resumes_drafting_quickly() -> None:
    """A request left at the prior (0.6: with these costs K=0 wins) once exploration is over:
    probes that hit must bring drafting back within a few probes, not a dozen."""
    costs = CostTable(cycle=[1.0, 1.65, 2.0, 2.35, 2.7], trunk=[1.0] * 5, head_step=0.3)
    request = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES).for_request()
    choices = []
    for _ in range(4 * PROBE_EVERY):
        k = request.choose(None)
        choices.append(k)
        request.observe(k, k)  # every draft is accepted
    assert choices[0] == 0 and sum(c > 0 for c in choices[-8:]) >= 7
    assert choices.index(next(c for c in choices if c > 1)) <= 2 * PROBE_EVERY + 1


def test_a_probe_that_hits_outweighs_a_bad_start() -> None:
    """A request starts badly (1 of 4 drafts accepted for 12 cycles, as a bench prompt did) and
    goes plain; then the text turns predictable. The first probe that hits must bring drafting
    back: the misses from before the plain stretch age as if the stretch had drafted. (When
    they aged at the plain rate the request stayed plain for hundreds of cycles.)"""
    costs = CostTable(cycle=[1.0, 1.9, 2.3, 2.7, 3.1], trunk=[1.0] * 5, head_step=0.4)
    kind = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES)
    for _ in range(50):  # the kind's record: drafting pays
        for position in range(MAX_AUTO_K):
            kind.counts.observe(position, True)
    request = kind.for_request()
    for _ in range(12):
        request.observe(4, 1)
    assert request.choose(None) == 0
    choices = []
    for _ in range(2 * PROBE_EVERY + 4):
        k = request.choose(None)
        choices.append(k)
        request.observe(k, k)  # from now on every draft is accepted
    first_probe = next(i for i, k in enumerate(choices) if k)
    assert all(k > 0 for k in choices[first_probe:])  # drafting from the first probe on


def test_a_plain_stretch_decides_every_few_cycles_and_probes_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a plain stretch auto K weighs the K's afresh on one cycle in ``PLAIN_DECIDE_EVERY``
    (its ~20 µs were what auto K cost over fixed K=0 where plain cycles are short), and
    nothing else moves: the same K every cycle and its probes on the same cycles as deciding
    every cycle, a new request deciding on its first."""
    costs = CostTable(cycle=[1.0, 1.5, 2.0, 2.5, 3.0], trunk=[1.0] * 5, head_step=0.4)

    def run(every: int) -> tuple[list[int], list[int]]:
        monkeypatch.setattr(autok_module, "PLAIN_DECIDE_EVERY", every)
        kind = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES)
        choices: list[int] = []
        weighed: list[int] = []  # the cycles on which the K's were weighed
        rates = kind.rates

        def counted(acceptance: list[float]) -> list[float]:
            weighed.append(len(choices))
            return rates(acceptance)

        monkeypatch.setattr(kind, "rates", counted)
        request = kind.for_request()
        for _ in range(20 * PROBE_EVERY):
            k = request.choose(None)
            choices.append(k)
            request.observe(k, 0)  # drafts never accepted: plain pays
        return choices, weighed

    every_cycle, weighed_every_cycle = run(1)
    stretched, weighed = run(PLAIN_DECIDE_EVERY)
    assert stretched == every_cycle and any(every_cycle)  # the same K, the same probes
    assert weighed[0] == 0 and stretched[0] == 0  # a new request decides on its first cycle
    assert len(weighed) <= len(weighed_every_cycle) // 2


def test_no_probe_where_drafting_could_not_pay_even_if_every_draft_were_accepted() -> None:
    """A probe from plain decoding costs its drafting cycles and the head's catch-up; where no K
    would pay even with every draft accepted (a fast model's plain cycles: the demo model in 8
    bits), auto K does not probe at all. Where some K would, the same stretch probes."""
    hopeless = CostTable(cycle=[1.0, 2.1, 3.1, 4.1, 5.1], trunk=[1.0] * 5, head_step=0.4)
    paying = CostTable(cycle=[1.0, 1.9, 2.9, 3.9, 4.9], trunk=[1.0] * 5, head_step=0.4)
    for costs, probes in ((hopeless, False), (paying, True)):
        kind = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES)
        assert kind.drafting_hopeless() is not probes
        request = kind.for_request()
        choices = []
        for _ in range(10 * PROBE_EVERY):
            k = request.choose(None)
            choices.append(k)
            request.observe(k, 0)
        assert any(choices) is probes


def test_a_deeper_probe_frees_an_estimate_pinned_by_an_early_miss() -> None:
    """One early miss at position 2 makes K=1 look best, and K=1 cycles never reveal position 2
    again (the miss only fades with age). The one-longer probe reveals it within a few probes,
    and auto K goes deeper."""
    costs = CostTable(cycle=[1.0, 1.3, 1.76, 2.3, 2.8], trunk=[1.0] * 5, head_step=0.4)
    request = AutoK(costs).for_request()
    for _ in range(3):
        request.observe(1, 1)
    request.observe(2, 1)  # the miss
    for _ in range(3 * DEEPER_PROBE_EVERY):
        k = request.choose(None)
        request.observe(k, k)  # from now on everything is accepted
    assert request.estimates()[1] > 0.8
    assert request.choose(None) >= 2


def test_a_request_falls_back_to_its_kinds_estimates_when_its_own_evidence_fades() -> None:
    """Position 4 is revealed 20x less often than position 1 (and accepted only half the
    time): a new request starts from the kind's rates, not from the fixed prior; and after a
    dry spell put a request on plain decoding, a long plain stretch brings its estimates back
    to the kind's, so it drafts again."""
    costs = CostTable(cycle=[1.0, 1.3, 1.5, 1.7, 1.9], trunk=[1.0] * 5, head_step=0.2)
    shared = AutoK(
        costs,
        AcceptanceCounts(hits=[190.0, 180.0, 170.0, 5.0], trials=[200.0, 190.0, 180.0, 10.0]),
        drafting_cycles_seen=200,
    )
    request = shared.for_request()
    assert request.estimates()[3] == pytest.approx(shared.counts.estimates()[3], abs=0.02)
    assert request.estimates()[3] < 0.6 and request.choose(None) >= 2
    for _ in range(20):  # a dry spell
        request.observe(k := request.choose(None), 0)
    assert request.choose(None) == 0
    for _ in range(150):  # plain cycles (and probes that hit)
        k = request.choose(None)
        request.observe(k, k)
    assert request.choose(None) >= 2


def test_the_calibration_tells_the_machines_speed_from_drafting_over_plain() -> None:
    """The start-up table said a plain cycle costs 1.0 and a K=1 cycle 1.6: at acceptance 0.55
    plain decoding wins. In the run plain cycles take 1.4: the machine is slower, and drafting
    is priced 1.4x too (a class timed alone says nothing of the other's price against it), so
    the choice stands. Then stretches of K=1 cycles at the table's 1.6 alternate with plain
    ones at 1.4: drafting is cheaper against plain than the table said, and wins. Then K=1 takes
    1.5x the table while plain stays at 1.4: plain wins again. Timings across a plain/drafting
    switch are not counted."""
    costs = CostTable(cycle=[1.0, 1.6, 2.2, 2.8, 3.4], trunk=[1.0] * 5, head_step=0.5)
    kind = AutoK(costs, drafting_cycles_seen=100)
    for i in range(100):
        kind.counts.observe(0, i < 55)  # a_1 = 0.55
    request = kind.for_request()

    def best() -> int:
        rates = kind.rates(request.estimates())
        return max(range(len(rates)), key=rates.__getitem__)

    assert best() == 0
    request.observe_seconds(0, 1, None)
    request.observe_seconds(2, 3, 9.0)  # a probe after a plain cycle: not counted
    request.observe_seconds(0, 1, 9.0)  # the first plain cycle after it: not counted
    assert kind.calibration == [1.0, 1.0]
    for _ in range(200):
        request.observe_seconds(0, 1, 1.4)
    assert kind.calibration == pytest.approx([1.4, 1.4], rel=0.01)
    assert best() == 0
    for _ in range(20):
        for _ in range(10):
            request.observe_seconds(1, 2, 1.6)
        for _ in range(10):
            request.observe_seconds(0, 1, 1.4)
    assert kind.calibration[0] == pytest.approx(1.4, rel=0.01)
    assert kind.calibration[1] * kind.tilt[1] == pytest.approx(1.0, rel=0.01)
    assert best() == 1
    assert request.choose(None) > 0  # and the choice follows the calibrated costs
    for _ in range(40):
        for _ in range(10):
            request.observe_seconds(1, 2, 1.6 * 1.5)
        for _ in range(10):
            request.observe_seconds(0, 1, 1.4)
    assert kind.calibration[1] * kind.tilt[1] == pytest.approx(1.5, rel=0.02)
    assert best() == 0


def test_a_kind_that_only_drafts_re_times_plain_decoding() -> None:
    """After ``RETIME_PLAIN_EVERY`` counted drafting timings without a counted plain one, the
    next drafting request decodes ``SETTLE_CYCLES + 2`` plain cycles (the last two settled
    timings), then drafts on; one request re-times plain decoding for its kind, and a counted
    plain timing starts the count again. A seeded request's own kind is never timed, so its K
    stays a function of its plan and draws."""
    from engine.scheduling.autok import RETIME_PLAIN_EVERY, SETTLE_CYCLES, SeededAutoK

    costs = CostTable(cycle=[1.0, 1.3, 1.5, 1.7, 1.9], trunk=[1.0] * 5, head_step=0.2)
    kind = AutoK(costs, AcceptanceCounts(hits=[90.0] * 4, trials=[100.0] * 4))
    kind.drafting_cycles_seen = 100
    request, other = kind.for_request(), kind.for_request()
    request.observe_seconds(3, 4, None)
    for _ in range(RETIME_PLAIN_EVERY):
        assert (k := request.choose(None)) > 0
        request.observe(k, k)
        request.observe_seconds(k, k + 1, 1.7)
    plain = [request.choose(None) for _ in range(SETTLE_CYCLES + 3)]
    assert plain == [0] * (SETTLE_CYCLES + 2) + [request.current]
    assert request.current > 0 and other.choose(None) > 0  # the kind is being re-timed
    kind.drafting_since_plain_timed = RETIME_PLAIN_EVERY
    kind.calibrate(0, 1, 1.0)
    assert kind.drafting_since_plain_timed == 0
    seeded_kind = AutoK(costs, AcceptanceCounts(hits=[90.0] * 4, trials=[100.0] * 4))
    seeded_kind.drafting_cycles_seen = 100
    seeded = SeededAutoK(seeded_kind, AcceptanceCounts(), current=3)
    for _ in range(2 * RETIME_PLAIN_EVERY):
        assert (k := seeded.choose(None)) > 0
        seeded.observe(k, k)
        seeded.observe_seconds(k, k + 1, 1.7)
    assert seeded_kind.timed_cycles == 0


def test_a_kind_that_only_decodes_plain_re_times_drafting() -> None:
    """After ``RETIME_DRAFTING_EVERY`` counted plain timings without a drafting one counted in
    full, the next probe drafts ``SETTLE_CYCLES + 2`` cycles (its last two settled timings)
    instead of ``PROBE_CYCLES``, with the ratio's variance raised to at least
    ``RETIME_RATIO_VARIANCE`` for them; its settled timings start the count again."""
    from engine.scheduling.autok import (
        PROBE_CYCLES,
        RETIME_DRAFTING_EVERY,
        RETIME_RATIO_VARIANCE,
        SETTLE_CYCLES,
    )

    costs = CostTable(cycle=[1.0, 1.3, 1.5, 1.7, 1.9], trunk=[1.0] * 5, head_step=0.2)
    kind = AutoK(costs, AcceptanceCounts(hits=[5.0] * 4, trials=[100.0] * 4))
    kind.drafting_cycles_seen = 100
    kind.covariance[1][1] = RETIME_RATIO_VARIANCE / 10
    request = kind.for_request()
    request.observe_seconds(0, 1, None)
    probes: list[tuple[int, int, float]] = []  # (plain timings before it, cycles, variance)
    while len(probes) < 12:
        before = kind.plain_since_drafting_timed
        if (k := request.choose(None)) == 0:
            request.observe(0, 0)
            request.observe_seconds(0, 1, 1.0)
            continue
        variance, cycles = kind.covariance[1][1], 0
        while k > 0:
            cycles += 1
            request.observe(k, 0)
            request.observe_seconds(k, 1, costs.cycle[k] * 1.1)  # a warming stretch: dearer
            k = request.choose(None)
        probes.append((before, cycles, variance))
        request.observe(0, 0)
        request.observe_seconds(0, 1, 1.0)
    due = [before >= RETIME_DRAFTING_EVERY for before, _, _ in probes]
    assert sum(due) >= 2, probes
    for (_, cycles, variance), retimes in zip(probes, due, strict=True):
        assert cycles == (SETTLE_CYCLES + 2 if retimes else PROBE_CYCLES), probes
        assert (variance == RETIME_RATIO_VARIANCE) == retimes, probes


def test_a_stretchs_first_cycles_only_bound_its_price_from_above() -> None:
    """After a switch, a class's cycles count in full from the stretch's ``SETTLE_CYCLES +
    1``-th on; before that (the switch's own cycle aside, never counted) only where they price
    the class below its calibration: warm-up only ever makes them dearer."""
    from engine.scheduling.autok import SETTLE_CYCLES

    costs = CostTable(cycle=[1.0, 1.6, 2.2, 2.8, 3.4], trunk=[1.0] * 5, head_step=0.5)
    kind = AutoK(costs, drafting_cycles_seen=100)
    request = kind.for_request()
    request.observe_seconds(0, 1, None)
    for _ in range(SETTLE_CYCLES - 2):
        request.observe_seconds(0, 1, 2.0)  # a plain stretch's early cycles, dearer: not counted
    assert kind.calibration == [1.0, 1.0]
    request.observe_seconds(0, 1, 0.9)  # cheaper: counted
    assert kind.calibration[0] < 1.0
    request.observe_seconds(0, 1, 2.0)  # settled: counted, dearer too
    assert kind.calibration[0] > 1.0
    plain = kind.calibration[0]
    request.observe_seconds(2, 1, 9.0)  # a probe's first cycle: never counted
    request.observe_seconds(2, 1, 2.2 * plain * 1.3)  # its second, dearer than its price: not
    assert kind.calibration == [plain, plain]
    request.observe_seconds(2, 1, 2.2 * plain * 0.8)  # cheaper: counted
    lowered = kind.calibration[1]
    assert lowered < plain
    for _ in range(SETTLE_CYCLES - 3):
        request.observe_seconds(2, 1, 2.2 * plain * 1.3)
    assert kind.calibration[1] == lowered
    request.observe_seconds(2, 1, 2.2 * plain * 1.3)  # settled: counted in full, dearer too
    assert kind.calibration[1] > lowered


def test_a_drafting_ks_own_price_is_learned_and_a_machine_slowdown_is_not_taken_for_it() -> None:
    """K=2 and K=3 alternate. The table prices K=2 10% under what it takes in the run; K=3 is
    right: K=2's tilt learns the 10% over the K=3 one. Then the machine slows by 30% for every
    K: the drafting class factor takes it, and the tilts stay where they were."""
    costs = CostTable(cycle=[1.0, 1.6, 2.0, 2.4, 2.8], trunk=[1.0] * 5, head_step=0.5)
    kind = AutoK(costs, drafting_cycles_seen=100)
    request = kind.for_request()
    request.observe_seconds(2, 1, None)
    for i in range(3000):
        k = 2 + i % 2
        request.observe_seconds(k, 1, costs.cycle[k] * (1.1 if k == 2 else 1.0))
    assert kind.tilt[2] / kind.tilt[3] == pytest.approx(1.1, rel=0.01)
    acceptance = [0.7, 0.7, 0.7, 0.7]
    table_rates = costs.rates(acceptance)
    rates = kind.rates(acceptance)
    assert rates[2] / rates[3] == pytest.approx(table_rates[2] / table_rates[3] / 1.1, rel=0.01)
    tilts = list(kind.tilt)
    for i in range(300):
        k = 2 + i % 2
        request.observe_seconds(k, 1, 1.3 * costs.cycle[k] * (1.1 if k == 2 else 1.0))
    assert kind.calibration[1] * kind.tilt[3] == pytest.approx(1.3, rel=0.02)
    assert kind.tilt == pytest.approx(tilts, rel=0.02)
    assert kind.tilt[1] == kind.tilt[4] == 1.0  # never timed: the table's price


def test_probe_backoff_carries_over_to_the_next_request_of_the_kind() -> None:
    """Probes that keep failing back off to MAX_PROBE_INTERVAL; the kind's next request starts
    there instead of probing every PROBE_EVERY plain cycles again."""
    from engine.scheduling.autok import MAX_PROBE_INTERVAL

    costs = CostTable(cycle=[1.0, 1.9, 2.8, 3.7, 4.6], trunk=[1.0] * 5, head_step=0.9)
    kind = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES)

    def probes(request: object, cycles: int) -> list[int]:
        at = []
        for i in range(cycles):
            k = request.choose(None)
            request.observe(k, 0)
            if k:
                at.append(i)
        return at

    first = probes(kind.for_request(), 1000)
    # two drafting cycles per probe (PROBE_CYCLES): after 16 plain cycles, then after 32
    assert first[:4] == [15, 16, 48, 49]
    second = probes(kind.for_request(), 300)
    assert second == [127, 128, 256, 257]
    assert MAX_PROBE_INTERVAL == 128


def test_lowest_keeps_each_entrys_lower_reading() -> None:
    """The benchmark predicts from two measurements of the cost table, entry by entry the lower
    one: a slow moment during either (here the first one's plain step) must not carry over."""
    slow_plain = CostTable(
        cycle=[3.2, 4.3, 5.4], trunk=[3.0, 3.3, 3.6], head_step=0.9, absorb=[1.0, 1.1]
    )
    later = CostTable(
        cycle=[2.4, 4.5, 5.3],
        trunk=[2.9, 3.4, 3.6],
        head_step=1.0,
        absorb=[1.2, 1.0],
        absorb_far=2.6,
    )
    low = slow_plain.lowest(later)
    assert low.cycle == [2.4, 4.3, 5.3] and low.trunk == [2.9, 3.3, 3.6]
    assert (
        low.head_step == 0.9 and low.absorb == [1.0, 1.0] and low.absorb_far == 2.6
    )  # (0: not measured)


@pytest.mark.parametrize(
    "absorb, acceptance",
    [
        ([], [0.8, 0.5, 0.5]),  # no catch-up measured: one head step; the last a_i repeats
        ([0.4, 0.5, 0.6], [0.9, 0.7, 0.6, 0.5]),  # fewer counts measured than a K=4 commits
        ([0.3, 0.45, 0.5, 0.7, 0.8, 0.9], [0.95, 0.1, 0.99, 0.0]),
        ([0.4], []),  # no estimates: nothing accepted
    ],
)
def test_rates_in_one_pass_are_each_ks_tokens_over_its_cycle(
    absorb: list[float], acceptance: list[float]
) -> None:
    """``CostTable.rates`` sums every K's committed-token distribution in one pass; each rate
    is still that K's expected tokens over its expected cycle seconds."""
    costs = CostTable(
        cycle=[1.0, 1.6, 2.2, 2.8, 3.4], trunk=[1.0] * 5, head_step=0.35, absorb=absorb
    )
    expected = [1.0]
    for k in range(1, 5):
        committed = committed_distribution(acceptance, k)
        catch_up = sum(p * costs.absorb_seconds(n) for n, p in enumerate(committed, 1))
        seconds = costs.cycle[k] + catch_up - costs.absorb_seconds(1)
        expected.append(expected_tokens(acceptance, k) / seconds)
    assert costs.rates(acceptance) == pytest.approx(expected, rel=1e-12)


def test_calibrated_rates_are_the_scaled_tables_rates() -> None:
    """Auto K divides the table's rates by the class factors each cycle instead of building
    the scaled table; both must give the same rates."""
    costs = CostTable(
        cycle=[1.0, 1.6, 2.2, 2.8, 3.4], trunk=[1.0] * 5, head_step=0.5, absorb=[0.4, 0.5, 0.6]
    )
    kind = AutoK(costs)
    kind.calibration = [1.3, 0.8]
    assert kind.calibration == pytest.approx([1.3, 0.8], rel=1e-12)
    acceptance = [0.9, 0.7, 0.6, 0.5]
    assert kind.rates(acceptance) == pytest.approx(kind.calibrated_costs().rates(acceptance))


def test_the_head_catches_up_on_the_longest_plain_stretch_between_probes() -> None:
    """engine.cycle.sequence cannot import engine.scheduling.autok (the other way round), so
    MAX_CATCH_UP is a literal: it must cover MAX_PROBE_INTERVAL plain cycles plus auto K's
    longest commit."""
    from engine.cycle.sequence import MAX_CATCH_UP
    from engine.scheduling.autok import MAX_PROBE_INTERVAL

    assert MAX_CATCH_UP >= MAX_PROBE_INTERVAL + MAX_AUTO_K + 1


def test_start_up_estimates_costs_and_no_request_waits_on_a_measurement(
    make_checkpoint, monkeypatch, tmp_path
) -> None:
    """Auto K starts from a few timed forwards (no long measurement at start-up or in the first
    sampled request), refines from live cycles, and writes the refined tables to the cache,
    from which the next start reads them instead of timing anything."""
    from checkpoints import VARIANTS

    import engine.scheduling.autok as autok
    import engine.scheduling.costs as costs
    from engine.api import GenerationRequest
    from engine.runtime import Engine
    from sampling.params import SamplingParams

    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(autok, "SAVE_EVERY_TIMED", 1)
    measure = costs.measure_costs

    def quick_only(*args, reps: int = 9, **kwargs):
        # (a fast model's start-up table: the decode loop's cycles, one repetition)
        if reps > 1:
            pytest.fail("long measurement")
        return measure(*args, reps=reps, **kwargs)

    monkeypatch.setattr(costs, "measure_costs", quick_only)
    estimates: list[int] = []
    real_estimate = autok.estimate_costs

    def counted(*args, **kwargs):
        estimates.append(1)
        return real_estimate(*args, **kwargs)

    monkeypatch.setattr(autok, "estimate_costs", counted)
    model = str(make_checkpoint(VARIANTS["dense-tied"]))
    engine = Engine.load(model)
    # the seeded plan, measured at load (the checkpoint samples), times its own cycles: one
    # estimate, the greedy kind's
    assert estimates == [1] and set(engine.autok.kinds) == {"greedy"}
    assert engine.autok.seeded is not None
    sampled = SamplingParams(temperature=1.0, top_k=20)
    for _ in range(2):
        request = GenerationRequest([5, 6, 7], sampled, 80, draft_tokens=None, ignore_eos=True)
        for _ in engine.generate(request):
            pass
    assert estimates == [1]  # the sampled kind started from the greedy table
    kind = engine.autok.kinds["sampled"]
    assert kind.timed_cycles > 0 and kind.calibration != [1.0, 1.0]  # refined in the run
    engine.autok.for_request(sampled)  # new timed cycles since the last save: written back
    saved = {p.name.rsplit("-", 1)[-1] for p in tmp_path.glob("costs-*.json")}
    assert saved == {"greedy.json", "sampled.json"}

    again = Engine.load(model)
    assert estimates == [1]  # read from the cache
    assert again.autok.costs(sampled).cycle == pytest.approx(kind.refined_costs().cycle)


def test_a_slow_model_waits_for_one_timed_forward_only(load_engine, monkeypatch) -> None:
    """Where one forward takes seconds (bf16 on a CPU, a large model) start-up times only it:
    a verify is priced as one forward, a head step by the bytes it reads."""
    from engine.scheduling import costs as cost_table

    engine = load_engine("dense-tied", draft_tokens=0)
    monkeypatch.setattr(cost_table, "SLOW_FORWARD", 0.0)
    monkeypatch.setattr(cost_table, "LOOP_TIMED_FORWARD", 0.0)
    costs = cost_table.estimate_costs(engine)
    ratio = cost_table.head_bytes_ratio(engine)
    assert 0 < ratio < 1
    assert costs.trunk == [costs.cycle[0]] * (MAX_AUTO_K + 1)
    assert costs.head_step == pytest.approx(costs.cycle[0] * ratio)
    assert costs.cycle[2] == pytest.approx(costs.cycle[0] * (1 + 2 * ratio))


def test_a_fast_model_is_priced_by_the_decode_loops_own_cycles(load_engine, monkeypatch) -> None:
    """Where a forward is fast, one timed alone is mostly the host's sync and per-op costs,
    which the decode loop overlaps: start-up times one repetition of the loop's own cycles
    (``measure_costs``) instead, and a slower forward keeps the timed forwards."""
    from engine.scheduling import costs as cost_table

    engine = load_engine("dense-tied", draft_tokens=0)
    calls: list[int] = []
    measure = cost_table.measure_costs

    def spy(*args, reps: int = 9, **kwargs):
        calls.append(reps)
        return measure(*args, reps=reps, **kwargs)

    monkeypatch.setattr(cost_table, "measure_costs", spy)
    monkeypatch.setattr(cost_table, "LOOP_TIMED_FORWARD", 10.0)
    looped = cost_table.estimate_costs(engine)
    assert calls == [1] and len(looped.cycle) == MAX_AUTO_K + 1
    assert all(c > 0 for c in looped.cycle) and looped.absorb_far > 0
    assert looped.absorb == sorted(looped.absorb)  # a line through the timings (``affine_fit``)
    # one noisy row is no cheaper than a shorter draft's: a longer draft never costs less
    noisy = replace(looped, cycle=[1.0, 2.0, 4.0, 3.0, 5.0])
    monkeypatch.setattr(cost_table, "measure_costs", lambda *args, **kwargs: noisy)
    assert cost_table.estimate_costs(engine).cycle == [1.0, 2.0, 4.0, 4.0, 5.0]
    monkeypatch.setattr(cost_table, "measure_costs", spy)
    monkeypatch.setattr(cost_table, "LOOP_TIMED_FORWARD", 0.0)
    forwards = cost_table.estimate_costs(engine)
    assert calls == [1]  # timed forwards only
    assert forwards.absorb_far >= forwards.absorb[-1]  # never priced below a short catch-up


def test_a_seeded_chooser_follows_its_plan_and_its_own_draws_only() -> None:
    """A seeded request's K per cycle is a function of its plan and of its own outcomes: it
    starts at the plan's K, moves to drafting when its drafts land and back to plain when they
    do not, and cycle timings (a slow spell, a fast one) change nothing, so two choosers that
    see the same drafts choose the same K every cycle."""
    from engine.scheduling.autok import SeededPlan

    plan = SeededPlan([0.4] * MAX_AUTO_K, [1.0, 1.5, 1.9, 2.3, 2.7])
    assert plan.chooser().choose(None) == 0  # at the probe's acceptance plain decoding wins

    def follow(hit: bool, plain_timing: float) -> list[int]:
        """1,000 cycles whose drafts all land (or none), plain cycles timed at ``plain_timing``
        times the plan's (a plain plan's requests probe every MAX_PROBE_INTERVAL cycles)."""
        chooser = plan.chooser()
        choices = []
        for _ in range(1000):
            choices.append(k := chooser.choose(None))
            chooser.observe(k, k if hit else 0)
            slow = plain_timing if k == 0 else 1.0
            chooser.observe_seconds(k, 1 + (k if hit else 0), plan.cycle_seconds[k] * slow)
        return choices

    landing = follow(True, 1.0)
    assert follow(True, 0.5) == follow(True, 1.9) == landing  # timings never enter
    assert min(landing[-PROBE_EVERY:]) >= 1  # its drafts land: it drafts
    missing = follow(False, 1.0)
    assert missing.count(0) > 0.9 * len(missing)  # its drafts miss: it stays plain
    assert plan.chooser().shared is not plan.chooser().shared  # no state shared across requests


def test_a_seeded_request_under_a_plain_plan_probes_after_the_longest_interval() -> None:
    """A seeded request's probe backoff is its own, so each request would start it again: under
    a plan that starts requests plain the first probe waits MAX_PROBE_INTERVAL plain cycles; a
    request that stopped drafting under a drafting plan probes after PROBE_EVERY."""
    from engine.scheduling.autok import MAX_PROBE_INTERVAL, SeededPlan

    def missing(plan: SeededPlan) -> tuple[int, int]:
        """The cycles at which a chooser of ``plan`` whose drafts all miss first runs plain
        and first probes from plain decoding."""
        chooser = plan.chooser()
        stopped = None
        for cycle in range(1000):
            k = chooser.choose(None)
            if k == 0 and stopped is None:
                stopped = cycle
            if k and chooser.plain_cycles == 0 and cycle and chooser.current == 0:
                return stopped, cycle
            chooser.observe(k, 0)
        raise AssertionError("no probe")

    plain = SeededPlan([0.4] * MAX_AUTO_K, [1.0, 1.5, 1.9, 2.3, 2.7])
    assert plain.k == 0
    assert missing(plain)[1] == MAX_PROBE_INTERVAL - 1
    drafting = SeededPlan([0.9] * MAX_AUTO_K, [1.0, 1.2, 1.4, 1.6, 1.8])
    assert drafting.k > 0
    # its drafts all miss: it stops drafting, then probes after PROBE_EVERY plain cycles
    stopped, probed = missing(drafting)
    assert probed < MAX_PROBE_INTERVAL
    assert probed - stopped == PROBE_EVERY - 1


def test_a_plans_drafting_cycles_lie_on_one_line_through_each_ks_median() -> None:
    """Plain cycles keep their median; drafting cycles take the least-squares line through each
    K's median, so one K's stray median (here K=2 timed above K=3) moves the plan by a quarter
    of its error, not all of it; within a K a preempted cycle does not count (the median)."""
    from engine.scheduling.autok import probe_cycle_seconds

    timings = [(0, 1, 1.0), (0, 1, 1.1), (0, 1, 9.0)]  # one plain cycle preempted
    for k, seconds in ((1, 1.9), (2, 2.9), (3, 2.8), (4, 3.2)):
        timings += [(k, 2, seconds), (k, 3, seconds), (k, 1, 50.0 if k == 3 else seconds)]
    plan = probe_cycle_seconds([timings])
    assert plan[0] == pytest.approx(1.1)
    steps = [b - a for a, b in zip(plan[1:], plan[2:], strict=False)]
    assert steps == pytest.approx([steps[0]] * 3) and steps[0] > 0  # one line, rising
    assert 2.4 < plan[2] < 2.6  # K=2's stray 2.9: near the line of its neighbours
    assert probe_cycle_seconds([[(0, 1, 1.0), (4, 1, 2.0)]])[1:] == [float("inf")] * 3 + [2.0]


def test_a_plans_drafting_cycles_are_priced_against_their_own_rounds_plain_cycles() -> None:
    """The machine's speed moves between rounds: each round's drafting cycles count by their
    ratio to that round's own plain cycles, so a round run 1.5x slower throughout prices
    drafting as the others do, where medians over all rounds' cycles would mix the speeds."""
    from engine.scheduling.autok import probe_cycle_seconds

    def round_(speed: float, ks: tuple[int, ...]) -> list[tuple[int, int, float]]:
        return [(k, 1, speed * (1.0 + 0.5 * k)) for k in (0, *ks, 0)]

    # K=1 and K=2 timed only in fast rounds, K=3 and K=4 only in slow ones
    rounds = [round_(1.0, (1, 2))] * 3 + [round_(1.5, (3, 4))] * 2
    plan = probe_cycle_seconds(rounds)
    assert plan == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_request_stops_drafting_only_when_plain_decoding_is_clearly_faster(
    kind: str,
) -> None:
    """A drafting request whose estimates put plain decoding 2% ahead of its K drafts on (a
    sampled one: a few unlucky draws, and stopping waits for a probe; a greedy one: starting
    again costs a probe, a catch-up and a cold cycle); 5% ahead a sampled one stops, a greedy
    one from 10% on."""
    from engine.scheduling.autok import POLICIES

    def choose_at(plain_ahead: float) -> int:
        # K=1 only (the other K priced out); a_1 = 0.5: K=1 emits 1.5 tokens a cycle
        costs = CostTable(
            cycle=[1.0, 1.5 * (1 + plain_ahead), 99.0, 99.0, 99.0], trunk=[1.0] * 5, head_step=0.1
        )
        shared = AutoK(costs, drafting_cycles_seen=EXPLORE_CYCLES, policy=POLICIES[kind])
        shared.counts = AcceptanceCounts(hits=[5e5] * MAX_AUTO_K, trials=[1e6] * MAX_AUTO_K)
        request = shared.for_request()
        request.current = 1
        return request.choose(None)

    assert choose_at(-0.02) == 1
    assert choose_at(0.02) == 1
    assert choose_at(0.05) == (1 if kind == "greedy" else 0)
    assert choose_at(0.12) == 0


def test_a_plans_drafting_cycles_are_priced_at_the_upper_quartile_of_their_rounds() -> None:
    """Each round's drafting cycles over that round's own plain ones (a drift of the whole
    machine between rounds cancels), over each K's median ratio: the upper quartile, at least
    1; too few rounds to tell, 1."""
    from engine.scheduling.autok import drafting_spread

    def round_(plain: float, drafting: float) -> list[tuple[int, int, float]]:
        return [(0, 1, plain), *((k, 1, (1 + k) * drafting) for k in (1, 2, 3)), (0, 1, plain)]

    steady = [round_(s, s) for s in (1.0, 1.5, 0.7, 2.0)]  # the whole machine drifting
    assert drafting_spread(steady) == pytest.approx(1.0)
    noisy = [round_(1.0, f) for f in (1.0, 1.0, 1.0, 1.2, 0.8, 1.0, 1.0, 1.1)]
    assert drafting_spread(noisy) == pytest.approx(1.1)
    assert drafting_spread(noisy[:1]) == 1.0


def test_the_start_up_table_times_every_k_where_its_drafts_are_accepted() -> None:
    """A cycle after one that rejected drafts costs more (the recurrent state is rolled back
    and replayed), so the table times every K in one regime: on the demo model, whose greedy
    text on tokens in no pattern falls into a loop only as it goes on (its K=1 and K=2 rows
    rejected, K=3 and K=4 accepted all), every row's cycles accept (nearly) every draft."""
    from pathlib import Path

    import engine.scheduling.costs as costs
    from engine.runtime import Engine

    demo = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
    engine = Engine.load(str(demo), draft_tokens=0)
    accepted: dict[int, list[int]] = {}
    decode = engine.decode

    def traced(seq, request, **kwargs):
        row = accepted.setdefault(request.draft_tokens, [])
        return decode(seq, request, trace=lambda cycle: row.append(cycle["accepted"]))

    engine.decode = traced  # type: ignore[method-assign]
    costs.measure_costs(engine, reps=1)
    assert sorted(accepted) == list(range(MAX_AUTO_K + 1))
    for k, row in accepted.items():  # (a backend's rounding may cost a draft now and then)
        assert row and sum(row) >= 0.95 * k * len(row), (k, row)


def test_the_catch_up_is_priced_by_a_line_through_its_timings() -> None:
    """Single timings of the head's catch-up over 1..5 positions differ by noise alone, and
    their differences price one drafting K against another: the table keeps the least-squares
    line through them, never falling (more positions never cost less), exact where they
    already lie on a line, and an outlier does not take its low end under every reading."""
    from engine.scheduling.costs import affine_fit

    assert affine_fit([1.0, 1.5, 2.0, 2.5]) == pytest.approx([1.0, 1.5, 2.0, 2.5])
    assert affine_fit([0.5, 0.7, 0.5, 0.7, 0.7]) == pytest.approx([0.54, 0.58, 0.62, 0.66, 0.7])
    assert affine_fit([0.8, 0.6, 0.6, 0.5]) == pytest.approx([0.625] * 4)  # falling: flat
    assert affine_fit([0.1, 0.1, 0.1, 0.1, 5.0]) == pytest.approx([0.1, 0.1, 1.08, 2.06, 3.04])
    assert affine_fit([0.7]) == [0.7]
