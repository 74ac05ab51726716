"""mlx's CPU matmuls with the wheel's reference BLAS, OpenBLAS and BLIS, side by side.

Runs each measurement in a fresh process (the BLAS is chosen at import time): MTPSERVE_BLAS=none
for the bundled reference BLAS, else the named library (engine/blas.py). Measures a big product
(prefill-like), the small products decoding is made of (M = 1, 2, 5 rows against a 256 x 768
weight, in a compiled chain) and the demo model's decode (K=0 and K=4, greedy) and prefill.

    .venv/bin/python scripts/experiments/bench_blas.py [--model models/qwen3.5-demo] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
from engine.blas import all_cores, use_fast_blas, blas_in_use
use_fast_blas()
import mlx.core as mx
out = {"blas": blas_in_use()}
n = 1024
a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
with all_cores():  # as prefill runs
    mx.eval(a, b, a @ b)
    t = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    out["matmul_gflops"] = 2 * n**3 * 5 / (time.perf_counter() - t) / 1e9
weights = [(mx.random.normal((768, 256)), mx.random.normal((256, 768))) for _ in range(8)]
mx.eval(weights)
def chain(x):
    for up, down in weights:
        x = (x @ up.T) @ down.T
    return x
chain = mx.compile(chain)
for rows in (1, 2, 5):
    x = mx.random.normal((rows, 256))
    for _ in range(20):
        mx.eval(chain(x))
    t = time.perf_counter()
    for _ in range(200):
        mx.eval(chain(x))
    out[f"small_us_{rows}"] = (time.perf_counter() - t) / 200 / 16 * 1e6
model, tokens = sys.argv[1], int(sys.argv[2])
if model:
    from engine.api import GenerationRequest
    from engine.runtime import Engine
    from sampling.params import SamplingParams
    engine = Engine.load(model, draft_tokens=0)
    prompt = list(range(10, 522))
    for k in (0, 4):
        request = GenerationRequest(prompt, SamplingParams(temperature=0.0), tokens,
                                    draft_tokens=k, ignore_eos=True)
        for _ in range(2):  # the first run compiles
            for event in engine.generate(request):
                pass
        out[f"decode_tps_k{k}"] = event.stats.generation_tps
    out["prefill_tps"] = event.stats.prompt_tps
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--openblas", default="/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    )
    parser.add_argument("--blis", default="/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4")
    args = parser.parse_args()
    results = {}
    for name, blas in (("reference", "none"), ("openblas", args.openblas), ("blis", args.blis)):
        env = {**os.environ, "MTPSERVE_BLAS": blas}
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, str(args.tokens)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    names = list(results)
    print(f"{'':<34}" + "".join(f"{name:>12}" for name in names))
    for key, label in (
        ("matmul_gflops", "fp32 1024x1024 matmul, GFLOP/s"),
        ("small_us_1", "[1,256]x[256,768], us"),
        ("small_us_2", "[2,256]x[256,768], us"),
        ("small_us_5", "[5,256]x[256,768], us"),
        ("decode_tps_k0", "decode tok/s, K=0"),
        ("decode_tps_k4", "decode tok/s, K=4"),
        ("prefill_tps", "prefill tok/s (512 tokens)"),
    ):
        if key in results[names[0]]:
            print(f"{label:<34}" + "".join(f"{results[n][key]:>12.1f}" for n in names))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
