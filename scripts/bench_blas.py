"""Before/after: mlx's CPU matmuls with the wheel's reference BLAS vs OpenBLAS.

Runs each measurement in a fresh process (the BLAS is chosen at import time), with
MTPSERVE_BLAS=none for the bundled reference BLAS and the default (OpenBLAS preload) otherwise.

    .venv/bin/python scripts/bench_blas.py [--model models/qwen3.5-demo] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
from engine.blas import use_fast_blas, blas_in_use
use_fast_blas()
import mlx.core as mx
out = {"blas": blas_in_use()}
n = 1024
a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
mx.eval(a, b, a @ b)
t = time.perf_counter()
for _ in range(5):
    mx.eval(a @ b)
out["matmul_gflops"] = 2 * n**3 * 5 / (time.perf_counter() - t) / 1e9
model, tokens = sys.argv[1], int(sys.argv[2])
if model:
    from engine.api import GenerationRequest
    from engine.runtime import Engine
    from sampling.params import SamplingParams
    engine = Engine.load(model, draft_tokens=0)
    request = GenerationRequest(list(range(10, 74)), SamplingParams(temperature=0.0), tokens,
                                draft_tokens=0, ignore_eos=True)
    warm = GenerationRequest(list(range(10, 20)), SamplingParams(temperature=0.0), 4,
                             draft_tokens=0, ignore_eos=True)
    for _ in engine.generate(warm):
        pass
    for event in engine.generate(request):
        pass
    out["decode_tps"] = event.stats.generation_tps
    out["prefill_tps"] = event.stats.prompt_tps
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/qwen3.5-demo")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    results = {}
    for name, blas in (("reference", "none"), ("openblas", "")):
        env = {**os.environ, "MTPSERVE_BLAS": blas}
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, str(args.tokens)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref, fast = results["reference"], results["openblas"]
    print(f"{'':<22}{'reference BLAS':>16}{'OpenBLAS':>12}{'ratio':>8}")
    for key, label in (
        ("matmul_gflops", "fp32 matmul GFLOP/s"),
        ("decode_tps", "decode tok/s"),
        ("prefill_tps", "prefill tok/s"),
    ):
        if key in ref:
            print(f"{label:<22}{ref[key]:>16.1f}{fast[key]:>12.1f}{fast[key] / ref[key]:>7.1f}x")
    print(f"OpenBLAS library: {fast['blas']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
