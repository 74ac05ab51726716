"""Start-up of a checkpoint as `mtpserve serve` does it, and its first requests, in one process.

    python scripts/startup_bench.py runs/shapes/qwen3.5-0.8B [--dtype bfloat16] [--warm]

Prints one JSON object: seconds from start to weights loaded and from weights loaded to ready
(the engine built, auto K's cost table estimated; what `serve` waits for before /health answers),
mlx's peak memory and the process's peak RSS while loading against the resident weights, and
for Qwen's sampler (the checkpoint's generation_config) and greedy decoding the time to first
token of the first request of its kind against the same request run again: the difference is
what the first request spends on measurement and compilation. Also a plain decode step
(K=0, the mean over 16 tokens) and the prefill of the 128-token prompt. Times are wall clock
and, beside them (``_cpu``), the process's CPU time: on a machine shared with other jobs wall
time is mostly waiting for a core.

With a fresh cost cache (the default: a temporary MTPSERVE_CACHE) this is a first start; with
``--warm`` the user's cache is used as is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--warm", action="store_true", help="use the existing cost cache")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--ready-only", action="store_true", help="stop once the engine is ready")
    args = parser.parse_args()
    if not args.warm:
        os.environ["MTPSERVE_CACHE"] = tempfile.mkdtemp(prefix="mtpserve-cache-")

    from engine.blas import use_fast_blas

    use_fast_blas()
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.api import GenerationRequest
    from engine.runtime import Engine
    from sampling.params import SamplingParams, resolve

    marks: dict[str, float] = {}
    peaks: dict[str, int] = {}

    class Marks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            print(f"{record.created - t0:7.2f}s {record.name}: {message}", file=sys.stderr)
            if message.startswith("weights loaded"):
                marks["weights_loaded"] = record.created
                peaks["load_peak"] = mx.get_peak_memory()
                peaks["load_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    logging.getLogger("mtpserve").addHandler(Marks())
    logging.getLogger("mtpserve").setLevel(logging.INFO)

    t0 = time.time()
    mx.reset_peak_memory()
    engine = Engine.load(args.model, dtype=args.dtype)
    ready = time.time()
    params_all = tree_flatten(engine.trunk.parameters())
    resident = sum(a.nbytes for _, a in params_all)

    out: dict = {
        "model": str(args.model),
        "dtype": str(engine.trunk.model.embed_tokens.weight.dtype).removeprefix("mlx.core."),
        "resident_bytes": resident,
        "load_seconds": marks["weights_loaded"] - t0,
        "ready_after_weights_seconds": ready - marks["weights_loaded"],
        "load_peak_bytes": peaks["load_peak"],
        "load_peak_rss_bytes": peaks["load_rss"],
    }
    if args.ready_only:
        print(json.dumps(out, indent=2))
        return 0
    prompt = [(i * 7919) % 1000 for i in range(args.prompt_tokens)]

    def first_token(params: SamplingParams, k: int | None, tokens: int = 8) -> tuple:
        request = GenerationRequest(prompt, params, tokens, draft_tokens=k, ignore_eos=True)
        t, cpu = time.perf_counter(), time.process_time()
        ttft = ttft_cpu = None
        event = None
        for event in engine.generate(request):
            if ttft is None:
                ttft, ttft_cpu = time.perf_counter() - t, time.process_time() - cpu
        return ttft, ttft_cpu, event.stats, time.process_time() - cpu

    sampled = resolve(engine.sampling_defaults)
    greedy = SamplingParams(temperature=0.0)
    for name, params in (("sampled", sampled), ("greedy", greedy)):
        first, first_cpu, stats, _ = first_token(params, None)
        again, again_cpu, _, _ = first_token(params, None)
        out[name] = {
            "first_request_ttft": first,
            "again_ttft": again,
            "first_request_ttft_cpu": first_cpu,
            "again_ttft_cpu": again_cpu,
            "prefill_seconds": stats.prompt_seconds,
        }
    _, _, plain, plain_cpu = first_token(greedy, 0, tokens=17)
    step = plain.generation_seconds / max(1, plain.completion_tokens)
    _, _, _, prefill_cpu = first_token(greedy, 0, tokens=1)
    step_cpu = (plain_cpu - prefill_cpu) / max(1, plain.completion_tokens - 1)
    out["plain_step_seconds"] = step
    out["plain_step_cpu_seconds"] = step_cpu
    out["prefill_tokens_per_second"] = args.prompt_tokens / plain.prompt_seconds
    for name in ("sampled", "greedy"):
        row = out[name]
        row["extra_in_plain_steps"] = (row["first_request_ttft"] - row["again_ttft"]) / step
        row["extra_in_plain_steps_cpu"] = (
            row["first_request_ttft_cpu"] - row["again_ttft_cpu"]
        ) / step_cpu
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
