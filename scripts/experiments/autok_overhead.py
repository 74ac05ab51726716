"""What auto K's own machinery costs, apart from the K it chooses.

Auto K's row in ``make bench`` trails the best fixed K by its choices (which K, when to stop
drafting) and by what it does besides choosing: probes one draft longer every
``DEEPER_PROBE_EVERY`` cycles, plain stretches that re-time plain decoding
(``RETIME_PLAIN_EVERY``), the calibration's bookkeeping a cycle. This runs, in turns on each
bench prompt in one process (the demo model, 256 tokens a request, EOS ignored):

* ``auto``: auto K with its rates replaced so that ``--k`` always wins (every probe, deeper
  draft, re-timing and calibration as in a run; only the choice pinned);
* ``pattern``: the same K and auto's deeper drafts as a fixed pattern (``PatternChooser``:
  ``--k`` seven cycles, ``--k`` + 1 the eighth), none of auto's machinery;

and prints each one's tokens per second, the time auto K's calls (``choose``, ``observe``,
``observe_seconds``) take on the decoding thread, and the median and mean seconds of each mode's
cycles by the K of the cycle before and its own (the decode loop's timings, as auto K's
calibration gets them)::

    .venv/bin/python scripts/experiments/autok_overhead.py --k 3 --sampler unseeded:qwen

On the AMD EPYC Zen 4 VM (``8500aaa``, ``unseeded:qwen``, 24 prompts twice): auto over the
pattern 0.974x at K=3 and 0.968x at K=2 (more runs: K=3 0.937-0.976x, K=2 0.946x), its cycles of the
same K after the same K dearer on average (K=3 2.254 against 2.185 ms, K=2 1.904 against
1.842), and its calls ~41-57 µs a cycle on the decoding thread (choose 12-17 with its rates
pinned, observe 11-14, observe_seconds 18-26 with this script's recording), 1.8-2.2% of its
decoding time,
where the same calls alone in a loop take ~12 µs (``choose`` 6.9, of it ``AutoK.rates`` 3.8):
on two cores that the stream thread and the product pool keep busy, Python on the decoding
thread costs throughput in proportion. So auto K's machinery alone takes ~3% against the same
K fixed, as much as auto K may trail the best fixed K; the rest of its gap in a bench run is its
choice. In
one run the same process's unseeded auto drafted K=3 for its first ~1,100 cycles and K=2 after,
where fixed K=2 ran 2.6% faster than fixed K=3: the start-up table priced a K=3 cycle at 1.17x
a K=2 one against 1.24x in the decode loop, and a K's cycles price the drafting class as a
whole (``AutoK.calibrate``), so only K=2's own cycles could have shown it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import engine.scheduling.autok as autok  # (the engine package binds the fast BLAS first)
from engine.api import DEMO_MODEL
from engine.bench.prompts import load_prompts
from engine.bench.speed import Row, parse_samplers, request_params, run_ours
from engine.runtime import Engine
from engine.scheduling.policy import DraftPolicy

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    # below the longest auto K: the pattern drafts one more every few cycles, as auto does
    parser.add_argument("--k", type=int, default=3, choices=range(1, autok.MAX_AUTO_K))
    parser.add_argument("--sampler", default="unseeded:qwen")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    engine = Engine.load(args.model, draft_tokens=None)
    params = parse_samplers(args.sampler, engine)[args.sampler]
    engine.autok.costs(params, refresh=True)
    pinned = [1.0] * (autok.MAX_AUTO_K + 1)
    pinned[args.k] = 2.0
    autok.AutoK.rates = lambda self, acceptance: list(pinned)  # type: ignore[method-assign]

    state: dict[str, Any] = {"mode": "auto", "previous": None}
    cycles: dict[tuple[str, int | None, int], list[float]] = defaultdict(list)

    def recording(observe: Any) -> Any:
        def observe_seconds(self: Any, k: int, committed: int, seconds: float | None) -> None:
            if seconds is not None:
                cycles[(state["mode"], state["previous"], k)].append(seconds)
            state["previous"] = k
            observe(self, k, committed, seconds)

        return observe_seconds

    for chooser in (autok.RequestAutoK, autok.PatternChooser):
        chooser.observe_seconds = recording(chooser.observe_seconds)  # type: ignore[method-assign]
    # the seconds auto K's own calls take on the decoding thread, as the loop makes them
    spent: dict[str, float] = defaultdict(float)

    def timing(name: str) -> Any:
        method = getattr(autok.RequestAutoK, name)

        def timed(self: Any, *call: Any) -> Any:
            start = time.perf_counter()
            out = method(self, *call)
            spent[name] += time.perf_counter() - start
            return out

        return timed

    for name in ("choose", "observe", "observe_seconds"):
        setattr(autok.RequestAutoK, name, timing(name))
    auto_policy = engine.policy
    pattern = [args.k] * (autok.DEEPER_PROBE_EVERY - 1) + [args.k + 1]

    def policy(draft_tokens: Any, sampling: Any) -> DraftPolicy:
        if state["mode"] == "auto":
            return auto_policy(draft_tokens, sampling)
        return DraftPolicy(fixed=None, chooser=autok.PatternChooser(pattern))

    engine.policy = policy  # type: ignore[method-assign]
    prompts = load_prompts(ROOT / "configs" / "bench_prompts.jsonl", engine.tokenizer, None)
    rows = {mode: Row(args.sampler, mode) for mode in ("auto", "pattern")}
    for n in range(args.passes):
        for i, prompt in enumerate(prompts):
            for mode in ("auto", "pattern") if i % 2 else ("pattern", "auto"):
                state["mode"], state["previous"] = mode, None
                sampling = request_params(args.sampler, params, 1000 * n + i)
                run_ours(engine, prompt["ids"], sampling, "auto", args.max_tokens, rows[mode])
    totals = {mode: row.totals for mode, row in rows.items()}
    speed = {mode: t.completion_tokens / t.generation_seconds for mode, t in totals.items()}
    print(
        f"K={args.k}, {args.sampler}: auto {speed['auto']:.1f} tokens/s, pattern "
        f"{speed['pattern']:.1f} ({speed['auto'] / speed['pattern']:.3f}x)"
    )
    auto_cycles = totals["auto"].cycles  # every cycle of an auto request, timed or not
    print(
        "  auto K's calls a cycle: "
        + ", ".join(f"{name} {1e6 * t / auto_cycles:.1f} µs" for name, t in spent.items())
        + f"; {100 * sum(spent.values()) / totals['auto'].generation_seconds:.1f}% of auto's decoding time"
    )
    for (mode, previous, k), seconds in sorted(cycles.items(), key=str):
        if len(seconds) >= 5:
            print(
                f"  {mode:7s} K={k} after K={previous}: {len(seconds):5d} cycles, median "
                f"{1e3 * statistics.median(seconds):.3f} ms, mean {1e3 * statistics.fmean(seconds):.3f}"
                f", sum {sum(seconds):.2f} s"
            )


if __name__ == "__main__":
    main()
