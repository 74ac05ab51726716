"""Milliseconds per generated token with token embeddings as one native op inside a tape
(``products.embedded``) against mlx's lookup and cast (four ops), the two taking turns in one
process (the compiled blocks rebuilt at each switch)::

    python scripts/experiments/embed_cost.py --ks 0,3 --rounds 24
    python scripts/experiments/embed_cost.py --ks 0,2 --rounds 24 --sampled

One prompt, EOS ignored, greedy or Qwen's sampler seeded. Each round runs both settings at every
K (in alternating order), after a short warm-up run of each. Reports each setting's median and
the median of the rounds' ratios (native over mlx) with its quartiles, and whether the two
settings generate the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402  (preloads the fast BLAS before mlx)

blas.use_fast_blas()

import mlx.nn as nn  # noqa: E402

from engine.api import GenerationRequest  # noqa: E402
from engine.model import products  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

PROMPT = (
    'def read_config(path):\n    """Read a JSON configuration file and return its settings."""\n'
)
SETTINGS = ("mlx", "native")
EMBEDDED = products.embedded


def use(setting: str) -> None:
    """Embed by the setting's way, every compiled block built anew."""
    if setting == "native":
        products.embedded = EMBEDDED
    else:
        products.embedded = lambda table, ids: products.activations(table(ids))
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
    args = parser.parse_args()
    engine = Engine.load(args.model)
    ids = engine.tokenizer.encode(PROMPT)
    if args.sampled:
        sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1)
    else:
        sampling = SamplingParams(temperature=0.0)

    def run(k: int, tokens: int) -> tuple[float, list[int]]:
        request = GenerationRequest(ids, sampling, tokens, draft_tokens=k, ignore_eos=True)
        start, out = time.perf_counter(), []
        for event in engine.generate(request):
            out += event.token_ids
        return (time.perf_counter() - start) * 1e3 / len(out), out

    ks = [int(k) for k in args.ks.split(",")]
    texts = {}
    for setting in SETTINGS:
        use(setting)
        for k in ks:
            texts[setting, k] = run(k, 60)[1]
    print(f"same tokens: {all(texts['mlx', k] == texts['native', k] for k in ks)}", flush=True)
    wall: dict[tuple[str, int], list[float]] = {(s, k): [] for s in SETTINGS for k in ks}
    for r in range(args.rounds):
        for k in ks:
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                use(setting)
                run(k, 10)
                wall[setting, k].append(run(k, args.tokens)[0])
    use("native")
    for k in ks:
        ratios = [n / m for m, n in zip(wall["mlx", k], wall["native", k], strict=True)]
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"K={k}: mlx {statistics.median(wall['mlx', k]):.3f} ms/token, native "
            f"{statistics.median(wall['native', k]):.3f}; native over mlx "
            f"{statistics.median(ratios):.3f} ({low:.3f}-{high:.3f}), {args.rounds} rounds",
            flush=True,
        )


if __name__ == "__main__":
    main()
