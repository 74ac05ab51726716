"""Milliseconds per generated token with the compiled blocks run as tapes (engine/model/tape.py)
against the compiled blocks alone, the two taking turns in one process (the blocks rebuilt at
each switch), and the calling thread's CPU milliseconds per token::

    python scripts/experiments/tape_cost.py --ks 0,2,3 --rounds 24
    python scripts/experiments/tape_cost.py --ks 0,2,3 --rounds 24 --sampled
    python scripts/experiments/tape_cost.py --ks 0 --rows 8 --rounds 12
    python scripts/experiments/tape_cost.py --ks 0,3 --rounds 30 --tokens 200 --embedding

One prompt, EOS ignored, greedy or Qwen's sampler seeded; with ``--rows`` that many requests
as rows of one batch (aggregate time per token). Each round runs both settings at every K (in
alternating order), after a short warm-up run of each. Reports each setting's
median and the median of the rounds' ratios (tape over compiled) with its quartiles. With
``--embedding`` the two settings are the token embedding as one native op in a tape
(``products.embedded``, "tape") and as mlx's lookup and cast ("compiled"), every other block a
tape in both.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.nn as nn  # noqa: E402

from engine.api import GenerationRequest  # noqa: E402
from engine.model import products, trunk  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

PROMPT = (
    'def read_config(path):\n    """Read a JSON configuration file and return its settings."""\n'
)
SETTINGS = ("compiled", "tape")


EMBEDDED = products.embedded


def use(setting: str, taped: Any, embedding: bool = False) -> None:
    """Build every block anew, as a tape or as the compiled block alone (``embedding``: the
    embedding by the native op in a tape, or by mlx's lookup and cast)."""
    if embedding:
        native = setting == "tape"
        products.embedded = EMBEDDED if native else (lambda t, ids: products.activations(t(ids)))
    else:
        trunk.Taped = taped if setting == "tape" else (lambda block: block)
    for o in gc.get_objects():
        if isinstance(o, nn.Module):
            o.__dict__.pop("_mtpserve_compiled", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--ks", default="0,3")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--sampled", action="store_true", help="Qwen's sampler, seeded")
    parser.add_argument("--rows", type=int, default=1, help="requests as rows of one batch")
    parser.add_argument(
        "--embedding", action="store_true", help="the embedding's native op against mlx's"
    )
    args = parser.parse_args()
    engine = Engine.load(args.model)
    ids = engine.tokenizer.encode(PROMPT)
    sampling = (
        SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1)
        if args.sampled
        else SamplingParams(temperature=0.0)
    )
    taped = trunk.Taped

    def run(k: int, tokens: int) -> tuple[float, float, list[int]]:
        request = GenerationRequest(ids, sampling, tokens, draft_tokens=k, ignore_eos=True)
        wall, cpu, out = time.perf_counter(), time.thread_time(), []
        if args.rows == 1:
            for event in engine.generate(request):
                out += event.token_ids
        else:
            batch = engine.batch(args.rows)
            for row in range(args.rows):
                batch.add(row, request)
            while len(batch):
                for _, item in batch.step():
                    if isinstance(item, BaseException):
                        raise item
                    out += item.token_ids
        per = 1e3 / len(out)
        return (time.perf_counter() - wall) * per, (time.thread_time() - cpu) * per, out

    ks = [int(k) for k in args.ks.split(",")]
    texts = {}
    for setting in SETTINGS:
        use(setting, taped, args.embedding)
        for k in ks:
            texts[setting, k] = run(k, 60)[2]
    same = all(texts["tape", k] == texts["compiled", k] for k in ks)
    print(f"same tokens: {same}", flush=True)
    wall: dict[tuple[str, int], list[float]] = {(s, k): [] for s in SETTINGS for k in ks}
    cpu: dict[tuple[str, int], list[float]] = {(s, k): [] for s in SETTINGS for k in ks}
    for r in range(args.rounds):
        for k in ks:
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                use(setting, taped, args.embedding)
                run(k, 10)
                w, c, _ = run(k, args.tokens)
                wall[setting, k].append(w)
                cpu[setting, k].append(c)
    use("tape", taped, args.embedding)
    for k in ks:
        ratios = sorted(t / c for c, t in zip(wall["compiled", k], wall["tape", k], strict=True))
        q = len(ratios) // 4
        print(
            f"K={k}: compiled {statistics.median(wall['compiled', k]):.3f} ms/token "
            f"(calling thread {statistics.median(cpu['compiled', k]):.3f} ms CPU), "
            f"tape {statistics.median(wall['tape', k]):.3f} "
            f"({statistics.median(cpu['tape', k]):.3f}); tape over compiled "
            f"{statistics.median(ratios):.3f} (quartiles {ratios[q]:.3f}-{ratios[-q - 1]:.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
