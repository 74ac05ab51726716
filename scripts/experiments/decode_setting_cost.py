"""Milliseconds per generated token with one of the decode loop's settings on against off, the
two taking turns in one process, and the calling thread's CPU milliseconds per token::

    python scripts/experiments/decode_setting_cost.py --setting head-ahead --ks 0,3 --rounds 30
    python scripts/experiments/decode_setting_cost.py --setting head-ahead --ks 2,3 --sampled
    python scripts/experiments/decode_setting_cost.py --setting helping-wait --ks 0,2 --rows 8
    python scripts/experiments/decode_setting_cost.py --setting tapes --ks 0,2,3 --rounds 24
    python scripts/experiments/decode_setting_cost.py --setting embedding --ks 0,3 --rounds 30

Settings (off in parentheses):
- ``head-ahead``: a drafting cycle's next first head step launched before its read-back
  (``engine.scheduling.batching.launch_heads_ahead``; nothing runs ahead, so K=0 is a control);
- ``helping-wait``: the read-back's waiting thread taking part in the kernel's products
  (``products.wait``; ``mx.eval``, the thread sleeps);
- ``tapes``: every compiled block run as a tape (``engine/model/tape.py``; the compiled block
  alone), the blocks rebuilt at each switch;
- ``embedding``: the token embedding as one native op in a tape (``products.embedded``; mlx's
  lookup and cast), every other block a tape either way.

Three prompts (code, prose, a question) of ``--tokens`` each a turn, EOS ignored, greedy or
Qwen's sampler seeded; with ``--rows`` that many requests (the prompts in turn) as rows of one
batch, the aggregate time per token. First each setting's tokens at every K (every setting is
exact: they must be the same), then rounds: each runs both settings at every K (in alternating
order), each after a short warm-up run. Reports each setting's median time and calling-thread
CPU per token and the median of the rounds' ratios (on over off) with its quartiles.
"""

from __future__ import annotations

import argparse
import gc
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
import mlx.nn as nn  # noqa: E402

from engine.api import GenerationRequest  # noqa: E402
from engine.model import products, trunk  # noqa: E402
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
TAPED = trunk.Taped
EMBEDDED = products.embedded


def rebuild_blocks() -> None:
    """Drop every cached compiled block, so that the next step builds each anew."""
    for o in gc.get_objects():
        if isinstance(o, nn.Module):
            o.__dict__.pop("_mtpserve_compiled", None)


def set_head_ahead(on: bool) -> None:
    batching.launch_heads_ahead = LAUNCH_HEAD_AHEAD if on else (lambda *_: None)


def set_helping_wait(on: bool) -> None:
    products.wait = WAIT if on else mx.eval


def set_tapes(on: bool) -> None:
    trunk.Taped = TAPED if on else (lambda block: block)
    rebuild_blocks()


def set_embedding(on: bool) -> None:
    products.embedded = EMBEDDED if on else (lambda t, ids: products.activations(t(ids)))
    rebuild_blocks()


SETTINGS: dict[str, Callable[[bool], None]] = {
    "head-ahead": set_head_ahead,
    "helping-wait": set_helping_wait,
    "tapes": set_tapes,
    "embedding": set_embedding,
}


def run(
    engine: Engine, k: int, params: SamplingParams, tokens: int, rows: int
) -> tuple[float, float, list[int]]:
    """Milliseconds and calling-thread CPU milliseconds per token, and the tokens."""
    prompts = [list(engine.tokenizer.encode(prompt)) for prompt in PROMPTS]
    requests = [
        GenerationRequest(ids, params, tokens, draft_tokens=k, ignore_eos=True) for ids in prompts
    ]
    out: list[int] = []
    wall, cpu = time.perf_counter(), time.thread_time()
    if rows == 1:
        for request in requests:
            for event in engine.generate(request):
                out += event.token_ids
    else:
        batch = engine.batch(rows)
        for row in range(rows):
            batch.add(row, requests[row % len(requests)])
        while len(batch):
            for _, item in batch.step():
                if isinstance(item, BaseException):
                    raise item
                out += item.token_ids
    per = 1e3 / len(out)
    return (time.perf_counter() - wall) * per, (time.thread_time() - cpu) * per, out


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
    ks = [int(k) for k in args.ks.split(",")]
    texts = {}
    for on in (True, False):
        setting(on)
        for k in ks:
            texts[on, k] = run(engine, k, params, 60, args.rows)[2]
    print(f"same tokens: {all(texts[True, k] == texts[False, k] for k in ks)}", flush=True)
    wall: dict[tuple[bool, int], list[float]] = {(on, k): [] for on in (True, False) for k in ks}
    cpu: dict[tuple[bool, int], list[float]] = {(on, k): [] for on in (True, False) for k in ks}
    for round_number in range(args.rounds):
        for k in ks:
            for on in (True, False) if round_number % 2 == 0 else (False, True):
                setting(on)
                run(engine, k, params, 10, args.rows)
                w, c, _ = run(engine, k, params, args.tokens, args.rows)
                wall[on, k].append(w)
                cpu[on, k].append(c)
    setting(True)
    for k in ks:
        ratios = [a / b for a, b in zip(wall[True, k], wall[False, k], strict=True)]
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"{args.setting} K={k}: on {statistics.median(wall[True, k]):.3f} ms a token "
            f"(calling thread {statistics.median(cpu[True, k]):.3f} ms CPU), off "
            f"{statistics.median(wall[False, k]):.3f} ({statistics.median(cpu[False, k]):.3f}); "
            f"on over off {statistics.median(ratios):.3f} ({low:.3f}-{high:.3f}), "
            f"{args.rounds} rounds",
            flush=True,
        )


if __name__ == "__main__":
    main()
