"""What a plain cycle costs with the MTP head attached, against one without it.

    python scripts/experiments/plain_with_head.py [--sampler preset:qwen] [--prompts 20]

Each prompt runs 256 plain cycles (EOS ignored) under every mode in turn, in one process:
``plain`` (``draft_tokens=0``: no head), ``head`` (the head attached, a ``PatternChooser``
that always answers 0: the sequence keeps every cycle's state for a drafting cycle's
catch-up) and ``auto`` (automatic K, which may draft: only its plain cycles count). Prints the
median and mean seconds of a plain cycle, from one cycle's event to the next.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.api import GenerationRequest  # noqa: E402
from engine.bench.prompts import load_prompts  # noqa: E402
from engine.bench.speed import parse_samplers, request_params  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from engine.scheduling.autok import PatternChooser  # noqa: E402
from engine.scheduling.policy import DraftPolicy  # noqa: E402

MODES = ("plain", "head", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/qwen3.5-demo")
    ap.add_argument("--sampler", default="preset:qwen")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    engine = Engine.load(args.model, draft_tokens=None)
    name, base = next(iter(parse_samplers(args.sampler, engine).items()))
    prompts = load_prompts(ROOT / "configs/bench_prompts.jsonl", engine.tokenizer, args.prompts)
    own_policy = engine.policy
    mode = {"now": "plain"}

    def policy(draft_tokens, params=None):  # noqa: ANN001, ANN202
        if mode["now"] == "head":
            return DraftPolicy(fixed=None, chooser=PatternChooser([0]))
        return own_policy(draft_tokens, params)

    engine.policy = policy
    times: dict[str, list[float]] = {m: [] for m in MODES}

    def run(m: str, ids: list[int], params, tokens: int, keep: bool = True) -> None:  # noqa: ANN001
        mode["now"] = m
        last: list[float | None] = [None]

        def trace(cycle: dict) -> None:
            now = time.perf_counter()
            if keep and last[0] is not None and not cycle["draft"]:
                times[m].append(now - last[0])
            last[0] = now

        request = GenerationRequest(
            ids, params, tokens, draft_tokens=0 if m == "plain" else None, ignore_eos=True
        )
        for _ in engine.generate(request, trace=trace):
            pass

    for m in MODES:  # warm-up: every mode's graphs once
        run(m, prompts[0]["ids"], base, 16, keep=False)
    for i, prompt in enumerate(prompts):
        params = request_params(name, base, i)
        for m in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
            run(m, prompt["ids"], params, args.tokens)
    for m, seconds in times.items():
        print(
            f"{m:10s} {len(seconds):6d} plain cycles: median {1e3 * statistics.median(seconds):.3f} ms,"
            f" mean {1e3 * statistics.mean(seconds):.3f} ms"
        )


if __name__ == "__main__":
    main()
