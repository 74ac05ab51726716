"""Auto K replayed on recorded acceptance over a grid of cases, against the best fixed K::

    .venv/bin/python scripts/experiments/autok_replay_sweep.py
    .venv/bin/python scripts/experiments/autok_replay_sweep.py --settle 1 --machine-drift 1e-3

The replay is tests/unit/test_autok_replay.py's (the real ``AutoK`` on the demo model's
recorded per-position acceptance, costs from the record's table, 20% timing noise). The grid:
greedy and Qwen's sampler; the replay's machines plus a "marginal" one (1.5 ms more per verify
position: sampled drafting loses ~6%, greedy pays ~10%), or those ``--machines`` names ("slight":
0.5 ms more, where sampled K=2 pays ~1.10x; "today":
a ``make bench`` run's start-up tables at today's speed, with ``--switch 0,0.7`` the measured
cost of starting to draft beyond them); the exact table and the four 15% table errors of the
replay's tests; three noise seeds; with and without a stretch's warm-up (``WARM_UP``). Prints,
with and without the warm-up, each case's tokens per second over the best fixed K's under the
same costs: mean, worst, tenth percentile, and how many fall under 0.97. ``--settle``,
``--clip``, ``--machine-drift``, ``--ratio-drift``, ``--timing-noise``, ``--machine-start`` and
``--ratio-start`` set ``SETTLE_CYCLES``, ``CALIBRATION_CLIP`` and the calibration's variances
(``--settle 1``: a stretch's cycles after the switch's own all count in full); ``--pauses`` and
``--spells`` the machine's pauses and slow spells (tests/unit/test_autok_replay.py's
``replay``); ``--raise`` multiplies the kind's drafting-over-plain ratio by that factor after
its fourth request (a price raised at switches, ``RETIME_DRAFTING_EVERY``); ``--noise`` the
timings' noise (the replay tests' 20% by default; the calibration assumes 10%).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

import test_autok_replay as replayed  # noqa: E402

import engine.scheduling.autok as autok  # noqa: E402

TABLE_ERRORS = ((1.0, 1.0), (0.85, 1.0), (1.15, 1.0), (1.0, 0.85), (1.0, 1.15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settle", type=int, default=autok.SETTLE_CYCLES)
    parser.add_argument("--clip", type=float, default=autok.CALIBRATION_CLIP)
    parser.add_argument("--machine-drift", type=float, default=autok.MACHINE_DRIFT)
    parser.add_argument("--ratio-drift", type=float, default=autok.RATIO_DRIFT)
    parser.add_argument("--timing-noise", type=float, default=autok.TIMING_NOISE)
    parser.add_argument("--machine-start", type=float, default=autok.MACHINE_START_VARIANCE)
    parser.add_argument("--ratio-start", type=float, default=autok.RATIO_START_VARIANCE)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--noise", type=float, default=0.2, help="timings' noise (log, std)")
    parser.add_argument(
        "--pauses",
        default="0,0",
        help="rate a second, milliseconds: the machine's pauses (tests/unit/test_autok_replay.py)",
    )
    parser.add_argument(
        "--spells",
        default="0,1",
        help="seconds, factor: the machine that much slower every other period (the replay's)",
    )
    parser.add_argument(
        "--raise",
        dest="factor",
        type=float,
        default=1.0,
        help="the drafting price raised by this factor after four requests",
    )
    parser.add_argument(
        "--machines",
        default="measured,compute-bound,marginal",
        help="the replay's machines ('today': today's start-up tables, tests/data)",
    )
    parser.add_argument(
        "--switch",
        default="0,0",
        help="milliseconds more for the first plain and the first drafting cycle after a switch",
    )
    args = parser.parse_args()
    autok.SETTLE_CYCLES = args.settle
    autok.CALIBRATION_CLIP = args.clip
    autok.MACHINE_DRIFT, autok.RATIO_DRIFT = args.machine_drift, args.ratio_drift
    autok.TIMING_NOISE = args.timing_noise
    autok.MACHINE_START_VARIANCE, autok.RATIO_START_VARIANCE = args.machine_start, args.ratio_start
    replayed.MACHINES["marginal"] = 1.5e-3
    replayed.MACHINES["slight"] = 0.5e-3
    rate, pause_ms = (float(x) for x in args.pauses.split(","))
    pauses = (rate, pause_ms / 1e3)
    period, factor = (float(x) for x in args.spells.split(","))
    spells = (period, factor)
    switch = tuple(float(x) / 1e3 for x in args.switch.split(","))
    seeded = random.Random
    for warm_up in ((), replayed.WARM_UP):
        ratios = []
        for sampler in ("greedy", "preset:qwen"):
            for machine in args.machines.split(","):
                truth = replayed.true_table(sampler, machine)
                best = max(
                    replayed.replay(
                        sampler,
                        k,
                        machine=machine,
                        warm_up=warm_up,
                        pauses=pauses,
                        spells=spells,
                        switch_penalty=switch,
                    )[0]
                    for k in range(len(truth.cycle))
                )
                for seed in range(args.seeds):
                    # the replay draws its timing noise from random.Random(0)
                    replayed.random.Random = lambda _, seed=seed: seeded(seed)
                    for error in TABLE_ERRORS:
                        auto = autok.AutoK(truth.scaled(*error), policy=replayed.policy(sampler))
                        if args.factor != 1.0:
                            auto = replayed.raising_after_four(auto, args.factor)
                        tps, _ = replayed.replay(
                            sampler,
                            auto,
                            args.noise,
                            machine=machine,
                            warm_up=warm_up,
                            pauses=pauses,
                            spells=spells,
                            switch_penalty=switch,
                        )
                        ratios.append(tps / best)
        replayed.random.Random = seeded
        ratios.sort()
        print(
            f"{'with' if warm_up else 'without'} the warm-up: auto over the best fixed K mean "
            f"{statistics.mean(ratios):.4f}, worst {ratios[0]:.4f}, tenth percentile "
            f"{ratios[len(ratios) // 10]:.4f}, {sum(r < 0.97 for r in ratios)} of "
            f"{len(ratios)} under 0.97"
        )


if __name__ == "__main__":
    main()
