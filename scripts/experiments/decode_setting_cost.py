"""Milliseconds per generated token with one of the decode loop's settings on against off, the
two taking turns in one process::

    python scripts/experiments/decode_setting_cost.py --setting head-ahead --ks 0,3 --rounds 30
    python scripts/experiments/decode_setting_cost.py --setting head-ahead --ks 2,3 --sampled
    python scripts/experiments/decode_setting_cost.py --setting helping-wait --ks 0,2 --rows 8

Settings: ``head-ahead``, a drafting cycle's next first head step launched before its read-back
(``engine.scheduling.batching.launch_heads_ahead``; off: nothing runs ahead); ``helping-wait``,
the read-back's waiting thread taking part in the kernel's products (``products.wait``; off:
``mx.eval``, the thread sleeps).

Three prompts (code, prose, a question) of ``--tokens`` each a turn, EOS ignored, greedy or
Qwen's sampler seeded; with ``--rows`` that many requests (the prompts in turn) as rows of one
batch, the aggregate time per token. Each round runs both settings at every K (in alternating order), after a
warm-up run of each. Reports the median time per token of each setting and the median of the
rounds' ratios (with it over without) with its quartiles; K=0 runs nothing ahead (a control).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.api import GenerationRequest  # noqa: E402
from engine.model import products  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from engine.scheduling import batching  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

PROMPTS = (
    "def read_config(path):\n",
    "The history of the city goes back",
    "Question: what is a hash table?\nAnswer:",
)
LAUNCH_HEAD_AHEAD = batching.launch_heads_ahead
WAIT = products.wait


def set_head_ahead(on: bool) -> None:
    batching.launch_heads_ahead = LAUNCH_HEAD_AHEAD if on else (lambda *_: None)


def set_helping_wait(on: bool) -> None:
    products.wait = WAIT if on else mx.eval


SETTINGS: dict[str, Callable[[bool], None]] = {
    "head-ahead": set_head_ahead,
    "helping-wait": set_helping_wait,
}


def seconds_per_token(
    engine: Engine, k: int, params: SamplingParams, tokens: int, rows: int
) -> float:
    prompts = [list(engine.tokenizer.encode(prompt)) for prompt in PROMPTS]
    requests = [
        GenerationRequest(ids, params, tokens, draft_tokens=k, ignore_eos=True) for ids in prompts
    ]
    generated, start = 0, time.perf_counter()
    if rows == 1:
        for request in requests:
            for event in engine.generate(request):
                generated += len(event.token_ids)
    else:
        batch = engine.batch(rows)
        for row in range(rows):
            batch.add(row, requests[row % len(requests)])
        while len(batch):
            for _, item in batch.step():
                if isinstance(item, BaseException):
                    raise item
                generated += len(item.token_ids)
    return (time.perf_counter() - start) / generated


def timed(
    engine: Engine,
    setting: Callable[[bool], None],
    on: bool,
    k: int,
    params: SamplingParams,
    tokens: int,
    rows: int,
) -> float:
    setting(on)
    return seconds_per_token(engine, k, params, tokens, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="head-ahead")
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--ks", default="0,3")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sampled", action="store_true", help="Qwen's sampler, seeded")
    parser.add_argument("--rows", type=int, default=1, help="requests as rows of one batch")
    args = parser.parse_args()
    engine = Engine.load(args.model)
    if args.sampled:
        params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1)
    else:
        params = SamplingParams(temperature=0.0)
    setting = SETTINGS[args.setting]
    for k in (int(k) for k in args.ks.split(",")):
        for on in (True, False):
            timed(engine, setting, on, k, params, args.tokens, args.rows)
        runs: dict[bool, list[float]] = {True: [], False: []}
        ratios = []
        for round_number in range(args.rounds):
            order = (True, False) if round_number % 2 == 0 else (False, True)
            times = {
                on: timed(engine, setting, on, k, params, args.tokens, args.rows) for on in order
            }
            for on, t in times.items():
                runs[on].append(t)
            ratios.append(times[True] / times[False])
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"{args.setting} K={k}: on {1e3 * statistics.median(runs[True]):.3f} ms a token, "
            f"off {1e3 * statistics.median(runs[False]):.3f}; on over off "
            f"{statistics.median(ratios):.3f} ({low:.3f}-{high:.3f}), {args.rounds} rounds",
            flush=True,
        )
    setting(True)


if __name__ == "__main__":
    main()
