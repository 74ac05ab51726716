"""Plain batched cycles one ahead against read before the next, in one process.

The same greedy plain (K=0) requests (the first c bench prompts, EOS ignored) run as rows of
one ``BatchDecoder`` with the look-ahead (``BatchDecoder._look_ahead``) and with it switched
off (every cycle read back before the next: the batch before the look-ahead), and, for one row,
through ``Engine.generate`` (a request alone, which has always run plain cycles one ahead).
The ways alternate in a rotating order, ``--repeats`` times; aggregate tokens/s per run and the
per-round ratios with their median (this machine's speed drifts between rounds, so only ratios
of neighbouring runs mean anything)::

    python scripts/experiments/batch_lookahead.py --rows 1,4,8 --repeats 8
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from engine.api import DEMO_MODEL
from engine.bench.batch import _requests, run_batched, run_serial
from engine.bench.prompts import DEFAULT_PROMPTS, load_prompts
from engine.runtime import Engine
from engine.scheduling.batching import BatchDecoder

LOOK_AHEAD = BatchDecoder._look_ahead


def _read_first(self: BatchDecoder, rows: Any, current: Any) -> bool:
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    engine = Engine.load(args.model)
    sizes = [int(c) for c in args.rows.split(",")]
    prompts = load_prompts(Path(DEFAULT_PROMPTS), engine.tokenizer, max(sizes))

    def run(way: str, rows: int) -> float:
        reqs = _requests(engine, prompts, rows, 0, args.tokens)
        if way == "alone":
            return run_serial(engine, reqs)["aggregate_tps"]
        BatchDecoder._look_ahead = LOOK_AHEAD if way == "ahead" else _read_first
        try:
            return run_batched(engine, reqs)["aggregate_tps"]
        finally:
            BatchDecoder._look_ahead = LOOK_AHEAD

    ways = [(w, c) for c in sizes for w in ("ahead", "read", *(["alone"] if c == 1 else []))]
    for way in ways:  # warm-up: every shape compiled
        run(*way)
    tps: dict[tuple[str, int], list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        shift = repeat % len(ways)
        for way in ways[shift:] + ways[:shift]:
            tps[way].append(run(*way))

    def ratios(a: tuple[str, int], b: tuple[str, int]) -> dict[str, Any]:
        each = [x / y for x, y in zip(tps[a], tps[b], strict=True)]
        return {"median": round(statistics.median(each), 3), "rounds": [round(r, 3) for r in each]}

    out: dict[str, Any] = {
        "tokens_per_s": {f"{w} x{c}": [round(t, 1) for t in v] for (w, c), v in tps.items()}
    }
    for c in sizes:
        out[f"{c} rows: ahead / read first"] = ratios(("ahead", c), ("read", c))
    if 1 in sizes:
        out["1 row: ahead / alone"] = ratios(("ahead", 1), ("alone", 1))
        out["1 row: read first / alone"] = ratios(("read", 1), ("alone", 1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
