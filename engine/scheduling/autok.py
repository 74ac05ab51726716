"""Automatic K: choose each cycle the draft length that maximises expected tokens per second.

With per-position acceptance a_1..a_K (a_i = P(d_i accepted | d_1..d_{i-1} accepted)) a cycle
emits E(K) = 1 + a_1 + a_1 a_2 + ... + a_1...a_K tokens and costs C(K), measured on the machine
in use (``engine.scheduling.costs``: the only way this module learns what a cycle costs).

Acceptance is estimated per draft position from decayed counts (``AcceptanceCounts``): a
request's own, over its decoding kind's long-run counts, which serve as its prior (what a
request falls back to when its own evidence fades, e.g. in a stretch of plain cycles). K = 0
(no speculation) wins when acceptance is too low to pay for drafting; a probe (the drafting K
the estimates favour) every ``PROBE_EVERY`` plain cycles, backing off, keeps the estimates
alive so speculation resumes when the text gets predictable again; while drafting, a draft one
token longer every ``DEEPER_PROBE_EVERY`` cycles does the same for the next position. The
start-up table is calibrated in the run with the decode loop's own cycle times: the machine's
speed, drafting cycles' cost over plain ones, and a slow factor per drafting K on top
(``AutoK.calibrate``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any

from engine.api import GenerationRequest
from engine.scheduling.costs import (
    MAX_AUTO_K,
    CostProbe,
    CostTable,
    best_k,
    cached_costs,
    decoding_kind,
    estimate_costs,
    load_or_measure,
    save_costs,
    seeded_plan_path,
)
from sampling.params import resolve

log = logging.getLogger("mtpserve.autok")
PRIOR_ACCEPTANCE = 0.6
#: weight of the prior in pseudo-observations: a few hits outweigh it
PRIOR_WEIGHT = 2.0
#: ... for a request's estimates over its kind's long-run ones, when decoding samples. Greedy
#: acceptance is a fact of the text (a repetition loop drafts perfectly, new text does not), so a
#: request follows its own last few cycles; a sampled cycle's outcome is mostly the luck of the
#: draw, and ten cycles of it are noise. With the 8-layer demo model sampled K=0..2 lie within
#: 8% of each other, and at weight 2 that noise kept auto K switching: replayed on recorded
#: acceptance (tests/unit/test_autok_replay.py) sampled auto came to 0.945-0.99x of the best
#: fixed K, at 32 (with a 3% start margin) to 0.996-0.999x. Greedy keeps 2: at 32 it fell to
#: 0.957x on the 4-layer model's record, whose prompts switch between loops and new text
SAMPLED_PRIOR_WEIGHT = 32.0
#: per-cycle decay of a request's counts (~10-cycle memory): acceptance changes within a prompt
#: on that scale — one bench prompt accepted 1-3 of 4 drafts in its first 12 cycles and 4 of 4
#: from then on, and at 0.98 (~50 cycles) those first cycles kept it plain for 150 cycles where
#: K=4 was 1.4x faster. Replayed on recorded acceptance (tests/unit/test_autok_replay.py), greedy
#: auto comes to 1.00x of the best fixed K at 0.98 and 1.03x at 0.9
REQUEST_FORGET = 0.9
#: the same for a plain cycle, which reveals nothing: at 0.9 a two-cycle probe's hits faded
#: back to the kind's estimates within ten plain cycles, and a greedy request whose first cycles
#: had gone badly stayed plain (a greedy-only bench run: 4,917 of 5,245 auto cycles plain, auto
#: 1.05x where K=4 was 1.16x; with 0.99 the next run had 2,896 plain, 1.16x where K=4 was 1.24x)
#: -- but the evidence from before a plain stretch is aged at REQUEST_FORGET per plain cycle
#: once the next drafting cycle (a probe) reports (``RequestAutoK.observe``): at 0.99 alone the
#: misses of a request's bad start outweighed its probes' hits for a hundred cycles (traced in
#: a bench run: code-01 accepts 0-2 of 4 in its first 22 positions and 4 of 4 after, and auto's
#: estimates stayed at a_1 0.64-0.80 through the plain cycles that followed). Replayed on
#: recorded acceptance (tests/unit/test_autok_replay.py's cases with three bench runs' tables),
#: greedy auto went from 0.98-1.02x of the best fixed K to 1.00-1.03x; sampled unchanged
PLAIN_FORGET = 0.99
#: the same for the counts of a decoding kind (the prior of its requests), per drafting cycle:
#: ~1,000 cycles, a dozen requests. The prior stands for the workload, not for the request
#: before: at 0.99 (~one 256-token request) a few sampled prompts that accepted less pulled the
#: unseeded kind's a_1 from 0.79 to 0.69-0.72, and the requests after them started and stayed
#: plain though their own drafts would have paid (a trace of 48 bench requests: 2,053 of 5,986
#: auto cycles plain, auto 0.95x of K=3). Replayed on recorded acceptance
#: (tests/unit/test_autok_replay.py) 0.999 is level or better in every case: the worst greedy
#: case on the compute-bound table 0.975 -> 0.999x of the best fixed K
SHARED_FORGET = 0.999
PROBE_EVERY = 16
#: drafting cycles in a row per probe from plain decoding: two, for the evidence they bring.
#: Replayed on recorded acceptance (tests/unit/test_autok_replay.py), sampled requests
#: starting from the seeded plan on a machine where drafting pays ~6%, mean of 8 noise seeds
#: without / with a stretch's warm-up: one-cycle probes 0.981x / 0.992x of the best fixed K
#: (worst 0.942x), two 0.991x / 0.987x (worst 0.963x)
PROBE_CYCLES = 2
#: cycles of a class (plain or drafting) after a switch before its cycles price the class
#: (``RequestAutoK.observe_seconds``): a stretch's first cycles cost more than its settled
#: ones, which are what auto K chooses between. Timed in the decode loop on the demo model
#: (``scripts/experiments/plain_stretch.py timing --k 3 --drafting 64 --plain 64``, runs a few
#: minutes apart), a greedy K=3 stretch's second, third and fourth cycles took 1.10-1.23x,
#: 1.06-1.08x and 1.00-1.03x a settled one, and a plain stretch's second ~1.08-1.15x. Priced
#: by a probe's second cycle, a mostly-plain run saw drafting only through its probes: a bench
#: run's greedy auto calibrated its drafting cycles at 1.33x the start-up table and its plain
#: ones at 1.05x, and decoded mostly plain (1.35 tokens a cycle) where fixed K=3 paid 1.13x.
#: How a stretch's early cycles count instead: ``RequestAutoK.observe_seconds``
SETTLE_CYCLES = 4
#: drafting cycles of a kind timed since its last counted plain timing after which a drafting
#: request decodes ``SETTLE_CYCLES + 2`` plain cycles: the calibration learns drafting's cost
#: over plain cycles only where both run, and a table that overprices plain decoding would
#: otherwise keep auto drafting for good where plain decoding is faster. Replayed
#: (``scripts/experiments/autok_replay_sweep.py``, with the warm-up; greedy stopping at 10%):
#: on the record's table over five machines (two where greedy drafting loses), 3 noise seeds,
#: 150 cases, 9 fell under 0.97x of the best fixed K without it (worst 0.854x: sampled, plain
#: priced 15% over), 2 at 256 (0.967x), 1 at 128; with pauses 4 (0.923x) against 0. At today's
#: table with the measured switch cost (``--machines today --switch 0,0.7``, 8 seeds) sampled
#: 8 of 40 (worst 0.895x, mean 0.968x) against 5 (0.941x, 0.977x), greedy 6 of 40 either way
#: (mean 0.979x against 0.978x)
RETIME_PLAIN_EVERY = 256
#: ... and the other way round: plain cycles of a kind timed since its last counted drafting
#: timing after which a probe re-times drafting: it drafts ``SETTLE_CYCLES + 2`` cycles, the
#: last two counted in full, and the calibration takes them as if it knew drafting's price
#: over plain only within ~5% (``RETIME_RATIO_VARIANCE``). A probe's two cycles can only ever
#: lower drafting's price (its second bounds it from above), and the price rises without any
#: drafting cycle: each switch moves r with the machine's speed at that moment (a plain
#: stretch timed faster than the drafting one before it makes drafting look dearer, through
#: the calibration's covariance). On the demo model, in one process's unseeded requests, each
#: ``RETIME_PLAIN_EVERY`` stretch moved r by 1-5%, r rose from 1.09 to 1.16 over 14 requests,
#: and auto K decoded plain through the next 22 (two probe cycles each) where fixed K=2 ran
#: 1.04x K=0; with r raised 12% by hand after two requests, the next 22 decoded 93-99% plain.
#: With the re-timing probe, auto drafted again within one to two requests
#: (``scripts/experiments/autok_stuck.py``). Replayed with that 12% raise on a machine where
#: sampled K=2 pays 1.10x and greedy K=4 1.42x (6 noise seeds each, at the calibration's own
#: noise), auto came to 0.987x of the best fixed K (worst 0.923x: plain in 4,987 of 5,341
#: cycles) without it, 0.992x (worst 0.975x) with it (``test_autok_replay.py``). The sweep
#: (``autok_replay_sweep.py --machines measured,compute-bound,marginal,slight,today --switch
#: 0,0.7``) level without the raise (mean 0.9906, 19 of 120 under 0.97 without "slight"); with
#: it at 10% noise (``--raise 1.12 --noise 0.1``) 0.9897 (worst 0.9230, 30 of 150 under 0.97)
#: without the re-timing probe, 0.9908 (worst 0.9503, 27) with it. Did less, replayed with the
#: raise at 7% noise (``autok_stuck.py --replay --noise 0.07``: 0.9870, worst 0.9222, as things
#: were; 0.9955, worst 0.9823 with this): a probe's early cycles bounding the price against a
#: warm-up floor (1.10 / 1.03 / 1.00 at places 2-4) 0.9909 (worst 0.9520); ``RATIO_DRIFT`` 1e-5
#: 0.9885 (0.9222), and 1e-5 to 1e-4 with the floor up to 0.9954, but the sweep worse
#: (0.9880-0.9894 against 0.9906)
RETIME_DRAFTING_EVERY = 512
#: the ratio's variance (log) at least, when a probe re-times drafting
RETIME_RATIO_VARIANCE = 0.0025
#: in a plain stretch auto K decides afresh on every this many cycles (and on each that a probe
#: is due), the cycles between plain: in a stretch the estimates only fade towards the kind's
#: and the calibration follows the machine, which a few cycles do not move, while deciding took
#: ~20 µs of a cycle on the decoding thread. Where plain cycles are short that is what auto K
#: pays over fixed K=0: the demo model in 8 bits (plain cycles ~0.7 ms, drafting never paying),
#: 6,019 unseeded auto cycles, 52 of them drafting, ran 0.94x as fast as K=0 with auto K's calls
#: 4.7% of its time (choose 19.4 µs a cycle, observe_seconds 10.8, observe 4.4); deciding on
#: one plain cycle in three, choose took 6.3 µs a cycle and the calls 3.2%. Replayed
#: (``scripts/experiments/autok_replay_sweep.py --machines measured,compute-bound,marginal,today
#: --switch 0,0.7``, which counts no decision's cost) every 1, 3 or 4 cycles is level: mean
#: 0.9906 / 0.9906 / 0.9908 of the best fixed K, 19 of 120 cases under 0.97 each
PLAIN_DECIDE_EVERY = 3
#: while drafting K < max, every this many cycles draft K+1 (reveals position K+1)
DEEPER_PROBE_EVERY = 8
#: at K=0 the probe interval doubles after each probe that does not resume drafting, up to this
MAX_PROBE_INTERVAL = 128
#: prior ratio a_{i+1} / a_i: a position drafted rarely leans on the one before it
UNSEEN_DECAY = 0.95
#: another K must beat the current drafting K by this much before auto K switches to it. 1%,
#: not 3%: with the tuned demo head, sampled K=2..4 lie within ~3% of each other, and at 3% a
#: request that began at K=2 stayed there (a sampled trace: 189 K=2 cycles of 1,038, auto 6%
#: behind K=4; at 1%: 2). Replayed, 1% is as good or better in every case (mean 0.999x of the
#: best fixed K against 0.997x); the sampled estimates are steady enough (SAMPLED_PRIOR_WEIGHT)
SWITCH_MARGIN = 0.01
#: ... and drafting must beat plain decoding by this much before auto K starts: near break-even
#: acceptance noise alone would otherwise start losing drafts. Sampled requests lean on their
#: kind's long-run estimates (SAMPLED_PRIOR_WEIGHT), which are steadier: a smaller margin (at 8%,
#: sampled auto stayed plain where K=2 was 8% faster: 0.958x of it in the replay)
START_MARGIN = 0.08
SAMPLED_START_MARGIN = 0.03
#: ... and plain decoding must beat the drafting K by this much before a sampled request stops
#: drafting. A sampled request that stops waits for a probe to start again, while near
#: break-even a few unlucky draws are all that ``SWITCH_MARGIN`` needs: seeded requests on one
#: plan, in turns in one process (their K histograms repeat exactly), ran 1,228 of 5,117 cycles
#: plain at 1%, 0.960-0.970x of fixed K=3, and 750 of 4,769 at 3%, 0.976-0.984x (5%: 832,
#: 0.968x). Replayed, level within 0.005x of the best fixed K
SAMPLED_STOP_MARGIN = 0.03
#: ... and before a greedy one stops. Greedy acceptance follows the text, but stopping is not
#: free: starting again costs a probe, the head's catch-up, a first cycle not launched ahead and
#: a stretch's warm-up — on the demo model at this machine's speed a K=3 cycle after 30 plain
#: ones took 3.02 ms against 1.85 settled, ~0.7 ms of it beyond the table's catch-up
#: (``scripts/experiments/plain_stretch.py timing --k 3 --drafting 16 --plain 30``), where a
#: plain cycle takes ~0.6 ms. Replayed on the demo model's acceptance with the start-up tables
#: of a ``make bench`` run on this machine, that switch cost and the measured warm-up
#: (tests/unit/test_autok_replay.py, ``TODAY``), greedy auto came to 0.963x of the best fixed K
#: on average over the table errors and noise seeds at 1% (11 of 15 cases under 0.97x), 0.983x
#: at 10% (1 of 15), 0.990x at 20%; on a machine where greedy drafting loses (2.2-3 ms more per
#: verified position on the record's table) 0 / 2-3 / 3 of 30 cases fell under 0.97x (worst
#: 0.978 / 0.955 / 0.927x: plain priced 15% over, so drafting looks better than it is). In one
#: process on the demo model (24 bench prompts x 256 tokens, six turns), auto came to 0.974x of
#: fixed K=3 at 10% against 0.960x at 1%, ahead in every turn
GREEDY_STOP_MARGIN = 0.1


@dataclass(frozen=True)
class KindPolicy:
    """What differs between greedy and sampled decoding in auto K's choice: how much a request
    trusts its own evidence over its kind's (``prior_weight``), the margin by which drafting
    must beat plain decoding before it starts, and the one by which plain decoding must beat
    the drafting K before it stops."""

    prior_weight: float
    start_margin: float
    stop_margin: float = SWITCH_MARGIN


POLICIES = {
    "greedy": KindPolicy(PRIOR_WEIGHT, START_MARGIN, GREEDY_STOP_MARGIN),
    "sampled": KindPolicy(SAMPLED_PRIOR_WEIGHT, SAMPLED_START_MARGIN, SAMPLED_STOP_MARGIN),
}
#: until a decoding kind has seen this many drafting cycles, auto K explores: it drafts
#: MAX_AUTO_K, which reveals every position it can. With 3, greedy auto stayed plain through a
#: bench run (1.01 tokens per cycle where K=4 was 1.24x): a few early misses pinned the deep
#: positions' estimates
EXPLORE_CYCLES = 16
#: a timed cycle moves the calibration as if it were at most this factor from its price: a
#: preemption or a GC pause must not move it further than a cycle a little slow, and the price
#: tracks the cycles' typical time, not their mean. With the clip at 2x the table, a long
#: cycle's pauses were clipped less than a short one's (a pause of 2 ms doubles a plain demo
#: cycle and adds a third to a drafting one): in one process, settled greedy cycles' time over
#: the table had the same median for plain and drafting (0.766, 0.771-0.774) but means of 0.797
#: and 0.802-0.821, and the factors followed the means (0.759 plain, 0.813 drafting); in log
#: space at 1.25x they follow the medians
CALIBRATION_CLIP = 1.25
#: The calibration's model (``AutoK.calibrate``), in log space: a timed cycle costs the table's
#: price times the machine's speed factor m (both classes) times, for a drafting cycle, the
#: drafting class's ratio r over plain, plus noise. Its variances, per timed cycle:
#: the machine's speed, a random walk. This 2-core VM's cycles moved by 28% within a few
#: seconds and back (one process, greedy demo: settled plain cycles at 1.03x, then 1.32x, then
#: 1.06x the table), for both classes alike
MACHINE_DRIFT = 3e-4
#: ... the ratio r: it drifts too (plain cycles follow the memory's speed, drafting ones more the
#: arithmetic), but far slower than the machine
RATIO_DRIFT = 1e-6
#: ... one timing around its price (log): settled cycles' deciles spanned 0.92-1.10x their
#: median on the demo model
TIMING_NOISE = 0.01
#: ... and the start-up table's error in m and in r
MACHINE_START_VARIANCE = 0.0025
RATIO_START_VARIANCE = 0.04
#: weight of one timed cycle in a drafting K's own factor relative to the drafting class
#: (``AutoK.tilt``): ~256 cycles of that K. Slow, so that the class factor takes a change of the
#: machine's speed and the tilts only what stays: the start-up table's error between one
#: drafting K and another (in-run over table seconds ranged 1.05-1.11 across K=1..4 in one bench
#: run). Replayed with one drafting K mispriced by 5% (and the replay's 20% timing noise, over 4
#: noise seeds), auto's worst case went from 0.952-0.977x of the best fixed K to 0.975-0.983x
#: and its mean from 0.995-0.996x to 0.997-0.998x; at 1/128 a 15%-dear drafting table cost
#: 4.5% on the compute-bound table (noise taken for tilt)
TILT_WEIGHT = 1 / 256


@dataclass
class AcceptanceCounts:
    """Per draft position, decayed counts of accepted and revealed drafts.

    The estimate of a_i is the posterior mean ``(hits_i + w * prior_i) / (trials_i + w)``. The
    prior is given (a request's: its kind's long-run estimates) or, for the kind itself,
    ``prior_1 = PRIOR_ACCEPTANCE`` and ``prior_{i+1} = UNSEEN_DECAY * estimate_i``: a position
    never drafted borrows from the one before it (so K=1 data can justify trying K=2). A
    handful of observations outweighs the prior (a K=1 probe from K=0 that hits moves it at
    once, where a moving average of 0.08 needed a dozen probes, i.e. ~200 plain cycles).
    """

    hits: list[float] = field(default_factory=lambda: [0.0] * MAX_AUTO_K)
    trials: list[float] = field(default_factory=lambda: [0.0] * MAX_AUTO_K)

    def estimates(
        self, prior: list[float] | None = None, prior_weight: float = PRIOR_WEIGHT
    ) -> list[float]:
        w = prior_weight
        if prior is not None:  # every cycle, for every auto request: one comprehension
            return [
                (h + w * p) / (t + w) for h, t, p in zip(self.hits, self.trials, prior, strict=True)
            ]
        out: list[float] = []
        p = PRIOR_ACCEPTANCE
        for hits, trials in zip(self.hits, self.trials, strict=True):
            out.append((hits + w * p) / (trials + w))
            p = out[-1] * UNSEEN_DECAY
        return out

    def decay(self, forget: float) -> None:
        """Age every count by one cycle (also cycles that revealed nothing: old evidence from
        before a long plain stretch must fade, or one bad patch would stop drafting for good)."""
        self.hits = [h * forget for h in self.hits]
        self.trials = [t * forget for t in self.trials]

    def observe(self, position: int, hit: bool) -> None:
        self.hits[position] += float(hit)
        self.trials[position] += 1.0


@dataclass
class AutoK:
    """Shared state of one kind of decoding (greedy, or sampled): its cost table and the
    acceptance counts new requests start from. Greedy and sampled decoding differ in both —
    sampled cycles do more work and accept less — so an engine keeps one AutoK per kind."""

    costs: CostTable
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    #: drafting cycles ever observed for this kind (never decays: exploration happens once)
    drafting_cycles_seen: int = 0
    #: in-run cost calibration (``calibrate``), in log space: the machine's speed factor m over
    #: the table, the drafting class's ratio r over plain, and their covariance
    machine: float = 0.0
    ratio: float = 0.0
    covariance: list[list[float]] = field(
        default_factory=lambda: [[MACHINE_START_VARIANCE, 0.0], [0.0, RATIO_START_VARIANCE]]
    )
    #: each drafting K's factor relative to the drafting class (index K; ``calibrate``)
    tilt: list[float] = field(default_factory=lambda: [1.0] * (MAX_AUTO_K + 1))
    #: timed cycles so far, drafting ones counted since the last counted plain one, and plain
    #: ones counted since the last drafting one counted in full
    timed_cycles: int = 0
    drafting_since_plain_timed: int = 0
    plain_since_drafting_timed: int = 0
    #: plain cycles between probes. Kept per kind, not per request: restarting at
    #: PROBE_EVERY with every request cost sampled decoding ~5% (four failing probes in each
    #: 256-token request, each a catch-up and a K=1 cycle, ~3 ms over a plain step)
    probe_interval: int = PROBE_EVERY
    #: what differs between greedy and sampled decoding: ``POLICIES[decoding_kind(params)]``
    policy: KindPolicy = POLICIES["greedy"]

    @property
    def calibration(self) -> list[float]:
        """Measured over table seconds for plain and for drafting cycles: m and m r."""
        return [math.exp(self.machine), math.exp(self.machine + self.ratio)]

    @calibration.setter
    def calibration(self, factors: list[float]) -> None:
        plain, drafting = factors
        self.machine, self.ratio = math.log(plain), math.log(drafting / plain)

    def calibrate(
        self, k: int, committed_before: int, seconds: float, at_most: bool = False
    ) -> None:
        """Fold one timed cycle into the calibration; with ``at_most`` only when it prices its K
        below the calibration (a cycle that bounds the settled cost from above:
        ``RequestAutoK.observe_seconds``).

        A Kalman filter over two log factors: m, the machine's speed over the start-up table
        (every cycle), and r, drafting cycles' cost over plain ones beyond what the table says.
        Only r (and the tilts) decide between K: m multiplies every K's cost alike. Why not one
        factor per class, each learned from its own cycles: the machine's speed changes within
        seconds (``MACHINE_DRIFT``), and a class that was not running kept the speed of its last
        stretch — in one greedy run of the demo model the two factors' ratio wandered 0.86-1.23x
        around its true value (the medians of the run's own timings), and auto K decoded plain
        where K=3 paid 1.10x. Here a plain stretch moves m, which prices drafting as well; a
        drafting cycle's surprise goes to r in proportion to how well m is known at that
        moment (just after plain cycles: mostly to r; deep in a drafting stretch, where m is
        known only through r: to both). Replayed on the timings of such runs
        (``scripts/experiments/calibration_track.py``, two runs), r stayed within 1.5-2.2% of
        the run's own ratio on average (worst 5.6-8.7%) where the per-class factors were
        4.8-5.0% off (worst 23-27%). Replayed on recorded acceptance with the machine 1.3x
        slower every other 0.5 / 2 / 5 s (``scripts/experiments/autok_replay_sweep.py --spells
        0.5,1.3``, 90 cases each), 3-6 cases fell under 0.97x of the best fixed K (mean
        0.997-0.998x) where the per-class factors left 6-12 (mean 0.989-0.994x); without spells
        3-4 against 4, with pauses (``--pauses 20,5``) 3-4 against 0 (both before
        ``RETIME_PLAIN_EVERY``). The cases left were sampled decoding on a machine where
        drafting loses ~6%, with plain priced 15% over: auto drafted throughout and never timed
        plain (worst 0.92x; 0.93x with the per-class factors), which ``RETIME_PLAIN_EVERY``
        answers. A class that has not run for long is not stale: r drifts slowly
        (``RATIO_DRIFT``), and its uncertainty grows accordingly, so that its next timings count
        more.

        Within the drafting class each K's ``tilt`` learns slowly (``TILT_WEIGHT``) from the same
        surprise what stays of it: the start-up table's errors between one drafting K and
        another (a change of the machine's speed the filter takes within a few dozen cycles).
        """
        expected = self.costs.expected_seconds(k, committed_before)
        drafting = k > 0
        tilted = drafting and k < len(self.tilt)
        price = self.machine
        if drafting:
            price += self.ratio + (math.log(self.tilt[k]) if tilted else 0.0)
        # how far this timing is from the price, in log space, clipped (CALIBRATION_CLIP)
        limit = math.log(CALIBRATION_CLIP)
        off = min(max(math.log(seconds / expected) - price, -limit), limit)
        if at_most and off >= 0:
            return
        self.timed_cycles += 1
        self.drafting_since_plain_timed = self.drafting_since_plain_timed + 1 if drafting else 0
        if not at_most:
            self.plain_since_drafting_timed = 0 if drafting else self.plain_since_drafting_timed + 1
        p = self.covariance
        p[0][0] += MACHINE_DRIFT
        p[1][1] += RATIO_DRIFT
        h = float(drafting)  # the observation is m + h r
        spread = (p[0][0] + h * p[0][1], p[1][0] + h * p[1][1])
        total = spread[0] + h * spread[1] + TIMING_NOISE
        gain = (spread[0] / total, spread[1] / total)
        self.machine += gain[0] * off
        self.ratio += gain[1] * off
        for i in range(2):
            for j in range(2):
                p[i][j] -= gain[i] * spread[j]
        if tilted:
            self.tilt[k] *= math.exp(TILT_WEIGHT * off)

    def calibrated_costs(self) -> CostTable:
        """The table scaled by the class factors (the tilts apply per K, in ``rates``)."""
        return self.costs.scaled(*self.calibration)

    def refined_costs(self) -> CostTable:
        """The calibrated table with each drafting K's tilt folded into its cycle: what the run
        has learned, as a table to start from next time."""
        table = self.calibrated_costs()
        cycle = [c * self.tilt[min(k, len(self.tilt) - 1)] for k, c in enumerate(table.cycle)]
        return replace(table, cycle=[table.cycle[0], *cycle[1:]])

    def rates(self, acceptance: list[float]) -> list[float]:
        """``calibrated_costs().rates(acceptance)``, each drafting K's divided by its tilt,
        without building the scaled table (run every cycle): a factor scales every cost of its
        cycles, so it divides their rate."""
        rates = self.costs.rates(acceptance)  # a fresh list: divided in place
        rates[0] /= math.exp(self.machine)
        drafting = math.exp(self.machine + self.ratio)
        tilt, last = self.tilt, len(self.tilt) - 1
        for k in range(1, len(rates)):
            rates[k] /= drafting * tilt[min(k, last)]
        return rates

    def drafting_hopeless(self) -> bool:
        """Whether no drafting K would pay even with every draft accepted, at the calibrated
        costs: then a probe from plain decoding can only cost (its drafting cycles, the head's
        catch-up over the plain stretch, the plain look-ahead broken), and is skipped. On the
        demo model in 8 bits, whose plain cycles take ~0.5 ms and a K=3 cycle ~2.2 (4 tokens
        at most), 27 probes in 6,000 unseeded cycles took ~6% of auto K's time. A probe's
        timings only ever lower drafting's price (``RequestAutoK.observe_seconds``), so a table
        that overprices drafting is not kept from learning it by this."""
        best = self.rates([1.0] * MAX_AUTO_K)
        return max(best[1:]) <= best[0]

    def retimes_drafting(self) -> bool:
        """Whether the probe starting now re-times drafting (``RETIME_DRAFTING_EVERY``): if so,
        the calibration is readied for it — one probe re-times it for the kind."""
        if self.plain_since_drafting_timed < RETIME_DRAFTING_EVERY:
            return False
        self.plain_since_drafting_timed = 0
        self.covariance[1][1] = max(self.covariance[1][1], RETIME_RATIO_VARIANCE)
        return True

    def for_request(self) -> RequestAutoK:
        return RequestAutoK(self, AcceptanceCounts())


#: timed cycles of a kind after which its calibrated table is written back to the disk cache
SAVE_EVERY_TIMED = 64


@dataclass
class EngineAutoK:
    """One ``AutoK`` per decoding kind. Its table comes from the disk cache (what earlier runs
    measured and refined), else the other kind's table, else ``estimate_costs`` (seconds): no
    request waits on a long measurement. Live cycles refine it (``AutoK.calibrate``), and the
    refined table goes back to the cache every ``SAVE_EVERY_TIMED`` timed cycles."""

    engine: CostProbe
    kinds: dict[str, AutoK] = field(default_factory=dict)
    saved_at: dict[str, int] = field(default_factory=dict)
    #: ``seeded_plan`` once measured or read back
    seeded: SeededPlan | None = None

    def for_request(self, params: Any) -> RequestAutoK:
        self.costs(params)
        kind = decoding_kind(params)
        self.save_refined(kind)
        return self.kinds[kind].for_request()

    def costs(self, params: Any, refresh: bool = False) -> CostTable:
        """The cost table auto K uses for ``params``' kind (fully measured now if ``refresh``:
        the bench's start-up table)."""
        kind = decoding_kind(params)
        if refresh:
            sampler = representative_sampler(self.engine, params)
            costs = load_or_measure(self.engine, refresh, params=sampler)
        elif kind in self.kinds:
            return self.kinds[kind].costs
        elif cached := cached_costs(self.engine, kind):
            log.info("auto K: %s cycle costs from the cache", kind)
            costs = cached
        elif self.kinds:
            # The other kind's calibrated table: sampled cycles add sampler work, which this
            # kind's own calibration learns from its first timed cycles.
            costs = next(iter(self.kinds.values())).refined_costs()
            log.info("auto K: %s cycle costs start from the %s table", kind, next(iter(self.kinds)))
        else:
            costs = estimate_costs(self.engine)
            save_costs(self.engine, kind, costs)
        auto = AutoK(costs, policy=POLICIES[kind])
        plan = self.known_seeded_plan() if kind == "sampled" else None
        if plan is not None:
            # The plan's acceptance on its fixed texts is where the kind's long-run estimates
            # start, in place of exploring on the first request: that request's first cycles
            # alone made the prior of every request after it, and one that accepted 0.61 on
            # them (0.79 is usual) kept the unseeded kind plain through a bench run (3,471 of
            # 3,524 auto cycles, 0.88x of fixed K=3), probes adding too little evidence to lift
            # it. Replayed with the low-acceptance prompts first, the plan cut plain cycles 3x.
            auto.counts = plan.prior_counts()
            auto.drafting_cycles_seen = EXPLORE_CYCLES
        self.kinds[kind] = auto
        self.saved_at[kind] = 0
        return costs

    def known_seeded_plan(self) -> SeededPlan | None:
        """``seeded_plan`` when it has been measured or is in the cost cache (never measures)."""
        if self.seeded is None:
            self.seeded = read_seeded_plan(seeded_plan_path(self.engine))
        return self.seeded

    def seeded_plan(self, params: Any) -> SeededPlan:
        """What a seeded sampled request under automatic K chooses its K from: the same for
        every such request on this build and machine (``SeededPlan``).

        Why not live: with rejection sampling the token emitted at a position depends on
        whether it was drafted, so a seed repeats only if the row's K per cycle is a function
        of the request — not of live timings or batch neighbours, which the unseeded chooser
        follows. (Coupled draws that repeat whatever K runs accept less: at total-variation
        distance d between q and p at least (1-d)/(1+d) against rejection sampling's 1-d.) So
        the plan is measured once per build and machine: the acceptance the model shows on
        fixed texts (``probe_acceptance``) and the cycle times of every K on the same texts
        (``time_probe_cycles``; drafting cycles priced at the upper quartile of the rounds,
        ``drafting_spread``), kept in the cost cache (``seeded_plan_path``) and read back on
        every later start. A request then follows its own acceptance (``SeededAutoK``).

        Why the cycles are timed here and not read from the cost table: at start-up the table
        is a few timed forwards, which leave out the sampler, the host syncs and plain cycles'
        overlap (the live calibration learns those later), and a single timing each wanders by
        ~10% on a busy machine. Priced by that table, the same probe's acceptance made one
        fixed K of 0, 1, 2 or 4 on the demo model's builds, and K=0 ran its seeded row at 0.86x
        of the best fixed K."""
        if (known := self.known_seeded_plan()) is not None:
            return known
        path = seeded_plan_path(self.engine)
        sampler = representative_sampler(self.engine, params)
        sequences = probe_sequences(self.engine, sampler)  # each text prefilled once
        counts = AcceptanceCounts()
        for _ in rounds_within(ACCEPTANCE_PROBE_ROUNDS, ACCEPTANCE_PROBE_SECONDS):
            acceptance = probe_acceptance(self.engine, sampler, sequences=sequences, counts=counts)
        rounds: list[list[tuple[int, int, float]]] = []
        for _ in rounds_within(TIMED_PROBE_ROUNDS, TIMED_PROBE_SECONDS):
            timed: list[tuple[int, int, float]] = []
            for k in TIMED_PROBE_ORDER:
                time_probe_cycles(self.engine, sampler, k, timed, sequences=sequences)
            rounds.append(timed)
        self.seeded = SeededPlan.measured(acceptance, rounds)
        log.info(
            "auto K: seeded sampled requests start at K=%d (acceptance %s, cycles timed on the "
            "probe texts %s ms)",
            self.seeded.k,
            [round(a, 3) for a in acceptance],
            [round(1e3 * c, 2) for c in self.seeded.cycle_seconds],
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(self.seeded)))
        except OSError:
            pass
        return self.seeded

    def for_seeded_request(self, params: Any) -> SeededAutoK:
        """The chooser of one seeded sampled request (``seeded_plan``)."""
        return self.seeded_plan(params).chooser()

    def save_refined(self, kind: str) -> None:
        """Write the kind's calibrated table to the disk cache once it has enough new timings."""
        auto = self.kinds[kind]
        if auto.timed_cycles - self.saved_at.get(kind, 0) >= SAVE_EVERY_TIMED:
            save_costs(self.engine, kind, auto.refined_costs())
            self.saved_at[kind] = auto.timed_cycles


#: drafting cycles ``probe_acceptance`` runs on each of its texts, a round
ACCEPTANCE_PROBE_CYCLES = 12
#: ``seeded_plan`` probes up to this many rounds, until ``ACCEPTANCE_PROBE_SECONDS`` have
#: passed. The probe's draws are keyed, so its sampling error is the same on every build: with
#: one round the demo model's first position read 0.716 (seed 0; 0.61 and 0.82 with seeds 1
#: and 2) where four read 0.79 (0.74, 0.79), as its bench prompts accept, and the plan's K went
#: from a tie with plain decoding to K=2-3. A round takes ~0.15 s there and ~8 s at the
#: 0.8B shape, where one round is all start-up waits for: there a head step is 6-7% of a plain
#: step's time (the demo's ~20%), so drafting pays at a lower acceptance and the same error
#: in it moves the decision less
ACCEPTANCE_PROBE_ROUNDS = 4
ACCEPTANCE_PROBE_SECONDS = 2.0
#: cycles that ``seeded_plan`` times on each probe text at each turn of ``TIMED_PROBE_ORDER``
TIMED_PROBE_CYCLES = 5
#: ``seeded_plan`` times ``TIMED_PROBE_ORDER`` up to this many rounds, until
#: ``TIMED_PROBE_SECONDS`` have passed. The plan's ratio of a K=3 to a plain cycle decides
#: whether seeded requests draft, and one round's (nine timed cycles a K) wandered over
#: 2.44-2.70 in one process on the demo model (the bench's rows: 2.50): one build's plan at
#: 2.69 sent seeded auto plain for 2,229 of its 5,864 bench cycles (0.944x of fixed K=3). A
#: round took ~0.2 s on the demo and ~4 s at the 0.8B shape while it timed K=0-3 (K=4's cycles,
#: in it since, add about a quarter at that shape by the cost table's prices, not timed there),
#: where start-up keeps one
TIMED_PROBE_ROUNDS = 8
TIMED_PROBE_SECONDS = 1.0
#: the K that ``seeded_plan`` times, in this order. Plain cycles both first and last: the plan
#: decides by the ratio of drafting to plain cycles, and a busy machine's speed drifts within
#: the measurement. Every drafting K in the rounds: ``MAX_AUTO_K``'s cycles taken from the
#: acceptance probe, timed seconds before the others, priced K=4 against K=1-3 as the
#: machine's speed had moved in between — two ``make bench`` runs' plans on the demo model
#: put a K=1-3 cycle at 1.56 / 2.15 / 2.74x a plain one and K=4 at 3.33x, and at 1.92 / 2.29 /
#: 2.65x and 3.01x, where the runs' own rows came to 1.61-1.78 / 2.00-2.11 / 2.44-2.57x and
#: 3.03-3.08x: their lines through the four K tilted either way, and seeded requests drafted
#: K=1 where K=2 was 1.13x faster, or a third of their cycles plain. In one process, eight
#: plans each way in turns: the K=3 and K=4 ratios' spread (standard deviation) 3.8% and 4.6%
#: with K=4 in the rounds and each round's own plain cycles as the base, against 5.3% and 7.1%
TIMED_PROBE_ORDER = (0, *range(1, MAX_AUTO_K + 1), 0)
#: each probe text's first cycles, not timed
PROBE_WARM_CYCLES = 2
#: the texts ``probe_acceptance`` continues: code, prose and a question. On one text alone the
#: estimate follows that text (the demo model's first-position acceptance: 0.92 on a
#: docstring, 0.74 on prose, 0.77 on a question; 0.79 over the bench prompts)
ACCEPTANCE_PROBE_TEXTS = (
    "def read_config(path):\n"
    '    """Read a JSON configuration file and return its settings as a dict."""\n',
    "The history of the city goes back to a small fishing village on the river.",
    "Question: how does a hash table handle two keys that land in the same bucket?\nAnswer:",
)


def probe_acceptance(
    engine: CostProbe,
    params: Any,
    cycles: int = ACCEPTANCE_PROBE_CYCLES,
    sequences: list[Any] | None = None,
    counts: AcceptanceCounts | None = None,
) -> list[float]:
    """Per-position acceptance estimates (a_i given 1..i-1 accepted, as ``AcceptanceCounts``)
    from ``cycles`` cycles drafting ``MAX_AUTO_K`` under ``params`` on each of
    ``ACCEPTANCE_PROBE_TEXTS``, their counts pooled. The draws are keyed by ``params``' seed,
    so on one build and machine the probe, and what is decided from it, comes out the same
    every time. ``sequences`` (``probe_sequences``) are continued instead of fresh ones, and
    ``counts`` (an earlier round's) added to instead of fresh ones. Its cycles are not timed:
    the plan times every K in rounds of its own (``TIMED_PROBE_ORDER``)."""
    counts = AcceptanceCounts() if counts is None else counts
    for seq in sequences or probe_sequences(engine, params):
        with closing(_timed_cycles(engine, seq, params, MAX_AUTO_K, cycles, None)) as events:
            seen = 0
            for event in events:
                k = event.cycle_draft_tokens
                if k:
                    accepted = sum(event.drafted or [])
                    for position in range(min(accepted + 1, k)):
                        counts.observe(position, position < accepted)
                    seen += 1
                if seen == cycles:
                    break
    estimates = counts.estimates()
    log.debug(
        "auto K: %d drafting cycles on %d fixed texts accept %s per position",
        cycles * len(ACCEPTANCE_PROBE_TEXTS),
        len(ACCEPTANCE_PROBE_TEXTS),
        [round(a, 3) for a in estimates],
    )
    return estimates


def rounds_within(most: int, seconds: float) -> Iterator[int]:
    """Round numbers 0, 1, ...: at least one, at most ``most``, none begun after ``seconds``
    have passed since the first."""
    started = time.perf_counter()
    for round_number in range(most):
        if round_number and time.perf_counter() - started >= seconds:
            return
        yield round_number


def probe_sequences(engine: CostProbe, params: Any) -> list[Any]:
    """A fresh sequence (prefilled) for each of ``ACCEPTANCE_PROBE_TEXTS``."""
    return [
        engine.new_sequence(list(engine.tokenizer.encode(text)), params, draft=True)
        for text in ACCEPTANCE_PROBE_TEXTS
    ]


def _timed_cycles(
    engine: CostProbe,
    seq: Any,
    params: Any,
    k: int,
    cycles: int,
    timings: list[tuple[int, int, float]] | None,
) -> Iterator[Any]:
    """The decode loop's events continuing ``seq`` at ``k`` for up to ``cycles`` cycles (close
    it to stop), each cycle after the first ``PROBE_WARM_CYCLES`` (compilation, the prompt's
    catch-up, a pipeline not yet filled) timed into ``timings`` when given: ``(K, tokens the
    cycle before committed, seconds since that cycle's event)``."""
    # One cycle's tokens to spare: a request's last cycle has no cycle launched behind it and
    # reads back early (a plain probe's last one timed 0.8 ms where its others took 1.1)
    budget = (cycles + 1) * (k + 1)
    request = GenerationRequest(seq.tokens, params, budget, draft_tokens=k, ignore_eos=True)
    events = engine.decode(seq, request)
    last: tuple[float, int] | None = None
    try:
        for seen, event in enumerate(events, 1):
            now = time.perf_counter()
            if timings is not None and last is not None and seen > PROBE_WARM_CYCLES:
                timings.append((event.cycle_draft_tokens, last[1], now - last[0]))
            last = (now, len(event.token_ids))
            yield event
    finally:
        events.close()


def time_probe_cycles(
    engine: CostProbe,
    params: Any,
    k: int,
    timings: list[tuple[int, int, float]],
    cycles: int = TIMED_PROBE_CYCLES,
    sequences: list[Any] | None = None,
) -> None:
    """Append to ``timings`` the ``k``-cycles the decode loop runs under ``params`` on each of
    ``ACCEPTANCE_PROBE_TEXTS`` (plain ones launched one ahead of the other, as requests run
    them), as ``(K, tokens the cycle before committed, seconds since that cycle's event)``;
    ``sequences`` (``probe_sequences``) are continued instead of fresh ones (no prefill)."""
    for seq in sequences or probe_sequences(engine, params):
        with closing(_timed_cycles(engine, seq, params, k, cycles, timings)) as events:
            for _ in islice(events, cycles):
                pass


def probe_cycle_seconds(rounds: list[list[tuple[int, int, float]]]) -> list[float]:
    """Each K's cycle seconds from the timed ``rounds``, K = 0..MAX_AUTO_K: plain cycles'
    median over every round; a drafting K's the plain median times the median over the rounds
    of that K's median over the round's own plain median (the machine's speed drifts between
    rounds, and a ratio within one round cancels it), and then the least-squares line through
    those K's. Why a line: a drafting cycle is its one catch-up, K-1 further head steps and a
    verify of K+1 positions, each further K about one head step and one verify position more
    (the demo model's bench rows: 1.88 / 2.32-2.42 / 2.75-2.86 / 3.17-3.32 ms at K=1..4), while
    a median of a dozen cycles wanders by ~10% on a busy machine (one probe timed K=2 at 2.76
    ms, above its K=3): the line takes the four medians' common slope, and one stray median
    moves it by a quarter. The median, not the mean, within a K: one preempted cycle must not
    move it. A K without timings gets infinity, never the choice."""
    plain = [seconds for timed in rounds for k, _, seconds in timed if k == 0]
    if not plain:
        return [math.inf] * (MAX_AUTO_K + 1)
    base = statistics.median(plain)
    ratios = round_ratios(rounds)
    medians = [base, *(base * statistics.median(r) if r else math.inf for r in ratios[1:])]
    drafting = [(k, m) for k, m in enumerate(medians) if k > 0 and m < math.inf]
    if len(drafting) < 2:
        return medians
    slope, intercept = statistics.linear_regression(*zip(*drafting, strict=True))
    line = [intercept + slope * k if ratios[k] else math.inf for k in range(1, MAX_AUTO_K + 1)]
    return [base, *line]


def round_ratios(rounds: list[list[tuple[int, int, float]]]) -> list[list[float]]:
    """Per drafting K (index K), each timed round's median cycle of that K over the round's own
    median plain cycle (rounds without either leave it out): within one round the machine's
    drift cancels."""
    ratios: list[list[float]] = [[] for _ in range(MAX_AUTO_K + 1)]
    for timed in rounds:
        plain = [seconds for k, _, seconds in timed if k == 0]
        if not plain:
            continue
        base = statistics.median(plain)
        for k in range(1, MAX_AUTO_K + 1):
            cycles = [seconds for kk, _, seconds in timed if kk == k]
            if cycles:
                ratios[k].append(statistics.median(cycles) / base)
    return ratios


def drafting_spread(rounds: list[list[tuple[int, int, float]]]) -> float:
    """What ``seeded_plan`` multiplies its drafting cycles by: the upper quartile, over the timed
    rounds and drafting K, of a round's drafting-to-plain ratio over that K's median ratio
    (at least 1). Why price drafting pessimistically: the plan is kept for the build and machine,
    so a drafting K chosen on one noisy second slows every seeded request after it, and on two
    shared cores a K=3 cycle's ratio to a plain one wandered over 2.2-4.2 between rounds a tenth
    of a second apart (demo model): five fresh plans at one commit chose K=0 four times and K=2
    once, where the bench ran K=2 at 0.87x plain. Drafting then has to pay in three rounds of
    four. Within a round each ratio is over that round's own plain cycles (timed first and last),
    so the machine's drift between rounds cancels. Against the decode loop itself
    (``scripts/experiments/seeded_plan_cost.py``, six plans in one process at a fast moment of
    the machine): plans priced a K=2 cycle at 2.39-2.67x a plain one where fixed K=2 decoding ran
    ~2.59x (2.42 tokens a cycle at 1.071x K=0's time a token, the median of six trials that
    themselves ranged over 0.88-1.13x); five plans chose K=0 and one K=3."""
    relative = sorted(r / statistics.median(rs) for rs in round_ratios(rounds) for r in rs)
    if len(relative) < 4:
        return 1.0
    return max(1.0, relative[(3 * len(relative)) // 4])


def representative_sampler(engine: CostProbe, params: Any) -> Any:
    """The sampler ``params``' kind of decoding is timed with (``measure_costs``): None for
    greedy decoding. Sampled cycles cost about the same whatever the exact settings; measure
    with the checkpoint's own defaults (or the request's when those are greedy), without
    penalties."""
    if params.greedy:
        return None
    defaults = resolve(engine.sampling_defaults)
    base = params if defaults.greedy else defaults
    return replace(
        base,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias={},
        seed=0,
    )


@dataclass
class RequestAutoK:
    shared: AutoK
    counts: AcceptanceCounts
    plain_cycles: int = 0
    #: plain cycles observed since the last drafting cycle
    plain_run: int = 0
    drafting_cycles: int = 0
    current: int = 0
    #: the K of a probe in progress and how many more cycles it runs
    probe_k: int = 0
    probe_cycles_left: int = 0
    #: plain cycles left of a stretch that re-times plain decoding (``RETIME_PLAIN_EVERY``)
    retime_cycles_left: int = 0
    #: plain cycles left before auto K decides afresh in a plain stretch (``PLAIN_DECIDE_EVERY``)
    plain_left: int = 0
    #: K and committed tokens of the last observed cycle (what the next one's timing depends on)
    last_k: int | None = None
    last_committed: int = 1
    #: the last observed cycle's place in its stretch of one class (1: the first after a switch)
    stretch: int = 0

    def estimates(self) -> list[float]:
        """This request's per-position acceptance estimates: its own decayed evidence over its
        kind's long-run estimates. In a stretch of plain cycles the request's evidence fades
        and the estimates return to what drafting has achieved on this kind of decoding — not
        to a fixed prior: that let one dry spell (the prior 0.6 says "do not draft" at these
        costs) keep a greedy request plain for good, every probe's hit fading before the next
        (a bench run's greedy auto: 5,966 plain cycles where K=4 was 1.22x faster)."""
        return self.counts.estimates(
            prior=self.shared.counts.estimates(), prior_weight=self.shared.policy.prior_weight
        )

    def choose(self, seq: Any) -> int:
        if self.shared.drafting_cycles_seen < EXPLORE_CYCLES:
            # No evidence yet (the first request of its kind): draft the longest K until there
            # is some. Starting plain instead left the decision to the prior and to probes
            # backing off, and the first request ran half its cycles plain (bench: 1,432 of
            # 2,820 auto cycles) where K=4 was 1.2x faster. Counted over the kind's lifetime:
            # decayed counts would fall below any threshold in a long plain stretch, and
            # re-exploring there cost sampled decoding 12% (239 K=4 cycles in a bench run).
            self.current = MAX_AUTO_K
            return MAX_AUTO_K
        if self.probe_cycles_left:
            self.probe_cycles_left -= 1
            return self.probe_k
        if self.retime_cycles_left:
            self.retime_cycles_left -= 1
            return 0
        if self.current and self.shared.drafting_since_plain_timed >= RETIME_PLAIN_EVERY:
            self.shared.drafting_since_plain_timed = 0  # one request re-times it for the kind
            self.retime_cycles_left = SETTLE_CYCLES + 1
            return 0
        if self.plain_left and self.plain_cycles + 1 < self.shared.probe_interval:
            self.plain_left -= 1  # (PLAIN_DECIDE_EVERY)
            self.plain_cycles += 1  # as a decision for plain decoding counts it
            return 0
        self.plain_left = 0
        rates = self.shared.rates(self.estimates())
        k = max(range(len(rates)), key=rates.__getitem__)
        policy = self.shared.policy
        if self.current == 0:
            margin = policy.start_margin
        else:
            margin = policy.stop_margin if k == 0 else SWITCH_MARGIN
        if k != self.current and rates[k] < rates[self.current] * (1 + margin):
            k = self.current  # hysteresis: estimate noise alone must not flip K back and forth
        self.current = k
        if k == 0:
            self.plain_cycles += 1
            if self.plain_cycles >= self.shared.probe_interval:
                # Back off while probes keep failing: each costs a drafting cycle and the
                # head's catch-up over the plain stretch (5% of the time at interval 16).
                self.plain_cycles = 0
                self.shared.probe_interval = min(2 * self.shared.probe_interval, MAX_PROBE_INTERVAL)
                if not self.shared.drafting_hopeless():
                    # Probe the drafting K the estimates favour: K=1 probes alone never
                    # revealed the deeper positions, whose few early misses then kept drafting
                    # off.
                    self.probe_k = max(range(1, len(rates)), key=rates.__getitem__)
                    retimes = self.shared.retimes_drafting()  # (RETIME_DRAFTING_EVERY)
                    self.probe_cycles_left = (SETTLE_CYCLES + 2 if retimes else PROBE_CYCLES) - 1
                    return self.probe_k
            self.plain_left = PLAIN_DECIDE_EVERY - 1
        else:
            self.shared.probe_interval = PROBE_EVERY
            self.drafting_cycles += 1
            if k < MAX_AUTO_K and self.drafting_cycles % DEEPER_PROBE_EVERY == 0:
                # A K-cycle never reveals position K+1: one early miss there would pin its
                # estimate, and K, for good. A one-longer draft now and then reveals it.
                return k + 1
        return k

    def observe(self, k: int, n_accepted: int) -> None:
        """Update a_i for every position whose outcome the cycle revealed.

        Costs are calibrated separately (``observe_seconds``), per class of cycle, and per K
        only slowly (``AutoK.tilt``): only the K in use can be re-timed in a run, and when each
        K was re-timed on its own at the class's pace, a K=0 step that wandered by +-15% within
        minutes (3.3 -> 4.0 -> 3.4 ms) against the other K's start-up figures made K follow
        the noise (the sampled bench row fell to 0.94x of plain decoding).
        """
        if k > 0 and self.plain_run:
            # What was seen before the plain stretch ages as if the stretch had drafted (see
            # PLAIN_FORGET): the probe's outcome, not the old evidence, decides what comes next.
            self.counts.decay((REQUEST_FORGET / PLAIN_FORGET) ** self.plain_run)
        self.plain_run = 0 if k > 0 else self.plain_run + 1
        self.counts.decay(REQUEST_FORGET if k > 0 else PLAIN_FORGET)
        if k > 0:
            # The kind's memory ages with evidence only: plain cycles reveal nothing about
            # what drafting would achieve.
            self.shared.counts.decay(SHARED_FORGET)
            self.shared.drafting_cycles_seen += 1
        own, shared = self.counts, self.shared.counts
        for i in range(min(k, n_accepted + 1)):  # (AcceptanceCounts.observe, inlined)
            hit = float(i < n_accepted)
            own.hits[i] += hit
            own.trials[i] += 1.0
            shared.hits[i] += hit
            shared.trials[i] += 1.0

    def observe_seconds(self, k: int, committed: int, seconds: float | None) -> None:
        """A cycle's wall time, from the previous cycle's end to its own as the decode loop runs
        them (None for a request's first cycle), and the tokens it committed.

        A switch's own cycle (a probe's first, the first plain cycle after drafting) is never
        counted: it costs extra — the head's catch-up over the plain stretch, a pipeline not yet
        filled. Nor, in full, are the next ``SETTLE_CYCLES - 1``, which still cost more than the
        settled cycles auto K chooses between: they count only where they price their class
        below its calibration (``AutoK.calibrate``'s ``at_most``), bounding the settled cost
        from above. In a mostly-plain run a probe's second cycle is the only drafting cycle
        there is (and in a mostly-drafting one a short plain stretch the only plain cycles):
        not timed at all, one slow settled timing kept a class overpriced for good, since auto
        then ran the other class; timed in full, they overprice their class by the warm-up.
        Replayed with the warm-up (``scripts/experiments/autok_replay_sweep.py``, 90 cases),
        counting early cycles in full (``--settle 1``) left 10 cases under 0.97x the best
        fixed K (worst 0.928x), 13 with the machine's pauses (``--pauses 20,5``; 0.904x);
        bounding them 4 (0.931x) and 0 (0.972x). A drafting cycle is compared with the
        table's cost for the catch-up it ran (what the previous cycle committed).
        """
        previous_k, before = self.last_k, self.last_committed
        self.last_k, self.last_committed = k, committed
        same_class = previous_k is not None and (previous_k > 0) == (k > 0)
        self.stretch = self.stretch + 1 if same_class else 1
        if seconds is None or self.stretch == 1:
            return
        self.shared.calibrate(
            k, before if k > 0 else 1, seconds, at_most=self.stretch <= SETTLE_CYCLES
        )


#: pseudo-trials per position with which a seeded request's long-run acceptance starts from
#: the plan's probe (``SeededPlan.chooser``). That long run is the request's own, so it must be
#: steadier than a kind's pooled one: simulated on the demo model's plan and costs, 256-token
#: requests at a steady acceptance of 0.6-0.85 came to 0.95-0.99x of the best fixed K with 8
#: (a few misses in a row sent a request plain: 1,278 of 3,030 cycles at 0.8), 0.966-0.995x
#: with 32, and 128 held them at K=2 where K=4 was best (0.952x at 0.85)
SEEDED_PRIOR_TRIALS = 32.0


def read_seeded_plan(path: Path) -> SeededPlan | None:
    """The plan kept at ``path`` (``EngineAutoK.seeded_plan``), or None without a readable one."""
    try:
        record = json.loads(path.read_text())
        return SeededPlan(
            [float(a) for a in record["acceptance"]],
            [float(c) for c in record["cycle_seconds"]],
        )
    except (OSError, KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class SeededPlan:
    """The costs and prior a seeded sampled request under automatic K chooses with, measured
    once per build and machine (``EngineAutoK.seeded_plan``): ``acceptance`` the probe's
    per-position estimates; ``cycle_seconds[K]`` a K-cycle as the decode loop ran it on the
    probe texts (the catch-up included)."""

    acceptance: list[float]
    cycle_seconds: list[float]

    @classmethod
    def measured(
        cls, acceptance: list[float], rounds: list[list[tuple[int, int, float]]]
    ) -> SeededPlan:
        """The plan from the probe's acceptance and the timed ``rounds``: each K's cycle as
        ``probe_cycle_seconds`` prices it, drafting ones times ``drafting_spread``."""
        seconds = probe_cycle_seconds(rounds)
        spread = drafting_spread(rounds)
        return cls(acceptance, [seconds[0], *(s * spread for s in seconds[1:])])

    @property
    def k(self) -> int:
        """Where a request starts: the K of the most tokens a second at the probe's acceptance."""
        return best_k(self.costs(), self.acceptance)

    def costs(self) -> CostTable:
        """The cycle times as a cost table; their catch-up is in them, so none is added."""
        zeros = [0.0] * len(self.cycle_seconds)
        return CostTable(cycle=list(self.cycle_seconds), trunk=zeros, head_step=0.0, absorb=zeros)

    def prior_counts(self) -> AcceptanceCounts:
        """The probe's per-position acceptance as ``SEEDED_PRIOR_TRIALS`` pseudo-trials each."""
        return AcceptanceCounts(
            hits=[a * SEEDED_PRIOR_TRIALS for a in self.acceptance],
            trials=[SEEDED_PRIOR_TRIALS] * len(self.acceptance),
        )

    def chooser(self) -> SeededAutoK:
        """A fresh chooser: auto K's rules (``RequestAutoK``) over a kind of its own — this
        plan's costs, never calibrated, and a long-run acceptance that starts from the probe's
        and learns from this request alone — so that its K per cycle is a function of the plan
        and of the request's own draws, which its seed fixes."""
        own = AutoK(
            self.costs(),
            self.prior_counts(),
            drafting_cycles_seen=EXPLORE_CYCLES,
            policy=POLICIES["sampled"],
            probe_interval=self.first_probe_after(),
        )
        return SeededAutoK(own, AcceptanceCounts(), current=self.k)

    def first_probe_after(self) -> int:
        """Plain cycles before a request's first probe. Its probes' backoff is the request's
        own (a kind's would carry other requests into its K), so each request would start it
        again at ``PROBE_EVERY``: under a plan that starts requests plain, three failing probes
        in each 128-token request (a catch-up, two drafting cycles, the plain look-ahead
        broken twice) made seeded auto K 0.958x as fast as fixed K=0 on the demo model, and
        starting at ``MAX_PROBE_INTERVAL`` 1.051x as fast as that (200 alternations in one
        process: 1.009x K=0). A request whose text drafts much better than the probe texts
        still finds out, a hundred-odd tokens later; under a drafting plan a request that
        stops probes soon, since its plan expects drafting to pay."""
        return MAX_PROBE_INTERVAL if self.k == 0 else PROBE_EVERY


class SeededAutoK(RequestAutoK):
    """``RequestAutoK`` for a seeded request (``SeededPlan.chooser``): it ignores cycle
    timings, which would make its K, and so its text, depend on the machine's moment."""

    def observe_seconds(self, k: int, committed: int, seconds: float | None) -> None:
        pass


@dataclass
class PatternChooser:
    """A stand-in for ``RequestAutoK`` that drafts a repeating pattern of K and keeps the cycle
    times the decode loop reports: for measuring and testing the loop itself (pass it as
    ``DraftPolicy(fixed=None, chooser=...)``)."""

    pattern: list[int]
    chosen: int = 0
    timed: list[tuple[int, float | None]] = field(default_factory=list)

    def choose(self, seq: Any) -> int:
        self.chosen += 1
        return self.pattern[(self.chosen - 1) % len(self.pattern)]

    def observe(self, k: int, n_accepted: int) -> None:
        pass

    def observe_seconds(self, k: int, committed: int, seconds: float | None) -> None:
        self.timed.append((k, seconds))
