"""How well auto K's calibration tracks drafting cycles' cost over plain ones, on real timings.

Runs greedy auto K over the bench prompts (``--passes`` times, 256 tokens each) in one process,
recording every timing its calibration is given (``AutoK.calibrate``: the cycle's K, the
catch-up it ran, its seconds, whether it only bounds its class's price from above). Then
replays that stream through two calibrations and prints, over the last 90% of it, how far each
one's drafting-over-plain ratio (all that decides between K; a common factor cancels) lies from
the run's own: the median of the drafting timings over the table's price, over that of the plain
ones.

* ``filter``: ``AutoK.calibrate`` as it is (the machine's speed m and the ratio r, one Kalman
  filter);
* ``per class``: one factor per class learned from its own timings alone (log space, clipped at
  ``CALIBRATION_CLIP``, weight 1/32, a class timed again after 256 timings of the other taking
  its new timing at up to 0.25), the rule the filter replaced.

    .venv/bin/python scripts/experiments/calibration_track.py --passes 2

The decisions in the run are the filter's; both replays see the same timings.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import engine.scheduling.autok as autok  # (the engine package binds the fast BLAS first)
from engine.api import GenerationRequest
from engine.bench.prompts import load_prompts
from engine.runtime import Engine
from sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def per_class(stream: list[tuple[int, float, bool, float]]) -> list[float]:
    """The drafting-over-plain ratio after each timing, one factor per class."""
    factors, last, ratios = [0.0, 0.0], [0, 0], []
    limit = math.log(autok.CALIBRATION_CLIP)
    for n, (k, logged, at_most, _) in enumerate(stream, 1):
        cls = int(k > 0)
        off = min(max(logged - factors[cls], -limit), limit)
        if not (at_most and off >= 0):
            weight = min(0.25, max(1 / 32, (n - last[cls]) / 256))
            last[cls] = n
            factors[cls] += weight * off
        ratios.append(math.exp(factors[1] - factors[0]))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()

    stream: list[tuple[int, float, bool, float]] = []
    calibrate = autok.AutoK.calibrate

    def recording(
        self: autok.AutoK, k: int, before: int, seconds: float, at_most: bool = False
    ) -> None:
        # the timing over the table's price (the K's tilt taken out), and the filter's ratio
        tilt = self.tilt[k] if 0 < k < len(self.tilt) else 1.0
        logged = math.log(seconds / (self.costs.expected_seconds(k, before) * tilt))
        calibrate(self, k, before, seconds, at_most)
        stream.append((k, logged, at_most, math.exp(self.ratio)))

    autok.AutoK.calibrate = recording
    engine = Engine.load(args.model, draft_tokens=0)
    prompts = load_prompts(ROOT / "configs" / "bench_prompts.jsonl", engine.tokenizer, None)
    params = SamplingParams(temperature=0.0)
    for _ in range(args.passes):
        for prompt in prompts:
            request = GenerationRequest(
                prompt["ids"], params, 256, draft_tokens="auto", ignore_eos=True
            )
            for _ in engine.generate(request):
                pass
    settled = [(k, logged) for k, logged, at_most, _ in stream if not at_most]
    drafting = statistics.median(x for k, x in settled if k > 0)
    plain = statistics.median(x for k, x in settled if k == 0)
    truth = math.exp(drafting - plain)
    print(f"{len(stream)} timings; the run's drafting-over-plain ratio (medians) {truth:.3f}")
    tail = len(stream) // 10
    for name, ratios in (("filter", [r for *_, r in stream]), ("per class", per_class(stream))):
        errors = [abs(math.log(r / truth)) for r in ratios[tail:]]
        print(
            f"{name:9s}: mean |log error| {statistics.fmean(errors):.3f}, worst {max(errors):.3f};"
            f" ratio over the run {min(ratios[tail:]):.3f}-{max(ratios[tail:]):.3f}"
        )


if __name__ == "__main__":
    main()
